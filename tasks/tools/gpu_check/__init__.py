"""`python -m tasks.tools.gpu_check`: prove "single GPU, cuDNN pinned" on a machine, in one run and one table.

Not a pipeline stage (dvc.yaml does not list it): run it once on each new kind of machine, the first
time on a GPU. It needs torch, torchvision, numpy, pydantic, pyyaml and safetensors only; compress and
export also need onnx, onnxruntime and onnxscript (torchao for qat_int8) and are reported as skipped,
with the wheel to carry, where they are missing. It never imports MLflow, DVC or Prefect: a bare CUDA
machine has none of them.

Checks, on `--device cuda` (default) or `--device cpu` (smaller sizes; what CI runs):

1. strict: one training step of every `train.model` x `train.optimizer` choice (read from
   tasks/core/config/, so a new model is covered by itself) under `torch.use_deterministic_algorithms(True)`;
   an op without a deterministic kernel is a FAIL row naming the op, and the other rows still run;
2. determinism: the same training twice, pinned by tasks/determinism/pinning.py, weights compared by sha256,
   in fp32, bf16 autocast and fp16 with a GradScaler (CUDA only; "n/a on cpu");
3. throughput: resnet18 on CIFAR-shaped data, images/s of the project's loop pinned vs with
   `cudnn.benchmark` and nondeterministic kernels allowed, in fp32 and bf16 autocast (target: pinning
   costs <= 1.3x on CUDA in bf16; fp32 is reported), and vs a plain hand-written loop; warm-up first,
   medians of timed runs, synchronised;
4. compress and export (tasks/ship/compress.py, tasks/ship/export.py) from a checkpoint trained on the device.

The data is synthetic and seeded: CIFAR-shaped uint8 images (3x32x32, 10 classes), each a class
template plus noise, so that training learns something. Exit codes: 0 every check that ran passed,
1 a check failed, 2 bad arguments, 4 missing hardware (`--device cuda` without a CUDA device).

- workload.py: the sizes per device, the synthetic data, the project's training loop pinned
- checks_training.py (1, 2), checks_throughput.py (3), checks_ship.py (4): the checks, one row each
- report.py: the rows, the table and the JSON; checks.py: the groups in order, the machine's
  fingerprint (tasks/determinism/fingerprint.py, as every run records it); cli.py: the command line
"""

from tasks.tools.gpu_check.checks import run_checks
from tasks.tools.gpu_check.cli import main
from tasks.tools.gpu_check.report import Check, GpuCheckReport
from tasks.tools.gpu_check.workload import MODELS, SIZES, CheckOptions

__all__ = ["MODELS", "SIZES", "Check", "CheckOptions", "GpuCheckReport", "main", "run_checks"]
