"""Where a download's credentials come from, and which hosts get them.

Credentials never go into params.yaml (which dvc.lock and MLflow record): `Auth` takes them from the
environment (`LOCKSTEP_DATA_TOKEN`, sent as `Authorization: Bearer <token>`, or `LOCKSTEP_DATA_AUTH`,
the whole header value) for the configured hosts only, or from `~/.netrc` (`$NETRC`): an entry goes
only to the host its `machine` line names, and only over https; the environment's header goes over
https, or plain http to loopback only. Unlike curl and requests, the netrc
`default` entry is never used: it would answer for every host (torchvision's, a mirror a run record
names) and, over plain http, hand the password to anyone on the path. tasks/core/fetch.py asks
`Auth.header_for` before each request, and never forwards the header on a redirect.
"""

from __future__ import annotations

import base64
import netrc
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from tasks.core.config.base import is_loopback
from tasks.core.errors import ExpectedFailure
from tasks.core.redact import redact

TOKEN_ENV, AUTH_ENV = "LOCKSTEP_DATA_TOKEN", "LOCKSTEP_DATA_AUTH"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Auth:
    """An Authorization header from the environment, sent to `hosts` only (the configured mirror or
    url: never to a published host the user did not name, nor to where a redirect points)."""

    header: str | None = None
    hosts: frozenset[str] = frozenset()
    netrc: bool = True  # False: no ~/.netrc entry either (a published host the user did not name)

    @classmethod
    def from_environment(cls, urls: Iterable[str | None]) -> Auth:
        token, whole = os.environ.get(TOKEN_ENV), os.environ.get(AUTH_ENV)
        if token and whole:
            raise ExpectedFailure(f"{TOKEN_ENV} and {AUTH_ENV} are both set; set one")
        name, header = (TOKEN_ENV, f"Bearer {token}") if token else (AUTH_ENV, whole)
        if header and _CONTROL.search(header):  # a newline would inject a header
            raise ExpectedFailure(f"{name}: contains a control character; it is sent as an HTTP header")
        return cls(header or None, frozenset(host for url in urls if url and (host := _host(url))))

    def header_for(self, url: str) -> str | None:
        """The Authorization value for `url`: user info in the URL, else the environment's for a
        configured host, else a netrc entry naming its host (https only); None when there is none."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            return None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            return "Basic " + base64.b64encode(pair.encode()).decode()
        if self.header and _host(url) in self.hosts:
            # over plain http the header is the secret in clear for anyone on the path; loopback
            # (a local mirror, the tests' server) never leaves the machine
            if parts.scheme == "http" and not is_loopback(url):
                raise ExpectedFailure(
                    f"{redact(url)}: {TOKEN_ENV}/{AUTH_ENV} is not sent over plain http (anyone on the path "
                    "reads it): use the host's https:// URL"
                )
            return self.header
        if not self.netrc or parts.scheme != "https":  # a Basic header over http is the password in clear
            return None
        return _netrc_header(parts.hostname or "")


NO_AUTH = Auth()  # no token: a netrc entry for the host, if any
NO_CREDENTIALS = Auth(netrc=False)  # nothing at all: torchvision's own hosts


def _host(url: str) -> str:
    """host[:port] of `url`, lower case, without user info ("" for a URL that does not parse)."""
    try:
        return urlsplit(url).netloc.rpartition("@")[2].lower()
    except ValueError:  # fetching it fails later, with a message naming it
        return ""


def _netrc_header(hostname: str) -> str | None:
    """Basic credentials from $NETRC or ~/.netrc for `hostname`: its own `machine` entry, never `default`."""
    file = os.environ.get("NETRC")
    if not os.path.exists(file or os.path.expanduser("~/.netrc")):
        return None
    try:
        hosts = netrc.netrc(file).hosts
    except netrc.NetrcParseError as exc:
        # exc.msg can quote a token of the file (a password): only its fixed texts are shown
        fixed = exc.msg.startswith("~/.netrc ")  # the permission and owner checks
        why = exc.msg.removeprefix("~/.netrc ") if fixed else f"not a valid netrc file (line {exc.lineno})"
        raise ExpectedFailure(f"{file or os.path.expanduser('~/.netrc')}: {why}") from None
    except OSError as exc:
        raise ExpectedFailure(f"{file or '~/.netrc'}: cannot be read: {exc.strerror}") from None
    # `authenticators` falls back to `default`, which the module keeps under the key "default": a host
    # really named "default" is no reason to send it either.
    named = {name.lower(): entry for name, entry in hosts.items() if name != "default"}
    entry = named.get(hostname.lower()) if hostname else None
    if entry is None:
        return None
    login, _, password = entry
    return "Basic " + base64.b64encode(f"{login}:{password or ''}".encode()).decode()
