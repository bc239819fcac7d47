"""The Prefect server's credentials (PREFECT_API_AUTH_STRING, PREFECT_API_KEY) in the two plain requests
lockstep makes to it besides Prefect's own client: the reachability check before a flow starts
(flows/prefect_env.py `check_api`) and the orphan sweep's look at a flow run (tasks/tracking/owners.py
`flow_run_state`). urllib copies ordinary headers to wherever a redirect points, another host too: the
header goes to the configured server and nowhere else. Two loopback servers (benchmarks/httpserver.py):
the configured one redirects to the other, which records what it was sent.
"""

from __future__ import annotations

import base64
import json
import uuid

import pytest

from benchmarks.httpserver import FileServer
from flows.prefect_env import check_api
from tasks.tracking.owners import flow_run_state

AUTH_STRING = "lockstep:Zq8vR2mK7pWx4nT1sLc9"
API_KEY = "pnu_Zq8vR2mK7pWx4nT1sLc9Hb6yE3"
FLOW_RUN = str(uuid.UUID(int=7))


def test_the_reachability_check_sends_the_auth_string_to_the_server_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with FileServer() as mine, FileServer() as other:
        mine.redirect("/api/admin/version", other.add("/elsewhere", b'"3.8"'))
        settings = {PREFECT_API_URL: mine.url + "/api", PREFECT_API_AUTH_STRING: AUTH_STRING}
        with temporary_settings(settings):
            check_api(timeout_s=10)
        basic = "Basic " + base64.b64encode(AUTH_STRING.encode()).decode()
        assert mine.authorizations("/api/admin/version") == [basic]  # sent where it belongs
        assert other.authorizations("/elsewhere") == [None]  # and not where the redirect pointed


@pytest.mark.parametrize(
    ("variable", "secret", "scheme"),
    [("PREFECT_API_AUTH_STRING", AUTH_STRING, "Basic"), ("PREFECT_API_KEY", API_KEY, "Bearer")],
)
def test_the_orphan_sweep_sends_the_credentials_to_the_server_only(
    monkeypatch: pytest.MonkeyPatch, variable: str, secret: str, scheme: str
) -> None:
    for name in ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with FileServer() as mine, FileServer() as other:
        state = {"state": {"type": "CRASHED", "name": "Crashed", "message": "gone"}}
        mine.redirect(f"/api/flow_runs/{FLOW_RUN}", other.add("/elsewhere", json.dumps(state).encode()))
        monkeypatch.setenv("PREFECT_API_URL", mine.url + "/api")
        monkeypatch.setenv(variable, secret)
        assert flow_run_state(FLOW_RUN) == ("CRASHED", "Crashed", "gone")  # the redirect is still followed
        sent = mine.authorizations(f"/api/flow_runs/{FLOW_RUN}")
        expected = secret if scheme == "Bearer" else base64.b64encode(secret.encode()).decode()
        assert sent == [f"{scheme} {expected}"]
        assert other.authorizations("/elsewhere") == [None]
