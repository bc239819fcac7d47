"""Faults a team's hosts meet, as small functions on the bed (tests/support/hosts.py, tests/support/team.py):
for the fault tests (tests/hosts/test_faults_hosts.py) and the soak (tests/hosts/soak.py).

Each fault has its undoing beside it, and the undoing is safe to call when the fault did not happen
(a caller puts it in a `finally`): a link set up that is up, `stack up` with every server running.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from tests.support.hosts import Bed

SERVICES = "services"


def _switch_port(bed: Bed, name: str, state: str) -> None:
    # The host's port on the bed's switch, named as Bed._make names it (an interface name has 15 characters
    # at most). The host's own eth0 stays up: its processes see a silent network (timeouts), as with a
    # pulled cable or a dead switch port, not a vanished interface (immediate errors).
    port = f"v-{name}"[:15]
    subprocess.run(["ip", "-n", bed.switch, "link", "set", port, state], check=True, timeout=30)


def cut_link(bed: Bed, name: str) -> None:
    """Take host `name` off the bed's network: nothing it sends arrives, nothing reaches it."""
    _switch_port(bed, name, "down")


def restore_link(bed: Bed, name: str) -> None:
    """Put host `name` back on the bed's network (its connections that timed out meanwhile stay broken)."""
    _switch_port(bed, name, "up")


@contextmanager
def link_cut(bed: Bed, name: str) -> Iterator[None]:
    """Host `name` off the network for the block, back on it after, also when the block fails."""
    cut_link(bed, name)
    try:
        yield
    finally:
        restore_link(bed, name)


def restart_postgres(bed: Bed) -> float:
    """Restart `services`' PostgreSQL as its operator would (`python -m stack restart postgres`): every
    session ends (the pipeline lock's too). Returns how long it took, in seconds."""
    started = time.monotonic()
    bed.host(SERVICES).run(["python", "-m", "stack", "restart", "postgres"])
    return time.monotonic() - started


def start_missing_servers(bed: Bed) -> None:
    """`python -m stack up` on `services`: starts whichever of its servers is not running (none: a no-op).
    The undoing of `restart_postgres` gone wrong and of `stop_s3_gateway`."""
    bed.host(SERVICES).run(["python", "-m", "stack", "up"])


def s3_gateway(bed: Bed) -> psutil.Process:
    """SeaweedFS's S3 gateway among `services`' processes (`weed -config_dir=... -logtostderr s3 -port=...`:
    its command is the first argument that is no flag): the one part of the object store that clients
    (DVC, MLflow's server) talk to."""
    for pid in bed.host(SERVICES).pids():
        try:
            proc = psutil.Process(pid)
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        command = next((arg for arg in cmdline[1:] if not arg.startswith("-")), None)
        if cmdline and cmdline[0].endswith("weed") and command == "s3":
            return proc
    raise AssertionError("no S3 gateway (weed s3) among services' processes")


def stop_s3_gateway(bed: Bed) -> None:
    """Stop the S3 gateway (SIGTERM, bounded wait): the object store's data stays, clients get
    'Could not connect to the endpoint URL'. `start_missing_servers` starts it again."""
    gateway = s3_gateway(bed)
    gateway.terminate()
    gateway.wait(timeout=30)


def s3_endpoint(bed: Bed) -> str:
    """The S3 gateway's URL, as the clients' error messages name it (from the stack's state: no secret)."""
    services = bed.host(SERVICES)
    state = json.loads((services.project / ".stack" / "state.json").read_text())
    return f"http://{services.address}:{state['ports']['s3']}"
