"""The served deployment as `make schedule` runs it (`python -m flows.deployments serve`, its own
Prefect server on a free loopback port), and its runs started as a user types them. For
tests/flows/test_service.py (with an MLflow server) and tests/flows/test_served_deployment.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import free_port, run, service
from tests.support.prefect_client import PrefectAPI, wait_for_deployment

DEPLOYMENT = "lockstep-pipeline/nightly"


@contextmanager
def serving(repo: Path, log: Path, *allow: str, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], PrefectAPI]]:
    """`serve` in `repo` for the block, its runs allowed to override `allow` too (--allow-override);
    yields the process and its API with the auth string as a user finds it (the project's .prefect/api-auth)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    command = [sys.executable, "-m", "flows.deployments", "serve", "--port", str(port)]
    for key in allow:
        command += ["--allow-override", key]
    with service(command, repo, f"{api}/health", log, **env) as proc:
        yield proc, PrefectAPI(api, wait_for_deployment(api, repo / ".prefect" / "api-auth", DEPLOYMENT, proc, 180))


def deployment_run(
    prefect: PrefectAPI, repo: Path, *args: str, name: str = DEPLOYMENT, watch: bool = True, check: bool = True
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`prefect deployment run NAME [--watch] ARGS`; (the flow run's id, the finished command)."""
    watching = ["--watch", "--watch-timeout", "600"] if watch else []
    done = run(["prefect", "deployment", "run", name, *watching, *args], repo, check=check, **prefect.client_env)
    found = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert found, done.stdout + done.stderr
    return found.group(1), done


def until(done: Callable[[], bool], what: str, deadline: float, seen: object = None, poll_s: float = 0.2) -> None:
    """Poll `done` until it holds; past `deadline` (time.monotonic()) fail with `what` and what was `seen`."""
    while not done():
        assert time.monotonic() < deadline, what if seen is None else f"{what}: {seen}"
        time.sleep(poll_s)
