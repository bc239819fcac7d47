"""What a pipeline run did, in a line for a person: a stage's headline metrics, and the run's verdict
(a scheduled run must say when it retrained nothing). Shared by the command line (flows/pipeline.py)
and the flow (flows/pipeline_flow.py)."""

from __future__ import annotations

from typing import Any

NOTHING_RAN = "stages run: none (everything up to date): nothing retrained"
REREAD_UNCHANGED = "source re-read, data unchanged"


INTERVAL = ("_ci95_low", "_ci95_high")  # a metric's 95% interval (the evaluate stage's accuracy has one)


def brief(metrics: dict[str, Any], limit: int = 6) -> str:
    """A stage's summary metrics for a person: numbers to 4 digits, the first few (all are in MLflow);
    a metric's 95% interval in brackets after it."""
    own = [key for key in metrics if not key.endswith(INTERVAL)]
    first = sorted(own, key=lambda key: "accuracy" not in key)  # the number a person looks for first
    shown = [_shown(key, metrics) for key in first]
    more = f", … {len(shown) - limit} more in its MLflow run" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


def summarize(results: dict[str, dict[str, Any]], data_md5_before: str, data_md5_after: str) -> str:
    """One line that says what this run did: a scheduled run must say when it retrained nothing."""
    ran = [name for name, result in results.items() if result["ran"]]
    retrained = [name for name in ran if name != "download"]
    if retrained:
        data = "new data" if data_md5_after != data_md5_before else "same data"
        return f"stages run: {', '.join(ran)} ({data}, md5 {data_md5_after})"
    if ran or reread_unchanged(results):
        stages = "download" if ran else "none"
        return f"stages run: {stages}; {REREAD_UNCHANGED} (md5 {data_md5_after}): nothing retrained"
    return NOTHING_RAN


def reread_unchanged(results: dict[str, dict[str, Any]]) -> bool:
    """The source was read again and gave data/ byte for byte, so no stage ran (flows/pipeline_flow.py)."""
    return results.get("download", {}).get("reread") == "unchanged"


def _shown(key: str, metrics: dict[str, Any]) -> str:
    value = metrics[key]
    text = f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
    low, high = (metrics.get(key + end) for end in INTERVAL)
    return text if low is None or high is None else f"{text} (95%: {low:.3g}-{high:.3g})"
