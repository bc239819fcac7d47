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
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

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
