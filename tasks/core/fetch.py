"""Robust downloads: retries with backoff, resume, checksum before use, one downloader at a time.
In core, not data/: the download stage fetches datasets with it and the train stage pretrained weights
(tasks/train/pretrained.py), and neither stage imports the other.

A file is fetched into a download cache (never into data/) as `<name>.part`, verified against its
published checksum, and only then renamed to `<name>`. So a file under its final name is always
complete and verified, whatever killed an earlier attempt; and a verified file already in the
cache is reused without touching the network.

Written on urllib rather than torchvision's `download_url`, which has no retry or backoff on
connection errors and 5xx, no resume, and verifies only after writing to the final path.

Concurrency: an exclusive `flock` on `<name>.lock` makes every process that wants the same file
(DDP ranks on a node, two pipeline runs) wait for the one that downloads it, then reuse it.

Limits (a hostile or broken server must not hold the pipeline lock or fill the disk): at most
`max_bytes` per file, counted while the body streams (a missing or lying Content-Length changes
nothing), and one deadline per file over every attempt and URL (`Retry.deadline_s`): a server that
sends a byte a second is given up on at the deadline, not after days.

Credentials (tasks/core/credentials.py: `Auth`) are sent to the hosts they are for; the header is
never forwarded on a redirect, and every URL in a message or log line passes tasks/core/redact.py.
"""

from __future__ import annotations

import fcntl
import http.client
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tqdm import tqdm

from tasks.core.config.base import is_loopback
from tasks.core.credentials import NO_AUTH, Auth
from tasks.core.errors import ExpectedFailure
from tasks.core.hashing import file_digest
from tasks.core.redact import escape_controls, redact

log = logging.getLogger(__name__)

BLOCK = 1 << 20
USER_AGENT = "lockstep (+https://github.com/lockstep)"
DEFAULT_MAX_BYTES = 4 << 30  # DataConfig.max_download_bytes's default
# A checkpoint fetched from a tracking store (`make reproduce`, a sweep's winner): resnet18 in fp32 is 45 MB
MAX_CHECKPOINT_BYTES = 1 << 30
_LENGTH = re.compile(r"^[0-9]{1,19}$")  # what int() accepts beyond this (" 1_0", "-5") is no Content-Length


class DownloadError(ExpectedFailure):
    """A file could not be fetched or failed verification; the message names it.

    `transient`: the source was unreachable or failing (connection errors, HTTP 5xx) on every
    attempt, so trying again later may succeed; a 404 or a checksum mismatch will not.
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(redact(message))  # a URL's credentials never reach a message, a log or a Prefect state
        self.transient = transient

    def __reduce__(self) -> tuple[type, tuple[str, bool]]:  # keep `transient` across pickling (Prefect states)
        return type(self), (str(self), self.transient)


@dataclass(frozen=True)
class Checksum:
    algorithm: str  # "md5" (what torchvision publishes) or "sha256"
    hexdigest: str
    prefix: bool = False  # hexdigest is the digest's first characters (torchvision's weights file names)

    def of(self, path: Path) -> str:
        return file_digest(path, self.algorithm)

    def matches(self, digest: str) -> bool:
        return digest.startswith(self.hexdigest) if self.prefix else digest == self.hexdigest

    def expected(self) -> str:
        return f"{self.hexdigest}..." if self.prefix else self.hexdigest


@dataclass(frozen=True)
class Retry:
    attempts: int = 5  # 1 + retries
    backoff_s: float = 1.0  # sleep before attempt k (k >= 2): backoff_s * 2**(k-2), capped
    max_backoff_s: float = 30.0
    timeout_s: float = 60.0  # per connection attempt and per read
    deadline_s: float = 3600.0  # the whole file, every attempt and URL included

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 2), self.max_backoff_s)


class _Retryable(Exception):
    """A transient failure (connection, timeout, truncated body, HTTP 5xx): try again."""


@dataclass(frozen=True)
class _Job:
    """One file's transfer: where it goes and what bounds it."""

    name: str  # the file's name, for messages
    part: Path
    timeout_s: float
    deadline_s: float
    deadline: float  # time.monotonic() by which the file must be complete
    max_bytes: int
    auth: Auth

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def late(self, url: str, got: str) -> DownloadError:
        return DownloadError(
            f"{self.name}: {url}: not complete within data.deadline_s ({self.deadline_s:g} s, retries "
            f"included; {got}); a slow or stalling server is given up on"
        )


def fetch(
    urls: list[str],
    dest: Path,
    checksum: Checksum,
    retry: Retry = Retry(),
    max_bytes: int = DEFAULT_MAX_BYTES,
    auth: Auth = NO_AUTH,
) -> Path:
    """Make `dest` a verified copy of the file at the first of `urls` that delivers it.

    Each URL gets `retry.attempts` tries on transient errors; a 4xx or a checksum mismatch moves
    on to the next URL. The file must arrive within `retry.deadline_s` (all URLs together) and be
    at most `max_bytes`. Raises DownloadError naming the file and every URL's failure.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest):
        if dest.exists():
            if checksum.matches(checksum.of(dest)):
                log.info("%s: verified copy in %s, not downloading", dest.name, dest.parent)
                return dest
            dest.unlink()  # wrong content under the final name (edited by hand?): fetch again
        part = dest.with_name(dest.name + ".part")
        deadline = time.monotonic() + retry.deadline_s
        job = _Job(dest.name, part, retry.timeout_s, retry.deadline_s, deadline, max_bytes, auth)
        failures: list[DownloadError] = []
        for url in urls:
            try:
                _fetch_one(url, job, checksum, retry)
                os.replace(part, dest)
                log.info("%s: downloaded from %s and verified (%s)", dest.name, redact(url), checksum.algorithm)
                return dest
            except DownloadError as exc:
                failures.append(exc)
        raise DownloadError("; ".join(str(f) for f in failures), transient=all(f.transient for f in failures))


def _fetch_one(url: str, job: _Job, checksum: Checksum, retry: Retry) -> None:
    try:
        _attempts(url, job, retry)
        verify(job.part, checksum, name=job.name, origin=url)
    except DownloadError as exc:
        if not exc.transient:  # never resume from (or keep) bytes that do not verify, or were refused
            job.part.unlink(missing_ok=True)
        raise


def _attempts(url: str, job: _Job, retry: Retry) -> None:
    """`_transfer` until it completes, with backoff between attempts; DownloadError when it cannot."""
    last_error = ""
    for attempt in range(1, retry.attempts + 1):
        if attempt > 1:
            delay = retry.delay(attempt)
            if delay >= job.remaining():
                raise DownloadError(
                    f"{job.name}: {url} failed {attempt - 1} time(s), the last: {last_error}; "
                    "no time left for another attempt within data.deadline_s",
                    transient=True,
                )
            log.warning(
                "%s: %s; retry %d/%d in %.1f s", redact(url), last_error, attempt - 1, retry.attempts - 1, delay
            )
            time.sleep(delay)
        try:
            return _transfer(url, job)
        except _Retryable as exc:
            last_error = redact(str(exc))
    raise DownloadError(f"{job.name}: {url} failed after {retry.attempts} attempts: {last_error}", transient=True)


class _Watchdog:
    """Shuts the transfer's sockets down at the deadline. A read timeout bounds one read only: a
    server trickling its headers or body a byte at a time, each within the timeout, would otherwise
    stretch one request (headers included, before any of our code sees the response) for ever."""

    def __init__(self, delay: float) -> None:
        self.fired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(delay, 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                _shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shut(sock)

    def stop(self) -> None:
        self._timer.cancel()

    def opener(self, direct: bool = False) -> urllib.request.OpenerDirector:
        """urllib's opener, with every HTTP(S) connection it makes (redirects too) watched; `direct`: no
        proxy from the environment (http_proxy...), whatever no_proxy says."""
        watchdog = self

        def watched(connection_class: type[http.client.HTTPConnection]) -> Any:
            def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
                connection = connection_class(*args, **kwargs)
                connect = connection.connect

                def connect_and_watch() -> None:
                    connect()
                    watchdog.watch(connection.sock)

                connection.connect = connect_and_watch  # type: ignore[method-assign]
                return connection

            return make

        class Http(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(watched(http.client.HTTPConnection), req)

        class Https(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(watched(http.client.HTTPSConnection), req)

        return urllib.request.build_opener(Http(), Https(), *([urllib.request.ProxyHandler({})] if direct else []))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read, which then fails or ends
    except OSError:  # already closed
        pass


def _open(url: str, job: _Job, have: int, watchdog: _Watchdog) -> Any:  # HTTPResponse, or a file:// response
    """The response for `url` from byte `have` on; raises _Retryable or DownloadError."""
    remaining = job.remaining()
    if remaining <= 0:
        raise job.late(url, f"{have} bytes received")
    try:
        request = _request(url, job, have)
        # A loopback URL is this machine's: a proxy would fetch its own loopback instead, and over plain
        # http it would get the credentials that tasks/core/credentials.py lets go to loopback only
        direct = is_loopback(url)
        return watchdog.opener(direct).open(request, timeout=min(job.timeout_s, remaining))
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # our partial file is longer than the resource: start over
            job.part.unlink()
            raise _Retryable(f"HTTP 416 on resume at byte {have}") from None
        if exc.code >= 500 or exc.code in (408, 429):
            raise _Retryable(f"HTTP {exc.code} {_said(exc.reason)}") from None
        raise DownloadError(f"{job.name}: {url}: HTTP {exc.code} {_said(exc.reason)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, urllib.error.URLError) and isinstance(reason, FileNotFoundError):
            raise DownloadError(f"{job.name}: {url}: no such file") from None
        raise _Retryable(f"connection failed: {_said(reason)}") from None
    except (ValueError, http.client.HTTPException) as exc:  # a malformed URL or response: no retry helps
        raise DownloadError(f"{job.name}: {url}: {_said(exc)}") from None


def _said(what: object) -> str:
    """What a server said (a reason phrase, a malformed status line), as one short line: it reaches log
    lines and messages, where a control character would forge a line or rewrite the terminal."""
    text = escape_controls(str(what))
    return text if len(text) <= 200 else text[:200] + "..."


def _request(url: str, job: _Job, have: int) -> urllib.request.Request:
    parts = urlsplit(url)
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))  # urllib cannot take user:pass@
    headers = {"User-Agent": USER_AGENT, **({"Range": f"bytes={have}-"} if have else {})}
    request = urllib.request.Request(bare, headers=headers)
    if (header := job.auth.header_for(url)) is not None:
        request.add_unredirected_header("Authorization", header)  # a redirect's target does not get it
    return request


def _transfer(url: str, job: _Job) -> None:
    """Append the rest of `url` to `job.part` (resuming with a Range request when it has bytes)."""
    have = job.part.stat().st_size if job.part.exists() else 0
    watchdog = _Watchdog(job.remaining())
    try:
        with _open(url, job, have, watchdog) as response:
            _stream(url, job, response, have)
        if watchdog.fired:  # a body without a length, cut at the deadline, ends like a complete one
            raise job.late(url, "cut at the deadline")
    except (_Retryable, DownloadError):
        if watchdog.fired:  # whatever the cut connection looked like, the deadline is the reason
            raise job.late(url, "cut at the deadline") from None
        raise
    finally:
        watchdog.stop()


def _stream(url: str, job: _Job, response: Any, have: int) -> None:
    resumed = getattr(response, "status", 200) == 206
    if have and not resumed:
        have = 0  # the server ignored Range: take the whole body from the start
    total = _declared_total(url, job, have, response.headers.get("Content-Length"))
    with (
        open(job.part, "ab" if resumed else "wb") as out,
        tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=job.name, disable=None, leave=False) as bar,
    ):
        try:
            # read1: one socket read per call, so limits are checked as the bytes arrive
            while block := response.read1(BLOCK):
                if out.tell() + len(block) > job.max_bytes:
                    raise _too_large(url, job, f"at least {out.tell() + len(block)} bytes")
                out.write(block)
                bar.update(len(block))
                if job.remaining() <= 0:
                    raise job.late(url, f"{out.tell()} bytes received")
        except (http.client.HTTPException, OSError, ValueError) as exc:  # ValueError: a malformed chunk
            raise _Retryable(f"transfer interrupted after {out.tell()} bytes: {exc!r}") from None
        if total is not None and out.tell() != total:
            raise _Retryable(f"truncated transfer: {out.tell()} of {total} bytes")


def _declared_total(url: str, job: _Job, have: int, length: str | None) -> int | None:
    """The file's size from Content-Length (None when absent); refused when malformed or too large."""
    if length is None:
        return None
    if not _LENGTH.match(length):
        shown = repr(length[:40]) + ("..." if len(length) > 40 else "")
        raise DownloadError(f"{job.name}: {url}: the server sent an invalid Content-Length {shown}")
    if have + int(length) > job.max_bytes:
        raise _too_large(url, job, f"{have + int(length)} bytes announced")
    return have + int(length)


def _too_large(url: str, job: _Job, got: str) -> DownloadError:
    return DownloadError(f"{job.name}: {url}: {got}, more than data.max_download_bytes ({job.max_bytes})")


@contextmanager
def _exclusive(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock for `dest` across processes (released when the holder dies, too)."""
    with open(dest.with_name(dest.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another process is downloading it; waiting", dest.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def verify(path: Path, checksum: Checksum, name: str | None = None, origin: str | None = None) -> None:
    """Raise DownloadError unless `path` has `checksum`; the message names the file and where it came from."""
    got = checksum.of(path)
    if not checksum.matches(got):
        raise DownloadError(
            f"checksum mismatch for {name or Path(path).name}: expected {checksum.expected()}, "
            f"got {got} ({checksum.algorithm}, from {origin or path})"
        )
