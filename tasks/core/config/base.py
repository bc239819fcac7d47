"""What every section of the config shares: the error type, the strict base model, the upper bounds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tasks.core.errors import ExitCode


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


def shown(value: Any, limit: int = 80) -> str:
    """A key or value as one short line (YAML keys can be anything: numbers, null, text with newlines).
    reprlib, not repr: a huge or deeply nested value must not be rendered whole to show 80 characters."""
    import reprlib

    if isinstance(value, str) and value.isprintable() and value.strip() == value:
        text = value
    else:
        shortener = reprlib.Repr()  # Python 3.11 takes no arguments here
        shortener.maxlevel, shortener.maxstring, shortener.maxother, shortener.maxlong = 3, limit, limit, limit
        text = shortener.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
