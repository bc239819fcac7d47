"""Headless Chromium (Debian's package) on a page, as a user would open it: its DOM and a screenshot."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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


def dom_and_screenshot(url: str, profile: Path, screenshot: Path) -> str:
    """The page's DOM once its scripts ran; a PNG of it kept at `screenshot` for a person to look at."""
    flags = chromium_flags(profile)
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    screenshot.unlink(missing_ok=True)
    subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    assert screenshot.stat().st_size > 10_000, f"{screenshot}: an empty page?"
    return dom


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
