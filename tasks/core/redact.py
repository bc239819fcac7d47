"""One redaction for everything that leaves a process: log lines, error messages, MLflow params,
tags and text artifacts, the model card.

Masked, wherever they appear in a string:
- the value of every environment variable whose name says it is a secret (token, password,
  secret, key, auth, credential, jwt, cookie: API tokens, cloud keys,
  MLFLOW_TRACKING_PASSWORD, PREFECT_API_AUTH_STRING...): a value can end up in a URL or a path;
- credentials in URLs: user info (`https://user:pass@host` -> `https://***@host`), query and
  fragment parameters named like a secret (`?token=`, `&sig=`, `?auth=`, `?jwt=`, `?session=`,
  `#access_token=`), and path segments that are credentials: the one after a segment named like a
  secret (`/token/<x>`), a Telegram-style `bot<digits>:<x>`, the part of the path where a known host
  keeps its secret (`PATH_SECRETS`: Slack and Discord webhooks...), tokens by their shape (`ghp_...`,
  `glpat-...`: `TOKEN_SHAPE`, anywhere in the text) and random-looking strings (20+ characters of
  upper case, lower case and digits mixed, as base64 tokens are; hex digests and run ids, which are
  one case, stay readable). Names and paths are read as a server reads them: percent-escapes
  decoded until none is left (`?pass%77ord=` is psycopg's `password`, `?%74oken=` a web server's
  `token`);
- header values: `Bearer <x>`, `Authorization: <scheme> <x>`;
- the whole value of a param or tag whose name is secret-like.

`install()` applies `redact` to every log record of the process (message and traceback, before any
handler sees it, Prefect's API log handler included) and to uncaught tracebacks, so that no call
site has to remember it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import Any
from urllib.parse import quote, unquote, urlsplit

MASK = "***"
# names of variables, params and tags that hold secrets
SECRET_NAME = re.compile(r"token|passw|secret|key|auth|credential|jwt|cookie", re.IGNORECASE)
# names of URL parameters that do (signed URLs carry `sig`, web apps `session`); params.yaml refuses
# URLs holding one (tasks/core/config/base.py `url_credentials`)
SECRET_URL_WORDS = r"token|passw|secret|key|auth|credential|jwt|cookie|session|sig"
_MIN_SECRET_LENGTH = 6  # shorter values ("1", "true", "us-east") would mask ordinary text
# Hosts whose URLs keep a credential in the path, and where (group 1 of the pattern, matched on the path
# with its escapes decoded): the URL is the secret. One list for the log masking here and for params.yaml,
# which refuses a URL-valued key holding one (tasks/core/config/base.py `url_credentials`).
PATH_SECRETS: tuple[tuple[str, re.Pattern[str], re.Pattern[str]], ...] = (
    ("a Slack webhook", re.compile(r"hooks\.slack\.com"), re.compile(r"^/(?:services|workflows|triggers)/(.+)", re.S)),
    (
        "a Discord webhook",
        re.compile(r"(?:[\w-]+\.)?discord(?:app)?\.com"),
        re.compile(r"^/api/(?:v\d+/)?webhooks/[^/]+/([^/]+)"),
    ),
    ("a Telegram bot token", re.compile(r"api\.telegram\.org"), re.compile(r"^/(?:file/)?bot([^/]+)")),
    (
        "a Microsoft Teams webhook",
        re.compile(r"[\w-]+\.webhook\.office\.com|outlook\.office(?:365)?\.com"),
        re.compile(r"^/webhook\w*/(.+)", re.S),
    ),
)
# Tokens that say what they are by their prefix (GitHub, GitLab, Slack, Hugging Face), wherever they sit.
TOKEN_SHAPE = re.compile(
    r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}|glpat-[\w-]{20,}|xox[abeprs]-[\w-]{10,}"
    r"|hf_[A-Za-z0-9]{30,})"
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_URL_PARTS = re.compile(r"([^:]+://[^/?#]*)([^?#]*)(.*)", re.S)  # scheme and authority, path, the rest
# A URL's user info, read as urlsplit reads it: all of the authority (up to the first / ? # or space) before
# its last @. A password may hold ' and @ (RFC 3986 allows ' unescaped; clients accept a raw @), so neither ends it.
_USERINFO = re.compile(r"(?<=://)[^/?#\s\"<>`]*@")
_PARAM = re.compile(r"([?&#;])([^=&#;?/\s]*)=([^&#\s'\"]*)")
_BOT_TOKEN = re.compile(r"^(bot)\d+:.+", re.S)
_RANDOM_SEGMENT = re.compile(
    r"(?<=/)(?=[A-Za-z0-9_\-]*[a-z])(?=[A-Za-z0-9_\-]*[A-Z])(?=[A-Za-z0-9_\-]*\d)[A-Za-z0-9_\-]{20,}"
)
_AUTH_HEADER = re.compile(
    r"(\bBearer\s+|Authorization[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z]+\s+)?)[A-Za-z0-9._~+/=*\-]{6,}", re.IGNORECASE
)
_SHOWN_AS_IS = "/:@!$&'()*+,;=-._~"  # what a masked path keeps unescaped


# C0 and C1 controls (newline, escape...), line and paragraph separators, bidirectional overrides: all
# that str.splitlines, a terminal or a reader's eye takes for the end of a line or another order of text
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """`text` with every `CONTROL` character written as its escape (`\\n`, `\\x1b`, `\\u202e`): what
    leaves a process as one line (tasks/core/cli.py `one_line`) cannot forge another or move the cursor."""
    return CONTROL.sub(lambda match: ascii(match.group())[1:-1], text)


def unquoted(text: str) -> str:
    """`text` with its percent-escapes decoded until none is left (`%2577` -> `%77` -> `w`): a server
    may decode a name more than once, so a check must see what the last decoding gives."""
    while (decoded := unquote(text)) != text:  # each pass shortens it: this ends
        text = decoded
    return text


def secret_named(name: str, words: str = SECRET_URL_WORDS) -> bool:
    """Whether a URL parameter or path segment `name`, decoded, is named like a secret (any case)."""
    return re.search(words, unquoted(name), re.IGNORECASE) is not None


def path_secret(host: str | None, path: str) -> tuple[str, re.Match[str]] | None:
    """Where a known host (`PATH_SECRETS`) keeps a secret in `path`: what it is, and its match on the
    decoded path (group 1); None for other hosts and paths."""
    host, path = unquoted(host or "").lower().rstrip("."), unquoted(path)
    for what, hosts, where in PATH_SECRETS:
        if hosts.fullmatch(host) and (found := where.search(path)):
            return what, found
    return None


def secret_values() -> list[str]:
    """Values of this process's environment variables with secret-looking names, longest first."""
    values = {
        value for name, value in os.environ.items() if SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_LENGTH
    }
    return sorted(values, key=len, reverse=True)


def _mask_param(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if secret_named(name):
        return f"{separator}{name}={MASK}" if value else match.group(0)
    return f"{separator}{name}={_PARAM.sub(_mask_param, value)}"  # `a=1;token=x`: the value holds another


def _mask_segment(segment: str, after_secret: bool) -> str:
    if after_secret and segment:
        return MASK
    plain = unquoted(segment)
    masked = TOKEN_SHAPE.sub(MASK, _BOT_TOKEN.sub(rf"\g<1>{MASK}", plain))
    return segment if masked == plain else quote(masked, safe=_SHOWN_AS_IS)


def _redact_path(head: str, path: str) -> str:
    try:
        host = urlsplit(head).hostname
    except ValueError:
        host = None
    known = path_secret(host, path)
    if known is not None:
        plain, found = unquoted(path), known[1]
        return quote(plain[: found.start(1)] + MASK + plain[found.end(1) :], safe=_SHOWN_AS_IS)
    segments = path.split("/")
    return "/".join(
        _mask_segment(segment, i > 1 and secret_named(segments[i - 1])) for i, segment in enumerate(segments)
    )


def _redact_url(match: re.Match[str]) -> str:
    url = match.group(0)
    parts = _URL_PARTS.fullmatch(url)
    if parts is not None:
        head, path, rest = parts.groups()
        url = head + _redact_path(head, path) + rest
    url = _PARAM.sub(_mask_param, url)
    return _RANDOM_SEGMENT.sub(MASK, url)


def redact(text: str) -> str:
    """`text` with every secret masked."""
    for value in secret_values():
        text = text.replace(value, MASK)
    text = _USERINFO.sub(f"{MASK}@", text)  # before _URL, which a ' in a password would end
    text = _URL.sub(_redact_url, text)
    text = _PARAM.sub(_mask_param, text)  # query strings outside a full URL ("?token=...")
    text = TOKEN_SHAPE.sub(MASK, text)
    return _AUTH_HEADER.sub(rf"\g<1>{MASK}", text)


def redact_mapping(values: dict[str, Any]) -> dict[str, str]:
    """Params or tags as MLflow stores them (strings), secrets masked."""
    return {key: MASK if SECRET_NAME.search(key) else redact(str(value)) for key, value in values.items()}


def redact_tree(value: Any) -> Any:
    """A JSON-like structure (params as a dict of sections) with secret-named keys masked and every
    string redacted; numbers, booleans and None stay as they are."""
    if isinstance(value, dict):
        return {k: MASK if SECRET_NAME.search(str(k)) else redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(item) for item in value]
    return redact(value) if isinstance(value, str) else value


def install() -> None:
    """Redact every log record this process creates, and uncaught tracebacks. Idempotent."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "lockstep_redacts", False):
        return

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed %-format: the handler reports it as logging always has
            return record
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[0] is not None:  # formatted once here, then cached
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return record

    redacting_factory.lockstep_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(redacting_factory)

    def redacting_excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        sys.stderr.write(redact("".join(traceback.format_exception(kind, exc, tb))))

    sys.excepthook = redacting_excepthook
