"""`make ui` as a person meets it: the root URL in a browser that never opened MLflow, a click on the
experiment, and the pipeline's runs table in MLflow's model-training pages (tasks/tracking/ui.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.tracking.dashboard import VIEW_TAG
from tasks.tracking.ui import landing_script
from tests.conftest import ROOT, client_for, free_port, service
from tests.support.chromium import DevTools, devtools

SCREENSHOTS = ROOT / "test-artifacts"  # kept for a person to look at
# The experiment's link in the root page's list of recent experiments (drawn once the list has loaded).
EXPERIMENT_LINK = "[...document.querySelectorAll('a')].find(a => a.innerText.trim() === 'lockstep')"
# What a click on the experiment draws: the runs table with the pipeline's view, or the GenAI overview.
RUNS_TABLE = "location.hash.includes('/runs') && document.body.innerText.includes('shipped_test_accuracy')"
GENAI_OVERVIEW = "document.body.innerText.includes('Token Usage')"


def test_the_landing_script_carries_its_data_as_json_only() -> None:
    column = "tags.`</script><script>alert(1)`"
    script = landing_script({"7": {"selectedColumns": [column]}})
    assert script.count("</script>") == 1 and script.endswith("</script>")
    config = json.loads(script[script.rindex("})(") + 3 : script.rindex(");")])
    assert config["views"] == {"7": {"selectedColumns": [column]}}


def _click(page: DevTools, element: str) -> None:
    """A person's click (mouse down and up at its middle) on the element the JavaScript `element` finds."""
    middle = "r => [r.x + r.width / 2, r.y + r.height / 2]"
    box = page.evaluate(f"({middle})(({element}).getBoundingClientRect())")
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


def _click_the_experiment(page: DevTools, base: str) -> tuple[str, str]:
    """Open the root URL, click the experiment in its list; the page's URL and text once it has drawn."""
    page.open(f"{base}/", EXPERIMENT_LINK)
    _click(page, EXPERIMENT_LINK)
    deadline = time.monotonic() + 90
    while not page.evaluate(f"({RUNS_TABLE}) || ({GENAI_OVERVIEW})"):
        assert time.monotonic() < deadline, page.evaluate("location.href + '\\n' + document.body.innerText")
        time.sleep(0.25)
    return page.evaluate("location.href"), page.evaluate("document.body.innerText")


@pytest.mark.slow
def test_opening_the_ui_and_clicking_the_experiment_shows_the_training_runs(
    dvc_repo: dict[str, Any], tmp_path: Path
) -> None:
    repo: Path = dvc_repo["repo"]
    client = client_for(repo)
    experiment = client.get_experiment_by_name("lockstep")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    pipeline = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)  # the latest pipeline run
    selected = [c.split("`")[:2] for c in json.loads(experiment.tags[VIEW_TAG])["selectedColumns"]]
    # the table draws a column some run has a value for: auto.train.* are a folder's (digits' are fixed)
    columns = [key for kind, key in selected if kind != "params." or key in pipeline.data.params]
    absent = ["auto.train.epochs", "auto.train.lr"]
    assert [key for kind, key in selected if kind == "params." and key not in columns] == absent
    port, venv = free_port(), ROOT / ".venv"
    # `make ui` in the project the pipeline ran in, on a free port, with this checkout's environment
    make = ["make", "ui", f"VENV={venv}", f"MLFLOW_PORT={port}"]
    with (
        service(make, repo, f"http://127.0.0.1:{port}/health", tmp_path / "ui.log"),
        devtools(tmp_path / "profile", width=1800, height=900) as page,  # a new profile: nothing remembered
    ):
        base = f"http://127.0.0.1:{port}"
        url, text = _click_the_experiment(page, base)
        page.screenshot(SCREENSHOTS / "mlflow-ui-click-on-the-experiment.png")
        assert "Token Usage" not in text and "/overview" not in url, url  # not the GenAI overview
        assert f"#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning" in url, url
        # the pipeline runs with the pipeline's columns: the latest one's numbers and data
        assert pipeline.info.run_name in text, text
        assert [c for c in columns if c not in text] == [], text
        assert str(pipeline.data.metrics["test_accuracy"])[:5] in text, text
        assert pipeline.data.tags["export.shipped_variant"] in text and "digits" in text, text
        # a person who picks MLflow's GenAI pages keeps them: the defaults are only for a browser without a choice
        _click(page, "[...document.querySelectorAll('[role=button]')].find(e => e.innerText.trim() === 'GenAI')")
        assert page.evaluate("localStorage.getItem('mlflow.workflowType_v1')") == '"genai"'
        url, text = _click_the_experiment(page, base)
        assert "Token Usage" in text and "workflowType=genai" in url, url


def test_make_ui_takes_no_artifact_uploads_into_the_checkout_and_still_shows_the_runs_artifacts(
    tmp_path: Path,
) -> None:
    """Issue 66, point 8: `make ui` is a server any local user can reach. MLflow's default would proxy
    artifact uploads into `<checkout>/mlartifacts/` (a way to plant a params file there): an upload
    through its artifacts API writes nothing, while the artifacts the pipeline logged beside its
    store (file:// under mlartifacts/, as tasks/tracking/runs.py makes the experiment) still show."""
    import urllib.request

    from mlflow import MlflowClient

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("Makefile", "pyproject.toml", "uv.lock"):  # make names the environment by the last two
        shutil.copy(ROOT / name, checkout / name)
    (checkout / "tasks").symlink_to(ROOT / "tasks", target_is_directory=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{checkout / 'mlflow.db'}")
    experiment = client.create_experiment("lockstep", artifact_location=(checkout / "mlartifacts").as_uri())
    run = client.create_run(experiment)
    (tmp_path / "note.txt").write_text("logged by the pipeline")
    client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    before = sorted(p.relative_to(checkout) for p in checkout.rglob("*"))

    port, venv = free_port(), ROOT / ".venv"
    make = ["make", "ui", f"VENV={venv}", f"MLFLOW_PORT={port}"]
    with service(make, checkout, f"http://127.0.0.1:{port}/health", tmp_path / "ui.log"):
        base = f"http://127.0.0.1:{port}"
        statuses = [
            # the artifact proxy (--serve-artifacts: into --artifacts-destination, ./mlartifacts by default)
            _status(f"{base}/api/2.0/mlflow-artifacts/artifacts/planted/params.yaml", "PUT"),
            # the UI's own upload into a run's artifact folder, here <checkout>/mlartifacts/<exp>/<run>/...
            _status(f"{base}/ajax-api/2.0/mlflow/upload-artifact?run_uuid={run.info.run_id}&path=planted/params.yaml"),
        ]
        shown = f"{base}/get-artifact?run_uuid={run.info.run_id}&path=note.txt"
        with urllib.request.urlopen(shown, timeout=30) as answer:
            artifact = answer.read()
    assert all(status >= 400 for status, _ in statuses), statuses
    assert not list(checkout.rglob("params.yaml")) and not list(tmp_path.rglob("planted")), "the upload was written"
    assert sorted(p.relative_to(checkout) for p in checkout.rglob("*")) == before
    assert artifact == b"logged by the pipeline"


def _status(url: str, method: str = "POST") -> tuple[int, str]:
    """The HTTP status of an upload of a params file to `url`, and the start of the answer."""
    import urllib.error
    import urllib.request

    try:
        headers = {"Content-Type": "application/octet-stream"}  # (a form's type would leave Flask no body)
        upload = urllib.request.Request(url, data=b"train: {}\n", method=method, headers=headers)
        with urllib.request.urlopen(upload, timeout=30) as answer:
            return answer.status, answer.read(200).decode(errors="replace")
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read(200).decode(errors="replace")
