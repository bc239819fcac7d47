"""Shared fixtures: real subprocesses in temporary copies of the repository, tiny configs.

The expensive one, `dvc_repo` (a project the whole pipeline ran in), is built once per test process
(once per xdist worker); tests read it, and a test that changes a project changes a clone of it
(`clone_project`).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import yaml

from flows import prefect_settings
from flows.local_server import wait_until_healthy
from tasks.core.processes import stop_group, tune_collector

if TYPE_CHECKING:  # (imported where used: tests/support/first_run.py imports this module)
    from tests.support.first_run import TwoRuns

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Prefect used inside the test process (flows.pipeline's tasks and states) keeps its database in a
# directory of its own, not in the checkout's .prefect/ (a user's `make run` state; and a second
# xdist worker would share it). Subprocesses get the variable stripped (`subprocess_env`).
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="lockstep-tests-prefect-")
# The temporary folder of the processes tests start (`subprocess_env`): what they leave there (torchrun's
# agent, Dask's scratch space, a process a test killed) goes when this process exits, with PREFECT_HOME.
SUBPROCESS_TMP = tempfile.mkdtemp(prefix="lockstep-tests-tmp-")


def _remove_at_exit(*folders: str) -> None:
    for folder in folders:
        try:
            shutil.rmtree(folder)
        except OSError as exc:  # a process a test started may still be writing there
            print(f"lockstep tests: {folder} not removed: {exc}", file=sys.stderr)


atexit.register(_remove_at_exit, os.environ["PREFECT_HOME"], SUBPROCESS_TMP)
# The project's other Prefect settings (each yields to PREFECT_HOME above), as an entry point applies them:
# the flows tests run in this process see Prefect as `make run` does. (How OpenMP's threads wait, set
# before torch loads, is tests/support/cpu_pin.py's.)
prefect_settings.configure()

# The test process loads torch, MLflow, Prefect and DVC as the entry points do, and has its collector set as
# theirs is (full collections rare while it imports, none at its exit: tasks/core/processes.py).
tune_collector()

# The MLflow servers tests start (`make ui`, `make mlflow-server`, the team stack's) run one uvicorn
# worker, not MLflow's default four: each worker is a process that imports MLflow and opens the store,
# CPU that two cores running three test workers have none to spare for, and one serves a test's
# requests. (The stack's servers inherit it from this process's environment.)
MLFLOW_WORKERS = "1"
os.environ["MLFLOW_WORKERS"] = MLFLOW_WORKERS

# The DVC repositories tests make with `dvc init` lack the project's `core.analytics = false`: every DVC
# command there would start a background process posting a report to analytics.dvc.org. Tests reach
# loopback and their own namespaces only.
os.environ["DVC_NO_ANALYTICS"] = "1"

# Tests shrink the config, not the code.
TINY: dict[str, Any] = {
    # Enough epochs for a model that has learnt digits (val accuracy ~0.98 in ~4 s): after 2, one
    # machine's run sat at 0.72 and its int8 copy failed the export gates, another's passed.
    "train": {"epochs": 6, "num_workers": 0},
    "determinism": {"num_threads": 1},
    # the variant export ships (a pruned one too in the shared project, SHARED_PROJECT; every other in
    # tests/ship/test_compress_export.py): each variant more fine-tunes, exports and times a model again
    "compress": {
        "variants": ["static_int8"],
        "calibration_size": 128,
        "finetune_epochs": 1,
        "qat_epochs": 1,
        "latency_runs": 20,
        "latency_warmup": 1,
    },
    # A short-trained model sits nearer decision boundaries, so int8 flips a few more of its 271
    # test predictions than a fully trained one does (failing gates: tests/ship/test_compress_export.py).
    "export": {"min_top1_agreement": 0.95, "max_accuracy_drop": 0.03},
}


# The shared project (`dvc_repo`, and the first `make run`s compared with it) on top of TINY: one quantized
# and one pruned variant, so that a pipeline run builds and measures a pruned model too.
SHARED_PROJECT: dict[str, Any] = {"compress": {"variants": ["static_int8", "pruned_l1"]}}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_params(path: Path, override: dict[str, Any], base: Path = ROOT / "params.yaml") -> Path:
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(base.read_text()), override), sort_keys=False))
    return path


# `make test ARGS=-k x` passes ARGS (and its other variables) to every make below it through the
# environment: a test's own `make run` would then run with the developer's pytest arguments.
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLFLOW_", "PREFECT_", "LOCKSTEP_", "DVC_")) and k not in MAKE_VARIABLES
    }
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["MLFLOW_WORKERS"] = MLFLOW_WORKERS
    env["DVC_NO_ANALYTICS"] = "1"
    env["TMPDIR"] = SUBPROCESS_TMP
    # No Prefect server kept after a test's run (flows/kept_server.py): each project copy's would idle for
    # minutes beside the other tests; tests/flows/test_kept_server.py keeps one on purpose
    env["LOCKSTEP_PREFECT_SERVER_IDLE_S"] = "0"
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a command like a user would; on failure show its output in the assertion."""
    done = subprocess.run(cmd, cwd=cwd, env=subprocess_env(**env), capture_output=True, text=True, timeout=900)
    if check and done.returncode != 0:
        shown = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}\n{shown}")
    return done


def _git_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    # dvc.lock is the checkout's own pipeline state (a developer's `make run` writes it, untracked):
    # a copy is a project whose pipeline has not run yet
    return [name for name in listed.split("\0") if name and name != "dvc.lock" and (ROOT / name).is_file()]


def copy_project(dest: Path, override: dict[str, Any] | None = None) -> Path:
    """A fresh clone-like copy of the repository in `dest`: own git history, no data/, no outputs,
    params shrunk by TINY (+ `override`)."""
    for rel in _git_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    write_params(dest / "params.yaml", merge(TINY, override or {}))
    run(["git", "init", "-q"], dest)
    commit_all(dest, "test copy")
    return dest


GIT = ["git", "-c", "user.name=lockstep-tests", "-c", "user.email=tests@lockstep.invalid"]


def commit_all(repo: Path, message: str) -> None:
    """Commit everything git does not ignore: what `dvc exp run` takes as its baseline."""
    run([*GIT, "add", "-A"], repo)
    run([*GIT, "commit", "-q", "-m", message], repo)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PREFECT_WORKER_GRACE_S = 3.0  # how long `stop_prefect_worker` waits after each SIGTERM


def stop_prefect_worker(proc: subprocess.Popen[Any]) -> None:
    """Stop a `prefect worker start` process by PID, and the process group it leads, if it leads one.

    Why not stop_group: Prefect 3.8.8's process worker answers its first SIGTERM (or Ctrl-C) by
    sending itself SIGINT, and then goes on polling, idle, for minutes (seen here 2026-12-05: still up
    after 11 min), so stop_group waited its 30 s for nothing at each teardown. Its second SIGTERM is
    Prefect's own escalation: the worker SIGKILLs itself."""
    own_group = proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    for _ in range(2):
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=PREFECT_WORKER_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if own_group:  # the flow-run processes it started, if any is left
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def service(
    cmd: list[str],
    cwd: Path,
    health_url: str,
    log: Path,
    timeout_s: float = 180,
    *,
    ready: bool = True,
    stop: Callable[[subprocess.Popen[bytes]], None] = stop_group,
    **env: str,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server process for the block: started in its own process group, ready when `health_url`
    answers 200, stopped by PID with `stop` (SIGTERM to the group, SIGKILL after 30 s). Its output goes
    to `log`.

    `ready=False` yields it as soon as it started, for servers that start side by side: the caller
    then waits with `until_healthy`."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=subprocess_env(**env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            if ready:
                until_healthy(proc, health_url, log, timeout_s)
            yield proc
        finally:
            stop(proc)


def until_healthy(proc: subprocess.Popen[Any], health_url: str, log: Path, timeout_s: float = 180) -> None:
    """Block until `health_url` answers 200; fail with the end of the server's `log` if it exits first."""
    try:
        wait_until_healthy(health_url, proc, timeout_s)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}\n--- {log}:\n{log.read_text()[-5000:]}") from None


def listening(proc: subprocess.Popen | psutil.Process) -> set[str]:
    """host:port of every listening TCP socket of `proc` and its descendants."""
    root = psutil.Process(proc.pid)
    found = set()
    for member in (root, *root.children(recursive=True)):
        try:
            connections = member.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found |= {f"{c.laddr.ip}:{c.laddr.port}" for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def client_for(repo: Path) -> Any:
    """An MlflowClient on a test project's sqlite store."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def with_environment(repo: Path) -> Path:
    """The project's `make` targets work in `repo`: the environment they would create, already made."""
    for env_dir in (".venv", ".uv"):
        (repo / env_dir).symlink_to(ROOT / env_dir)
    return repo


def clone_project(source: Path, dest: Path) -> Path:
    """A copy of a test project, to change without touching `source` (shared by other tests).

    Its MLflow store is relocated too: the sqlite store records absolute artifact locations, which
    would otherwise still point into `source` (a run logged in the copy would write there).
    """
    shutil.copytree(source, dest, symlinks=True)
    store = dest / "mlflow.db"
    if store.exists():
        old, new = str(source), str(dest)
        with closing(sqlite3.connect(store)) as db, db:
            tables = [name for (name,) in db.execute("select name from sqlite_master where type = 'table'")]
            for table in tables:
                for column in db.execute(f"pragma table_info('{table}')").fetchall():
                    name, kind = column[1], column[2].upper()
                    if "CHAR" in kind or "TEXT" in kind:
                        db.execute(f'update "{table}" set "{name}" = replace("{name}", ?, ?)', (old, new))
    return dest


def _once_per_run(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, build: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """`build(folder)`'s record (JSON), built once per test run: under xdist the first worker to need it
    builds it (the others wait on a file lock) in the run's common temporary directory."""
    if worker_id == "master":  # one process: nothing to share
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # this run's, common to its workers
    record = shared / f"{name}.json"
    with FileLock(shared / f"{name}.lock"):
        if not record.exists():
            record.write_text(json.dumps(build(shared / name), default=str))
    return json.loads(record.read_text())


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory: pytest.TempPathFactory, worker_id: str, prefect_database: Path) -> dict[str, Any]:
    """A copy reproduced by `dvc repro` (every stage, MLflow on), with what it looked like right after.

    Built once per test run. Tests only read it; a test that changes a project clones it (`clone_project`).
    """
    loaded = _once_per_run(tmp_path_factory, worker_id, "dvc", lambda base: _build_dvc_repo(base, prefect_database))
    return {**loaded, "repo": Path(loaded["repo"])}


@pytest.fixture(scope="session")
def first_make_runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> TwoRuns:
    """A fresh copy's first `make run`, started twice at once (tests/support/first_run.py); built once per
    test run. Tests only read it; a test that changes the project clones it."""
    from tests.support.first_run import TwoRuns, two_make_runs

    return TwoRuns.from_record(
        _once_per_run(tmp_path_factory, worker_id, "two", lambda base: two_make_runs(base).record())
    )


@dataclass(frozen=True)
class PrefectServer:
    """A Prefect server of the test worker's: `env` points a flow run at it (`run(..., **prefect_server.env)`),
    as `PREFECT_API_URL` names a user's server; its database lies in `home`."""

    env: dict[str, str]
    home: Path


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory, prefect_database: Path) -> Iterator[PrefectServer]:
    """One Prefect server for a module's flow runs whose subject is what the flow does, not the server
    it starts for itself: each such start costs several CPU-seconds that a test reading a flow's result
    has no use for. Module-wide, not session-wide: an idle server still takes a little of a core, and
    a module's flow runs come one after another. The flow's own server is tested where it is the
    subject: the first `make run`s (tests/support/first_run.py, whose Prefect database
    tests/flows/test_e2e.py reads), the bind test (tests/reliability/test_server_binds.py) and the
    benchmarks' no-op and whole-pipeline runs.
    """
    from flows.local_server import LocalServer

    home = seed_prefect_home(tmp_path_factory.mktemp("prefect-server"), prefect_database)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_HOME", str(home))
        server = LocalServer(ephemeral=True, quiet=True, die_with_parent=True)
    try:
        yield PrefectServer({"PREFECT_API_URL": server.wait(), "PREFECT_API_AUTH_STRING": server.auth_string}, home)
    finally:
        server.stop()


# A Prefect server started on an empty database first runs all of Prefect's migrations, which take longer
# than the rest of its start together. The database a server leaves is made once per test run (`prefect_database`)
# and copied into the Prefect home of each server a test starts for a project of its own, as a project's
# first `make run` leaves it; what a test examines is never the migrations. The cold start is tested
# where it is the subject: the first `make run`s (tests/support/first_run.py) and the benchmarks' runs.
PREFECT_DATABASE = """
from flows.local_server import LocalServer
server = LocalServer(ephemeral=True, quiet=True)
server.wait()
server.stop()
"""


def _build_prefect_database(folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-c", PREFECT_DATABASE], ROOT, PREFECT_HOME=str(folder))
    return {"database": str(folder / "prefect.db")}


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A migrated Prefect database (SQLite), made once per test run; tests copy it (`seed_prefect_home`)."""
    return Path(_once_per_run(tmp_path_factory, worker_id, "prefect-database", _build_prefect_database)["database"])


def seed_prefect_home(home: Path, database: Path) -> Path:
    """`home` (a PREFECT_HOME) holding a copy of the migrated `database`, unless it has a database already.
    Copied through SQLite's backup API: the server left part of it in its write-ahead log."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        with closing(sqlite3.connect(database)) as source, closing(sqlite3.connect(home / "prefect.db")) as copy:
            source.backup(copy)
    return home


def _build_dvc_repo(base: Path, prefect_db: Path) -> dict[str, Any]:
    repo = copy_project(base / "repo", SHARED_PROJECT)
    committed_data_dvc = (repo / "data.dvc").read_text()
    # A fresh clone has no data/ yet: the download stage (or `dvc pull`) brings it first.
    first = run(["dvc", "repro", "download"], repo)
    second = run(["dvc", "repro"], repo)
    # The project's Prefect database, as a project's first `make run` leaves it: a flow run or `serve` in
    # a clone then starts its server in seconds (PREFECT_DATABASE).
    seed_prefect_home(repo / ".prefect", prefect_db)
    return {
        "repo": repo,
        "committed_data_dvc": committed_data_dvc,
        "outputs": [first.stdout, second.stdout],
        "lock": yaml.safe_load((repo / "dvc.lock").read_text()),
        "weights": sha256(repo / "artifacts/train/last.safetensors"),
    }


# Seconds each module's tests took on a 2-core machine, its fast tier's and its slow ones' apart
# (`LOCKSTEP_RECORD_DURATIONS=1 make test-all` writes them): {"module": {"fast": s, "slow": s}}. xdist
# hands whole modules (all of tests/hosts/ as one unit) to its workers in collection order; the longest
# go first, so that the run does not end on a long module with the other workers idle. A unit's length
# counts only the kinds of test this run selected: in `make test` a module of one fast test beside a
# slow fixture is short. Only an order: a stale or missing entry costs time, never a result; the tests
# within a module keep pytest-randomly's order.
MODULE_DURATIONS = Path(__file__).parent / "module_durations.json"
KINDS = ("fast", "slow")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _unit(module: str) -> str:
    """The unit of work xdist hands a worker (`OneBed` below): the module, or the whole bed."""
    return BED_SCOPE if module.startswith(BED_SCOPE) else module


def _kind(keywords: Any) -> str:
    return "slow" if "slow" in keywords else "fast"


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected what this run leaves out
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    recorded = json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.exists() else {}
    selected = {(_module(item), _kind(item.keywords)) for item in items}
    seconds: dict[str, float] = {}
    for module, kind in selected:
        spent = recorded.get(module, {}).get(kind, 0.0)
        seconds[_unit(module)] = seconds.get(_unit(module), 0.0) + spent
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(_unit(_module(item)), index)
    items.sort(key=lambda item: (-seconds.get(_unit(_module(item)), 0.0), first_seen[_unit(_module(item))]))


_spent: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("LOCKSTEP_RECORD_DURATIONS") == "1":
        module = _spent.setdefault(report.nodeid.split("::")[0], dict.fromkeys(KINDS, 0.0))
        module[_kind(report.keywords)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _spent and not hasattr(session.config, "workerinput"):  # the controller sees every report
        # merged into what is there: a run of one tier (or of a few modules) keeps the others' figures
        recorded = json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.exists() else {}
        for module, spent in _spent.items():
            ran = {kind: round(seconds) for kind, seconds in spent.items() if seconds > 0}
            recorded[module] = {**dict.fromkeys(KINDS, 0), **recorded.get(module, {}), **ran}
        MODULE_DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=2) + "\n")


# The multi-host bed (tests/hosts/) is one unit of work for xdist: its modules share one bed and one team
# stack (package fixtures, ~1 min to make and a trained run on top), which a second worker taking one of
# them would make again. Every other test keeps `--dist loadscope`'s module grouping.
BED_SCOPE = "tests/hosts/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own choice

    from xdist.scheduler import LoadScopeScheduling

    class OneBed(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return BED_SCOPE if nodeid.startswith(BED_SCOPE) else super()._split_scope(nodeid)

    return OneBed(config, log)
