"""Headless Chromium (Debian's package) on a page, as a user would open it: its DOM and a screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


def chromium_flags(profile: Path) -> list[str]:
    """The browser and its flags, or a skip (a failure under CI, which installs it: .ci/run)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=20000",
        "--window-size=1400,1800",
    ]


@contextmanager
def chromium_env() -> Iterator[dict[str, str]]:
    """The browser's environment, with a temporary folder of its own, removed afterwards: Chromium leaves
    its socket folder (org.chromium.Chromium.*) there. A short path: the socket's must fit 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="lockstep-chromium-") as temporary:
        yield {**os.environ, "TMPDIR": temporary}


def dom_and_screenshot(url: str, profile: Path, screenshot: Path) -> str:
    """The page's DOM once its scripts ran; a PNG of it kept at `screenshot` for a person to look at.

    One browser does both (headless Chromium runs every command it is given on the loaded page): a
    launch on a page as heavy as MLflow's UI costs seconds of CPU."""
    flags = chromium_flags(profile)
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    screenshot.unlink(missing_ok=True)
    with chromium_env() as env:
        done = subprocess.run(
            [*flags, "--dump-dom", f"--screenshot={screenshot}", url],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    assert screenshot.stat().st_size > 10_000, f"{screenshot}: an empty page?"
    return done.stdout


@contextmanager
def basic_auth_proxy(upstream: str, username: str, password: str) -> Iterator[str]:
    """A loopback proxy that adds HTTP basic credentials to every request to `upstream`; its URL.

    Chromium's pages cannot fetch() from a URL with credentials in it (`http://user:pw@host/`), and
    a headless one-shot browser has no login prompt, so a test opens the proxy instead, as a user
    behind a company's authenticating proxy would.
    """
    target = urllib.parse.urlparse(upstream)
    header = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()

    class Forward(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            headers |= {"Authorization": header, "Host": target.netloc}
            request = urllib.request.Request(upstream + self.path, data=body, headers=headers, method=self.command)
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    status, reply, data = response.status, response.headers, response.read()
            except urllib.error.HTTPError as exc:
                status, reply, data = exc.code, exc.headers, exc.read()
            self.send_response(status)
            for key, value in reply.items():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _forward  # noqa: N815 - http.server's names

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


class DevTools:
    """One Chromium tab driven over the DevTools protocol: for pages that need a step before they show
    (a login the UI keeps in the browser's storage) or a wait for what they fetch. It also records
    every request that failed, for pages that must not reach outside (`failed`)."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._next = 0
        self.failed: list[str] = []
        self.requested: dict[str, str] = {}  # request id -> URL, every request the page made
        self.call("Page.enable")
        self.call("Network.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        self._socket.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=60))
            if message.get("id") == self._next:
                assert "error" not in message, (method, message["error"])
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        params = message.get("params", {})
        if message.get("method") == "Network.requestWillBeSent":
            self.requested[params["requestId"]] = params["request"]["url"]
        elif message.get("method") == "Network.loadingFailed" and not params.get("canceled"):
            self.failed.append(f"{self.requested.get(params['requestId'], '?')}: {params.get('errorText')}")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def open(self, url: str, ready: str = "true", timeout_s: float = 60) -> None:
        """Go to `url`, then wait until the JavaScript expression `ready` holds (the page has drawn)."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"document.readyState === 'complete' && Boolean({ready})"):
            assert time.monotonic() < deadline, f"{url}: not ready ({ready}) after {timeout_s} s"
            time.sleep(0.25)

    def resize(self, width: int, height: int) -> None:
        """Show the page in a window this size: pages that draw only what is in view (MLflow's charts)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def screenshot(self, path: Path) -> None:
        """A PNG of the page as shown, kept at `path` for a person to look at."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        assert path.stat().st_size > 10_000, f"{path}: an empty page?"


@contextmanager
def devtools(profile: Path, width: int = 1400, height: int = 1800) -> Iterator[DevTools]:
    """Headless Chromium with its DevTools endpoint on a loopback port of its choosing; one tab."""
    from websockets.sync.client import connect

    flags = [f for f in chromium_flags(profile) if not f.startswith(("--window-size", "--virtual-time"))]
    with chromium_env() as env, _browser(flags, width, height, env) as proc:
        port_file = profile / "DevToolsActivePort"  # Chromium writes the port it bound here
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start its DevTools endpoint"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.loads(response.read()) if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as socket:
            yield DevTools(socket)


@contextmanager
def _browser(flags: list[str], width: int, height: int, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """The browser process, ended (and waited for) when the block does."""
    proc = subprocess.Popen(
        [*flags, f"--window-size={width},{height}", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
