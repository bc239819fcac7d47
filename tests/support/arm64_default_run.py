"""The default run trained on the emulated arm64 machine, against the golden record of x86-64 (issue 71).

    python -m tests.support.arm64_default_run [--out benchmarks/results/arm64-default-run.json]

The data and train stages of params.yaml's defaults, in portable mode, as
tests/determinism/test_golden_weights.py trains them, run by Debian's arm64 Python with the lock's arm64
wheels under qemu (tests/support/arm64.py, `make arm64-env`); the sha256 of best.safetensors and
last.safetensors are compared with tests/determinism/golden/default_weights.json's portable record. Too
slow for the test tiers (emulated, the run takes tens of minutes), so it is run by hand, and its report
kept. The emulator executes each NEON and FMA instruction exactly; its time is no measure of a real
arm64 CPU, and the report has none.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from tests.conftest import ROOT
from tests.support import arm64

RESULTS = ROOT / "benchmarks/results/arm64-default-run.json"
GOLDEN = ROOT / "tests/determinism/golden/default_weights.json"

TRAIN = """
import hashlib, json, tempfile
from pathlib import Path
from tasks.determinism.bootstrap import start
start(0, 2, strict=True, cpu="portable")
from tasks.core.config.yaml_io import load_params
from tasks.data.download import download
from tasks.data.preprocess import preprocess
from tasks.data.stats import compute_stats
from tasks.determinism.fingerprint import fingerprint
from tasks.train.stage import train

params = load_params(Path("params.yaml"))
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    download(params.data, tmp / "data", tmp / "cache")
    stats = compute_stats(tmp / "data", params.split, params.seed, params.stats.chunk_size)
    preprocess(tmp / "data", stats, params.split, params.seed, tmp / "preprocessed")
    start(params.seed, params.determinism.num_threads, strict=params.determinism.strict, cpu="portable")
    train(params.train, params.seed, tmp / "preprocessed", tmp / "train")
    names = ("best.safetensors", "last.safetensors")
    made = {name: hashlib.sha256((tmp / "train" / name).read_bytes()).hexdigest() for name in names}
print(json.dumps({"weights": made, "machine": fingerprint()}))
"""


def measure() -> dict:
    """Train on the emulated machine; the report (module docstring)."""
    expected = json.loads(GOLDEN.read_text())[f"portable | torch {torch.__version__}"]
    done = arm64.run_python(["-c", TRAIN], timeout_s=6 * 3600)
    if done.returncode != 0:
        raise arm64.Arm64Unavailable(f"the emulated run failed: {done.stderr.strip().splitlines()[-1:]}")
    made = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "date": date.today().isoformat(),
        "arm64": f"qemu-aarch64-static -cpu {arm64.CPU} (tests/support/arm64.py): bytes, no timing",
        "weights": made["weights"],
        "golden": {name: expected[name] for name in made["weights"]},
        "same_as_golden": all(made["weights"][name] == expected[name] for name in made["weights"]),
        "golden_recorded_on": expected["recorded_on"]["hw.cpu.model"],
        "machine": made["machine"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.arm64_default_run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = measure()
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(args.out)
    print(json.dumps({key: report[key] for key in ("weights", "same_as_golden")}, indent=1))
    return 0 if report["same_as_golden"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
