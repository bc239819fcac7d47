"""Where a process computes: its device, and its place among the ranks of a torchrun job.

A lone process is rank 0 of 1 and every collective below returns its input; under torchrun
(RANK/WORLD_SIZE set) `join_process_group` joins the process group: gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def resolve_device(spec: str) -> torch.device:
    """`auto` picks the first GPU when there is one; an explicit `cuda` without one is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {spec!r} but torch sees no CUDA device")
    return torch.device(spec)


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job; a lone process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"

    def _device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sums over ranks (float64 on the CPU process group, NCCL tensors on GPUs)."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor)
        return tensor.tolist()

    def minimum(self, value: float) -> float:
        """The smallest `value` over ranks."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.item()

    def share_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm running stats), as the saved model has them.

        DDP broadcasts buffers at the start of each training forward, so after the last step each
        rank still holds the statistics of its own last batch.
        """
        if self.world_size > 1:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def join_process_group(device_spec: str) -> tuple[Distributed, torch.device]:
    """Join the process group torchrun describes in the environment, or run alone.

    The backend follows the device: NCCL when each rank has a GPU, gloo on CPU.
    """
    device = resolve_device(device_spec)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Distributed(), device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            store=_attempt_store(rank, world),
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
        )
    return Distributed(rank, world, local_rank, backend), device


def _attempt_store(rank: int, world: int) -> dist.Store:
    """The rendezvous store torchrun describes, with keys scoped to this restart attempt.

    With torch 2.14, ranks restarted by `--max-restarts` found the first attempt's keys in the
    agent's store and gloo dialled the dead ranks' addresses ("Connection refused"). A prefix
    per attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt a clean namespace.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent_hosts_it and rank == 0)
    return dist.PrefixStore(f"lockstep/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
