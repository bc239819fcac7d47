"""The GPU check's rows: one `Check` per model, precision or stage, and the report that holds them,
as a plain-text table (no rich: a bare machine may not have it) and JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIPPED, NA, REPORT = "pass", "FAIL", "skipped", "n/a", "report"

# torch's messages when strict mode refuses an op: "<op> does not have a deterministic implementation"
# and cuBLAS's "... set an environment variable ... CUBLAS_WORKSPACE_CONFIG".
_NONDETERMINISTIC_OP = re.compile(r"(\S+) does not have a deterministic implementation")


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    status: str  # pass | FAIL | skipped | n/a | report (measured, no target on this device)
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class GpuCheckReport:
    device: dict[str, Any]  # a summary of `machine`
    machine: dict[str, str]  # the fingerprint a run records (tasks/determinism/fingerprint.py)
    versions: dict[str, str]
    determinism: dict[str, Any]  # the pinned settings (tasks/determinism/pinning.py) the checks ran under
    options: dict[str, Any]
    checks: list[Check]
    group_seconds: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def failed(self) -> bool:
        return any(check.status == FAIL for check in self.checks)

    def to_json(self) -> str:
        counts = {status: sum(c.status == status for c in self.checks) for status in (PASS, FAIL, SKIPPED, NA, REPORT)}
        return json.dumps({**asdict(self), "passed": not self.failed, "counts": counts}, indent=2) + "\n"

    def table(self) -> str:
        """The report as plain text (no rich: a bare machine may not have it)."""
        rows = [("group", "check", "status", "detail")] + [(c.group, c.name, c.status, c.detail) for c in self.checks]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            f"lockstep gpu-check: {self.device['summary']}; torch {self.versions['torch']}; "
            f"CPU threads: {self.determinism.get('num_threads')}; {self.wall_s:.1f} s",
            *("  ".join([*(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3]]) for row in rows),
        ]
        counts = ", ".join(f"{sum(c.status == s for c in self.checks)} {s}" for s in (PASS, FAIL, SKIPPED, NA, REPORT))
        lines.append(f"result: {'FAILED' if self.failed else 'ok'} ({counts})")
        return "\n".join(lines)


def describe(exc: BaseException) -> str:
    """One line: the op strict mode refused, or the error's first line."""
    text = str(exc).strip()
    match = _NONDETERMINISTIC_OP.search(text)
    if match:
        return f"strict mode refused {match.group(1)} (no deterministic implementation)"
    if "CUBLAS_WORKSPACE_CONFIG" in text:
        return "strict mode refused a cuBLAS call: CUBLAS_WORKSPACE_CONFIG was not set before CUDA started"
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:400]
