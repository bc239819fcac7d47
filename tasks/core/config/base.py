"""What every section of the config shares: the error type, the strict base model, the upper bounds."""

from __future__ import annotations

import ipaddress
import re
import reprlib
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

from tasks.core.errors import ExitCode
from tasks.core.redact import SECRET_URL_WORDS, TOKEN_SHAPE, path_secret, secret_named, unquoted


class ConfigError(ValueError):
    """params.yaml is malformed; the message names the file and the key."""

    exit_code = ExitCode.BAD_INPUT


class OverrideRefused(ConfigError):
    """An override of a key that runs started through the API may not change (tasks/core/config/policy.py)."""

    exit_code = ExitCode.REFUSED


# Upper bounds: every number has one, so that a typo or a hostile run record (tasks/tools/reproduce/
# rebuilds from params logged on a shared server) is a clear error, not hours of training, a
# process per core times a thousand, or an OverflowError deep in torch.
MAX_EPOCHS = 10_000
MAX_BATCH = 65_536
MAX_STEPS = 10**9
MAX_PROCESSES = 256  # per node (GPUs or CPU ranks)
MAX_NODES = 1024
# Learning rates only need to stay finite: a huge one diverges, and training stops at the first
# non-finite loss (tests/reliability/test_nan_loss.py trains at 1e10 on purpose).
MAX_LR = 1e10


class Section(BaseModel):
    # strict: a value of the wrong type is an error, not silently converted (`epochs: true` is not 1,
    # `strict: "no"` is not False, `epochs: 2.5` is not 2); ints are still fine where floats are
    # expected, and YAML lists where tuples are (those fields say `strict=False`, their items stay strict).
    # No inf or NaN anywhere: `lr: .inf` would pass `gt=0` and train a model of NaNs.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


Auto = Literal["auto"]  # a key whose value is resolved from others (train: per data.source)


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine (localhost, 127.0.0.0/8, ::1): traffic that never leaves it."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shown(value: Any, limit: int = 80) -> str:
    """A key or value as one short line (YAML keys can be anything: numbers, null, text with newlines).
    reprlib, not repr: a huge or deeply nested value must not be rendered whole to show 80 characters."""
    if isinstance(value, str) and value.isprintable() and value.strip() == value:
        text = value
    else:
        shortener = reprlib.Repr()  # Python 3.11 takes no arguments here
        shortener.maxlevel, shortener.maxstring, shortener.maxother, shortener.maxlong = 3, limit, limit, limit
        text = shortener.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def url_credentials(url: str, *, user_alone_ok: bool = False, names: str = SECRET_URL_WORDS) -> str | None:
    """What in `url` is a credential, in words ("user info", "query parameter 'token'"), or None.

    User info (`user:pw@`, or a token as the user name: `ghp_...@github.com`), query or fragment
    parameters whose name matches `names` (by default those tasks/core/redact.py masks in logs: token,
    password, key, signature...), the path of a host that keeps a secret there (redact.py `PATH_SECRETS`:
    a Slack or Discord webhook, a Telegram bot) and a token known by its shape anywhere (`ghp_...`).
    Names and paths are matched as the server reads them, percent-escapes decoded (`pass%77ord`).
    `user_alone_ok`: a user name without a password is no secret (a database URL whose password comes
    from ~/.pgpass); an escaped colon in it (`user%3Apw@`) counts as one."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return None  # not a URL at all: the key's pattern says so
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        if not (user_alone_ok and ":" not in unquoted(userinfo)):
            return "a user:password@ or token@ before the host"
    for where, text in (("query", parts.query), ("fragment", parts.fragment)):
        for field in re.split(r"[&;]", text):
            name = field.partition("=")[0]
            if name and secret_named(name, names):
                decoded = unquoted(name)
                return f"{where} parameter {shown(name, 40)!r}" + (
                    f" ({shown(decoded, 40)!r})" if decoded != name else ""
                )
    known = path_secret(host, parts.path)
    if known is not None:
        return f"{known[0]} in the path"
    if TOKEN_SHAPE.search(unquoted(url)):
        return "an access token (ghp_..., glpat-..., hf_...)"
    return None


def _no_credentials(url: str) -> str:
    found = url_credentials(url)
    if found is not None:
        raise ValueError(
            f"credentials in a URL ({found}): params.yaml and dvc.lock would record them; give them in env "
            "LOCKSTEP_DATA_TOKEN (a bearer token) or LOCKSTEP_DATA_AUTH (the Authorization header), or in ~/.netrc"
        )
    return url


# Every URL-valued key (data.mirror, data.url, train.pretrained_url): http(s) or a local file, and no
# credentials in it. Downloads read those from the environment or ~/.netrc (tasks/core/fetch.py);
# params.yaml is committed, and dvc.lock, MLflow and Prefect record every param.
Url = Annotated[
    str, StringConstraints(max_length=2048, pattern=r"^(https?|file)://\S+$"), AfterValidator(_no_credentials)
]
