"""Issue 66, point 9: the CIFAR batches (pickles) are decoded without running code. A batch carrying a
live payload (a `__reduce__` that creates a file, checked to run under plain `pickle.loads`) is refused
naming the global, and the payload never runs; genuine batches, as Python 2 and Python 3 pickle them,
decode to the same arrays as `pickle.loads` gives."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.core.plain_pickle import NotPlainData, load_plain


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - what an attacker's pickle does: run a command when loaded
        return os.system, (f"touch {self.marker}",)


def _batch(n: int = 4) -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {
        "batch_label": "training batch 1 of 5",
        "labels": [int(v) for v in rng.integers(0, 10, n)],
        "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        "filenames": [f"img_{i}.png" for i in range(n)],
    }


def _python2_style(batch: dict[str, object]) -> bytes:
    """The batch as Python 2 pickled CIFAR: numpy's `numpy.core.multiarray` name, the array's bytes a str."""

    class Py2Array:
        def __init__(self, array: np.ndarray) -> None:
            self.array = array

        def __reduce__(self):  # noqa: ANN204
            rebuild, args, state = self.array.__reduce__()
            version, shape, dtype, fortran, raw = state
            return rebuild, args, (version, shape, dtype, fortran, raw.decode("latin1"))

    data = pickle.dumps({**batch, "data": Py2Array(batch["data"])}, protocol=2)
    assert b"cnumpy._core.multiarray\n_reconstruct\n" in data
    return data.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


@pytest.mark.parametrize("style", ["python 3", "python 2"])
def test_a_genuine_batch_decodes_as_pickle_would(style: str) -> None:
    batch = _batch()
    data = pickle.dumps(batch, protocol=2) if style == "python 3" else _python2_style(batch)
    decoded, reference = load_plain(data), pickle.loads(data, encoding="latin1")
    assert decoded.keys() == reference.keys() == batch.keys()
    assert decoded["data"].dtype == np.uint8 and np.array_equal(decoded["data"], batch["data"])
    assert np.array_equal(decoded["data"], reference["data"])
    assert decoded["labels"] == batch["labels"] and decoded["filenames"] == batch["filenames"]


@pytest.mark.parametrize(
    "planted",
    ["payload", "payload beside an array", "another numpy global", "bytes by another codec"],
)
def test_a_batch_carrying_code_is_refused_and_never_runs(tmp_path: Path, planted: str) -> None:
    marker = tmp_path / "payload-ran"
    if planted.startswith("payload"):
        batch: dict[str, object] = {"labels": [1], "extra": Payload(marker)}
        if planted.endswith("array"):
            batch["data"] = np.zeros((1, 3072), np.uint8)
        data = pickle.dumps(batch, protocol=2)
        probe = tmp_path / "probe.pkl"  # live: plain pickle runs it (in a process of its own)
        probe.write_bytes(data)
        code = f"import pickle; pickle.loads(open({str(probe)!r}, 'rb').read())"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        assert marker.exists()
        marker.unlink()
        named = "posix.system"
    elif planted == "another numpy global":
        data = pickle.dumps({"data": np.load}, protocol=2)  # any callable numpy exposes, by name
        named = "numpy."
    else:
        data = b"\x80\x02c_codecs\nencode\nX\x05\x00\x00\x00helloX\x04\x00\x00\x00zlib\x86R."
        named = "zlib"
    with pytest.raises(NotPlainData, match=named.replace(".", r"\.")):
        load_plain(data)
    assert not marker.exists(), "the payload ran"
