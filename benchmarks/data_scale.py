"""Peak memory and time of ingest, stats and preprocess at N and N/4 images (issue: real datasets).

    python benchmarks/data_scale.py [--images 50000] [--work /tmp/lockstep-scale]

Generates an ImageFolder of small PNGs of mixed sizes (10 classes; 28..36 px, resized to 32x32
RGB), then runs each step in a fresh Python process and reports its wall time and peak RSS
(`ru_maxrss`) next to the RSS of the same process before the step (imports done), then runs it
again under `tracemalloc` for the peak of what the step allocates itself (numpy buffers
included). The claim under test: neither grows with the number of images, beyond the output the
step holds (none: outputs are written with plain file writes, not memory-mapped). RSS also
carries what the C allocator keeps after frees, so it can creep a little before it levels off.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]

# Runs in a child process: one step, then prints {"seconds", "peak_mib", "baseline_mib"}.
STEP = r"""
import json, resource, sys, time
from pathlib import Path
from tasks.core.config.data import DataConfig, SplitConfig
from tasks.data.download import download
from tasks.data.preprocess import preprocess
from tasks.data.stats import compute_stats, ChannelStats

step, work, traced = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "traced"
if traced:
    import tracemalloc
    tracemalloc.start()
split = SplitConfig(train=0.7, val=0.15, test=0.15)
mib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
baseline = mib()
start = time.perf_counter()
if step == "ingest":
    cfg = DataConfig(source="imagefolder", path=str(work / "folder"), image_size=(32, 32), channels=3)
    download(cfg, work / "data", work / "cache")
elif step == "stats":
    stats = compute_stats(work / "data", split, seed=42, chunk_size=4096)
    (work / "stats.json").write_text(json.dumps(stats.__dict__))
else:
    stats = ChannelStats(**json.loads((work / "stats.json").read_text()))
    preprocess(work / "data", stats, split, 42, work / "preprocessed")
seconds = time.perf_counter() - start
if traced:
    print(json.dumps({"heap_peak_mib": tracemalloc.get_traced_memory()[1] / 2**20}))
else:
    print(json.dumps({"seconds": seconds, "peak_mib": mib(), "baseline_mib": baseline}))
"""


def make_folder(folder: Path, images: int, seed: int = 0) -> float:
    """`images` random PNGs in 10 class folders; returns seconds taken."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    for cls in range(10):
        (folder / f"class_{cls}").mkdir(parents=True)
    for i in range(images):
        side = int(rng.integers(28, 37))
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"class_{i % 10}" / f"{i:06d}.png", compress_level=1)
    return time.perf_counter() - start


def measure(work: Path, images: int) -> dict[str, object]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    generated = make_folder(work / "folder", images)
    row: dict[str, object] = {"images": images, "generate_s": round(generated, 1)}
    for step in ("ingest", "stats", "preprocess"):
        result: dict[str, float] = {}
        for mode in ("timed", "traced"):  # tracemalloc slows Python code: time the untraced run
            done = subprocess.run(
                [sys.executable, "-c", STEP, step, str(work), mode],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            result.update(json.loads(done.stdout.strip().splitlines()[-1]))
        row[step] = {k: round(v, 1) for k, v in result.items()}
    row["data_mib"] = round((work / "data" / "images.npy").stat().st_size / 2**20, 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lockstep-scale"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rows = [measure(args.work, n) for n in (args.images // 4, args.images)]
    print("| images | step | seconds | peak RSS MiB | RSS before MiB | RSS growth MiB | heap peak MiB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        for step in ("ingest", "stats", "preprocess"):
            r = row[step]
            print(
                f"| {row['images']} | {step} | {r['seconds']} | {r['peak_mib']} | {r['baseline_mib']} | "
                f"{r['peak_mib'] - r['baseline_mib']:.1f} | {r['heap_peak_mib']} |"
            )
    for row in rows:
        print(
            f"{row['images']} images: data/images.npy {row['data_mib']} MiB; folder generated in {row['generate_s']} s"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
