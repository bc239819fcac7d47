"""Talking to the project's Prefect servers from tests as any other client must: with the auth
string (HTTP basic) and, for changes, a CSRF token (flows/prefect_env.py turns both on)."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def basic_auth(auth_string: str) -> str:
    return "Basic " + base64.b64encode(auth_string.encode()).decode()


class PrefectAPI:
    """GET and POST on a Prefect REST API (`http://host:port/api`) with `auth_string`."""

    def __init__(self, url: str, auth_string: str) -> None:
        self.url, self.auth_string = url, auth_string
        self._client = str(uuid.uuid4())
        self._csrf: str | None = None

    def __call__(self, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": basic_auth(self.auth_string), "Content-Type": "application/json"}
        if body is not None:
            headers |= {"Prefect-Csrf-Token": self._csrf_token(), "Prefect-Csrf-Client": self._client}
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers)
        for attempt in range(5):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                # 503: the server's SQLite database was busy (a loaded machine); Prefect's own client
                # retries it the same way
                if exc.code != 503 or attempt == 4:
                    raise
                time.sleep(1 + attempt)
        raise AssertionError("unreachable")

    def _csrf_token(self) -> str:
        if self._csrf is None:
            self._csrf = self(f"/csrf-token?client={self._client}")["token"]
        return self._csrf

    @property
    def client_env(self) -> dict[str, str]:
        """What a `prefect` CLI or worker process needs in its environment."""
        return {"PREFECT_API_URL": self.url, "PREFECT_API_AUTH_STRING": self.auth_string}


def status_of(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str]]:
    """HTTP status and headers of one request (an error status is an answer too)."""
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def wait_for_deployment(api_url: str, auth_file: Path, name: str, proc: subprocess.Popen[Any], timeout_s: float) -> str:
    """Once `serve` has written its auth string and registered deployment `name`: the auth string."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited with code {proc.returncode}"
        if auth_file.exists():
            auth = auth_file.read_text().strip()
            try:
                PrefectAPI(api_url, auth)(f"/deployments/name/{name}")
                return auth
            except OSError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"deployment {name} not served at {api_url} within {timeout_s:g} s")


def cron_far_from_now() -> str:
    """A daily cron twelve hours (UTC) away, for a deployment a test serves: with the default nightly
    `0 3 * * *`, a session that spans 03:00 UTC would see the scheduled run start beside the tests'
    own runs and take the pipeline lock they expect to be free."""
    return f"0 {(datetime.now(UTC).hour + 12) % 24} * * *"


# The real flow function in a process of its own, as a deployment's flow run calls it (no
# LOCKSTEP_ALLOW_OVERRIDES in its environment; Prefect's settings applied first, as a served deployment's
# process has them), one call per case; each case's final Prefect state (type and message) on the last line.
FLOW_RUNS = """
import json, sys
from flows import prefect_settings
prefect_settings.configure()
from flows import prefect_env
from flows.pipeline import pipeline

states = []
with prefect_env.local_api():
    for case in json.loads(sys.argv[1]):
        state = pipeline(**case, return_state=True)
        states.append({"type": state.type.value, "message": state.message or ""})
print("STATES " + json.dumps(states), flush=True)
"""


def start_flow_runs(repo: Path, cases: list[dict[str, Any]], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """FLOW_RUNS for `cases` in `repo`, started and not waited for (a test acts while it runs): its
    console goes to `log`; `env` is its environment (tests/conftest.py `subprocess_env`)."""
    import sys

    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", FLOW_RUNS, json.dumps(cases)],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def flow_run_states(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> list[dict[str, str]]:
    """The states FLOW_RUNS printed once `proc` ended (its log's end in the assertion otherwise)."""
    proc.wait(timeout=timeout_s)
    text = log.read_text()
    assert "STATES " in text, text[-5000:]
    return json.loads(text.split("STATES ")[-1].splitlines()[0])


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    """Block until `text` appears in `log` (a process's console); fail if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"exited {proc.returncode} before saying {text!r}:\n{log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"{text!r} not said within {timeout_s:g} s:\n{log.read_text()[-5000:]}"
        time.sleep(0.2)
