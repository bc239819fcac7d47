"""The stack's folder: its ports, its generated credentials, and what a client needs to reach it.

Ports and credentials are chosen once, on the first `make stack`, and kept (`state.json`,
`secrets/`): a restarted stack answers where it did, with the same keys, so the environment file
that users sourced stays right.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from flows.prefect_env import HEARTBEAT_ENV
from tasks.core.atomic import atomic_file, write_text
from tasks.core.errors import ExpectedFailure
from tasks.core.layout import ROOT
from tasks.core.lock import LOCK_URL_ENV

STACK_DIR_ENV = "LOCKSTEP_STACK_DIR"
USER = "lockstep"  # PostgreSQL role and S3 identity
DATABASES = ("mlflow", "mlflow_auth", "prefect", "optuna")  # mlflow_auth: the basic-auth app's users
MLFLOW_ADMIN = "admin"
# The pipeline lock's login (tasks/core/lock.py): it may connect to its own database only, where it
# takes an advisory lock; it reads no table. The hosts that run pipelines hold its password, not
# the superuser's.
LOCK_USER, LOCK_DATABASE = "lockstep_lock", "pipeline_lock"
LOCK_PASSFILE = "pg-lock-pass"  # a libpq password file with that login's one line
# A sweep's Optuna study (flows/sweep.py): its own login, owner of the `optuna` database and nothing
# more. The host that coordinates a sweep holds its password, not the superuser's (stack/logins.py).
SWEEP_USER, SWEEP_DATABASE = "lockstep_sweep", "optuna"
SWEEP_PASSFILE = "pg-sweep-pass"
# How often a flow run sends Prefect a heartbeat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY in the client
# environment; Prefect's floor is 30 s), for the zombie automation `up` makes (flows/prefect_env.py).
FLOW_HEARTBEAT_S = 30
START_TIMEOUT_S = 180  # a server's first start: initdb, MLflow's and Prefect's migrations on 2 cores
MLFLOW_BUCKET, DVC_BUCKET = "lockstep-mlflow", "lockstep-dvc"
DVC_REMOTE = "stack"
REGION = "us-east-1"  # SeaweedFS ignores it; AWS clients want one to sign requests
# SeaweedFS listens on an HTTP and a gRPC port per component: each is set, so that two stacks (a
# user's and a test's) never meet on a default port.
PORTS = (
    "postgres",
    "mlflow",
    "prefect",
    "s3",
    "s3_grpc",
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "admin",
    "admin_grpc",
)
# `weed mini`'s built-in plugin worker dials the admin server's gRPC at its HTTP port + 10000 (Go's
# GrpcPortOffset) whatever -admin.port.grpc says (SeaweedFS 4.48): any other pair leaves the worker
# retrying, and logging it, for as long as the stack runs.
ADMIN_GRPC_OFFSET = 10000


class StackError(ExpectedFailure):
    """A server of the stack would not start or stop: a line naming it and its log, then the log's last lines."""


@dataclass(frozen=True)
class Stack:
    root: Path
    host: str  # what the servers bind to
    ports: dict[str, int]

    # ------------------------------------------------------------------ files
    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def env_file(self) -> Path:
        return self.root / "env"

    @property
    def weed_config(self) -> Path:
        """SeaweedFS's configuration folder (its `-config_dir`): security.toml and the gRPC certificate."""
        return self.secrets / "seaweedfs"

    # ------------------------------------------------------------------ where clients connect
    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    def url(self, port: str) -> str:
        return f"http://{self.client_host}:{self.ports[port]}"

    def database_url(self, database: str, driver: str = "psycopg") -> str:
        """A SQLAlchemy URL without the password: libpq and asyncpg read it from PGPASSFILE."""
        return f"postgresql+{driver}://{USER}@{self.client_host}:{self.ports['postgres']}/{database}"

    def lock_url(self) -> str:
        """The pipeline lock's libpq URL: its own login and password file (a path, no secret), so that
        a host holds the lock's password and not the superuser's, and PGPASSFILE does not matter."""
        passfile = quote(str(self.secrets / LOCK_PASSFILE))
        return (
            f"postgresql://{LOCK_USER}@{self.client_host}:{self.ports['postgres']}/{LOCK_DATABASE}?passfile={passfile}"
        )

    def sweep_url(self) -> str:
        """The sweeps' Optuna storage (SQLAlchemy, psycopg): the sweep login and its password file by
        name, as `lock_url`; PGPASSFILE does not matter."""
        passfile = quote(str(self.secrets / SWEEP_PASSFILE))
        where = f"{self.client_host}:{self.ports['postgres']}/{SWEEP_DATABASE}"
        return f"postgresql+psycopg://{SWEEP_USER}@{where}?passfile={passfile}"

    def secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()

    def client_env(self) -> dict[str, str]:
        """What a process needs to use the stack (the Prefect auth string's value included)."""
        return {
            "MLFLOW_TRACKING_URI": self.url("mlflow"),
            "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_TRACKING_PASSWORD": self.secret("mlflow-password"),
            "PREFECT_API_URL": f"{self.url('prefect')}/api",
            "PREFECT_API_AUTH_STRING": self.secret("prefect-auth"),
            "PGPASSFILE": str(self.secrets / "pgpass"),
            "LOCKSTEP_SWEEP_STORAGE": self.sweep_url(),
            LOCK_URL_ENV: self.lock_url(),
            STACK_DIR_ENV: str(self.root),
            HEARTBEAT_ENV: str(FLOW_HEARTBEAT_S),  # for the zombie automation (up)
        }

    def env_file_text(self) -> str:
        """The client environment as a file to `source`: it names the secret files, holds no secret."""
        lines = [
            "# lockstep team stack: `source` this file (written by `python -m stack up`).",
            f"# DVC remote '{DVC_REMOTE}': s3://{DVC_BUCKET} at {self.url('s3')} (in .dvc/config.local;",
            "# another clone of the project: `make stack-join` there; the S3 keys are in its credentialpath).",
        ]
        from_files = {"PREFECT_API_AUTH_STRING": "prefect-auth", "MLFLOW_TRACKING_PASSWORD": "mlflow-password"}
        for key, value in self.client_env().items():
            # shell-quoted: inside "...", a `$(...)`, a backquote or a `"` in the folder's path or the host
            # would run when the file is sourced; only the secret files' `$(cat ...)` is meant to
            if key in from_files:
                lines.append(f'export {key}="$(cat {shlex.quote(str(self.secrets / from_files[key]))})"')
            else:
                lines.append(f"export {key}={shlex.quote(value)}")
        return "\n".join(lines) + "\n"


def stack_dir() -> Path:
    return Path(os.environ.get(STACK_DIR_ENV) or ROOT / ".stack").resolve()


def open_stack(root: Path, host: str | None = None) -> Stack:
    """The stack in `root`, made (ports picked, credentials generated) if it is not there yet."""
    state = root / "state.json"
    if state.exists():
        saved = json.loads(state.read_text())
        if host is not None and host != saved["host"]:
            raise StackError(
                f"{root} was made for host {saved['host']}, not {host}: stop it and remove the folder, "
                f"or use another {STACK_DIR_ENV}"
            )
        return Stack(root, saved["host"], _paired_admin_ports(state, saved))
    stack = Stack(root, host or "127.0.0.1", _free_ports(host or "127.0.0.1"))
    root.mkdir(parents=True, exist_ok=True, mode=0o700)  # before anything is written in it
    _make_secrets(stack)
    write_text(state, json.dumps({"host": stack.host, "ports": stack.ports}, indent=2) + "\n")
    return stack


def _free_ports(host: str, names: tuple[str, ...] = PORTS, taken: frozenset[int] = frozenset()) -> dict[str, int]:
    """A port for each of `names` that nobody listens on now and is not in `taken` (all held open
    together, so none is picked twice), with the admin server's gRPC port at its HTTP port +
    ADMIN_GRPC_OFFSET."""
    with ExitStack() as held:

        def bind(port: int = 0) -> int:
            sock = held.enter_context(socket.socket())
            sock.bind((host, port))
            return int(sock.getsockname()[1])

        def fresh() -> int:
            while (port := bind()) in taken:  # held: the next bind gets another
                pass
            return port

        ports = {name: fresh() for name in names if name not in ("admin", "admin_grpc")}
        if "admin" not in names:
            return ports
        for _ in range(100):
            admin = fresh()
            grpc = admin + ADMIN_GRPC_OFFSET
            if grpc <= 65535 and grpc not in taken:
                try:
                    return {**ports, "admin": admin, "admin_grpc": bind(grpc)}
                except OSError:  # in use: another admin port (the one tried stays held until the return)
                    pass
        raise StackError(f"{host}: no free pair of ports N and N+{ADMIN_GRPC_OFFSET} for SeaweedFS's admin server")


def _paired_admin_ports(state: Path, saved: dict[str, Any]) -> dict[str, int]:
    """The saved ports, with the admin pair picked again if a stack made before ADMIN_GRPC_OFFSET holds
    another pair (state.json rewritten; a running object store takes the new pair at its next start)."""
    ports = {name: int(saved["ports"][name]) for name in PORTS}
    if ports["admin_grpc"] == ports["admin"] + ADMIN_GRPC_OFFSET:
        return ports
    others = frozenset(port for name, port in ports.items() if name not in ("admin", "admin_grpc"))
    ports.update(_free_ports(saved["host"], ("admin", "admin_grpc"), taken=others))
    write_text(state, json.dumps({**saved, "ports": ports}, indent=2) + "\n")
    return ports


def _make_secrets(stack: Stack) -> None:
    password, access, key, auth, admin, flask = (secrets.token_urlsafe(n) for n in (24, 12, 30, 24, 24, 32))
    access = "LS" + access.replace("-", "A").replace("_", "B").upper()  # S3 access keys are [A-Z0-9]
    files = {
        "pg-password": password,
        # libpq's password file: host:port:database:user:password (our passwords hold no ':' or '\')
        "pgpass": f"*:*:*:{USER}:{password}",
        "aws-credentials": f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {key}",
        "s3.json": json.dumps(
            {
                "identities": [
                    {
                        "name": USER,
                        "credentials": [{"accessKey": access, "secretKey": key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        ),
        "prefect-auth": f"{USER}:{auth}",
        "mlflow-password": admin,
        "mlflow-flask-secret": flask,
        "mlflow-auth.ini": _mlflow_auth_ini(stack, admin),
    }
    stack.secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(stack.secrets, 0o700)
    for name, text in files.items():
        write_secret(stack.secrets / name, text + "\n")
    ensure_login_passwords(stack)


def ensure_login_passwords(stack: Stack) -> None:
    """The password file of each narrow login (stack/logins.py: the pipeline lock's, the sweeps'), made
    once; also on `up` of a stack made before a login existed. A token_urlsafe holds no ':' or '\\'."""
    for user, passfile in ((LOCK_USER, LOCK_PASSFILE), (SWEEP_USER, SWEEP_PASSFILE)):
        if not (stack.secrets / passfile).exists():
            # libpq's password file: host:port:database:user:password
            write_secret(stack.secrets / passfile, f"*:*:*:{user}:{secrets.token_urlsafe(24)}\n")


def write_object_store_security(stack: Stack) -> None:
    """SeaweedFS's security.toml, made anew for each start of the object store: the keys that sign the
    JWTs its master and filer hand out for volume and filer requests, and one certificate that every
    gRPC connection between its parts must present (mutual TLS). Only SeaweedFS reads them: clients
    use the S3 port and its keys."""
    from distributed.security import Security  # Dask's self-signed certificate and key (cryptography)

    folder = stack.weed_config
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    made = Security.temporary()  # valid for a year: renewed at every start
    cert, key = folder / "grpc.pem", folder / "grpc-key.pem"
    write_secret(cert, made.tls_client_cert)
    write_secret(key, made.tls_client_key)
    write_secret(folder / "security.toml", _security_toml(cert, key))


def _security_toml(cert: Path, key: Path) -> str:
    """jwt.signing: volume server writes; .read: its reads; jwt.filer_signing(.read): the filer's HTTP
    API and its IAM gRPC service. gRPC: the certificate is its own CA (SeaweedFS checks no host name)."""
    quoted = {name: json.dumps(str(path)) for name, path in (("cert", cert), ("key", key))}  # TOML strings
    lines = []
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"):
        lines += [f"[{section}]", f'key = "{secrets.token_urlsafe(32)}"', ""]
    lines += ["[grpc]", f"ca = {quoted['cert']}", ""]
    for part in ("master", "volume", "filer", "s3", "admin", "worker", "client"):
        lines += [f"[grpc.{part}]", f"cert = {quoted['cert']}", f"key = {quoted['key']}", ""]
    return "\n".join(lines)


def write_secret(path: Path, text: str) -> None:
    """Atomically, readable by this user only from the first byte."""
    with atomic_file(path) as tmp:
        os.chmod(tmp, 0o600)
        tmp.write_text(text)


def _mlflow_auth_ini(stack: Stack, admin_password: str) -> str:
    """MLflow's basic-auth app settings (as in mlflow/server/auth/basic_auth.ini): its users live in
    PostgreSQL; the admin is created with this password on the server's first start."""
    return "\n".join(
        [
            "[mlflow]",
            "default_permission = READ",
            f"database_uri = {stack.database_url('mlflow_auth')}",
            f"admin_username = {MLFLOW_ADMIN}",
            f"admin_password = {admin_password}",
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
            # A password check is a scrypt hash, ~0.1 s of CPU, and MLflow's clients send the password
            # with every request (a training logs hundreds): each server process remembers a login that
            # passed for 60 s (keyed by an HMAC of the password under a per-process random key, not the
            # password). The cost: a password changed or a user removed is seen by the server's other
            # processes up to 60 s late.
            "auth_cache_ttl_seconds = 60",
        ]
    )
