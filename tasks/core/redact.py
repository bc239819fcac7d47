"""One redaction for everything that leaves a process: log lines, error messages, MLflow params,
tags and text artifacts, the model card.

Masked, wherever they appear in a string:
- the value of every environment variable whose name says it is a secret (token, password,
  secret, key, auth, credential, jwt, cookie: API tokens, cloud keys,
  MLFLOW_TRACKING_PASSWORD, PREFECT_API_AUTH_STRING...): a value can end up in a URL or a path;
- credentials in URLs: user info (`https://user:pass@host` -> `https://***@host`), query and
  fragment parameters named like a secret (`?token=`, `&sig=`, `?auth=`, `?jwt=`, `?session=`,
  `#access_token=`), and path segments that are credentials: the one after a segment named like a
  secret (`/token/<x>`), a Telegram-style `bot<digits>:<x>`, and random-looking strings (20+
  characters of upper case, lower case and digits mixed, as base64 tokens are; hex digests and
  run ids, which are one case, stay readable);
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

MASK = "***"
# names of variables, params and tags that hold secrets
SECRET_NAME = re.compile(r"token|passw|secret|key|auth|credential|jwt|cookie", re.IGNORECASE)
# names of URL parameters that do (signed URLs carry `sig`, web apps `session`); params.yaml refuses
# URLs holding one (tasks/core/config/base.py `url_credentials`)
SECRET_URL_WORDS = r"token|passw|secret|key|auth|credential|jwt|cookie|session|sig"
_MIN_SECRET_LENGTH = 6  # shorter values ("1", "true", "us-east") would mask ordinary text
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")
_SECRET_PARAM = re.compile(rf"([?&#;][^=&#\s]*(?:{SECRET_URL_WORDS})[^=&#\s]*=)[^&#\s'\"]+", re.IGNORECASE)
_SEGMENT_AFTER_SECRET = re.compile(rf"(/[^/?#]*(?:{SECRET_URL_WORDS})[^/?#]*/)[^/?#]+", re.IGNORECASE)
_BOT_TOKEN = re.compile(r"(/bot)\d+:[^/?#]+")
_RANDOM_SEGMENT = re.compile(
    r"(?<=/)(?=[A-Za-z0-9_\-]*[a-z])(?=[A-Za-z0-9_\-]*[A-Z])(?=[A-Za-z0-9_\-]*\d)[A-Za-z0-9_\-]{20,}"
)
_AUTH_HEADER = re.compile(
    r"(\bBearer\s+|Authorization[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z]+\s+)?)[A-Za-z0-9._~+/=*\-]{6,}", re.IGNORECASE
)


def secret_values() -> list[str]:
    """Values of this process's environment variables with secret-looking names, longest first."""
    values = {
        value for name, value in os.environ.items() if SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_LENGTH
    }
    return sorted(values, key=len, reverse=True)


def _redact_url(match: re.Match[str]) -> str:
    url = _USERINFO.sub(f"{MASK}@", match.group(0))
    url = _SECRET_PARAM.sub(rf"\g<1>{MASK}", url)
    url = _SEGMENT_AFTER_SECRET.sub(rf"\g<1>{MASK}", url)
    url = _BOT_TOKEN.sub(rf"\g<1>{MASK}", url)
    return _RANDOM_SEGMENT.sub(MASK, url)


def redact(text: str) -> str:
    """`text` with every secret masked."""
    for value in secret_values():
        text = text.replace(value, MASK)
    text = _URL.sub(_redact_url, text)
    text = _SECRET_PARAM.sub(rf"\g<1>{MASK}", text)  # query strings outside a full URL ("?token=...")
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
