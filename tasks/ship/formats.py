"""The export formats' writers: how the fp32 model is saved in each format of `export.formats` beside
`model.onnx`, and read back for its parity gate (tasks/ship/export.py runs both).

The formats are the registry tasks/core/config/ship.py `EXPORT_FORMATS` (each one's file under
artifacts/export/ and its gate's label); each registers its `Writer` here under the same name
(docs/extending.md). onnx has none: its file is the compress stage's fp32.onnx, copied, and ONNX
Runtime reads it back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.config.ship import EXPORT_FORMATS
from tasks.core.registry import Implementations


@dataclass(frozen=True)
class Writer:
    """How one format is written from the eager fp32 model (`save(model, parity batch, path)`) and read
    back for its parity gate (`load(path)`: a module that maps pixels to logits)."""

    save: Callable[[torch.nn.Module, torch.Tensor, Path], None]
    load: Callable[[Path], torch.nn.Module]


WRITERS: Implementations[Writer] = Implementations(EXPORT_FORMATS, elsewhere=("onnx",))


def _save_pt2(model: torch.nn.Module, parity: torch.Tensor, path: Path) -> None:
    program = torch.export.export(model, (parity,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    for node in program.graph.nodes:  # stack traces name this checkout's paths: bytes would depend on it
        node.meta.pop("stack_trace", None)
    torch.export.save(program, path)


def _load_pt2(path: Path) -> torch.nn.Module:
    return torch.export.load(path).module()


def _save_torchscript(model: torch.nn.Module, parity: torch.Tensor, path: Path) -> None:
    with torch.no_grad():
        # Not byte-reproducible: TorchScript archives carry a random serialization id and pickled
        # debug info. It is for legacy consumers; the ONNX and .pt2 files are reproducible.
        torch.jit.save(torch.jit.trace(model, parity), path)


WRITERS.register("pt2")(Writer(_save_pt2, _load_pt2))
WRITERS.register("torchscript")(Writer(_save_torchscript, torch.jit.load))
