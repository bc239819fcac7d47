"""Nobody runs code on the sweep's Dask cluster without its credentials (issue 35, point 1).

The attack: with no credentials, a client reached the scheduler and its workers from another address
and ran a function in each (`run_on_scheduler`, `run`). Planted here against real processes
(`python -m flows.sweep scheduler|worker`, as a user starts them, and the local cluster `make sweep`
starts): the servers listen on loopback by default, a plain-TCP address off loopback is refused with
one line, and a TLS cluster turns away a client without its credentials, or with another cluster's.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.core.config.base import ConfigError
from tasks.core.errors import ExitCode, Refused
from tasks.tools.sweep import cluster
from tests.conftest import ROOT, copy_project, free_port, listening, stop_group, subprocess_env


def _sweep(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.sweep", *args], cwd=cwd, env=subprocess_env(), capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("role", "host", "dashboard", "rest", "scheduler"),
    [
        ("scheduler", "0.0.0.0", None, [], None),
        ("scheduler", "::", None, [], None),
        ("scheduler", None, ":8787", [], None),  # the dashboard on every interface
        ("scheduler", None, None, ["--interface", "eth0"], None),
        ("scheduler", None, None, ["--listen-address=tcp://0.0.0.0:8786"], None),
        ("scheduler", None, None, ["--jupyter"], None),
        ("worker", None, None, [], "tcp://192.0.2.10:8786"),
        ("worker", None, None, [], "tls://192.0.2.10:8786"),  # TLS without credentials
        ("worker", "0.0.0.0", None, [], "tcp://127.0.0.1:8786"),
        ("worker", None, None, ["--dashboard"], "tcp://127.0.0.1:8786"),  # a worker dashboard on ':0'
        ("worker", None, None, ["--scheduler-file", "s.json"], "tcp://127.0.0.1:8786"),
    ],
)
def test_an_open_port_is_refused(
    role: str, host: str | None, dashboard: str | None, rest: list[str], scheduler: str | None
) -> None:
    with pytest.raises(Refused) as refused:
        cluster.dask_arguments(role, host, dashboard, None, rest, scheduler)
    assert "\n" not in str(refused.value)


def test_the_defaults_stay_on_loopback() -> None:
    assert cluster.dask_arguments("scheduler", None, None, None, ["--port", "8786"], None) == [
        "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:8787", "--port", "8786"
    ]  # fmt: skip
    assert cluster.dask_arguments("worker", None, None, None, [], "tcp://127.0.0.1:8786") == [
        "--host", "127.0.0.1", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"
    ]  # fmt: skip


def test_a_worker_of_a_remote_scheduler_listens_on_the_address_that_reaches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not on every interface (Dask's default without --host): on the one that routes to the scheduler."""
    monkeypatch.setattr(cluster, "route_to", lambda host: {"192.0.2.10": "192.0.2.77"}.get(host))
    tls = cluster.write_credentials(tmp_path / "tls")
    options = cluster.dask_arguments("worker", None, None, tls, [], "tls://192.0.2.10:8786")
    assert options[:2] == ["--host", "192.0.2.77"], options
    assert "0.0.0.0" not in options
    monkeypatch.undo()
    assert cluster.route_to("127.0.0.1") == "127.0.0.1"  # the real one: routing only, nothing sent


@pytest.mark.parametrize("args", [["scheduler", "--host", "0.0.0.0"], ["--set", "sweep.address=tcp://192.0.2.10:8786"]])
def test_the_commands_refuse_in_one_line_with_nothing_written(args: list[str], tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    params = (project / "params.yaml").read_bytes()
    done = _sweep(*args, cwd=project)
    assert done.returncode == ExitCode.REFUSED, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "plain TCP off loopback" in done.stderr
    assert (project / "params.yaml").read_bytes() == params  # the override was not written


def test_loopback_is_what_every_address_names() -> None:
    assert cluster.is_loopback("127.0.0.1") and cluster.is_loopback("::1") and cluster.is_loopback("[::1]")
    assert cluster.is_loopback("localhost")
    for host in ("", "0.0.0.0", "::", "192.0.2.10", "*", "no-such-host.invalid"):
        assert not cluster.is_loopback(host), host
    assert cluster.split_address("tls://[::1]:8786") == ("tls", "[::1]")
    assert cluster.split_address("tcp://10.0.0.5:8786") == ("tcp", "10.0.0.5")


def test_credentials_are_private_and_never_overwritten(tmp_path: Path) -> None:
    made = cluster.write_credentials(tmp_path / "tls")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in made.iterdir()} == {"cert.pem": 0o600, "key.pem": 0o600}
    key = (made / "key.pem").read_bytes()
    with pytest.raises(Refused, match="exists"):
        cluster.write_credentials(made)
    assert (made / "key.pem").read_bytes() == key
    assert [p.name for p in tmp_path.iterdir()] == ["tls"]  # no staging left behind

    assert cluster.tls_dir(str(made)) == made
    (made / "key.pem").chmod(0o644)
    with pytest.raises(Refused, match="readable by others"):
        cluster.tls_dir(str(made))
    (made / "key.pem").unlink()
    with pytest.raises(Refused, match="key.pem: missing"):
        cluster.tls_dir(str(made))


def _start(role: str, *args: str, log: Path) -> subprocess.Popen[Any]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.sweep", role, *args],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_listening(proc: subprocess.Popen[Any], count: int, log: Path, timeout_s: float = 90) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while len(found := listening(proc)) < count:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, (
            f"{count} ports not open in {timeout_s} s: {found}\n{log.read_text()[-3000:]}"
        )
        time.sleep(0.3)
    return found


@pytest.mark.slow
def test_scheduler_and_worker_listen_on_loopback_by_default(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "dask.log"
    scheduler = _start("scheduler", "--port", str(port), log=log)
    worker = None
    try:
        ports = _wait_listening(scheduler, 2, log)  # the scheduler and its dashboard
        worker = _start("worker", f"tcp://127.0.0.1:{port}", log=log)
        ports |= _wait_listening(worker, 2, log)  # the nanny and its worker process
        assert all(p.rsplit(":", 1)[0] == "127.0.0.1" for p in ports), ports
    finally:
        for proc in filter(None, (worker, scheduler)):
            stop_group(proc)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A scheduler on every interface (allowed with TLS) and a worker, with credentials from `tls`."""
    base = tmp_path_factory.mktemp("dask-tls")
    assert _sweep("tls", str(base / "tls")).returncode == 0
    port, log = free_port(), base / "dask.log"
    scheduler = _start("scheduler", "--host", "0.0.0.0", "--port", str(port), "--tls", str(base / "tls"), log=log)
    worker = None
    try:
        _wait_listening(scheduler, 2, log)
        worker = _start("worker", f"tls://127.0.0.1:{port}", "--tls", str(base / "tls"), log=log)
        _wait_listening(worker, 2, log)
        with _client(f"tls://127.0.0.1:{port}", cluster.security(base / "tls")) as client:
            client.wait_for_workers(1, timeout=60)
            ((address, info),) = client.scheduler_info(n_workers=-1)["workers"].items()
        servers = [address, info["nanny"]]  # the worker and its nanny: each answers `run`
        yield {"port": port, "tls": base / "tls", "scheduler": scheduler, "servers": servers, "worker": worker}
    finally:
        for proc in filter(None, (worker, scheduler)):
            stop_group(proc)


def _client(address: str, security: Any = None) -> Any:
    from distributed import Client

    return Client(address, security=security, timeout=5)


@pytest.mark.slow
def test_tls_cluster_runs_code_only_for_its_credentials(tls_cluster: dict[str, Any], tmp_path: Path) -> None:
    port, scheduler_pid = tls_cluster["port"], tls_cluster["scheduler"].pid
    # the attack: no credentials, over plain TCP, and over TLS without a client certificate
    with pytest.raises((OSError, TimeoutError)):
        _client(f"tcp://127.0.0.1:{port}")
    with pytest.raises((OSError, TimeoutError)):
        _rpc(f"tls://127.0.0.1:{port}", _anonymous_tls(), "identity")
    # another cluster's credentials: Dask's TLS checks the client's certificate against its CA
    other = cluster.write_credentials(tmp_path / "other")
    with pytest.raises((OSError, TimeoutError)):
        _client(f"tls://127.0.0.1:{port}", cluster.security(other))
    # the cluster's own credentials: the scheduler and the worker run what they are sent
    with _client(f"tls://127.0.0.1:{port}", cluster.security(tls_cluster["tls"])) as client:
        assert client.run_on_scheduler(os.getpid) == scheduler_pid
        assert len(client.run(os.getpid)) == 1


def _anonymous_tls() -> dict[str, Any]:
    """Connection arguments for TLS without a client certificate (and without checking the server's)."""
    import ssl

    anonymous = ssl.create_default_context()
    anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE
    return {"ssl_context": anonymous, "require_encryption": True}


def _rpc(address: str, connection_args: dict[str, Any], op: str = "run") -> Any:
    """An RPC to a Dask server: by default the worker's (and nanny's) `run` with a pickled function,
    as the attack sent it."""
    import asyncio

    from distributed.core import rpc
    from distributed.protocol.pickle import dumps

    async def attack() -> Any:
        async with rpc(address, timeout=5, connection_args=connection_args) as remote:
            if op == "run":
                return await remote.run(function=dumps(os.getpid))
            return await getattr(remote, op)()

    return asyncio.run(attack())


@pytest.mark.slow
def test_worker_ports_run_nothing_without_the_credentials(tls_cluster: dict[str, Any]) -> None:
    credentials = cluster.security(tls_cluster["tls"]).get_connection_args("client")
    assert all(p.startswith("127.0.0.1:") for p in listening(tls_cluster["worker"]))  # a loopback scheduler's worker
    for server in tls_cluster["servers"]:
        port = server.removeprefix("tls://")
        for address, args in ((f"tcp://{port}", {}), (f"tls://{port}", _anonymous_tls())):
            with pytest.raises((OSError, TimeoutError)):
                _rpc(address, args)
        assert _rpc(f"tls://{port}", credentials)["status"] == "OK"  # the control: the same call, admitted


@pytest.mark.slow
def test_the_local_cluster_is_loopback_and_needs_its_temporary_credentials(tmp_path: Path) -> None:
    """`make sweep` without an address: the cluster flows/sweep.py builds, as it builds it (one worker,
    no preload, to keep it quick)."""
    import psutil
    from distributed import LocalCluster

    from flows.sweep import _task_runner
    from tasks.core.config.params import Params

    kwargs = {**_task_runner(Params.model_validate({}), None, None).cluster_kwargs, "n_workers": 1, "preload": []}
    me = psutil.Process()
    children_before = {c.pid for c in me.children(recursive=True)}
    own_before = {c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    with LocalCluster(**kwargs) as local:
        assert local.scheduler_address.startswith("tls://127.0.0.1:"), local.scheduler_address
        own = {c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN} - own_before
        ports = {f"{a.ip}:{a.port}" for a in own}
        for child in me.children(recursive=True):
            if child.pid not in children_before:
                ports |= listening(child)
        assert len(ports) >= 4 and all(p.startswith("127.0.0.1:") for p in ports), ports  # scheduler, dashboard, worker
        with pytest.raises((OSError, TimeoutError, ValueError)):
            _client(local.scheduler_address.replace("tls://", "tcp://"))
        with pytest.raises((OSError, TimeoutError)):
            _client(local.scheduler_address, cluster.security(cluster.write_credentials(tmp_path / "other")))


def test_workers_on_other_machines_are_not_sent_the_projects_own_tracking_file(tmp_path: Path) -> None:
    """Trials log where the coordinator does: its project's sqlite store is a file no other machine
    reaches, so a cluster off loopback is refused before anything starts (with a tracking server, or
    tracking off, it runs: tests/hosts/test_sweep_hosts.py)."""
    project = copy_project(tmp_path / "project")
    assert _sweep("tls", str(tmp_path / "tls"), cwd=project).returncode == 0
    params = (project / "params.yaml").read_bytes()
    done = _sweep("--address", "tls://192.0.2.10:8786", "--tls", str(tmp_path / "tls"), cwd=project)
    assert done.returncode == ConfigError.exit_code, done.stderr
    assert done.stderr.startswith("error: sweep.address tls://192.0.2.10:8786") and done.stderr.count("\n") == 1
    assert "MLFLOW_TRACKING_URI" in done.stderr and "sqlite:///" in done.stderr
    assert (project / "params.yaml").read_bytes() == params and not (project / "mlflow.db").exists()
