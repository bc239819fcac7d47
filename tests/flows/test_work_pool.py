"""Issue 66, item 4: what a Prefect client may set on a run of a process work pool's deployment.

Prefect merges a flow run's job variables over its deployment's, and a process worker starts the
flow-run process with the merged `env` and `command`: anyone holding the API's auth string could
then give a run the allow-list (LOCKSTEP_ALLOW_OVERRIDES) or run any command as the worker's user.
`python -m flows.deployments deploy` creates its pool with a base job template that lets no run set
anything (the server answers 422), the worker applies no job variable of a flow run made some other
way, the flow refuses such a run at its start, and it reads the allow-list from the deployment's own
record through the API, never from its environment.

Real components: a Prefect server on loopback, the deployment made by `deploy`, a `prefect worker`
process on the pool, in a clone of the session's trained project (so the allowed run finds nothing stale).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import PrefectServer, clone_project, run, sha256, stop_prefect_worker, subprocess_env
from tests.support.prefect_client import PrefectAPI

pytestmark = pytest.mark.slow

POOL, DEPLOYMENT = "lockstep-locked", "lockstep-pipeline/pooled"
ALLOWED = "checks.max_image_drop"  # the deployment's --allow-override


@dataclass
class Pool:
    repo: Path
    api: PrefectAPI
    deployment_id: str
    flow_id: str
    worker_log: Path


@pytest.fixture(scope="module")
def pool(
    dvc_repo: dict[str, Any], prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    base = tmp_path_factory.mktemp("pool")
    repo = clone_project(dvc_repo["repo"], base / "repo")
    command = [sys.executable, "-m", "flows.deployments", "deploy", "--pool", POOL, "--name", "pooled"]
    deployed = run([*command, "--allow-override", ALLOWED], repo, **prefect_server.env)
    assert DEPLOYMENT in deployed.stdout, deployed.stdout
    api = PrefectAPI(prefect_server.env["PREFECT_API_URL"], prefect_server.env["PREFECT_API_AUTH_STRING"])
    deployment = api(f"/deployments/name/{DEPLOYMENT}")
    log = base / "worker.log"
    # A worker started from a shell that happens to hold a wider allow-list: runs of the pool must
    # take the deployment's, not this.
    env = subprocess_env(
        PREFECT_WORKER_QUERY_SECONDS="1", LOCKSTEP_ALLOW_OVERRIDES="checks,train", **prefect_server.env
    )
    with log.open("ab") as out:
        worker = subprocess.Popen(
            ["prefect", "worker", "start", "--pool", POOL, "--type", "process"],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Pool(repo, api, deployment["id"], deployment["flow_id"], log)
    finally:
        stop_prefect_worker(worker)


def _final_state(pool: Pool, flow_run_id: str, timeout_s: float = 300, marker: Path | None = None) -> dict[str, Any]:
    """The run's final state (or its state once `marker` exists: a command of the run's own ran)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = pool.api(f"/flow_runs/{flow_run_id}")["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED") or (marker and marker.exists()):
            return state
        assert time.monotonic() < deadline, (state, pool.worker_log.read_text()[-3000:])
        time.sleep(1)


def _start(pool: Pool, **body: Any) -> dict[str, Any]:
    return pool.api(f"/deployments/{pool.deployment_id}/create_flow_run", body)


@pytest.mark.parametrize(
    "job_variables",
    [
        {"env": {"LOCKSTEP_ALLOW_OVERRIDES": "checks"}},
        {"env.LOCKSTEP_ALLOW_OVERRIDES": "checks"},
        {"command": "touch pwned"},
        {"working_dir": "/tmp"},
        {"env": {"PYTHONPATH": "incoming"}},
    ],
    ids=["env", "env-dotted", "command", "working_dir", "pythonpath"],
)
def test_the_server_refuses_a_run_that_sets_job_variables(pool: Pool, job_variables: dict[str, Any]) -> None:
    before = sha256(pool.repo / "params.yaml")
    with pytest.raises(urllib.error.HTTPError) as refused:
        _start(pool, parameters={"overrides": {"checks.enabled": False}}, job_variables=job_variables)
    assert refused.value.code == 422, refused.value.read()
    assert not (pool.repo / "pwned").exists() and sha256(pool.repo / "params.yaml") == before


def test_a_flow_run_made_around_the_deployment_endpoint_runs_nothing_of_its_own(pool: Pool) -> None:
    """POST /flow_runs/ validates no job variables: the worker must apply none of them, and the flow
    refuses the run in one line before it reads a parameter."""
    before = sha256(pool.repo / "params.yaml")
    marker = pool.repo.parent / "pwned-by-command"
    flow_run = pool.api(
        "/flow_runs/",
        {
            "flow_id": pool.flow_id,
            "deployment_id": pool.deployment_id,
            "work_pool_name": POOL,
            "parameters": {"overrides": {"checks.enabled": False}},
            "job_variables": {"command": f"touch {marker}", "env": {"LOCKSTEP_ALLOW_OVERRIDES": "checks"}},
            "state": {"type": "SCHEDULED"},
        },
    )
    state = _final_state(pool, flow_run["id"], marker=marker)
    assert not marker.exists(), pool.worker_log.read_text()[-3000:]
    assert state["type"] == "FAILED", (state, pool.worker_log.read_text()[-3000:])
    assert "\n" not in state["message"] and "job_variables: command, env set by this flow run" in state["message"]
    assert sha256(pool.repo / "params.yaml") == before


def test_the_allow_list_is_the_deployments_not_the_workers_environment(pool: Pool) -> None:
    before = sha256(pool.repo / "params.yaml")
    refused = _final_state(pool, _start(pool, parameters={"overrides": {"checks.enabled": False}})["id"])
    assert refused["type"] == "FAILED", (refused, pool.worker_log.read_text()[-3000:])
    assert "overrides: checks.enabled is not among the keys" in refused["message"], refused
    assert sha256(pool.repo / "params.yaml") == before
    value = yaml.safe_load((pool.repo / "params.yaml").read_text())["checks"]["max_image_drop"]
    allowed = _final_state(pool, _start(pool, parameters={"overrides": {ALLOWED: value}})["id"])
    assert allowed["type"] == "COMPLETED", (allowed, pool.worker_log.read_text()[-3000:])


def test_deploy_refuses_a_pool_that_lets_runs_set_job_variables(pool: Pool, prefect_server: PrefectServer) -> None:
    """A pool made by hand, with the process worker's default template (env, command, working_dir...)."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    pool.api("/work_pools/", {"name": "open", "type": "process", "base_job_template": template})
    command = [sys.executable, "-m", "flows.deployments", "deploy", "--pool", "open", "--name", "open"]
    done = run(command, pool.repo, check=False, **prefect_server.env)
    assert done.returncode == 3, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: work pool open: its base job template lets a flow run set command, env"), line


def test_deploy_from_git_refuses_what_a_worker_on_another_host_could_not_fetch(tmp_path: Path) -> None:
    """`deploy --git`: a path on this machine, a checkout with uncommitted changes, a remote that does
    not answer: one line each, before anything is registered (the bed runs the accepted case:
    tests/hosts/test_many_hosts.py)."""
    from flows.deployments import GitSourceRefused, resolve_git
    from tests.conftest import GIT, free_port

    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    (repo / "params.yaml").write_text("seed: 1\n")
    run([*GIT, "add", "-A"], repo)
    run([*GIT, "commit", "-q", "-m", "x"], repo)
    nowhere = f"git://127.0.0.1:{free_port()}/lockstep.git"  # nothing listens there
    run(["git", "remote", "add", "origin", str(tmp_path / "bare.git")], repo)
    cases = [("origin", "is a path on this machine"), (str(tmp_path), "is a path on this machine")]
    for remote, refusal in cases:
        with pytest.raises(GitSourceRefused, match=refusal):
            resolve_git(remote, repo)
    (repo / "params.yaml").write_text("seed: 2\n")
    with pytest.raises(GitSourceRefused, match="this checkout has changes that commit [0-9a-f]{12} has not"):
        resolve_git(nowhere, repo)
    run([*GIT, "commit", "-q", "-am", "y"], repo)
    with pytest.raises(GitSourceRefused) as unreachable:
        resolve_git(nowhere, repo)
    assert str(unreachable.value).startswith("--git: git ls-remote failed: ") and "\n" not in str(unreachable.value)
