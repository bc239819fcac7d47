"""What a finished (or interrupted) study amounts to: its best trial, a row per trial, a summary, and the
files a person reads (artifacts/sweep/<name>/study/: sweep.json, trials.csv, the plots). trials.csv's
cells come from the study's storage, which others may write: each is neutralised as predictions.csv's are
(tasks/core/spreadsheet.py), numbers left as numbers.

tasks/tools/sweep.py runs the study; flows/sweep.py calls `summarise` and `write_study` once its
batches are done, then puts the files on the sweep's MLflow run. Every file is written to a temporary
path and renamed: a sweep killed while it writes them leaves the last complete set.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from tasks.core.atomic import atomic_file, write_text
from tasks.core.config.sweep import SweepConfig
from tasks.core.spreadsheet import value_cell
from tasks.tools.sweep import best_trial, derived_seed

log = logging.getLogger(__name__)

SUMMARY, TRIALS = "sweep.json", "trials.csv"


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
    import warnings

    import matplotlib

    matplotlib.use("Agg")
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
