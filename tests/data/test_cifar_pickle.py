"""The CIFAR source decodes its pickled batches without running code (issue 66, point 9).

A batch that matches every md5 the download checks (a planted cache, a collision, a mirror whose
archive was recomputed with the attacker's batch) but whose pickle calls a function is refused by
name, and the function never runs: tasks/core/plain_pickle.py rebuilds numpy arrays and nothing else.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torchvision.datasets

from benchmarks.fakedata.cifar import cifar_archive
from benchmarks.httpserver import FileServer
from tasks.core.config.data import DataConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import Retry
from tasks.core.tar import tarfile  # the `data` filter on every Python 3.11 (Debian's is 3.11.2)
from tasks.data.download import download

FAST = Retry(attempts=2, backoff_s=0.05, timeout_s=2.0)


class _Payload:
    """Unpickled by `pickle.load`, this creates the marker file: code from the batch runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.makedirs, (str(self.marker),))


@pytest.fixture
def server() -> Iterator[FileServer]:
    with FileServer() as srv:
        yield srv


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_a_cifar_batch_that_calls_a_function_is_refused_and_never_runs(
    tmp_path: Path, server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = cifar_archive(tmp_path / "files", "cifar10")
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive.path) as tar:
        tar.extractall(unpacked, filter="data")
    marker = tmp_path / "the batch ran code"
    batch = unpacked / archive.base_folder / archive.train_list[0][0]
    genuine = pickle.loads(batch.read_bytes())  # the test's own fake file: the reference decode
    genuine["labels"] = _Payload(marker)
    batch.write_bytes(pickle.dumps(genuine, protocol=2))
    # every md5 the download checks now names the planted files
    planted = tmp_path / archive.path.name
    with tarfile.open(planted, "w:gz") as tar:
        tar.add(unpacked / archive.base_folder, arcname=archive.base_folder)
    train_list = [[name, _md5(unpacked / archive.base_folder / name)] for name, _ in archive.train_list]
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "tgz_md5", _md5(planted))
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "train_list", train_list)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "test_list", archive.test_list)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "meta", archive.meta)
    server.add_file(f"/mirror/{planted.name}", planted)

    with pytest.raises(ExpectedFailure, match=r"calls os\.makedirs, which is not plain data"):
        download(DataConfig(source="cifar10", mirror=f"{server.url}/mirror/"), tmp_path / "data", tmp_path / "c", FAST)

    assert not marker.exists()
    assert not (tmp_path / "data").exists()
