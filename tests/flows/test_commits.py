"""The flow's dvc.lock records (flows/commits.py): stages committed together write what `dvc commit -f`
writes for each, quick stages wait for the next commit, and a failing run still records what ran."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import yaml

from flows import commits
from flows.commits import PendingCommits, commit_stages
from tasks.core.config.yaml_io import text_with_overrides
from tests.conftest import run

# three stages in a row; b reads a key whose value is null (how dvc.lock writes it is checked below)
DVC_YAML = {
    "stages": {
        "a": {"cmd": "cp in.txt a.txt", "deps": ["in.txt"], "outs": ["a.txt"]},
        "b": {"cmd": "cp a.txt b.txt", "deps": ["a.txt"], "params": ["x"], "outs": ["b.txt"]},
        "c": {"cmd": "cp b.txt c.txt", "deps": ["b.txt"], "outs": ["c.txt"]},
    }
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git and DVC project whose three stages' outputs exist, none of them in dvc.lock yet."""
    repo = tmp_path_factory.mktemp("commits") / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (repo / "params.yaml").write_text("x:\n  y: null\n  z: 3\n")
    for name in ("in", "a", "b", "c"):
        (repo / f"{name}.txt").write_text("same\n")
    return repo


def _copy(made: Path, dest: Path) -> Path:
    shutil.copytree(made, dest, symlinks=True)
    return dest


def _stale(repo: Path) -> set[str]:
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        return {name.split(":")[-1] for name in dvc.status()}


def test_stages_committed_together_write_what_dvc_commit_writes_for_each(
    made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = _copy(made, tmp_path / "ours"), _copy(made, tmp_path / "theirs")
    monkeypatch.chdir(ours)  # where the flow runs (pipeline_flow.py: the project root)
    _override_with_null()  # as a flow run with `--set` does first: its null style once leaked into dvc.lock

    commit_stages(ours, ["a", "b"])
    for stage in ("a", "b"):
        run(["dvc", "commit", "-f", "-q", stage], theirs)

    assert (ours / "dvc.lock").read_text() == (theirs / "dvc.lock").read_text()
    assert "y:\n" in (ours / "dvc.lock").read_text()  # DVC's style for null, not `y: null`
    assert _stale(ours) == {"c"}  # the stage not named stays unrecorded
    commit_stages(ours, [])  # nothing ran: nothing written
    assert _stale(ours) == {"c"}


def test_stages_that_come_out_as_recorded_leave_dvc_lock_as_it_was(
    made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-read source that had not changed: its stage ran again to the same outputs, and dvc.lock (which
    DVC would write again whole, ~1 s for the project's) is not touched; a changed output still is."""
    ours = _copy(made, tmp_path / "ours")
    monkeypatch.chdir(ours)
    commit_stages(ours, ["a", "b"])
    lock = ours / "dvc.lock"
    recorded, written_at = lock.read_text(), lock.stat().st_mtime_ns
    (ours / "a.txt").write_text("same\n")  # stage a ran again: the same bytes, a new file
    commit_stages(ours, ["a", "b"])
    assert lock.stat().st_mtime_ns == written_at and lock.read_text() == recorded

    (ours / "b.txt").write_text("other\n")  # b now puts out something else: its entry is written
    commit_stages(ours, ["a", "b"])
    assert lock.read_text() != recorded and _stale(ours) == {"c"}


def _override_with_null() -> None:
    """What `python -m flows.pipeline --set KEY=null` does in the flow's process before it commits."""
    text, _ = text_with_overrides(
        "data:\n  mirror: https://mirror.example/data\n", {"data.mirror": None}, "params.yaml"
    )
    assert "mirror: null" in text  # params.yaml's own style is kept there


def test_quick_stages_wait_for_the_next_commit_and_a_long_one_commits_them_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    written: list[list[str]] = []
    monkeypatch.setattr(commits, "commit_stages", lambda root, stages: written.append(list(stages)))
    with PendingCommits(tmp_path, commit_after_s=30).flushed() as pending:
        pending.ran("download", 4.0)
        pending.ran("stats", 1.0)
        assert written == []  # 5 s of work: a kill would redo 5 s
        pending.ran("train", 300.0)
        assert written == [["download", "stats", "train"]]
        pending.ran("evaluate", 2.0)
        pending.ran("export", 3.0)
    assert written == [["download", "stats", "train"], ["evaluate", "export"]]


def test_a_failing_run_commits_what_ran_before_the_failure_and_raises_the_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    written: list[list[str]] = []
    monkeypatch.setattr(commits, "commit_stages", lambda root, stages: written.append(list(stages)))
    with pytest.raises(KeyboardInterrupt), PendingCommits(tmp_path).flushed() as pending:
        pending.ran("stats", 1.0)
        raise KeyboardInterrupt  # Ctrl-C during the next stage
    assert written == [["stats"]]

    def broken(root: Path, stages: list[str]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(commits, "commit_stages", broken)
    with caplog.at_level(logging.ERROR, logger=commits.__name__), pytest.raises(RuntimeError, match="the stage's"):
        with PendingCommits(tmp_path).flushed() as pending:
            pending.ran("stats", 1.0)
            raise RuntimeError("the stage's own failure")  # is what the run reports, not the commit's
    assert "could not record the stages" in caplog.text and "disk full" in caplog.text
    with pytest.raises(OSError, match="disk full"), PendingCommits(tmp_path).flushed() as pending:
        pending.ran("stats", 1.0)  # a run that succeeded and could not record it fails
