"""Which ATen ops give other bytes on arm64 than on x86-64 in portable mode, family by family (issue 71).

    python -m tests.support.arm64_ops [--out benchmarks/results/arm64-ops.json] [FAMILY ...]

For each model of the zoo test (tests/determinism/test_portable_escapes.py ZOO), one training step in
portable mode on this x86-64 machine records every ATen op it ran with its inputs and outputs
(a TorchDispatchMode; calls over RECORD_LIMIT_BYTES are left out, and counted). The emulated arm64 machine
(tests/support/arm64.py, `make arm64-env`) then runs each recorded op alone on the recorded inputs, in
portable mode, and lists the ops whose outputs (or, for an in-place op, its mutated inputs) differ in a
byte. Replaying op by op finds every op that differs, not only the first: after it, a training's
inputs differ anyway. Random ops (dropout's bernoulli_) are left out: their generator's state is not
recorded, and replayed they differ on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

from tests.conftest import ROOT
from tests.determinism.test_portable_escapes import SIZE, ZOO
from tests.support import arm64
from tests.support.portable import run_script

RESULTS = ROOT / "benchmarks/results/arm64-ops.json"
RECORD_LIMIT_BYTES = 64 << 20  # a call whose tensors, before and after, take more is not recorded
RANDOM_OPS = ("aten.bernoulli_", "aten.rand", "aten.randn", "aten.randint", "aten.normal_", "aten.uniform_")
BATCH = 3

RECORD = """
import io, json, sys
from tasks.determinism.bootstrap import start
start(0, 2, strict=True, cpu="portable")
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from tasks.train.models import build_model

name, precision, size, batch, limit, random_ops, path = sys.argv[1:8]
size, batch, limit, random_ops = int(size), int(batch), int(limit), tuple(json.loads(random_ops))


def clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def nbytes(*trees):
    return sum(t.numel() * t.element_size() for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor))


class Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows, self.skipped = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = str(func)
        keep = not op.startswith(("profiler.", *random_ops)) and 2 * nbytes(args, kwargs) <= limit
        saved = (tree_map(clone, args), tree_map(clone, kwargs)) if keep else None
        out = func(*args, **kwargs)
        if keep and 2 * nbytes(args, kwargs) + nbytes(out) <= limit:
            row = (op, *saved, tree_map(clone, out), tree_map(clone, args))
            try:
                torch.save(row, io.BytesIO())  # (an argument torch cannot save: a script object)
                self.rows.append(row)
                return out
            except Exception:
                pass
        if not op.startswith(("profiler.", *random_ops)):
            self.skipped[op] = self.skipped.get(op, 0) + 1
        return out


torch.manual_seed(0)
model = build_model(name, 10, [0.5] * 3, [0.25] * 3, [size, size])
generator = torch.Generator().manual_seed(1)
images = torch.rand(batch, 3, size, size, generator=generator)
labels = torch.randint(0, 10, (batch,), generator=generator)
optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
record = Record()
with record:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimiser.step()
torch.save(record.rows, path)
print(json.dumps({"recorded": len(record.rows), "skipped": record.skipped}))
"""

REPLAY = """
import json, sys
from tasks.determinism.bootstrap import start
start(0, 2, strict=True, cpu="portable")
import torch
from torch.utils._pytree import tree_map


def clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def same(a, b):
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
        if a.dtype in (torch.bfloat16, torch.float16):
            a, b = a.view(torch.int16), b.view(torch.int16)
        return a.numpy().tobytes() == b.numpy().tobytes()
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return True


report = {}
for path in sys.argv[1:]:
    differ, total = {}, {}
    for op, args, kwargs, out, after in torch.load(path, weights_only=False):
        namespace, name, overload = op.split(".")
        func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        args2, kwargs2 = tree_map(clone, args), tree_map(clone, kwargs)
        got = func(*args2, **kwargs2)
        total[op] = total.get(op, 0) + 1
        if not (same(out, got) and same(after, args2)):
            differ[op] = differ.get(op, 0) + 1
    report[path] = {"differ": differ, "replayed": total}
print(json.dumps(report))
"""


def measure(families: list[tuple[str, str]]) -> dict:
    """Record each family's step here, replay all of them emulated; the report (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="lockstep-arm64-ops-") as tmp:
        recorded, paths = {}, {}
        for name, precision in families:
            path = Path(tmp) / f"{name}-{precision}.pt"
            args = (name, precision, str(SIZE), str(BATCH), str(RECORD_LIMIT_BYTES), json.dumps(RANDOM_OPS))
            recorded[f"{name} {precision}"] = json.loads(run_script(RECORD, *args, str(path)).strip().splitlines()[-1])
            paths[f"{name} {precision}"] = str(path)
        done = arm64.run_python(["-c", REPLAY, *paths.values()], timeout_s=7200)
        if done.returncode != 0:
            raise arm64.Arm64Unavailable(f"the replay failed: {done.stderr.strip().splitlines()[-1:]}")
        replayed = json.loads(done.stdout.strip().splitlines()[-1])
    families_report = {}
    for key, path in paths.items():
        result = replayed[path]
        families_report[key] = {
            "ops_replayed": sum(result["replayed"].values()),
            "differ": dict(sorted(result["differ"].items())),
            "not_recorded": recorded[key]["skipped"],
        }
    return {
        "date": date.today().isoformat(),
        "x86_64": "this machine, portable mode (tests/support/arm64_ops.py)",
        "arm64": f"qemu-aarch64-static -cpu {arm64.CPU} (tests/support/arm64.py): bytes, no timing",
        "families": families_report,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.arm64_ops", description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="e.g. resnet9:fp32 (default: the zoo test's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    families = [tuple(f.split(":")) for f in args.families] or list(ZOO)
    report = measure(families)  # type: ignore[arg-type]
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(args.out)
    print(json.dumps(report["families"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
