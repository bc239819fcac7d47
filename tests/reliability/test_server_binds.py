"""Servers started by the project's commands listen on 127.0.0.1 unless the user asks otherwise.

`make mlflow-server`, `make ui`, `make schedule` (a Prefect server and the deployment) and the Prefect
server `make run` starts for itself: every listening socket of each command's process tree.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path
from secrets import token_hex

import psutil
import pytest

from flows.local_server import LocalServer, prefect_home, wait_until_healthy
from tests.conftest import (
    copy_project,
    free_port,
    listening,
    seed_prefect_home,
    stop_group,
    subprocess_env,
    with_environment,
)
from tests.support.prefect_client import basic_auth, cron_far_from_now, status_of, wait_for_deployment

pytestmark = pytest.mark.slow


def test_make_targets_bind_to_loopback_unless_asked(tmp_path: Path, prefect_database: Path) -> None:
    """Also: `make mlflow-server` runs with the README's recipe for a team (basic-auth, --allowed-hosts)."""
    repo = with_environment(copy_project(tmp_path / "repo", {"orchestration": {"cron": cron_far_from_now()}}))
    seed_prefect_home(repo / ".prefect", prefect_database)  # as the project's first `make run` leaves it
    ports = {name: free_port() for name in ("mlflow", "ui", "prefect")}
    password = f"Adm1n-{token_hex(8)}"
    team = [f"MLFLOW_AUTH_CONFIG={_auth_ini(tmp_path, password)}", f"MLFLOW_ALLOWED_HOSTS=127.0.0.1:{ports['mlflow']}"]
    commands = {
        "mlflow": (
            ["make", "mlflow-server", f"MLFLOW_PORT={ports['mlflow']}", *team],
            f"127.0.0.1:{ports['mlflow']}/health",
        ),
        # asked otherwise: another address (of the loopback network, so the test exposes nothing)
        "ui": (
            ["make", "ui", "MLFLOW_HOST=127.0.0.2", f"MLFLOW_PORT={ports['ui']}"],
            f"127.0.0.2:{ports['ui']}/health",
        ),
        "prefect": (
            ["make", "schedule", f"PREFECT_PORT={ports['prefect']}"],
            f"127.0.0.1:{ports['prefect']}/api/health",
        ),
    }
    procs = {}
    try:  # started together (their start-ups overlap), each stopped by PID
        for name, (cmd, _) in commands.items():
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    cmd,
                    cwd=repo,
                    # XDG_DATA_HOME: make mlflow-server keeps its artifacts there, outside the checkout
                    env=subprocess_env(
                        MLFLOW_FLASK_SERVER_SECRET_KEY=token_hex(16), XDG_DATA_HOME=str(tmp_path / "xdg")
                    ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        for name, (_, url) in commands.items():
            try:
                wait_until_healthy(f"http://{url}", procs[name], 180)
            except RuntimeError as exc:
                raise AssertionError(f"{exc}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}") from None
        # serve is up once its deployment is registered (with the auth string it wrote)
        api = f"http://127.0.0.1:{ports['prefect']}/api"
        wait_for_deployment(api, repo / ".prefect" / "api-auth", "lockstep-pipeline/nightly", procs["prefect"], 180)
        bound = {name: listening(proc) for name, proc in procs.items()}
        # where the project's other commands find it (flows/project_server.py), by its loopback URL
        record = json.loads((repo / ".prefect" / "server.json").read_text())
        assert (record["address"], record["port"]) == ("127.0.0.1", ports["prefect"]), record
        serve_tree = psutil.Process(procs["prefect"].pid).children(recursive=True)
        # browsing runs needs no MLflow job runner (GenAI jobs): neither MLflow command starts one
        for name in ("mlflow", "ui"):
            assert not [cmd for cmd in _command_lines(procs[name]) if "mlflow.server.jobs" in cmd], name
        assert [p for p in serve_tree if "server" in p.cmdline() and "start" in p.cmdline()], serve_tree
        _team_recipe_refuses_strangers(f"127.0.0.1:{ports['mlflow']}", password)
    finally:
        for proc in procs.values():
            stop_group(proc)  # SIGTERM to the group, by PID, as Ctrl-C reaches `make schedule`
    assert f"127.0.0.1:{ports['mlflow']}" in bound["mlflow"]
    assert f"127.0.0.2:{ports['ui']}" in bound["ui"]
    assert f"127.0.0.1:{ports['prefect']}" in bound["prefect"]
    expected = {"mlflow": "127.0.0.1", "ui": "127.0.0.2", "prefect": "127.0.0.1"}
    for name, sockets in bound.items():
        assert {address.rsplit(":", 1)[0] for address in sockets} == {expected[name]}, (name, sockets)
    # stopping a command stops its servers (make schedule's Prefect server lives in a session of its own)
    for address in set().union(*bound.values()):
        assert _closes(address), f"{address}: still listening after its command was stopped"
    # every process of serve's tree goes, its Prefect server too (it is not in the group that got the signal)
    _, alive = psutil.wait_procs(serve_tree, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
    assert not (repo / ".prefect" / "server.json").exists()  # and its record with it


def _command_lines(proc: subprocess.Popen[bytes]) -> list[str]:
    lines = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            lines.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:  # gone since it was listed
            continue
    return lines


def _closes(address: str, within_s: float = 30) -> bool:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) != 0:
                return True
        time.sleep(0.2)
    return False


def test_the_prefect_server_of_make_run_binds_to_loopback(prefect_database: Path) -> None:
    seed_prefect_home(prefect_home(), prefect_database)  # (this test worker's home: conftest.py)
    server = LocalServer(ephemeral=True, quiet=True)  # what `make run` (python -m flows.pipeline) starts
    try:
        server.wait()
        sockets = listening(server.proc)
        # and answers no one without the auth string it was given (a new one per run)
        assert status_of(f"{server.api_url}/deployments/name/lockstep-pipeline/nightly")[0] == 401
    finally:
        server.stop()
    assert sockets and {address.rsplit(":", 1)[0] for address in sockets} == {"127.0.0.1"}, sockets


def _auth_ini(folder: Path, password: str) -> Path:
    """MLflow's basic-auth config, as README's recipe writes it (sqlite for its users here)."""
    path = folder / "auth.ini"
    path.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{folder / 'auth.db'}\nadmin_username = admin\nadmin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    path.chmod(0o600)
    return path


def _team_recipe_refuses_strangers(host: str, password: str) -> None:
    """A stranger gets 401, MLflow's default admin password 401, a DNS-rebound host name 403; the user
    with credentials (MLflow's client reads them from the environment) logs a run."""
    search = f"http://{host}/api/2.0/mlflow/experiments/search?max_results=1"
    admin = basic_auth(f"admin:{password}")
    assert status_of(search)[0] == 401
    assert status_of(search, Authorization=basic_auth("admin:password1234"))[0] == 401
    assert status_of(search, Authorization=admin, Host=f"evil.example:{host.rsplit(':', 1)[1]}")[0] == 403
    assert status_of(search, Authorization=admin)[0] == 200
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        patch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        client = MlflowClient(f"http://{host}")
        run = client.create_run(client.create_experiment("team"))
        client.log_metric(run.info.run_id, "accuracy", 0.9)
        assert client.get_run(run.info.run_id).data.metrics == {"accuracy": 0.9}
