"""What a rebuild found: the weights' sha256 against the logged checkpoints, the upstream outputs'
md5 against the run's dvc.lock, and why bytes differ when they do (library versions, determinism
settings, the machine's fingerprint: tasks/determinism/fingerprint.py `explain`); as text for a
human, JSON, and one MLflow run in the original's experiment (tag `reproduce.of`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.core import layout
from tasks.core.config.yaml_io import load_yaml
from tasks.core.errors import ExitCode
from tasks.core.hashing import file_digest
from tasks.core.redact import redact
from tasks.determinism.fingerprint import explain
from tasks.tools.reproduce.record import WEIGHTS, inside
from tasks.tracking import owners

UPSTREAM = ("stats", "preprocess")  # their outputs are checked against the run's dvc.lock
# Tags that describe the machine rather than the run's inputs; a difference explains different bytes.
MACHINE_TAG_PREFIXES = ("version.", "determinism.", "device")  # hw.*: tasks/determinism/fingerprint.py explain


@dataclass(frozen=True)
class Comparison:
    """One file's digest as the run logged it and as the rebuild made it (None: not made)."""

    name: str
    algorithm: str
    logged: str
    rebuilt: str | None

    @property
    def identical(self) -> bool:
        return self.rebuilt == self.logged


@dataclass
class ReproduceReport:
    requested_run_id: str
    run_id: str  # the train stage run that was rebuilt
    experiment_id: str
    code: str  # where the rebuilt code came from
    data_md5: str
    data_from: str = ""  # "DVC cache" or "DVC remote '<name>'"
    stage_seconds: dict[str, float] = field(default_factory=dict)
    failed_stage: str | None = None
    failure_tail: list[str] = field(default_factory=list)
    weights: list[Comparison] = field(default_factory=list)
    upstream: list[Comparison] = field(default_factory=list)  # vs the run's dvc.lock: informative
    machine_now: dict[str, str] = field(default_factory=dict)
    machine_differences: dict[str, dict[str, str]] = field(default_factory=dict)
    explained_by: list[str] = field(default_factory=list)  # fingerprint differences that change bytes
    bytes_expected_to_differ: bool = False  # native mode on another CPU: metrics compared instead
    metrics: dict[str, dict[str, float | None]] = field(default_factory=dict)  # run vs rebuilt
    warnings: list[str] = field(default_factory=list)
    workspace: str | None = None  # kept for inspection (--keep / --workdir)
    reproduce_run_id: str | None = None

    @property
    def identical(self) -> bool:
        return self.failed_stage is None and bool(self.weights) and all(c.identical for c in self.weights)

    @property
    def verdict(self) -> str:
        if self.failed_stage is not None:
            return "stage_failed"
        return "identical" if self.identical else "different"

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if self.identical else ExitCode.FAILED

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("weights", "upstream"):
            data[key] = [{**asdict(c), "identical": c.identical} for c in getattr(self, key)]
        return (
            json.dumps(
                {"verdict": self.verdict, "identical": self.identical, "exit_code": self.exit_code, **data}, indent=2
            )
            + "\n"
        )


def compare_weights(record: Path, workspace: Path) -> list[Comparison]:
    rebuilt = workspace / layout.TRAIN_DIR
    return [
        Comparison(
            name,
            "sha256",
            file_digest(record / "checkpoints" / name),
            file_digest(rebuilt / name) if (rebuilt / name).exists() else None,
        )
        for name in WEIGHTS
    ]


def compare_upstream(workspace: Path, data_md5: str, warnings: list[str]) -> list[Comparison]:
    """Stats and preprocess outputs vs the md5s in the run's dvc.lock, where it describes this data."""
    lock_file = workspace / "dvc.lock"
    if not lock_file.exists():
        return []
    # heavy: dvc (~0.7 s), only when upstream outputs are compared
    from dvc.repo import Repo
    from dvc_data.hashfile.build import build

    stages = (load_yaml(lock_file.read_text(encoding="utf-8")) or {}).get("stages", {})  # checked on download
    checked = {name: stages.get(name) or {} for name in UPSTREAM}
    checked = {
        name: entry
        for name, entry in checked.items()
        if any(dep["path"] == "data" and dep.get("md5") == data_md5 for dep in entry.get("deps", []))
    }
    warnings += [
        f"the run's dvc.lock has no {name} entry for data {data_md5}: its outputs not checked"
        for name in UPSTREAM
        if name not in checked
    ]
    # every path first, then hash: a symlink out of the workspace stops the comparison before any read
    outs = [(out, inside(workspace, out["path"])) for entry in checked.values() for out in entry.get("outs", [])]
    found: list[Comparison] = []
    with Repo(str(workspace)) as repo:
        for out, path in outs:
            digest = None
            if path.exists():  # DVC's own md5 (a directory's is over its listing): the lock's algorithm
                _, _, obj = build(repo.cache.local, str(path), repo.fs, "md5", dry_run=True, ignore=repo.dvcignore)
                digest = obj.hash_info.value
            found.append(Comparison(out["path"], "md5", str(out.get("md5")), digest))
    return found


def machine_differences(run_tags: dict[str, str], now: dict[str, str]) -> dict[str, dict[str, str]]:
    return {
        key: {"run": run_tags[key], "now": value}
        for key, value in sorted(now.items())
        if key.startswith(MACHINE_TAG_PREFIXES) and key in run_tags and run_tags[key] != value
    }


def explain_difference(report: ReproduceReport, run: Any, workspace: Path) -> None:
    """Which fingerprint differences explain different bytes; metrics when bytes were never expected to match."""
    device = report.machine_now.get("device", "cpu")
    report.explained_by, report.bytes_expected_to_differ = explain(run.data.tags, report.machine_now, device)
    train_json = workspace / layout.TRAIN_DIR / "train.json"
    if report.bytes_expected_to_differ and train_json.exists():
        rebuilt = json.loads(train_json.read_text())
        report.metrics = {
            "best_val_accuracy": {
                "run": run.data.metrics.get("best_val_accuracy"),
                "rebuilt": rebuilt.get("best_val_accuracy"),
            }
        }


def log_outcome(client: Any, report: ReproduceReport, workdir: Path) -> str:
    """One MLflow run in the original's experiment (not nested: it belongs to no pipeline execution)."""
    tags = {
        "lockstep.entry_point": "reproduce",
        "reproduce.of": report.run_id,
        "reproduce.identical": str(report.identical).lower(),
        "reproduce.verdict": report.verdict,
        "data.md5": report.data_md5,
        **{f"reproduce.logged_sha256.{c.name}": c.logged for c in report.weights},
        **{f"reproduce.sha256.{c.name}": str(c.rebuilt) for c in report.weights},
        **report.machine_now,
        **owners.owner_tags(),  # a kill before it ends leaves it to the next sweep
    }
    run = client.create_run(report.experiment_id, run_name=f"reproduce {report.run_id[:8]}", tags=tags)
    report.reproduce_run_id = run.info.run_id
    for stage, seconds in report.stage_seconds.items():
        client.log_metric(run.info.run_id, f"{stage}_seconds", seconds)
    path = workdir / "reproduce.json"
    path.write_text(redact(report.to_json()))
    client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id, "FAILED" if report.failed_stage else "FINISHED")
    return run.info.run_id


def format_report(report: ReproduceReport) -> str:
    """A few lines for a human; the first is the verdict."""
    run_id = report.run_id
    if report.failed_stage is not None:
        lines = [
            f"reproduce {run_id}: stage {report.failed_stage} failed: weights not compared",
            *(f"  | {line}" for line in report.failure_tail),
        ]
    else:
        lines = []
        for c in report.weights:
            said = (
                f"byte-identical (sha256 {c.logged})"
                if c.identical
                else f"DIFFERS (logged sha256 {c.logged}, rebuilt {c.rebuilt})"
            )
            lines.append(f"reproduce {run_id}: {c.name} {said}" if not lines else f"  {c.name}: {said}")
    for c in report.upstream:
        lines.append(f"  {c.name}: md5 {'matches' if c.identical else 'differs from'} the run's dvc.lock")
    seconds = sum(report.stage_seconds.values())
    lines.append(
        f"  rebuilt from {report.code}, data {report.data_md5} ({report.data_from}); "
        f"{', '.join(report.stage_seconds)} in {seconds:.1f} s"
    )
    if report.machine_differences:
        lines.append("  library versions or determinism settings differ from the run's:")
        lines += [f"    {key}: run {d['run']}, now {d['now']}" for key, d in report.machine_differences.items()]
    if report.machine_now and not report.identical and report.failed_stage is None:
        lines += _why_different(report)
    elif report.machine_now and report.identical and report.machine_differences:
        # e.g. an x86-64 run rebuilt on arm64 in portable mode: each pins its own ATen capability
        lines.append("  the same bytes all the same: none of these differences changes them")
    elif report.machine_now and report.identical:
        lines.append("  same library versions, device and determinism settings as the run")
    lines += [f"  warning: {w}" for w in report.warnings]
    if report.reproduce_run_id:
        lines.append(f"  logged as MLflow run {report.reproduce_run_id} (experiment {report.experiment_id})")
    if report.workspace:
        lines.append(f"  workspace kept: {report.workspace}")
    return "\n".join(lines)


def _why_different(report: ReproduceReport) -> list[str]:
    if report.bytes_expected_to_differ:
        compared = [
            f"    {name}: run {_number(v['run'])}, rebuilt {_number(v['rebuilt'])}"
            for name, v in report.metrics.items()
        ]
        return [
            "  the run was made in native mode (determinism.cpu) on another CPU: its bytes are not expected "
            "to match here; its metrics instead:",
            *compared,
            *(f"    {line}" for line in report.explained_by),
        ]
    if report.explained_by:
        return ["  explained by the machine's fingerprint:", *(f"    {line}" for line in report.explained_by)]
    if report.machine_differences:
        return ["  explained by the differences above"]
    return [
        "  same fingerprint (CPU mode, kernels, threads, versions) and settings as the run: the weights should "
        "have been identical (a reproducibility bug: please report it with both runs' hw.* tags)"
    ]


def _number(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.4f}"
