"""The sections read by no stage: `tracking`, `orchestration` and its `notify`; and `NOTIFY_FORMATS`, the
registry of what `notify.format` names (tasks/core/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator

from tasks.core.config.base import (
    Section,
)
from tasks.core.registry import Registry


@dataclass(frozen=True)
class NotifyFormat:
    """A `notify.format` value: the JSON a webhook in `notify.url_env` is sent (flows/notify.py registers
    how an event becomes that JSON under the same name)."""

    summary: str  # for the docs' table


NOTIFY_FORMATS: Registry[NotifyFormat] = Registry(
    "orchestration.notify.format",
    {
        "slack": NotifyFormat('`{"text": ...}`: what a Slack incoming webhook takes'),
        "generic": NotifyFormat(
            "every field of the event (`event`, `flow`, `flow_run`, `stage`, `error`, ...) and `text`"
        ),
    },
)
NotifyFormatName = NOTIFY_FORMATS.named()


class NotifyConfig(Section):
    """Who is told when a run fails, crashes or is refused, and of each promotion decision
    (flows/notify.py). Webhook URLs carry tokens: they are never params. They come from a Prefect
    block (`block`, made with `prefect block create` or the UI) or from an environment variable
    (`url_env`); with neither set, nobody is told and the run says so once."""

    events: tuple[Literal["failed", "crashed", "refused", "promotion"], ...] = Field(
        ("failed", "crashed", "refused", "promotion"), strict=False
    )
    block: str | None = Field(None, max_length=256, pattern=r"^[a-z0-9-]+/[a-z0-9-]+$")  # <block type>/<name>
    url_env: str = Field("LOCKSTEP_NOTIFY_URL", max_length=128, pattern=r"^[A-Z_][A-Z0-9_]*$")
    format: NotifyFormatName = "slack"  # slack: {"text": ...}; generic: the event as JSON fields
    timeout_s: float = Field(5.0, gt=0, le=60)  # per message; a slow or dead receiver never stalls a run


class TrackingConfig(Section):
    enabled: bool = True
    experiment: str = Field("lockstep", min_length=1, max_length=256)
    registered_model: str = Field("lockstep-classifier", min_length=1, max_length=256)


class OrchestrationConfig(Section):
    """How the pipeline runs as a service (flows/deployments.py); read by no stage, so
    changing a schedule never retrains a model."""

    # lockstep-pipeline/<deployment>
    deployment: str = Field("nightly", max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # Five cron fields (Prefect checks the values when the deployment is created); null: no schedule.
    cron: str | None = Field("0 3 * * *", max_length=256, pattern=r"^\s*(\S+\s+){4}\S+\s*$")
    timezone: str = Field("UTC", max_length=64)
    reingest: bool = True  # scheduled runs re-read the source first; unchanged data means nothing retrains
    lock_wait_s: float = Field(3600.0, ge=0, le=7 * 24 * 3600)  # an overlapping run waits this long, then is refused
    notify: NotifyConfig = NotifyConfig()

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone (e.g. UTC, Europe/Berlin)") from None
        return value
