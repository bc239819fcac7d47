"""Where a process computes: its device, and its place among the ranks of a torchrun job.

A lone process is rank 0 of 1 and every collective below returns its input; under torchrun
(RANK/WORLD_SIZE set) `join_process_group` joins the process group: gloo on CPU, NCCL on GPUs.

What ranks exchange is tensors, never pickles (`gather` sends JSON as bytes): no peer, whatever
reached the store, can make a rank unpickle. A one-node job listens on loopback only: rank 0 hosts
the ranks' TCP store on 127.0.0.1 (TCPStore itself binds every interface), and gloo and NCCL use
the loopback interface.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

from tasks.core.errors import HardwareMissing


def resolve_device(spec: str) -> torch.device:
    """`auto` picks the first GPU when there is one; an explicit `cuda` without one is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise HardwareMissing(f"device {spec!r}: torch sees no CUDA device on this machine (use auto or cpu)")
    return torch.device(spec)


@dataclass(frozen=True)
class Distributed:
    """This process's place in the job; a lone process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    local_world_size: int = 1  # the ranks on this machine

    @property
    def one_node(self) -> bool:
        """Every rank runs on this machine (and sees its disk)."""
        return self.local_world_size == self.world_size

    @property
    def node_leader(self) -> bool:
        """The rank that writes this machine's files (each node has its own disk)."""
        return self.local_rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

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

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """`data` from rank `src` on every rank (the others pass None): a file sent to nodes that
        do not share rank `src`'s disk."""
        if self.world_size == 1:
            return data or b""
        mine = (data or b"") if self.rank == src else b""
        size = torch.tensor([len(mine)], dtype=torch.int64, device=self._device())
        dist.broadcast(size, src=src)
        if not size.item():
            return b""
        if self.rank == src:
            payload = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(self._device())
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device())
        dist.broadcast(payload, src=src)
        return payload.cpu().numpy().tobytes()

    def gather(self, obj: Any) -> list[Any]:
        """`obj` (JSON-ready) from every rank, in rank order, on every rank.

        Not `all_gather_object`: it unpickles what the other ranks send.
        """
        if self.world_size == 1:
            return [obj]
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device())
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8, device=self._device()) for _ in range(self.world_size)]
        dist.all_gather(parts, mine.to(self._device()))
        return [json.loads(part[: int(n.item())].cpu().numpy().tobytes()) for part, n in zip(parts, sizes, strict=True)]


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
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if _one_node(world):
        loopback = _loopback_interface()
        if loopback:  # else the OS's default; the stores are on 127.0.0.1 regardless
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            store=_attempt_store(rank, world),
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
        )
    return Distributed(rank, world, local_rank, backend, local_world), device


def _attempt_store(rank: int, world: int) -> dist.Store:
    """The ranks' store torchrun describes, with keys scoped to this attempt.

    With torch 2.14, ranks restarted by `--max-restarts` found the first attempt's keys in the
    agent's store and gloo dialled the dead ranks' addresses ("Connection refused"). On one node a
    prefix per attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt a clean namespace. Across
    nodes the restart counts differ (a node restarted by its operator counts from 0 again), so the
    prefix is the store's own address: the launcher has every node's agent leave the store to rank 0
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), which hosts a new one, on a new port, every round.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts_it = not agent_hosts_it and rank == 0
    if _one_node(world):
        host = "127.0.0.1"
        attempt = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    else:
        attempt = f"store_{host}:{port}"
        if agent_hosts_it:
            logging.getLogger(__name__).warning(
                "this node's torchrun shares its agent's store with the ranks: a restarted job may find the "
                "last attempt's keys there; start every node but the stage's with python -m tasks.train.launcher --join"
            )
    if hosts_it:
        # TCPStore binds every interface; a socket we bound ourselves keeps the store on MASTER_ADDR's
        # address (127.0.0.1 on one node, the address the launcher gave this node on several)
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(world)
        store = dist.TCPStore(host, port, world, is_master=True, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world, is_master=False)
    return dist.PrefixStore(f"lockstep/{attempt}", store)


def _one_node(world: int) -> bool:
    """Every rank of the job runs on this machine (torchrun sets LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world


def _loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None
