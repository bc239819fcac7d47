"""Memory for the portable kernels (kernels.py, depthwise.py): results in new memory that torch does not fill
first, and temporaries reused from one step to the next."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def channels_last(t: torch.Tensor) -> bool:
    """Whether `t` (N, C, H, W) is laid out channels-last, and not also contiguous (as with one channel or
    a 1x1 image): the portable kernels then lay out their operands and results as ATen would for it."""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """New memory for a result that is written in full before it is read: from numpy, unfilled.

    In deterministic mode torch fills every new tensor (torch.utils.deterministic.
    fill_uninitialized_memory), a pass over memory that buys nothing here. Returned tensors stay
    torch's own (resizable, aligned as ATen allocates).
    """
    dtype = NUMPY_DTYPES.get(like.dtype)
    return like.new_empty(shape) if dtype is None else torch.from_numpy(np.empty(shape, dtype))


class Pool(threading.local):
    """Temporaries by (shape, dtype), reused from one step to the next.

    A convolution's columns and products are megabytes that live for one call (or from a forward to
    its backward). Fresh memory of that size comes from the kernel page by page, faulted in on first
    touch every step again; the same shapes come back every step, so their memory is kept (like a
    caching allocator: the process keeps about one step's worth). Per thread (no locks); bounded in
    count per shape. Only temporaries that never escape the kernels come from here: every tensor
    handed back to autograd is new memory (`empty`).
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        dtype = NUMPY_DTYPES.get(like.dtype)
        if dtype is None:
            return like.new_empty(shape), None
        free = self.free.get((shape, dtype))
        array = free.pop() if free else np.empty(shape, dtype)
        return torch.from_numpy(array), array

    def give(self, array: np.ndarray | None) -> None:
        if array is not None:
            free = self.free.setdefault((array.shape, array.dtype.type), [])
            if len(free) < POOLED_PER_SHAPE:
                free.append(array)

    def clear(self) -> None:
        self.free.clear()


POOLED_PER_SHAPE = 4
pool = Pool()


@contextmanager
def temporaries() -> Iterator:
    """`take(shape, like)` for the duration of a block; what it gave out returns to the pool after."""
    taken: list[np.ndarray | None] = []

    def take(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        tensor, array = pool.take(shape, like)
        taken.append(array)
        return tensor

    try:
        yield take
    finally:
        for array in taken:
            pool.give(array)
