"""What a finished (or interrupted) study amounts to: its best trial, a row per trial, a summary, and the
files a person reads (artifacts/sweep/<name>/study/: sweep.json, trials.csv, the plots). trials.csv's
cells come from the study's storage, which others may write: each is neutralised as predictions.csv's are
(tasks/core/spreadsheet.py), numbers left as numbers.

tasks/tools/sweep/study.py runs the study; flows/sweep.py calls `summarise` and `write_study` once its
batches are done, then puts the files on the sweep's MLflow run. Every file is written to a temporary
path and renamed: a sweep killed while it writes them leaves the last complete set.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from tasks.core.atomic import atomic_file, write_text
from tasks.core.config.sweep import SweepConfig
from tasks.core.errors import ExpectedFailure
from tasks.core.fetch import MAX_CHECKPOINT_BYTES
from tasks.core.hashing import file_digest
from tasks.core.spreadsheet import value_cell
from tasks.tools.sweep.study import best_trial
from tasks.tools.sweep.trials import derived_seed

log = logging.getLogger(__name__)

SUMMARY, TRIALS = "sweep.json", "trials.csv"
WEIGHTS = "best.safetensors"  # a trial's best checkpoint, in its folder and as its run's checkpoints/ artifact


class WinnerUnavailable(ExpectedFailure):
    """The winner's weights cannot be put on the coordinator with the bytes its trial reported."""


def table(study: Any) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, epochs run, seed, params, MLflow run, weights."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "epochs": len(t.intermediate_values),
                "seed": t.user_attrs.get("seed"),
                **t.params,
                "run_id": t.user_attrs.get("run_id"),
                "best_sha256": t.user_attrs.get("best_sha256"),
                "seconds": t.user_attrs.get("seconds"),
                "error": t.user_attrs.get("error"),
            }
        )
    return rows


def summarise(study: Any, cfg: SweepConfig, seconds: float) -> dict[str, Any]:
    """The study as sweep.json holds it: every trial's row, the count per state, the trial phase's
    `seconds`, the best trial (None if none completed; every stored trial checked first, since --apply
    writes the best one's params) and a one-line verdict."""
    best = best_trial(study, cfg)
    rows = table(study)
    states = {state: sum(row["state"] == state for row in rows) for state in ("complete", "pruned", "fail")}
    summary: dict[str, Any] = {"study": cfg.name, "trials": rows, "states": states, "seconds": seconds, "best": None}
    if best is None:
        summary["line"] = f"{len(rows)} trials, none complete ({states['pruned']} pruned, {states['fail']} failed)"
        return summary
    summary["best"] = {
        "trial": best.number,
        "value": best.value,
        "params": dict(best.params),
        "seed": derived_seed(cfg.seed, best.number, "train"),  # derived, not read back from the storage
        "run_id": best.user_attrs.get("run_id"),
        "best_sha256": best.user_attrs.get("best_sha256"),
    }
    values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items())
    summary["line"] = (
        f"best trial {best.number}: {cfg.metric} {best.value:.4f} ({values}); "
        f"{states['complete']} complete, {states['pruned']} pruned, {states['fail']} failed"
    )
    return summary


def write_study(study: Any, summary: dict[str, Any], out: Path) -> list[Path]:
    """sweep.json, trials.csv and the plots in `out`; the files written (a plot that cannot be drawn is
    left out, with a warning)."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / SUMMARY, json.dumps(summary, indent=2, sort_keys=True, default=str))
    with atomic_file(out / TRIALS) as tmp, open(tmp, "w", newline="") as handle:
        # every cell as predictions.csv's: the storage's trial attributes and param names are others' text
        columns = sorted({k for row in summary["trials"] for k in row})
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow([value_cell(name) for name in columns])
        writer.writerows([value_cell(row.get(name)) for name in columns] for row in summary["trials"])
    return [out / SUMMARY, out / TRIALS, *plots(study, out)]


def plots(study: Any, out_dir: Path) -> list[Path]:
    """The optimisation history and the parameter importances as PNGs in `out_dir`: the ones drawn."""
    # heavy: matplotlib (~1.6 s), only when the study's plots are drawn
    import matplotlib

    matplotlib.use("Agg")
    # heavy: matplotlib after use("Agg"), optuna (~1.4 s): only when plots are drawn
    import matplotlib.pyplot as plt
    from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

    drawn = []
    for name, plot in (
        ("optimization_history", plot_optimization_history),
        ("param_importances", plot_param_importances),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "experimental" on every call
                axes = plot(study)
        except (ValueError, RuntimeError) as exc:  # e.g. importances need two complete trials that differ
            log.warning("sweep: no %s plot: %s", name, exc)
            continue
        path = out_dir / f"{name}.png"
        with atomic_file(path) as tmp:  # PNG metadata without matplotlib's version: the bytes follow the study
            axes.figure.savefig(tmp, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
        plt.close(axes.figure)
        drawn.append(path)
    return drawn


_HEX32, _HEX64 = re.compile(r"[0-9a-f]{32}"), re.compile(r"[0-9a-f]{64}")


def _check_size(study: str, run_id: str, size: int | None) -> None:
    if size is not None and size > MAX_CHECKPOINT_BYTES:
        raise WinnerUnavailable(
            f"sweep {study}: run {run_id}'s checkpoints/{WEIGHTS} is {size} bytes, more than the "
            f"{MAX_CHECKPOINT_BYTES} a checkpoint may be: not fetched"
        )


def winner_weights(summary: dict[str, Any], study_dir: Path, tracking_uri: str | None) -> Path | None:
    """The best trial's weights on this machine (the coordinator's), at
    `<study_dir>/trial-NNNN/best.safetensors`, with the sha256 its trial reported; None when no trial
    completed or they cannot be had here. A trial trained on another machine left them on that
    machine's disk and in its MLflow run (`checkpoints/best.safetensors`, in the tracking server's
    store): they are fetched from there, and refused (WinnerUnavailable) unless their sha256 is the
    one the trial reported. Machines share no disk; the tracking server is what they all reach."""
    best = summary.get("best")
    if best is None:
        return None
    target = study_dir / f"trial-{best['trial']:04d}" / WEIGHTS
    wanted = best.get("best_sha256")
    if target.exists() and file_digest(target) == wanted:
        return target  # trained here (a local cluster, or a worker on this machine)
    if not best.get("run_id") or tracking_uri is None:  # the study is complete all the same
        log.warning(
            "sweep %s: trial %d's weights are not on this machine and it has no MLflow run to fetch them from "
            "(tracking.enabled: false): they are on the worker that trained it (`--apply` and the train stage "
            "rebuild them)",
            summary["study"],
            best["trial"],
        )
        return None

    # heavy: mlflow (~4 s), only when the winner's weights are downloaded
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    # The run and the digest come back from the study's storage, which others may write (a shared
    # database): checked as a run id and a sha256 before they name anything, the file's size before it
    # is fetched, and again once it is here (a store may not know a size)
    run_id, study = str(best["run_id"]), summary["study"]
    if not (_HEX32.fullmatch(run_id) and isinstance(wanted, str) and _HEX64.fullmatch(wanted)):
        raise WinnerUnavailable(f"sweep {study}: trial {best['trial']}'s stored run id or sha256 is malformed")
    listed = {Path(a.path).name: a.file_size for a in MlflowClient(tracking_uri).list_artifacts(run_id, "checkpoints")}
    _check_size(study, run_id, listed.get(WEIGHTS))
    with tempfile.TemporaryDirectory(prefix="lockstep-winner-") as tmp:
        fetched = Path(
            download_artifacts(
                run_id=run_id, artifact_path=f"checkpoints/{WEIGHTS}", dst_path=tmp, tracking_uri=tracking_uri
            )
        )
        _check_size(study, run_id, fetched.stat().st_size)
        got = file_digest(fetched)
        if got != wanted:
            raise WinnerUnavailable(
                f"sweep {summary['study']}: trial {best['trial']}'s run {best['run_id']} holds weights with sha256 "
                f"{got[:12]}, not the {str(wanted)[:12]} its trial reported: not written"
            )
        with atomic_file(target) as staged:
            shutil.copyfile(fetched, staged)
    log.info(
        "sweep %s: trial %d's weights fetched from its MLflow run into %s", summary["study"], best["trial"], target
    )
    return target
