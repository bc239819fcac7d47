"""`python -m tasks.tools.reproduce` against a run record planted by someone who can write runs on a shared
tracking server (issue 18, points 1, 3 and 4): each attack is refused, exit 2 and one line, before
anything is checked out, hashed or run; and a one-node DDP job listens on loopback only.

Fast: the runs are planted in a sqlite MLflow store with tiny artifacts, the "project" is a small
git repository with the refs an attacker could point at (a stash, an unreachable commit, a fetched
pull request, a remote-tracking branch); reproduce runs in-process, except one real
`python -m tasks.tools.reproduce` and one real torchrun job of two gloo ranks.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tasks.core import layout
from tasks.core.config.params import Params
from tasks.tools.reproduce import ReproduceError, ReproduceReport, main
from tasks.tools.reproduce import cli as reproduce_cli
from tasks.tools.reproduce import record as reproduce_record
from tasks.tools.reproduce import report as reproduce_report
from tasks.tools.reproduce import workspace as reproduce_workspace
from tasks.train.launcher import launch_env, torchrun_command
from tests.conftest import ROOT, merge, run

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "-c", "commit.gpgsign=false"]
DATA_DVC = {"outs": [{"md5": "0123456789abcdef0123456789abcdef.dir", "size": 1, "nfiles": 1, "path": "data"}]}
STOPPED = "stopped here by the test: the code was checked out"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def _commit_tree(repo: Path, marker: str) -> str:
    """A commit no ref holds, whose tasks/marker.txt says `marker`."""
    blob = subprocess.run(
        [*GIT, "hash-object", "-w", "--stdin"], cwd=repo, input=marker, capture_output=True, text=True, check=True
    ).stdout.strip()
    tasks = subprocess.run(
        [*GIT, "mktree"],
        cwd=repo,
        input=f"100644 blob {blob}\tmarker.txt\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = subprocess.run(
        [*GIT, "mktree"], cwd=repo, input=f"040000 tree {tasks}\ttasks\n", capture_output=True, text=True, check=True
    ).stdout.strip()
    return _git(repo, "commit-tree", tree, "-m", marker)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A git repository with commits on a branch, a tag, and in places an attacker can name."""
    repo = tmp_path_factory.mktemp("project")
    _git(repo, "init", "-q", "-b", "main")
    (repo / "tasks").mkdir()
    (repo / "tasks" / "marker.txt").write_text("main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "main")
    commits = {"branch": _git(repo, "rev-parse", "HEAD")}
    (repo / "tasks" / "marker.txt").write_text("stash")
    _git(repo, "stash", "-q")
    commits["stash"] = _git(repo, "rev-parse", "refs/stash")
    commits["unreachable"] = _commit_tree(repo, "unreachable")
    commits["pull"] = _commit_tree(repo, "pull")
    _git(repo, "update-ref", "refs/pull/7/head", commits["pull"])
    commits["remote"] = _commit_tree(repo, "remote")
    _git(repo, "update-ref", "refs/remotes/origin/feature", commits["remote"])
    commits["tag"] = _commit_tree(repo, "tag")
    _git(repo, "tag", "v1", commits["tag"])
    commits["unknown"] = "f" * 40
    return {"repo": repo, "commits": commits}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mlflow import MlflowClient

    where = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{where / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("lockstep", artifact_location=(where / "artifacts").as_uri())
    return {"uri": uri, "client": client, "experiment": experiment, "files": tmp_path_factory.mktemp("planted")}


def plant(
    store: dict[str, Any],
    commit: str,
    params: dict[str, Any] | None = None,
    lock: dict[str, Any] | None = None,
    data_dvc: dict[str, Any] | None = None,
    extra: dict[str, bytes] | None = None,
) -> str:
    """A train run as the attacker logs it: its reproduce/ record, checkpoints, and `extra` files."""
    client = store["client"]
    run_id = client.create_run(store["experiment"], tags={"lockstep.stage": "train", "git.commit": commit}).info.run_id
    files = store["files"] / run_id
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    contents = {
        "reproduce/params.yaml": yaml.safe_dump(merge(base, params or {}), sort_keys=False).encode(),
        "reproduce/data.dvc": yaml.safe_dump(data_dvc or DATA_DVC).encode(),
        "checkpoints/best.safetensors": b"best",
        "checkpoints/last.safetensors": b"last",
        **({"reproduce/dvc.lock": yaml.safe_dump(lock).encode()} if lock is not None else {}),
        **(extra or {}),
    }
    for name, content in contents.items():
        path = files / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    for folder in ("reproduce", "checkpoints"):
        client.log_artifacts(run_id, str(files / folder), folder)
    return run_id


@pytest.fixture
def cli(
    store: dict[str, Any], project: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """`python -m tasks.tools.reproduce ...` in-process, on the planted store and project, its temporary
    directories in tmp_path/tmp; returns (exit code, stderr). Data is never fetched: the test stops
    there (after the checkout) with a refusal of its own."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(layout, "project_root", lambda: project["repo"])

    def stop(*args: Any) -> str:
        raise ReproduceError(STOPPED)

    monkeypatch.setattr(reproduce_workspace, "bring_data", stop)

    def call(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err

    yield call
    assert list((tmp_path / "tmp").iterdir()) == []  # every temporary workspace was removed


def _refused(code: int, err: str) -> str:
    """The one error line of a refusal (exit 3, no traceback)."""
    lines = err.strip().splitlines()
    assert code == 3 and "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


# --------------------------------------------------------------------------- point 1: the code's commit


@pytest.mark.parametrize("where", ["stash", "unreachable", "pull", "remote"])
def test_a_commit_on_no_local_branch_or_tag_is_refused_unless_named(
    where: str,
    project: dict[str, Any],
    store: dict[str, Any],
    cli: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    commit = project["commits"][where]
    run_id = plant(store, commit)
    work = tmp_path / "work"
    error = _refused(*cli(run_id, "--workdir", str(work), capsys=capsys))
    assert error == (
        f"error: run {run_id}: its commit {commit} is on no local branch or tag of {project['repo']} (a stash, a "
        "fetched pull request or remote branch, an unreachable object?): its code is not rebuilt unless you name "
        f"it with --trust-commit {commit}"
    )
    assert not (work / "workspace").exists()  # nothing checked out
    # another commit named does not trust this one
    other = project["commits"]["branch"]
    _refused(*cli(run_id, "--workdir", str(tmp_path / "w2"), "--trust-commit", other, capsys=capsys))
    assert not (tmp_path / "w2" / "workspace").exists()
    # named by the user: rebuilt from it
    named = tmp_path / "named"
    assert _refused(*cli(run_id, "--workdir", str(named), "--trust-commit", commit[:12], capsys=capsys)).endswith(
        STOPPED
    )
    assert (named / "workspace" / "tasks" / "marker.txt").read_text() == where


@pytest.mark.parametrize("where", ["branch", "tag"])
def test_a_commit_on_a_local_branch_or_tag_is_rebuilt_and_only_the_named_files_are_downloaded(
    where: str,
    project: dict[str, Any],
    store: dict[str, Any],
    cli: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    junk = {"checkpoints/junk.bin": b"x" * 4096, "reproduce/junk.txt": b"y"}
    run_id = plant(store, project["commits"][where], extra=junk)
    work = tmp_path / "work"
    assert _refused(*cli(run_id, "--workdir", str(work), capsys=capsys)).endswith(STOPPED)
    assert (work / "workspace" / "tasks" / "marker.txt").read_text() == ("main" if where == "branch" else "tag")
    assert sorted(p.name for p in (work / "record").rglob("*") if p.is_file()) == [
        "best.safetensors",
        "data.dvc",
        "last.safetensors",
        "params.yaml",
    ]
    assert stat.S_IMODE(work.stat().st_mode) == 0o700  # the record and workspace are private


def test_an_unknown_commit_is_refused_not_replaced_by_the_current_code_unless_asked(
    project: dict[str, Any], store: dict[str, Any], cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n, commit in enumerate([project["commits"]["unknown"], "none (not a git repository)\nerror: forged line"]):
        run_id = plant(store, commit)
        error = _refused(*cli(run_id, "--workdir", str(tmp_path / f"refused{n}"), capsys=capsys))
        shown = commit if n == 0 else repr(commit)  # a newline in the tag forges no second line
        assert error == (
            f"error: run {run_id}: its commit {shown} is not in the repository at {project['repo']}: fetch it, or "
            "pass --use-current-code to rebuild with the current tasks/ (which may differ from the run's)"
        )
        assert not (tmp_path / f"refused{n}" / "workspace").exists()
    current = tmp_path / "current"
    assert _refused(*cli(run_id, "--workdir", str(current), "--use-current-code", capsys=capsys)).endswith(STOPPED)
    assert (current / "workspace" / "tasks" / "marker.txt").read_text() == "main"


# --------------------------------------------------------------------------- point 1: the params


def _attacker() -> socket.socket:
    """A listening socket on loopback: the attacker's c10d store."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def _no_connection(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def test_a_run_asking_for_other_machines_is_refused_and_its_rendezvous_never_contacted(
    project: dict[str, Any], store: dict[str, Any], tmp_path: Path
) -> None:
    """The issue's attack, as a user meets it: `python -m tasks.tools.reproduce` (a real process)."""
    with _attacker() as attacker:
        endpoint = f"127.0.0.1:{attacker.getsockname()[1]}"
        params = {"train": {"strategy": "ddp", "nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": endpoint}}
        run_id = plant(store, project["commits"]["branch"], params)
        (tmp_path / "tmp").mkdir()
        done = run(
            [sys.executable, "-m", "tasks.tools.reproduce", run_id],
            ROOT,
            check=False,
            MLFLOW_TRACKING_URI=store["uri"],
            TMPDIR=str(tmp_path / "tmp"),
        )
        time.sleep(0.2)
        assert _no_connection(attacker)
    assert done.stdout == "" and _refused(done.returncode, done.stderr) == (
        f"error: run {run_id}: its params ask for train.nnodes: 2 (a rendezvous with other machines at "
        f"train.rdzv_endpoint {endpoint}): reproduce rebuilds on this machine only"
    )
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"train": {"epochs": 10**6}}, "its reproduce/params.yaml is refused: train.epochs: Input should be less"),
        (
            {"determinism": {"num_threads": 99999999999}},
            "its reproduce/params.yaml is refused: determinism.num_threads",
        ),
        ({"train": {"bogus": 1}}, "its reproduce/params.yaml is refused: train.bogus: Extra inputs"),
        (
            {"train": {"strategy": "ddp", "nproc_per_node": (os.cpu_count() or 1) + 1}},
            f"its params ask for train.nproc_per_node: {(os.cpu_count() or 1) + 1} processes, more than",
        ),
        (
            {"train": {"pretrained_url": "http://127.0.0.1:9/w.safetensors", "pretrained_sha256": "ab" * 32}},
            "its params fetch pretrained weights from http://127.0.0.1:9/w.safetensors: reproduce downloads nothing",
        ),
    ],
)
def test_params_out_of_bounds_are_refused_before_anything_runs(
    params: dict[str, Any],
    said: str,
    project: dict[str, Any],
    store: dict[str, Any],
    cli: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = plant(store, project["commits"]["branch"], params)
    error = _refused(*cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys))
    assert error.startswith(f"error: run {run_id}: {said}"), error
    assert len(error) < 600 and not (tmp_path / "work" / "workspace").exists()


def test_oversized_artifacts_are_refused_before_any_download(
    project: dict[str, Any], store: dict[str, Any], cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    padding = b"# " + b"x" * (2 << 20) + b"\n"
    run_id = plant(store, project["commits"]["branch"], extra={"reproduce/dvc.lock": padding})
    error = _refused(*cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys))
    assert error == (
        f"error: run {run_id}: its artifact reproduce/dvc.lock is {len(padding)} bytes, more than the "
        f"{1 << 20} reproduce reads"
    )
    assert not (tmp_path / "work" / "record").exists()


# --------------------------------------------------------------------------- point 3: paths in the record


def _lock(path: str) -> dict[str, Any]:
    md5 = DATA_DVC["outs"][0]["md5"]
    return {  # no shared objects: safe_dump would write YAML aliases, which are refused
        "schema": "2.0",
        "stages": {
            "stats": {
                "deps": [{"path": "data", "md5": md5}],
                "outs": [{"path": "artifacts/stats/stats.json", "md5": "a" * 32}],
            },
            "preprocess": {"deps": [{"path": "data", "md5": md5}], "outs": [{"path": path, "md5": "b" * 32}]},
        },
    }


@pytest.mark.parametrize("path", ["/etc/passwd", "../../../root/.bashrc", "/", "artifacts/../../x", ".."])
def test_paths_outside_the_workspace_in_the_runs_dvc_lock_are_refused(
    path: str, project: dict[str, Any], store: dict[str, Any], cli: Any, tmp_path: Path, capsys: Any
) -> None:
    run_id = plant(store, project["commits"]["branch"], lock=_lock(path))
    error = _refused(*cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys))
    assert error == (
        f"error: run {run_id}: its reproduce/dvc.lock is refused: stage preprocess names the path {path}, "
        "outside the workspace (absolute, or with '..')"
    )
    assert not (tmp_path / "work" / "workspace").exists()


def test_a_data_dvc_out_path_other_than_data_is_refused(
    project: dict[str, Any], store: dict[str, Any], cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = {"outs": [{**DATA_DVC["outs"][0], "path": "/etc"}]}
    run_id = plant(store, project["commits"]["branch"], data_dvc=planted)
    error = _refused(*cli(run_id, capsys=capsys))
    assert error == f"error: run {run_id}: its reproduce/data.dvc is refused: its output path is /etc, expected 'data'"


ESCAPES = "\x1b]0;owned\x07\x1b[31mALL WEIGHTS VERIFIED\x1b[0m"


@pytest.mark.parametrize(
    ("md5", "said"),
    [  # DVC reads join(cache, md5[:2], md5[2:]): a path names a file outside the cache
        ("ab/../../../etc/passwd", "ab/../../../etc/passwd"),
        ("ab/etc/passwd", "ab/etc/passwd"),
        (ESCAPES + "a" * 200_000 + ".dir", r"'\x1b]0;owned\x07\x1b[31mALL WEIGHTS V..." + "a" * 34 + ".dir'"),
        ("0123456789ABCDEF0123456789ABCDEF", "0123456789ABCDEF0123456789ABCDEF"),
        (12345, "12345"),
    ],
    ids=["parent", "below-cache", "escapes", "uppercase", "number"],
)
def test_a_data_dvc_md5_other_than_dvcs_is_refused_in_one_short_line(
    md5: Any, said: str, project: dict[str, Any], store: dict[str, Any], cli: Any, tmp_path: Path, capsys: Any
) -> None:
    planted = {"outs": [{**DATA_DVC["outs"][0], "md5": md5}]}
    run_id = plant(store, project["commits"]["branch"], data_dvc=planted)
    code, err = cli(run_id, "--workdir", str(tmp_path / "work"), capsys=capsys)
    assert _refused(code, err) == (
        f"error: run {run_id}: its reproduce/data.dvc is refused: its outs[0].md5 is {said}, expected DVC's md5 "
        "(32 hex digits, '.dir' for a directory)"
    )
    assert "\x1b" not in err and len(err) < 1000  # nothing logged it raw before the refusal
    assert not (tmp_path / "work" / "workspace").exists()


@pytest.mark.parametrize("md5", ["0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef.dir"])
def test_dvcs_md5_of_a_file_or_a_directory_is_accepted(md5: str, tmp_path: Path) -> None:
    (tmp_path / "reproduce").mkdir()
    (tmp_path / "reproduce" / "data.dvc").write_text(yaml.safe_dump({"outs": [{**DATA_DVC["outs"][0], "md5": md5}]}))
    reproduce_record.check_record_paths(tmp_path, "RUN")


def test_the_report_escapes_what_it_quotes_from_the_runs_tags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run tag (a library version) reaches the report's lines: no escape sequence, no forged line."""
    report = ReproduceReport("RUN", "RUN", "0", "git commit x", DATA_DVC["outs"][0]["md5"])
    report.machine_differences = {"version.torch": {"run": f"{ESCAPES}2.0\u2028error: forged", "now": "2.5"}}
    monkeypatch.setattr(reproduce_cli, "reproduce", lambda *args, **kwargs: report)
    monkeypatch.setattr(reproduce_cli, "tracking_client", lambda uri: None)  # no store is read
    monkeypatch.setattr(reproduce_cli.orphans, "mark_orphans_or_warn", lambda *args: None)
    main(["RUN"])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u2028" not in out
    assert f"    version.torch: run {ascii(ESCAPES)[1:-1]}2.0\\u2028error: forged, now 2.5" in out.split("\n")


def test_a_lock_path_through_a_symlink_out_of_the_workspace_is_refused_before_any_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that reads as inside (`artifacts/preprocessed`) but resolves outside: nothing is hashed,
    not even the outputs listed before it."""
    import dvc.output  # noqa: F401  (imported first: it binds `build` at import, and must keep the real one)
    import dvc_data.hashfile.build

    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    (workspace / "artifacts" / "stats").mkdir(parents=True)
    (workspace / "artifacts" / "stats" / "stats.json").write_text("{}")
    outside.mkdir()
    (workspace / "artifacts" / "preprocessed").symlink_to(outside)
    (workspace / "dvc.lock").write_text(yaml.safe_dump(_lock("artifacts/preprocessed")))

    def hashed(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"hashed {args[1]}")

    monkeypatch.setattr(dvc_data.hashfile.build, "build", hashed)
    with pytest.raises(ReproduceError) as refused:
        reproduce_report.compare_upstream(workspace, DATA_DVC["outs"][0]["md5"], [])
    assert str(refused.value) == (
        f"artifacts/preprocessed: resolves outside the workspace ({outside.resolve()}): not hashed"
    )


# --------------------------------------------------------------------------- point 4: DVC credentials


def test_dvc_remote_credentials_reach_dvc_in_memory_and_no_workspace_file(tmp_path: Path) -> None:
    from dvc.repo import Repo

    secret = "s3cr3t-Local-Passw0rd"
    project, workspace = tmp_path / "project", tmp_path / "workspace"
    (project / ".dvc").mkdir(parents=True)
    workspace.mkdir()
    (project / ".dvc" / "config").write_text(
        "[core]\n    remote = storage\n['remote \"storage\"']\n    url = https://dvc.example.invalid/store\n"
    )
    (project / ".dvc" / "config.local").write_text(
        f"['remote \"storage\"']\n    auth = basic\n    user = alice\n    password = {secret}\n"
    )
    cache_dir, remote, in_memory = reproduce_workspace.configure_dvc(project, workspace)
    assert remote == "storage" and cache_dir == str(project / ".dvc" / "cache")
    written = [p for p in workspace.rglob("*") if p.is_file()]
    assert written and not [p for p in written if secret.encode() in p.read_bytes()]
    with Repo(str(workspace), config=in_memory) as repo:
        assert repo.config["remote"]["storage"]["password"] == secret  # DVC still has it
        assert repo.config["core"]["remote"] == "storage"


# --------------------------------------------------------------------------- the rendezvous of a one-node job

_RANK = """
import json, os, sys, time
from pathlib import Path
from tasks.train.devices import join_process_group
ranks, _ = join_process_group("cpu")
gathered = ranks.gather({"rank": ranks.rank, "value": 0.1 + ranks.rank, "text": "x" * (1000 * ranks.rank)})
out = Path(sys.argv[1])
(out / f"rank{ranks.rank}.json").write_text(json.dumps(gathered))
while not (out / "go").exists():
    time.sleep(0.05)
"""


def _listening(pid: int) -> set[tuple[str, int]]:
    root = psutil.Process(pid)
    found = set()
    for member in (root, *root.children(recursive=True)):
        try:
            found |= {
                (c.laddr.ip, c.laddr.port)
                for c in member.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_one_node_ddp_job_listens_on_loopback_only_and_ignores_rdzv_endpoint(tmp_path: Path) -> None:
    """torchrun as the train stage starts it (its command and environment), two gloo ranks: every
    listening socket of the job is on 127.0.0.1, the rendezvous is a file in a private directory,
    train.rdzv_endpoint (the attacker's) is never contacted, and the ranks exchange JSON, not pickles."""
    (tmp_path / "rank.py").write_text(_RANK)
    out, private = tmp_path / "out", tmp_path / "private"
    out.mkdir()
    private.mkdir(mode=0o700)
    with _attacker() as attacker:
        endpoint = f"127.0.0.1:{attacker.getsockname()[1]}"
        params = Params.model_validate(
            {"train": {"strategy": "ddp", "nproc_per_node": 2, "rdzv_endpoint": endpoint}, "determinism": {}}
        )
        cmd = torchrun_command(params, private)
        assert cmd[-2:] == ["-m", "tasks.train.launcher"] and endpoint not in " ".join(cmd)
        env = {**launch_env(params, private), "PYTHONPATH": str(ROOT)}  # as the train stage runs it
        with subprocess.Popen(
            [*cmd[:-2], str(tmp_path / "rank.py"), str(out)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as job:
            try:
                deadline = time.monotonic() + 120
                while len(list(out.glob("rank*.json"))) < 2:
                    assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
                    time.sleep(0.1)
                listening = _listening(job.pid)
            finally:
                (out / "go").touch()
            output = job.communicate(timeout=60)[0]
        assert job.returncode == 0, output
        assert _no_connection(attacker)
    assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    # the rendezvous file and torchrun's log folder, in the private folder (which the launch then removes)
    assert sorted(p.name for p in private.iterdir()) == ["rendezvous", "torchelastic"]
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    expected = [{"rank": r, "value": 0.1 + r, "text": "x" * (1000 * r)} for r in (0, 1)]
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] == [expected, expected]
