"""Who may reach the sweep's Dask cluster: loopback by default, mutual TLS to leave the machine.

An unauthenticated Dask port runs any function sent to it (a scheduler's `run_on_scheduler`, a
worker's `run` RPC with a pickled function), so:

- a local cluster (no `sweep.address`) uses Dask's temporary credentials (`Security.temporary()`,
  in memory only): another local user who finds its loopback ports cannot join it;
- `python -m flows.sweep scheduler|worker` listen on 127.0.0.1 unless given `--host`, and a host off
  loopback needs `--tls DIR`;
- a coordinator or worker refuses a plain `tcp://` scheduler address off loopback;
- dashboards (which show worker logs and call stacks, with no authentication of their own) stay on
  loopback or are off.

`python -m flows.sweep tls DIR` writes the credentials that every member of a cluster is given: one
key and a self-signed certificate that is also the cluster's CA (made by Dask's own
`Security.temporary`). Dask's TLS checks both ends, so holding DIR is what admits a machine.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

from tasks.core.errors import Refused

TLS_ENV = "LOCKSTEP_DASK_TLS"  # the credentials directory, when not given by --tls
CERT, KEY = "cert.pem", "key.pem"
HOW = "python -m flows.sweep tls DIR, then --tls DIR on the scheduler, each worker and the coordinator"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address ('' and 0.0.0.0 mean every interface)."""
    host = host.strip("[]")
    if host in ("", "*"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # unresolvable: not known to be loopback
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def split_address(address: str) -> tuple[str, str]:
    """`tcp://host:port` -> ('tcp', 'host')."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    host = rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest
    return scheme, host


def route_to(host: str) -> str | None:
    """This machine's address on the route to `host` (a UDP socket's connect: routing only, nothing is
    sent); None when there is no route (Dask then chooses, and fails to connect with a clear error)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)
        family, _, _, _, target = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def check_scheduler_address(address: str, tls_dir: Path | None, what: str) -> None:
    """Refuse to send work to (or serve) a scheduler that anyone on the network could command."""
    scheme, host = split_address(address)
    if scheme not in ("tcp", "tls"):
        raise Refused(f"{what} {address}: only tcp:// (on loopback) or tls:// addresses are accepted")
    if scheme == "tls" and tls_dir is None:
        raise Refused(f"{what} {address}: a tls:// scheduler needs credentials: --tls DIR or env {TLS_ENV} ({HOW})")
    if scheme == "tcp" and not is_loopback(host):
        raise Refused(
            f"{what} {address}: plain TCP off loopback lets anyone who reaches the port run code; "
            f"use tls://{host}:PORT with credentials ({HOW})"
        )


def check_listen(host: str, tls_dir: Path | None, what: str) -> None:
    """A Dask server may listen off loopback only with TLS (which authenticates both ends)."""
    if tls_dir is None and not is_loopback(host):
        raise Refused(
            f"{what} {host or '(every interface)'}: plain TCP off loopback lets anyone who reaches the port "
            f"run code; keep 127.0.0.1 or give --tls DIR ({HOW})"
        )


def check_dashboard(address: str, what: str) -> None:
    """Dashboards have no authentication: loopback only (reach one from elsewhere through an SSH tunnel)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    if not is_loopback(host):
        raise Refused(
            f"{what} {address}: a Dask dashboard has no authentication and shows worker logs and call "
            "stacks: give 127.0.0.1:PORT and reach it through an SSH tunnel"
        )


def tls_dir(given: str | None) -> Path | None:
    """The credentials directory from --tls or env, checked as ssh checks a key: private to its owner."""
    value = given or os.environ.get(TLS_ENV)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    for name in (CERT, KEY):
        if not (path / name).is_file():
            raise Refused(f"{path / name}: missing: Dask TLS credentials are made by `python -m flows.sweep tls DIR`")
    for checked in (path, path / KEY):
        mode = checked.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise Refused(f"{checked}: readable by others (mode {stat.filemode(mode)}): chmod go-rwx {checked}")
    return path


def security(path: Path) -> Any:
    """A Dask `Security` for every role, from a credentials directory: TLS only, both ends checked."""
    # heavy: distributed (~1.3 s, loads numpy), only with a Dask cluster
    from distributed.security import Security

    cert, key = str(path / CERT), str(path / KEY)
    roles = ("client", "scheduler", "worker")
    pairs = {f"tls_{role}_{kind}": value for role in roles for kind, value in (("cert", cert), ("key", key))}
    return Security(require_encryption=True, tls_ca_file=cert, **pairs)


def tls_arguments(path: Path) -> list[str]:
    """The same credentials as `dask scheduler` / `dask worker` options."""
    cert, key = str(path / CERT), str(path / KEY)
    return ["--tls-ca-file", cert, "--tls-cert", cert, "--tls-key", key]


def write_credentials(directory: Path) -> Path:
    """A new credentials directory (0700, the key 0600), written whole or not at all; never overwrites."""
    # heavy: distributed (~1.3 s, loads numpy), only with a Dask cluster
    from distributed.security import Security

    directory = directory.expanduser().resolve()
    if directory.exists():
        raise Refused(f"{directory}: exists; the credentials are not overwritten: remove it or name another")
    made = Security.temporary()  # a 2048-bit RSA key and a one-year self-signed certificate
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))  # 0700
    try:
        for name, text, mode in ((KEY, made.tls_client_key, 0o600), (CERT, made.tls_client_cert, 0o600)):
            fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
        staging.rename(directory)
    except BaseException:
        for leftover in staging.glob("*"):
            leftover.unlink()
        staging.rmdir()
        raise
    return directory


# Options that would open a port or a server around the checks above: ours (--host, --tls,
# --dashboard-address) say the same thing and are checked.
REFUSED_OPTIONS = {
    "--interface": "use --host ADDRESS",
    "--listen-address": "use --host ADDRESS",
    "--protocol": "use --tls DIR for TLS",
    "--tls-ca-file": "use --tls DIR",
    "--tls-cert": "use --tls DIR",
    "--tls-key": "use --tls DIR",
    "--scheduler-file": "give the scheduler's address",
    "--jupyter": "a Jupyter server in the scheduler runs code for anyone who reaches the dashboard",
    "--dashboard": "use --dashboard-address 127.0.0.1:PORT",
}


def dask_arguments(
    role: str, host: str | None, dashboard: str | None, tls: Path | None, rest: list[str], scheduler: str | None
) -> list[str]:
    """The `dask scheduler|worker` options for our checked choices, followed by the user's others.

    host None: 127.0.0.1, except for a worker of a remote (TLS) scheduler, which listens on the one
    address of this machine that reaches the scheduler (Dask's own default would be every interface).
    dashboard None: the scheduler's on 127.0.0.1:8787, a worker's off.
    """
    what = f"python -m flows.sweep {role}"
    for option in rest:
        name = option.split("=", 1)[0]
        if name in REFUSED_OPTIONS:
            raise Refused(f"{what} {name}: not accepted here: {REFUSED_OPTIONS[name]}")
    if scheduler is not None:
        check_scheduler_address(scheduler, tls, f"{what}: scheduler")
    if host is None and (scheduler is None or is_loopback(split_address(scheduler)[1])):
        host = "127.0.0.1"
    elif host is None and scheduler is not None:
        host = route_to(split_address(scheduler)[1])
    out: list[str] = []
    if host is not None:
        check_listen(host, tls, f"{what} --host")
        out += ["--host", host]
    if dashboard is None and role == "worker":
        # with the dashboard off, a worker still serves health and metrics pages, by default on every interface
        out += ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
    else:
        dashboard = dashboard or "127.0.0.1:8787"
        check_dashboard(dashboard, f"{what} --dashboard-address")
        out += ["--dashboard-address", dashboard]
    if tls is not None:
        out += ["--protocol", "tls", *tls_arguments(tls)]
    return out + rest
