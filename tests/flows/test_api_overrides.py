"""Issue 35, points 5 and 10: what a run started through the Prefect API may change.

Overrides from the API are an allow-list (tasks/core/config/policy.py API_OVERRIDABLE: what a
scheduled retrain varies), not a deny-list: gates, promotion rules and notification routing are
refused unless the server allowed them (`serve --allow-override KEY`). A `params_file` is overrides by
another name: one that differs from params.yaml in a key the API may not change is refused the same
way (else any YAML inside the checkout, such as a file an MLflow client logged into the server's
artifact folder, could hand a run a foreign rendezvous). `make mlflow-server` keeps its artifacts
outside the checkout. A person at the prompt (`python -m flows.pipeline --set`) may change anything.

The refusals run the real flow function, as a served deployment's flow run calls it (its
environment holds no --allow-override), in a clone of the session's trained project.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.deployments import main as deployments_main
from tasks.core.cli import exit_code
from tasks.core.config.base import OverrideRefused
from tasks.core.config.policy import API_OVERRIDABLE, refuse_api_overrides
from tasks.core.lock import pipeline_lock
from tests.conftest import ROOT, PrefectServer, client_for, clone_project, run, sha256, subprocess_env
from tests.support.prefect_client import FLOW_RUNS, flow_run_states, start_flow_runs, wait_for_line

GATES = {"checks.enabled": False, "promotion.min_margin": -1, "orchestration.notify.url_env": "X"}
FOREIGN = {"train.strategy": "ddp", "train.nnodes": 2, "train.rdzv_endpoint": "attacker.example:29500"}


@pytest.mark.parametrize("key", sorted(GATES))
def test_gates_promotion_and_notification_keys_are_refused_from_the_api(key: str) -> None:
    with pytest.raises(OverrideRefused, match=f"{key} is not among the keys a run started through the API"):
        refuse_api_overrides({key: GATES[key]}, frozenset())
    assert exit_code(lambda: refuse_api_overrides({key: GATES[key]}, frozenset())) == 3


def test_the_allow_list_and_what_serve_adds() -> None:
    refuse_api_overrides({"train.lr": 0.01, "train.epochs": 3, "seed": 7, "train.seed": 8}, frozenset())
    assert "checks.enabled" not in API_OVERRIDABLE and not any(k.startswith("promotion") for k in API_OVERRIDABLE)
    refuse_api_overrides({"checks.enabled": False}, {"checks.enabled"})  # serve --allow-override checks.enabled
    refuse_api_overrides({"checks.max_image_drop": 0.2}, {"checks"})  # ... or the whole section
    with pytest.raises(OverrideRefused, match="train.rdzv_endpoint reach the network"):
        refuse_api_overrides({"train.rdzv_endpoint": "x:1"}, {"train"})  # a remote key must be named itself
    with pytest.raises(OverrideRefused, match="checks is not among"):
        refuse_api_overrides({"checks": {"enabled": False}}, frozenset())  # a whole section from the API


def test_serve_allows_only_keys_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        deployments_main(["serve", "--allow-override", "checks.enabeld"])
    assert done.value.code == 2 and "'checks.enabeld' is not a key or section of params.yaml" in capsys.readouterr().err


def test_the_mlflow_servers_artifacts_live_outside_the_checkout(tmp_path: Path) -> None:
    shown = run(["make", "-n", "mlflow-server", f"XDG_DATA_HOME={tmp_path}"], ROOT).stdout
    folder = Path(shown.split("--artifacts-destination ")[1].split()[0])
    assert folder.is_relative_to(tmp_path / "lockstep") and not folder.is_relative_to(ROOT), shown
    assert f"umask 077 && mkdir -p '{folder}'" in shown  # created private
    default = run(["make", "-n", "mlflow-server", "HOME=/home/someone", "XDG_DATA_HOME="], ROOT).stdout
    assert "--artifacts-destination /home/someone/.local/share/lockstep/" in default, default


# The two tests below run the real flow in a clone of the session's trained project (`dvc_repo`): in the
# fast tier they were the only tests to need it, and its build (every stage through `dvc repro`, ~4 min
# beside the other workers) alone outlasted the tier's 5 minutes. They run in the full tier.
@pytest.fixture(scope="module")
def project(dvc_repo: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clone_project(dvc_repo["repo"], tmp_path_factory.mktemp("api") / "repo")


def _flow_runs(repo: Path, cases: list[dict[str, Any]]) -> list[dict[str, str]]:
    done = run([sys.executable, "-c", FLOW_RUNS, json.dumps(cases)], repo)  # no LOCKSTEP_ALLOW_OVERRIDES
    return json.loads(done.stdout.split("STATES ")[-1])


@pytest.mark.slow
def test_an_api_run_changes_only_what_a_retrain_varies(project: Path) -> None:
    # an MLflow client logged a params file into an artifact folder inside the checkout (the old
    # `make mlflow-server` default): it names the attacker's rendezvous
    planted = project / "mlflow-server-artifacts" / "1" / "abc" / "artifacts" / "params.yaml"
    planted.parent.mkdir(parents=True)
    params = yaml.safe_load((project / "params.yaml").read_text())
    planted.write_text(yaml.safe_dump({**params, "train": {**params["train"], **_leaf(FOREIGN, "train")}}))
    gates_off = project / "params-nightly.yaml"
    gates_off.write_text(yaml.safe_dump({**params, "checks": {**params["checks"], "enabled": False}}))
    before = {name: sha256(project / name) for name in ("params.yaml", "dvc.lock")}
    cases = [
        *({"overrides": {key: value}} for key, value in GATES.items()),
        {"overrides": GATES},
        {"params_file": str(planted.relative_to(project))},
        {"params_file": gates_off.name},
        {"overrides": {"train.lr": params["train"]["lr"]}},  # allowed: the run goes on (nothing is stale)
    ]
    states = _flow_runs(project, cases)

    for key, state in zip(GATES, states, strict=False):
        assert state["type"] == "FAILED" and "\n" not in state["message"], state
        assert f"overrides: {key} is not among the keys a run started through the API may change" in state["message"]
    assert "checks.enabled, orchestration.notify.url_env, promotion.min_margin are not among" in states[3]["message"]
    assert states[4]["type"] == "FAILED", states[4]
    assert (
        "train.nnodes, train.rdzv_endpoint reach the network or other machines; train.strategy is not among"
        in states[4]["message"]
    ), states[4]
    assert "params_file params-nightly.yaml: checks.enabled is not among" in states[5]["message"], states[5]
    assert states[6]["type"] == "COMPLETED", states[6]
    assert {name: sha256(project / name) for name in before} == before


@pytest.mark.slow
def test_a_person_at_the_prompt_may_change_any_key(project: Path) -> None:
    margin = yaml.safe_load((project / "params.yaml").read_text())["promotion"]["min_margin"]
    command = [sys.executable, "-m", "flows.pipeline", "--set", f"promotion.min_margin={margin}"]
    done = run(command, project, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def _leaf(values: dict[str, Any], section: str) -> dict[str, Any]:
    return {key.removeprefix(f"{section}."): value for key, value in values.items()}


@pytest.mark.slow
def test_a_params_file_swapped_while_the_run_waits_for_the_lock_changes_nothing(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """Issue 66, item 3. A params file that passes the check (it is params.yaml's copy) is swapped
    while its run waits for the pipeline lock, held by a real holder: the new one switches the data
    checks off, names a foreign rendezvous and moves the records to another MLflow experiment. The run
    never computes with bytes it did not check, nor writes its own over another writer's: once it holds
    the lock it finds the file changed and checks it again, which refuses it in one line, with nothing
    run or written (a sweep's `--apply` written meanwhile passes the check and is what runs), and
    nothing is recorded in the swapped file's experiment."""
    repo = clone_project(dvc_repo["repo"], tmp_path / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    incoming = repo / "incoming" / "params.yaml"  # a folder others can write to (an upload, a data folder)
    incoming.parent.mkdir()
    incoming.write_text(yaml.safe_dump(params, sort_keys=False))
    swapped = {
        **params,
        "checks": {**params["checks"], "enabled": False},
        "train": {**params["train"], **_leaf(FOREIGN, "train")},
        "tracking": {**params["tracking"], "experiment": "swapped-in"},
    }
    lr = params["train"]["lr"]
    log = tmp_path / "flow.log"
    case = {"params_file": "incoming/params.yaml", "overrides": {"train.lr": lr}}
    with pipeline_lock("the test", wait_s=0, root=repo):
        proc = start_flow_runs(repo, [case], log, subprocess_env(**prefect_server.env))
        wait_for_line(log, "waiting up to", proc)  # checked, and waiting for the lock
        incoming.write_text(yaml.safe_dump(swapped, sort_keys=False))
    (state,) = flow_run_states(proc, log)

    assert state["type"] == "FAILED" and "\n" not in state["message"], (state, log.read_text()[-3000:])
    refused = state["message"].partition("params_file incoming/params.yaml: ")[2]  # refused by the check again
    assert "train.rdzv_endpoint reach the network" in refused and "checks.enabled" in refused, state
    assert yaml.safe_load(incoming.read_text()) == swapped  # as its writer left it: not overwritten
    assert client_for(repo).get_experiment_by_name("swapped-in") is None
