"""What a model computes in a training step, and what of it determinism.cpu: portable refuses.

The portable kernels (tasks/determinism/kernels.py, dispatch.py) refuse an op they have no CPU-independent kernel for
when it runs: for a model that reaches one, at its first step, after the data has loaded and the run has
started. `refused_ops` finds such ops as the model is built instead, by running one training step
(forward, cross-entropy, backward) on fake tensors: tensors with shapes and dtypes but no memory, whose
ops compute nothing, so the step costs a fraction of a second even for a large model (most of it the
first probe's set-up), and the model and torch's random numbers are left as they were. Fake tensors,
not the meta device: they present themselves as CPU tensors, so torch makes the choices it makes on
the CPU (scaled_dot_product_attention takes the fused CPU kernel portable refuses; on meta it takes
its math path, which would pass).

`OpRecorder` is the probe's witness, and the escape test's (tests/determinism/test_portable_escapes.py):
every ATen op a block reaches, forward and backward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tasks.determinism import dispatch, kernels

log = logging.getLogger(__name__)
PROBE_BATCH = 2  # the fewest images batch norm trains on where a feature map ends at 1x1


class OpRecorder(TorchDispatchMode):
    """Every op reached while active, with its count (forward and backward, in order of first use), and
    what the portable kernels would refuse of those calls (`dispatch.refusal`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[Any, int] = {}
        self.refused: list[str] = []
        self.failure: str | None = None  # why the probed step stopped early (training_step_ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops[func] = self.ops.get(func, 0) + 1
        refused = dispatch.refusal(func, args)
        if refused is not None and refused not in self.refused:
            self.refused.append(refused)
        return func(*args, **(kwargs or {}))


def training_step_ops(model: nn.Module, input_shape: Sequence[int]) -> OpRecorder:
    """The ops of one training step of `model` on `PROBE_BATCH` fake inputs of `input_shape` (C, H, W); a
    step fake tensors cannot finish (an op with no fake kernel) is recorded up to there, and why in
    `failure`."""
    recorder = OpRecorder()
    training = model.training
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), FakeTensorMode() as fake:
        try:
            tensors = {name: fake.from_tensor(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
            weights = [t for t in tensors.values() if t.requires_grad]
            images = torch.empty((PROBE_BATCH, *input_shape))
            labels = torch.zeros(PROBE_BATCH, dtype=torch.long)
            model.train()
            with recorder:
                logits = torch.func.functional_call(model, tensors, (images,))
                loss = nn.functional.cross_entropy(logits, labels)
                torch.autograd.grad(loss, weights, allow_unused=True)
        except kernels.PortableOpError:  # a refused op that fake tensors ran for real: the recorder has it
            pass
        except Exception as exc:  # whatever torch raises: the kernels still refuse what the step reaches later
            recorder.failure = (str(exc).splitlines() or [type(exc).__name__])[0]
        finally:
            model.train(training)
    return recorder


def refused_ops(model: nn.Module, input_shape: Sequence[int]) -> list[str]:
    """What the portable kernels would refuse in one training step of `model` on inputs of `input_shape`
    (C, H, W), in the order reached ([] if nothing). A step fake tensors cannot finish gives what it found
    until then, and a warning: the rest is refused as it runs."""
    recorder = training_step_ops(model, input_shape)
    if recorder.failure is not None and not recorder.refused:
        log.warning(
            "determinism.cpu: portable could not probe the model through a training step before it trains (%s); "
            "an op it refuses, if the model reaches one, stops the run when it is reached",
            recorder.failure,
        )
    return recorder.refused


def refuse_unportable(model: nn.Module, name: str, input_shape: Sequence[int]) -> None:
    """Raise PortableOpError (one line, exit 3) naming `name` and what it reaches that portable refuses, if
    anything; the way out is native mode or a GPU."""
    refused = refused_ops(model, input_shape)
    if refused:
        reaches = refused[0] + (f" (and {', '.join(refused[1:])})" if len(refused) > 1 else "")
        raise kernels.PortableOpError(
            f"train.model: {name} reaches {reaches} in a training step on the CPU, which determinism.cpu: portable "
            "has no CPU-independent kernel for (its bytes would depend on the CPU); set determinism.cpu: native "
            "(this CPU's own kernels), or train on a CUDA device"
        )
