"""`python -m tasks.tools.reproduce RUN_ID`: a past train run rebuilt from what it logged, byte for byte.

The slow tests take the session's trained project (`dvc repro`, real MLflow sqlite store), a clone
each, then reproduce that run from the DVC cache, refuse when its data version is gone, and pull it from a
local DVC remote. The fast ones check which runs are refused, on a real sqlite store.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tasks.tools.reproduce import ReproduceError, find_train_run, main, reproduce
from tests.conftest import TINY, client_for, clone_project, run, sha256

# --------------------------------------------------------------------------- fast: refusals


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real sqlite store with the kinds of runs a user might pass by mistake."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("lockstep")

    def make(tags: dict[str, str], parent: str | None = None) -> str:
        if parent:
            tags = {**tags, "mlflow.parentRunId": parent}
        return client.create_run(experiment, tags=tags).info.run_id

    pipeline = make({"lockstep.entry_point": "dvc"})
    no_train = make({"lockstep.entry_point": "dvc"})
    two_trains = make({"lockstep.entry_point": "prefect"})
    return {
        "uri": uri,
        "client": client,
        "pipeline": pipeline,
        "train": make({"lockstep.stage": "train"}, pipeline),  # logged without reproduce/ artifacts
        "evaluate": make({"lockstep.stage": "evaluate"}, pipeline),
        "no_train": no_train,
        "download": make({"lockstep.stage": "download"}, no_train),
        "two_trains": two_trains,
        "trains": [make({"lockstep.stage": "train"}, two_trains) for _ in range(2)],
        "reproduce": make({"lockstep.entry_point": "reproduce", "reproduce.of": "abc"}),
    }


def test_a_pipeline_run_resolves_to_its_one_train_run(store: dict[str, Any]) -> None:
    assert find_train_run(store["client"], store["pipeline"]).info.run_id == store["train"]
    assert find_train_run(store["client"], store["train"]).info.run_id == store["train"]


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("evaluate", "is a 'evaluate' stage run, not a train run"),
        ("no_train", "is a pipeline run in which the train stage did not run"),
        ("two_trains", "is a pipeline run with 2 train stage runs"),
        ("reproduce", "is a reproduce run (of abc), not a train run"),
    ],
)
def test_runs_that_are_not_a_train_run_are_refused(store: dict[str, Any], kind: str, said: str) -> None:
    with pytest.raises(ReproduceError) as refused:
        reproduce(store[kind], tracking_uri=store["uri"])
    assert str(refused.value).startswith(f"run {store[kind]} {said}"), refused.value


def test_unknown_run_and_run_without_record_are_refused_exit_3_without_traceback(
    store: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the workspace would go
    assert main(["0123456789abcdef", "--json", str(tmp_path / "report.json")]) == 3
    err = capsys.readouterr().err
    assert f"error: run 0123456789abcdef: no such run in the tracking store {store['uri']}" in err
    assert "Traceback" not in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["verdict"], report["exit_code"]) == ("refused", 3)

    # a train run logged before train runs recorded their inputs
    assert main([store["train"]]) == 3
    err = capsys.readouterr().err
    assert f"error: run {store['train']}: lacks the artifacts reproduce/data.dvc, reproduce/params.yaml" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "report.json"]  # its temporary workspace was removed


# --------------------------------------------------------------------------- slow: real rebuilds


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time, but Python's bytecode cache: the
    interpreter writes it on a module's first import (`make test` lets it), the tool does not."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def _reproduce(repo: Path, run_id: str, tmp_path: Path, *options: str) -> tuple[Any, dict[str, Any] | None]:
    """`python -m tasks.tools.reproduce` as a user runs it, against the copy's store, with its temporary
    files in tmp_path/tmp; (the finished process, its JSON report)."""
    report = tmp_path / "report.json"
    (tmp_path / "tmp").mkdir()
    done = run(
        ["python", "-m", "tasks.tools.reproduce", run_id, "--json", str(report), *options],
        repo,
        check=False,
        MLFLOW_TRACKING_URI=f"sqlite:///{repo / 'mlflow.db'}",
        TMPDIR=str(tmp_path / "tmp"),
    )
    return done, json.loads(report.read_text()) if report.exists() else None


@pytest.fixture
def trained(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A clone of the session's trained project (its own for each test, which may change it), with
    its train run and pipeline run ids."""
    repo = clone_project(dvc_repo["repo"], tmp_path_factory.mktemp("reproduce") / "repo")
    client = client_for(repo)
    experiment = client.get_experiment_by_name("lockstep").experiment_id
    (train,) = client.search_runs([experiment], filter_string="tags.`lockstep.stage` = 'train'")
    return {
        "repo": repo,
        "train": train,
        "pipeline": train.data.tags["mlflow.parentRunId"],
        "data_md5": yaml.safe_load((repo / "data.dvc").read_text())["outs"][0]["md5"],
    }


@pytest.mark.slow
def test_train_run_is_rebuilt_byte_identical_and_logged(trained: dict[str, Any], tmp_path: Path) -> None:
    repo, train = trained["repo"], trained["train"]
    train_id = train.info.run_id
    logged = client_for(repo).download_artifacts(train_id, "reproduce/params.yaml", str(tmp_path))
    assert yaml.safe_load(Path(logged).read_text())["train"]["epochs"] == TINY["train"]["epochs"]  # resolved

    done, report = _reproduce(repo, train_id, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    best = sha256(repo / "artifacts/train/best.safetensors")
    assert done.stdout.splitlines()[0] == f"reproduce {train_id}: best.safetensors byte-identical (sha256 {best})"
    assert report is not None and report["verdict"] == "identical"
    assert [(w["name"], w["rebuilt"]) for w in report["weights"]] == [
        ("best.safetensors", best),
        ("last.safetensors", sha256(repo / "artifacts/train/last.safetensors")),
    ]
    assert report["code"] == f"git commit {train.data.tags['git.commit']}" and report["warnings"] == []
    assert report["data_from"] == "DVC cache" and report["data_md5"] == trained["data_md5"]
    # the upstream outputs match the run's dvc.lock, and the machine was compared tag by tag
    assert [(u["name"], u["identical"]) for u in report["upstream"]] == [
        ("artifacts/stats/stats.json", True),
        ("artifacts/preprocessed", True),
    ]
    assert {"version.torch", "version.python", "device", "determinism.num_threads"} <= set(report["machine_now"])
    assert set(report["machine_now"]) <= set(train.data.tags) and report["machine_differences"] == {}
    assert list((tmp_path / "tmp").glob("lockstep-reproduce-*")) == []  # the temporary workspace is gone

    (outcome,) = client_for(repo).search_runs(
        [train.info.experiment_id], filter_string=f"tags.`reproduce.of` = '{train_id}'"
    )
    assert outcome.info.run_id == report["reproduce_run_id"] and outcome.info.status == "FINISHED"
    assert outcome.info.run_name == f"reproduce {train_id[:8]}" and "mlflow.parentRunId" not in outcome.data.tags
    tags = outcome.data.tags
    assert tags["lockstep.entry_point"] == "reproduce" and tags["reproduce.identical"] == "true"
    assert tags["reproduce.sha256.best.safetensors"] == tags["reproduce.logged_sha256.best.safetensors"] == best
    assert [a.path for a in client_for(repo).list_artifacts(outcome.info.run_id)] == ["reproduce.json"]


@pytest.mark.slow
def test_missing_data_version_is_refused_and_nothing_is_written(trained: dict[str, Any], tmp_path: Path) -> None:
    repo, train_id = trained["repo"], trained["train"].info.run_id
    cache = repo / ".dvc" / "cache"
    shutil.move(cache, tmp_path / "cache")  # no remote is configured either
    try:
        before = _snapshot(repo)
        done, report = _reproduce(repo, train_id, tmp_path)
        assert _snapshot(repo) == before  # no file in the project written, none added (no MLflow run either)
    finally:
        shutil.move(tmp_path / "cache", cache)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: run {train_id}: data version {trained['data_md5']} is not in the DVC cache ({cache}) and could not "
        "be fetched from remote (none configured): cannot reproduce"
    )
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert report is not None and report["verdict"] == "refused"
    assert list((tmp_path / "tmp").glob("lockstep-reproduce-*")) == []


@pytest.mark.slow
def test_a_failing_stage_is_reported_with_its_output_and_workdir_is_kept(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    repo, train = trained["repo"], trained["train"]
    train_id = train.info.run_id
    # The run's commit: one on a local branch (so trusted) whose stats stage fails. (Params that fail
    # validation are refused before anything runs: tests/tools/test_reproduce_security.py.)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    run([*git, "checkout", "-q", "-b", "broken"], repo)
    with (repo / "tasks" / "data" / "stats.py").open("a") as stats:
        stats.write('\nraise SystemExit("error: planted: this commit\'s stats stage fails")\n')
    run([*git, "commit", "-q", "-am", "broken stats"], repo)
    broken = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    run([*git, "checkout", "-q", "-"], repo)
    client_for(repo).set_tag(train_id, "git.commit", broken)
    done, report = _reproduce(repo, train_id, tmp_path, "--workdir", str(tmp_path / "work"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"reproduce {train_id}: stage stats failed: weights not compared"
    assert "error: planted: this commit's stats stage fails" in done.stdout
    assert report is not None and report["verdict"] == "stage_failed" and report["weights"] == []
    assert report["workspace"] == str(tmp_path / "work" / "workspace")  # --workdir is kept, for a look
    assert (tmp_path / "work" / "workspace" / "params.yaml").exists()
    assert (tmp_path / "work" / "record" / "checkpoints" / "best.safetensors").exists()
    outcome = client_for(repo).get_run(report["reproduce_run_id"])
    assert outcome.info.status == "FAILED" and outcome.data.tags["reproduce.verdict"] == "stage_failed"


@pytest.mark.slow
def test_data_is_pulled_from_the_remote_and_a_different_record_is_reported(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    repo, train_id = trained["repo"], trained["train"].info.run_id
    run(["dvc", "remote", "add", "-d", "storage", str(tmp_path / "remote")], repo)
    run(["dvc", "push"], repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    # One bit flipped in the logged last.safetensors: the check must see it (and it can fail).
    logged = Path(urlparse(trained["train"].info.artifact_uri).path) / "checkpoints" / "last.safetensors"
    original = logged.read_bytes()
    logged.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    # and a planted fingerprint difference that would explain it: the run "was made" with 7 threads
    client = client_for(repo)  # this test's own clone of the store
    threads = client.get_run(train_id).data.tags["hw.threads"]
    client.set_tag(train_id, "hw.threads", "7")
    try:
        done, report = _reproduce(repo, trained["pipeline"], tmp_path)  # the pipeline run: its train child
    finally:
        logged.write_bytes(original)
    assert done.returncode == 1, done.stdout + done.stderr
    assert report is not None and report["verdict"] == "different"
    assert report["requested_run_id"] == trained["pipeline"] and report["run_id"] == train_id
    assert report["data_from"] == "DVC remote 'storage'"
    md5 = trained["data_md5"]
    assert (repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]).exists()  # fetched into the cache
    assert [w["identical"] for w in report["weights"]] == [True, False]  # best rebuilt from the pulled data
    assert "last.safetensors: DIFFERS (logged sha256" in done.stdout
    assert report["explained_by"] == [f"hw.threads: run 7, now {threads}"] and not report["bytes_expected_to_differ"]
    assert f"explained by the machine's fingerprint:\n    hw.threads: run 7, now {threads}" in done.stdout


@pytest.mark.parametrize("differences", [{}, {"determinism.cpu_capability": {"run": "AVX2", "now": "DEFAULT"}}])
def test_the_report_of_identical_bytes_names_the_differences_it_saw(differences: dict[str, dict[str, str]]) -> None:
    """An x86-64 run rebuilt on arm64 (portable): identical weights, while each machine pinned its own ATen
    capability. The report shows the difference and says the bytes are the same; it claims the same
    settings only where there is no difference."""
    from tasks.tools.reproduce.report import Comparison, ReproduceReport, format_report

    report = ReproduceReport(
        "r", "r", "1", "git commit abc", "md5.dir", weights=[Comparison("best", "sha256", "x", "x")]
    )
    report.machine_now, report.machine_differences = {"version.torch": "2.14.1"}, differences
    text = format_report(report)
    assert text.startswith("reproduce r: best byte-identical")
    if differences:
        assert "determinism.cpu_capability: run AVX2, now DEFAULT" in text
        assert "the same bytes all the same" in text and "same library versions" not in text
    else:
        assert "same library versions, device and determinism settings as the run" in text
