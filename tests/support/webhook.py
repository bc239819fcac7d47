"""A webhook receiver on 127.0.0.1 for notification tests: it records the JSON of every POST.

Usage::

    with WebhookReceiver() as hook:                    # answers 200 at once
        url = hook.url("/hooks/T0KEN")                 # any path and query are accepted
        ...
        assert [m["event"] for m in hook.wait_for(1)] == ["failed"]

Modes:

- ``"normal"``: record the POST, answer 200.
- ``"slow"``: record the POST, then answer only after ``slow_s`` (or when the receiver closes): a
  receiver that takes the message but hangs on the answer.
- ``"error"``: record the POST, answer 500.
- ``"dead"``: nothing listens on the port (a connection is refused); nothing is ever recorded.

Each recorded message is the decoded JSON body (or ``{"_raw": text}`` if it was not JSON); ``paths``
lists the path (with query) each POST went to.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal

Mode = Literal["normal", "slow", "error", "dead"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a slow handler never holds up shutdown
    owner: WebhookReceiver


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        owner = self.server.owner
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode("utf-8", "replace")
        try:
            message = json.loads(body)
        except ValueError:
            message = {"_raw": body}
        with owner.lock:
            owner.messages.append(message)
            owner.paths.append(self.path)
            owner.received_at.append(time.monotonic())
        if owner.mode == "slow":
            owner.closing.wait(owner.slow_s)
        status = 500 if owner.mode == "error" else 200
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        except OSError:  # the client gave up waiting (slow mode)
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        pass  # quiet: the tests read what was recorded


class WebhookReceiver:
    """An HTTP receiver on 127.0.0.1 (a free port) in a background thread; see the module docstring."""

    def __init__(self, mode: Mode = "normal", slow_s: float = 60.0) -> None:
        self.mode, self.slow_s = mode, slow_s
        self.messages: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.received_at: list[float] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        if mode == "dead":  # a port nobody listens on: bound for a moment, then released
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.port = int(sock.getsockname()[1])
            return
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="webhook-receiver", daemon=True
        )
        self._thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The messages once at least `count` arrived (or what arrived when `timeout_s` ran out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.messages) >= count:
                    break
            time.sleep(0.05)
        with self.lock:
            return list(self.messages)

    def close(self) -> None:
        self.closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
