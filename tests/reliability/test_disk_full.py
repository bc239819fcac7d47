"""Disk full while writing outputs: a clear error, the previous outputs intact.

Two ways: a write that fails with ENOSPC half-way (faults/sitecustomize.py, any output, any machine),
and a real full filesystem (a small tmpfs mounted over artifacts/train in a private mount namespace).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env, write_params
from tests.reliability.conftest import Trained, clone, digests, stage
from tests.support.cli_errors import one_line_error

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("name", "target", "shown"),
    [
        ("train", "best.safetensors", "artifacts/train"),  # a checkpoint, written with the other train outputs
        ("stats", "stats.json", "artifacts/stats/stats.json"),  # a JSON output
        ("preprocess", "train_images.npy", "artifacts/preprocessed"),  # a directory output
    ],
)
def test_a_full_disk_fails_the_stage_clearly_and_keeps_the_previous_outputs(
    trained: Trained, tmp_path: Path, name: str, target: str, shown: str
) -> None:
    repo = clone(trained, tmp_path / "repo")
    write_params(repo / "params.yaml", {"seed": 7, "train": {"epochs": 1}}, base=repo / "params.yaml")
    error = one_line_error(stage(repo, name, "enospc", target))
    assert error.startswith(f"error: {name}: {shown}: could not write it: No space left on device"), error
    assert "the previous version is unchanged" in error
    after = {k: v for k, v in digests(repo).items() if not k.startswith("artifacts/train-resume/")}
    assert after == trained.digests  # every output as it was, and no temporary left behind


def _mount_namespaces_work() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(
    not _mount_namespaces_work(),
    reason="this kernel refuses unprivileged mount namespaces (the ENOSPC cases above cover the behaviour)",
)
def test_a_real_full_filesystem(trained: Trained, tmp_path: Path) -> None:
    repo = clone(trained, tmp_path / "repo")
    write_params(repo / "params.yaml", {"seed": 7, "train": {"epochs": 1}}, base=repo / "params.yaml")
    train_dir = repo / "artifacts/train"
    saved = tmp_path / "saved"
    shutil.copytree(train_dir, saved)
    used = sum(-(-p.stat().st_size // 4096) * 4096 for p in saved.iterdir())
    # Room for the current outputs and 8 KiB more: the new checkpoints do not fit next to the old ones.
    script = f"""set -e
        mount -t tmpfs -o size={used + 8192} tmpfs {train_dir}
        cp -a {saved}/. {train_dir}/
        set +e
        {sys.executable} -m tasks train 2> {tmp_path}/stderr
        echo $? > {tmp_path}/rc
        cd {train_dir} && sha256sum * > {tmp_path}/after && ls -A > {tmp_path}/listing
    """
    subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=repo,
        check=True,
        env=subprocess_env(),
        timeout=600,
    )
    stderr = (tmp_path / "stderr").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", stderr
    assert "Traceback" not in stderr
    assert "error: train: artifacts/train: could not write it: No space left on device" in stderr, stderr
    before = {path.removeprefix("saved/"): digest for path, digest in digests(tmp_path, "saved").items()}
    after = dict(reversed(line.split()) for line in (tmp_path / "after").read_text().splitlines())
    assert after == before  # the previous outputs, byte for byte
    assert sorted((tmp_path / "listing").read_text().split()) == sorted(before)  # and nothing else
