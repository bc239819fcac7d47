"""Pickles of plain data, decoded without running code: the one place lockstep reads a pickle.

The CIFAR-10/100 "python version" batches are pickles (a dict of a uint8 array, label lists and
names, written by Python 2). `pickle.load` would call whatever global a pickle names (`os.system`...),
so a batch is decoded here instead, by an unpickler that rebuilds numpy arrays and nothing else:
numpy's own array-rebuilding function, `numpy.ndarray` and `numpy.dtype` (under their Python 2 and 3
module names), and `_codecs.encode` to latin-1 (how Python 3 pickles bytes) are the only globals it
resolves; any other is refused (`NotPlainData`, the global named) before anything is called. The
containers, strings, bytes and numbers pickle opcodes build themselves run no code. The archive is also
checked against its published md5 before any of this (tasks/data/download.py); this makes a batch that
matched it by other means (a collision, a planted cache) still harmless. tests/test_architecture.py
keeps any other module from loading a pickle.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

MAX_BYTES = 512 * 1024 * 1024  # a CIFAR batch is 31 MB; the whole archive 184 MB


class NotPlainData(pickle.UnpicklingError):
    """The pickle names a global that is not one of numpy's array builders: it is not decoded."""


def _latin1(text: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """`_codecs.encode` as Python 3 pickles bytes (`encode(text, "latin1")`), and only that."""
    if encoding not in ("latin1", "latin-1") or errors != "strict" or not isinstance(text, str):
        raise NotPlainData(f"_codecs.encode to {encoding!r}: only latin1, how Python pickles bytes")
    return text.encode("latin1")


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own, wherever this numpy keeps it
ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # as Python 2's numpy named it (CIFAR's)
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy 2
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1,
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise NotPlainData(f"the pickle calls {module}.{name}, which is not plain data: not decoded") from None


def load_plain(data: bytes) -> Any:
    """The plain data (numpy arrays, dicts, lists, strings, numbers) pickled in `data`, strings of
    Python 2 read as latin-1 (as torchvision reads CIFAR); NotPlainData for any other object."""
    if len(data) > MAX_BYTES:
        raise NotPlainData(f"a pickle of {len(data)} bytes, over {MAX_BYTES}: not decoded")
    return _PlainUnpickler(io.BytesIO(data), encoding="latin1").load()
