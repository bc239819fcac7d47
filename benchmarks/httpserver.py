"""A loopback HTTP file server with per-path fault injection, for download tests.

Usage::

    with FileServer() as server:
        server.add("/mnist/train-images-idx3-ubyte.gz", data)
        server.fail("/mnist/train-images-idx3-ubyte.gz", "503", "truncate")  # 1st request 503, 2nd cut short
        download(server.url + "/mnist/train-images-idx3-ubyte.gz")
        assert server.count("/mnist/train-images-idx3-ubyte.gz") == 3

Behaviours for :meth:`FileServer.fail` (each consumed by one request, GET or HEAD, to that path):

- ``"ok"``: serve normally (Range honoured). Useful to let a probe request through first: torchvision's
  ``download_url`` sends one GET to resolve redirects (it never reads the body) before the real download.
- ``"<4xx|5xx>"`` e.g. ``"503"``, ``"500"``, ``"404"``, ``"429"``: that status with a short text body.
- ``"truncate"``: 200 with the full Content-Length, only the first half of the body, then the connection closes.
- ``"corrupt"``: 200 with the full length but one byte (the middle one) flipped.
- ``"hang"``: no response until the server shuts down (or ``hang_s`` passes), then the connection is dropped.
- ``"stall"``: headers and half the body, then silence as for ``"hang"`` (exercises read timeouts, not connect).
- ``"reset"``: the socket is closed with SO_LINGER 0 without any response, so the client sees a TCP RST.
- ``"drip"``: 200 with the full Content-Length, then one byte every ``drip_s`` (a slow-loris server).
- ``"dripheaders"``: the status line and headers themselves one byte every ``drip_s``, then the body.
- ``"nolength"``: 200 without Content-Length, the whole body, then the connection closes.
- ``"length:<value>"``: 200 with ``Content-Length: <value>`` as given (``abc``, ``-5``), the body, then close.

``redirect(path, url)`` answers 302 to ``url``; ``require_auth(path, value)`` answers 401 unless the
request's ``Authorization`` header is ``value``; ``authorizations(path)`` lists the header each request carried.

Paths never added answer 404. ``Range: bytes=N-`` / ``bytes=N-M`` / ``bytes=-K`` get 206 (or 416) but only on
requests served normally (no behaviour, or ``"ok"``); faulty responses always ignore Range and answer as for a full GET.
"""

from __future__ import annotations

import re
import socket
import struct
import sys
import threading
from collections import defaultdict, deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

__all__ = ["BEHAVIOURS", "FileServer"]

BEHAVIOURS = frozenset({"ok", "truncate", "corrupt", "hang", "stall", "reset", "drip", "dripheaders", "nolength"})
_STATUS_RE = re.compile(r"^[45]\d\d$")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer (daemon handler threads) that knows its :class:`FileServer` and keeps quiet."""

    daemon_threads = True
    owner: FileServer

    def handle_error(self, request: object, client_address: object) -> None:
        """Ignore clients hanging up mid-response (expected in fault tests); report anything else."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 so clients may keep connections alive and use Range like against a real server.
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - signature fixed by the base class
        """Silence the default per-request stderr logging."""

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._untrack(self.connection)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    # ------------------------------------------------------------------------------------------ responses

    def _serve(self, head: bool) -> None:
        owner = self.server.owner
        route = unquote(urlsplit(self.path).path)
        behaviour, data = owner._on_request(self.command, route, self.headers.get("Authorization"))
        if behaviour == "ok":
            behaviour = None
        if (location := owner._redirects.get(route)) is not None:
            return self._plain(302, head, {"Location": location})
        if (needed := owner._required.get(route)) is not None and self.headers.get("Authorization") != needed:
            return self._plain(401, head, {"WWW-Authenticate": 'Basic realm="test"'})
        if behaviour is not None and behaviour.startswith("length:") and data is not None:
            return self._raw_length(data, behaviour.removeprefix("length:"), head)
        if behaviour in ("drip", "dripheaders", "nolength") and data is not None:
            return self._slow_or_unsized(data, behaviour, head)

        if behaviour == "reset":
            return self._reset()
        if behaviour == "hang":
            owner._stop.wait(owner.hang_s)
            self.close_connection = True  # drop without a response
            return None
        if behaviour is not None and _STATUS_RE.match(behaviour):
            return self._plain(int(behaviour), head)
        if data is None:
            return self._plain(404, head)

        if behaviour in ("truncate", "stall"):
            self._headers(200, len(data))
            if not head:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if behaviour == "stall":
                    owner._stop.wait(owner.hang_s)
            # Closing after a short body is what makes the client see an incomplete read.
            self.close_connection = True
            return None
        if behaviour == "corrupt" and data:
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0xFF
            data = bytes(buf)
        elif behaviour is None and (rng := self.headers.get("Range")) is not None:
            return self._ranged(data, rng, head)

        self._headers(200, len(data))
        if not head:
            self.wfile.write(data)

    def _raw_length(self, data: bytes, length: str, head: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", length)
        self.end_headers()
        if not head:
            self.wfile.write(data)
        self.close_connection = True

    def _slow_or_unsized(self, data: bytes, behaviour: str, head: bool) -> None:
        owner = self.server.owner
        if behaviour == "dripheaders":
            padding = "p" * 200  # headers a client must wait ~13 s for at the default 0.05 s a byte
            raw = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nX-Padding: {padding}\r\n\r\n".encode()
            self.close_connection = True
            for i in range(len(raw)):
                self.wfile.write(raw[i : i + 1])
                self.wfile.flush()
                if owner._stop.wait(owner.drip_s):
                    return
            if not head:
                self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if behaviour == "drip":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.close_connection = True
        if head:
            return
        if behaviour == "nolength":
            self.wfile.write(data)
            return
        for i in range(len(data)):
            self.wfile.write(data[i : i + 1])
            self.wfile.flush()
            if owner._stop.wait(owner.drip_s):
                return

    def _headers(self, status: int, length: int, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def _plain(self, status: int, head: bool, extra: dict[str, str] | None = None) -> None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        body = f"{status} {phrase}\n".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _ranged(self, data: bytes, header: str, head: bool) -> None:
        total = len(data)
        match = _RANGE_RE.match(header.strip())
        if match is None or match.groups() == ("", ""):
            # Multi-range or malformed: RFC 9110 lets a server ignore Range and send the whole representation.
            self._headers(200, total)
            if not head:
                self.wfile.write(data)
            return
        first, last = match.groups()
        if first == "":  # suffix range: the last K bytes
            start, end = max(total - int(last), 0), total - 1
        else:
            start, end = int(first), min(int(last), total - 1) if last else total - 1
        if start >= total or start > end:
            return self._plain(416, head, {"Content-Range": f"bytes */{total}"})
        self._headers(206, end - start + 1, {"Content-Range": f"bytes {start}-{end}/{total}"})
        if not head:
            self.wfile.write(data[start : end + 1])

    def _reset(self) -> None:
        self.close_connection = True
        # The makefile()'d rfile holds a reference that would keep the fd open past close(); drop it first so the
        # close (with linger 0 -> RST rather than FIN) really happens now.
        # (wfile is a plain socket writer holding no reference, and the base class still flushes it afterwards.)
        self.rfile.close()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


class FileServer:
    """Serve registered bytes on ``http://127.0.0.1:<free port>`` from a daemon thread, with fault injection.

    Use as a context manager; ``__exit__`` wakes hanging handlers, shuts down, closes and joins promptly.
    """

    def __init__(self, hang_s: float = 300.0, drip_s: float = 0.05) -> None:
        self.hang_s = hang_s  # upper bound for "hang"/"stall" if the server is never shut down
        self.drip_s = drip_s  # seconds between the bytes of a "drip" response
        self._redirects: dict[str, str] = {}
        self._required: dict[str, str] = {}
        self._authorizations: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        self._files: dict[str, bytes] = {}
        self._faults: defaultdict[str, deque[str]] = defaultdict(deque)
        self._requests: list[tuple[str, str]] = []
        self._connections: set[socket.socket] = set()
        self._stop = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="FileServer", daemon=True
        )
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> FileServer:
        """Start serving (idempotent); ``__enter__`` calls this."""
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving: release hanging handlers, shut down, close the socket, join the thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._started:
            self._httpd.shutdown()
        # Kick idle keep-alive connections so their (daemon) handler threads end now rather than at exit.
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._httpd.server_close()
        if self._started:
            self._thread.join(timeout=10)

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ content

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL, without a trailing slash."""
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, path: str) -> str:
        """Absolute URL of a served path."""
        return self.url + _norm(path)

    def add(self, path: str, data: bytes) -> str:
        """Serve ``data`` at URL ``path`` (replacing any previous content); return its absolute URL."""
        with self._lock:
            self._files[_norm(path)] = bytes(data)
        return self.url_for(path)

    def add_file(self, path: str, file: Path) -> str:
        """Serve the current bytes of ``file`` at URL ``path``; return its absolute URL."""
        return self.add(path, Path(file).read_bytes())

    def remove(self, path: str) -> None:
        """Stop serving ``path`` (later requests get 404)."""
        with self._lock:
            self._files.pop(_norm(path), None)

    def fail(self, path: str, *behaviours: str) -> None:
        """Queue behaviours for ``path``, consumed one per request before normal serving resumes."""
        for b in behaviours:
            if b not in BEHAVIOURS and not _STATUS_RE.match(b) and not b.startswith("length:"):
                raise ValueError(f"unknown behaviour {b!r}; expected a 4xx/5xx status or one of {sorted(BEHAVIOURS)}")
        with self._lock:
            self._faults[_norm(path)].extend(behaviours)

    def redirect(self, path: str, location: str) -> None:
        """Answer requests for ``path`` with 302 to ``location``."""
        with self._lock:
            self._redirects[_norm(path)] = location

    def require_auth(self, path: str, value: str) -> None:
        """Answer 401 to requests for ``path`` whose Authorization header is not ``value``."""
        with self._lock:
            self._required[_norm(path)] = value

    def authorizations(self, path: str) -> list[str | None]:
        """The Authorization header (or None) of every request to ``path`` so far."""
        with self._lock:
            return [auth for p, auth in self._authorizations if p == _norm(path)]

    def pending(self, path: str) -> list[str]:
        """Behaviours still queued for ``path``."""
        with self._lock:
            return list(self._faults.get(_norm(path), ()))

    # ------------------------------------------------------------------------------------------ inspection

    @property
    def requests(self) -> list[tuple[str, str]]:
        """Snapshot of (method, path) for every request so far; path is URL-decoded, without query string."""
        with self._lock:
            return list(self._requests)

    def count(self, path: str, method: str | None = None) -> int:
        """Number of requests to ``path`` (optionally only those with ``method``)."""
        path = _norm(path)
        with self._lock:
            return sum(1 for m, p in self._requests if p == path and (method is None or m == method))

    # ------------------------------------------------------------------------------------------ handler hooks

    def _on_request(self, method: str, path: str, authorization: str | None) -> tuple[str | None, bytes | None]:
        # Record, pop the next behaviour and read the content atomically, so concurrent requests each get one.
        with self._lock:
            self._requests.append((method, path))
            self._authorizations.append((path, authorization))
            queue = self._faults.get(path)
            behaviour = queue.popleft() if queue else None
            return behaviour, self._files.get(path)

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)


def _norm(path: str) -> str:
    return path if path.startswith("/") else "/" + path
