"""One pipeline run at a time: the project lock, from the entry points' side (fast: a run that
is refused stops before it reads any data). On one host a file; across hosts an advisory lock in
the stack's PostgreSQL (a real server, made here as `make stack` makes it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.core.config.yaml_io import load_params, set_params
from tasks.core.lock import HOLDER_FILE, LOCK_FILE, LOCK_URL_ENV, LockUnavailable, PipelineBusy, pipeline_lock
from tasks.core.remote import PushFailed, push_outputs
from tests.conftest import ROOT, copy_project, free_port, run


def test_a_stage_run_by_dvc_is_refused_while_another_run_holds_the_lock(tmp_path: Path) -> None:
    repo = copy_project(tmp_path / "repo", {"orchestration": {"lock_wait_s": 1}})
    with pipeline_lock("Prefect flow run busy-bee", wait_s=0, root=repo):
        refused = run(["python", "-m", "tasks", "stats"], repo, check=False)
    assert refused.returncode == 3
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("error: stats: .dvc/tmp/lockstep-pipeline.lock: another pipeline run is in progress")
    assert "Prefect flow run busy-bee (pid" in message and "waited 1 s (orchestration.lock_wait_s)" in message
    assert "Traceback" not in refused.stderr
    assert not (repo / "artifacts").exists() and not (repo / "mlflow.db").exists()  # nothing written
    assert not (repo / HOLDER_FILE).exists()  # released with the block


def test_a_waiting_run_proceeds_when_the_holder_finishes(tmp_path: Path) -> None:
    order: list[str] = []
    with pipeline_lock("first", wait_s=0, root=tmp_path):
        waiter = threading.Thread(target=_take, args=(tmp_path, order))
        waiter.start()
        time.sleep(1.0)
        order.append("first done")
    waiter.join(timeout=30)
    assert order == ["first done", "second ran"]
    with pipeline_lock("holder", wait_s=0, root=tmp_path), pytest.raises(PipelineBusy, match="holder \\(pid"):
        _take(tmp_path, order, wait_s=0.2)


def _take(root: Path, order: list[str], wait_s: float = 30) -> None:
    with pipeline_lock("second", wait_s=wait_s, root=root):
        order.append("second ran")


def test_overrides_are_written_into_params_yaml_keeping_comments(tmp_path: Path) -> None:
    path = Path(shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml"))
    params = set_params(path, {"train.lr": 0.02, "compress.variants": ["static_int8"], "export.candidates": ["fp32"]})
    assert params.train.lr == 0.02 and params.compress.variants == ("static_int8",)
    assert load_params(path) == params
    changed = set((ROOT / "params.yaml").read_text().splitlines()) - set(path.read_text().splitlines())
    assert [line.split(":")[0].strip() for line in sorted(changed)] == ["candidates", "lr", "variants"]  # comments kept


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"train.lrr": 0.1}, "train.lrr: no such key"),
        ({"train.lr": -1}, "train.lr: Input should be greater than 0"),
        ({"nosection.x": 1}, "nosection.x: no such key"),
    ],
)
def test_bad_overrides_leave_params_yaml_untouched(tmp_path: Path, overrides: dict, fragment: str) -> None:
    from tasks.core.config.base import ConfigError

    path = Path(shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml"))
    with pytest.raises(ConfigError, match=fragment):
        set_params(path, overrides)
    assert path.read_text() == (ROOT / "params.yaml").read_text()


def test_the_download_task_retries_only_an_unreachable_source(tmp_path: Path) -> None:
    """The flow's retry condition, on real fetch failures and real Prefect states."""
    from prefect.states import Failed

    from flows.pipeline import STAGE_TASKS, _source_was_unreachable
    from tasks.core.fetch import Checksum, DownloadError, Retry, fetch
    from tests.conftest import free_port

    quick = Retry(attempts=2, backoff_s=0.01, timeout_s=2)
    checksum = Checksum("sha256", "0" * 64)
    with pytest.raises(DownloadError) as down:  # nothing listens on that port
        fetch([f"http://127.0.0.1:{free_port()}/digits.npz"], tmp_path / "a.npz", checksum, quick)
    with pytest.raises(DownloadError) as missing:
        fetch([(tmp_path / "absent.npz").as_uri()], tmp_path / "b.npz", checksum, quick)
    assert down.value.transient and not missing.value.transient
    assert _source_was_unreachable(None, None, Failed(data=down.value))
    assert not _source_was_unreachable(None, None, Failed(data=missing.value))
    assert not _source_was_unreachable(None, None, Failed(data=ValueError("a bug")))
    assert STAGE_TASKS["download"].retries == 2 and STAGE_TASKS["train"].retries == 0


# --------------------------------------------------------------------------- the lock across hosts


@pytest.fixture(scope="module")
def lock_db() -> Iterator[str]:
    """The stack's PostgreSQL (initdb in a temporary folder, as `make stack` does), on loopback: the
    pipeline lock's URL, as the stack's client environment gives it (LOCKSTEP_PIPELINE_LOCK_URL)."""
    from stack.postgres import Postgres, lock_folder
    from stack.state import open_stack

    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")) and not shutil.which("initdb"):
        pytest.skip("PostgreSQL's server is not installed (Debian: postgresql)")
    # As root, PostgreSQL runs as the `postgres` user, who must be able to enter the folder.
    shared = Path(tempfile.mkdtemp(prefix="lockstep-lock-db-"))
    shared.chmod(0o711)
    stack = open_stack(shared / "stack")
    server = Postgres(stack)
    try:
        lock_folder(stack.root)
        server.start()
        yield stack.lock_url()
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(shared, ignore_errors=True)


def test_the_database_lock_refuses_a_second_holder_naming_the_first(
    lock_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_URL_ENV, lock_db)
    order: list[str] = []
    with pipeline_lock("Prefect flow run busy-bee", wait_s=0, root=tmp_path):
        assert not (tmp_path / LOCK_FILE).exists()  # the file lock is not the one taken
        with pytest.raises(PipelineBusy) as busy:
            _take(tmp_path, order, wait_s=0.5)
        # and through an entry point, in another process: `python -m tasks stats`, as `dvc repro` runs it
        repo = copy_project(tmp_path / "repo", {"orchestration": {"lock_wait_s": 1}})
        refused = run(["python", "-m", "tasks", "stats"], repo, check=False, **{LOCK_URL_ENV: lock_db})
    port = lock_db.split(":")[2].split("/")[0]
    where = f"postgresql://127.0.0.1:{port}/pipeline_lock (advisory lock)"
    message = str(busy.value)
    assert message.startswith(f"{where}: another pipeline run is in progress: Prefect flow run busy-bee on "), message
    assert f"(pid {os.getpid()}), since 20" in message and "waited 0.5 s (orchestration.lock_wait_s)" in message
    assert "passfile" not in message and order == []
    assert refused.returncode == 3, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: stats: {where}: another pipeline run is in progress: Prefect flow run busy-bee")
    assert "Traceback" not in refused.stderr and not (repo / "artifacts").exists()


def test_the_database_lock_waits_then_runs_and_dies_with_its_holder(
    lock_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_URL_ENV, lock_db)
    order: list[str] = []
    with pipeline_lock("first", wait_s=0, root=tmp_path):
        waiter = threading.Thread(target=_take, args=(tmp_path, order))
        waiter.start()
        time.sleep(1.5)  # the waiter polls meanwhile (every POLL_S)
        order.append("first done")
    waiter.join(timeout=30)
    assert order == ["first done", "second ran"]
    # A holder that is SIGKILLed (an OOM kill, a lost machine) takes its session, and the lock, with it.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, LOCK_URL_ENV: lock_db},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(PipelineBusy, match="killed-run on"):
            _take(tmp_path, order, wait_s=0)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    _take(tmp_path, order, wait_s=10)
    assert order[-1] == "second ran"


def test_a_holder_whose_session_is_lost_stops_at_once_and_lets_the_next_run_in(
    lock_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarted, or the holder's network cut: the server ends the session and the lock
    with it. The holder's watch finds out at its next check and stops the run (in a real run: the
    process ends, as a killed one; here the stop is recorded), and the next run is not kept waiting."""
    import psycopg

    from tasks.core import lock

    stopped: list[str] = []
    seen = threading.Event()
    monkeypatch.setattr(lock, "CHECK_S", 0.2)
    monkeypatch.setattr(lock, "_stop_the_run", lambda message, logger: (stopped.append(message), seen.set()))
    monkeypatch.setenv(LOCK_URL_ENV, lock_db)
    order: list[str] = []
    with pipeline_lock("cut off", wait_s=0, root=tmp_path):
        time.sleep(0.5)
        assert not stopped  # a healthy session: checked, nothing said
        with psycopg.connect(lock_db, autocommit=True) as admin:  # the same login may end its own sessions
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            ).fetchall()
        assert ended == [(True,)]
        assert seen.wait(10), "the holder did not notice that its session was gone"
        _take(tmp_path, order, wait_s=10)  # the next run is not kept waiting
    assert order == ["second ran"]
    (message,) = stopped
    assert message.startswith("postgresql://127.0.0.1:") and "(advisory lock)" in message, message
    assert "the connection holding the pipeline lock was lost" in message and "this run stops here" in message
    assert "passfile" not in message


def test_a_holder_that_loses_its_session_ends_its_process_with_one_line(lock_db: str, tmp_path: Path) -> None:
    """The stop itself, in a process of its own: exit 1 at once, one `error:` line naming the lock."""
    import psycopg

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, LOCK_URL_ENV: lock_db},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with psycopg.connect(lock_db, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted")
        started = time.monotonic()
        assert holder.wait(timeout=30) == 1
        assert time.monotonic() - started < 10  # within CHECK_S (5 s), not after the holder's 120 s
    finally:
        holder.kill()
    _, stderr = holder.communicate(timeout=30)
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("error: postgresql://127.0.0.1:") and "this run stops here" in line, stderr


HOLD = """
import sys, time
from pathlib import Path
from tasks.core.lock import pipeline_lock
with pipeline_lock("killed-run", wait_s=0, root=Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_the_lock_login_reaches_nothing_else_and_a_bad_url_is_one_line(
    lock_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    for database in ("mlflow", "prefect", "optuna", "postgres", "template1"):
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            psycopg.connect(lock_db.replace("/pipeline_lock?", f"/{database}?")).close()
    # the lock's database down (nothing listens there): no run starts without the lock
    port = lock_db.split(":")[2].split("/")[0]
    monkeypatch.setenv(LOCK_URL_ENV, lock_db.replace(f":{port}/", f":{free_port()}/"))
    with pytest.raises(LockUnavailable) as down:
        _take(tmp_path, [], wait_s=0)
    assert "cannot take the pipeline lock" in str(down.value) and "nothing run" in str(down.value)
    assert "\n" not in str(down.value) and "passfile" not in str(down.value)
    monkeypatch.setenv(LOCK_URL_ENV, "mysql://x")
    with pytest.raises(LockUnavailable, match=f"^{LOCK_URL_ENV}: not a PostgreSQL URL"):
        _take(tmp_path, [], wait_s=0)


def test_a_run_pushes_what_it_made_to_the_default_remote_or_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a deployment run does last, under the lock (tasks/core/remote.py): a real DVC repository,
    a local remote, then a remote that cannot be written."""
    from dvc.repo import Repo

    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(repo)  # as the flow runs: from the project's root
    run(["git", "init", "-q"], repo)
    with Repo.init(str(repo)) as dvc:
        (repo / "weights.bin").write_bytes(b"trained on trainer-a")
        dvc.add("weights.bin")
    assert push_outputs(repo) == 0  # no default remote: nothing to push to, said in the log
    run(["dvc", "remote", "add", "-d", "store", str(tmp_path / "store")], repo)
    assert push_outputs(repo) == 1 and push_outputs(repo) == 0  # pushed once, then in sync
    (tmp_path / "not-a-folder").write_text("")
    run(["dvc", "remote", "add", "-d", "broken", str(tmp_path / "not-a-folder" / "store")], repo)
    (repo / "weights.bin").unlink()
    with Repo(str(repo)) as dvc:
        (repo / "weights.bin").write_bytes(b"retrained")
        dvc.add("weights.bin")
    with pytest.raises(PushFailed) as failed:
        push_outputs(repo)
    message = str(failed.value)
    assert message.startswith("dvc push to remote 'broken' failed: ") and "\n" not in message, message
