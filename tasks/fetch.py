"""Robust downloads: retries with backoff, resume, checksum before use, one downloader at a time.

A file is fetched into a download cache (never into data/) as `<name>.part`, verified against its
published checksum, and only then renamed to `<name>`. So a file under its final name is always
complete and verified, whatever killed an earlier attempt; and a verified file already in the
cache is reused without touching the network.

Written on urllib rather than torchvision's `download_url`, which has no retry or backoff on
connection errors and 5xx, no resume, and verifies only after writing to the final path.

Concurrency: an exclusive `flock` on `<name>.lock` makes every process that wants the same file
(DDP ranks on a node, two pipeline runs) wait for the one that downloads it, then reuse it.
"""

from __future__ import annotations

import fcntl
import http.client
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tasks.errors import ExpectedFailure
from tasks.hashing import file_digest

log = logging.getLogger(__name__)

BLOCK = 1 << 20
USER_AGENT = "lockstep (+https://github.com/lockstep)"


class DownloadError(ExpectedFailure):
    """A file could not be fetched or failed verification; the message names it.

    `transient`: the source was unreachable or failing (connection errors, HTTP 5xx) on every
    attempt, so trying again later may succeed; a 404 or a checksum mismatch will not.
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self) -> tuple[type, tuple[str, bool]]:  # keep `transient` across pickling (Prefect states)
        return type(self), (str(self), self.transient)


@dataclass(frozen=True)
class Checksum:
    algorithm: str  # "md5" (what torchvision publishes) or "sha256"
    hexdigest: str

    def of(self, path: Path) -> str:
        return file_digest(path, self.algorithm)


@dataclass(frozen=True)
class Retry:
    attempts: int = 5  # 1 + retries
    backoff_s: float = 1.0  # sleep before attempt k (k >= 2): backoff_s * 2**(k-2), capped
    max_backoff_s: float = 30.0
    timeout_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 2), self.max_backoff_s)


class _Retryable(Exception):
    """A transient failure (connection, timeout, truncated body, HTTP 5xx): try again."""


def fetch(urls: list[str], dest: Path, checksum: Checksum, retry: Retry = Retry()) -> Path:
    """Make `dest` a verified copy of the file at the first of `urls` that delivers it.

    Each URL gets `retry.attempts` tries on transient errors; a 4xx or a checksum mismatch moves
    on to the next URL. Raises DownloadError naming the file and every URL's failure.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest):
        if dest.exists():
            if checksum.of(dest) == checksum.hexdigest:
                log.info("%s: verified copy in %s, not downloading", dest.name, dest.parent)
                return dest
            dest.unlink()  # wrong content under the final name (edited by hand?): fetch again
        failures: list[DownloadError] = []
        for url in urls:
            try:
                _fetch_one(url, dest, checksum, retry)
                return dest
            except DownloadError as exc:
                failures.append(exc)
        raise DownloadError("; ".join(str(f) for f in failures), transient=all(f.transient for f in failures))


def _fetch_one(url: str, dest: Path, checksum: Checksum, retry: Retry) -> None:
    part = dest.with_name(dest.name + ".part")
    last_error = ""
    for attempt in range(1, retry.attempts + 1):
        if attempt > 1:
            delay = retry.delay(attempt)
            log.warning("%s: %s; retry %d/%d in %.1f s", url, last_error, attempt - 1, retry.attempts - 1, delay)
            time.sleep(delay)
        try:
            _transfer(url, part, retry.timeout_s)
            break
        except _Retryable as exc:
            last_error = str(exc)
    else:
        raise DownloadError(f"{dest.name}: {url} failed after {retry.attempts} attempts: {last_error}", transient=True)
    try:
        verify(part, checksum, name=dest.name, origin=url)
    except DownloadError:
        part.unlink()  # never resume from (or keep) bytes that do not verify
        raise
    os.replace(part, dest)
    log.info("%s: downloaded from %s and verified (%s)", dest.name, url, checksum.algorithm)


def _transfer(url: str, part: Path, timeout_s: float) -> None:
    """Append the rest of `url` to `part` (resuming with a Range request when `part` has bytes)."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT, **({"Range": f"bytes={have}-"} if have else {})}
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # our partial file is longer than the resource: start over
            part.unlink()
            raise _Retryable(f"HTTP 416 on resume at byte {have}") from None
        if exc.code >= 500 or exc.code in (408, 429):
            raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
        raise DownloadError(f"{part.name.removesuffix('.part')}: {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, urllib.error.URLError) and isinstance(reason, FileNotFoundError):
            raise DownloadError(f"{part.name.removesuffix('.part')}: {url}: no such file") from None
        raise _Retryable(f"connection failed: {reason}") from None
    with response:
        resumed = getattr(response, "status", 200) == 206
        if have and not resumed:
            have = 0  # the server ignored Range: take the whole body from the start
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        with (
            open(part, "ab" if resumed else "wb") as out,
            tqdm(
                total=total,
                initial=have,
                unit="B",
                unit_scale=True,
                desc=part.name.removesuffix(".part"),
                disable=None,
                leave=False,
            ) as bar,
        ):
            try:
                while block := response.read(BLOCK):
                    out.write(block)
                    bar.update(len(block))
            except (http.client.IncompleteRead, OSError) as exc:
                raise _Retryable(f"transfer interrupted after {out.tell()} bytes: {exc!r}") from None
            if total is not None and out.tell() != total:
                raise _Retryable(f"truncated transfer: {out.tell()} of {total} bytes")


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
    if got != checksum.hexdigest:
        raise DownloadError(
            f"checksum mismatch for {name or Path(path).name}: expected {checksum.hexdigest}, "
            f"got {got} ({checksum.algorithm}, from {origin or path})"
        )
