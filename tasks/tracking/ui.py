"""`make ui`: MLflow's own `mlflow ui`, whose first page leads a person to the training runs table.

Why a wrapper around MLflow's app (what MLflow 3.17's UI code does; WorkflowTypeContext.tsx and the
experiment page's default-tab redirect):
- The UI shows an experiment in its GenAI pages (an overview of traces and token usage) or in its
  model-training pages (the runs table) by a switch that lives in the browser only: the
  `workflowType` URL parameter, else the sidebar's "GenAI / Model training" switch as this browser
  remembers it (localStorage), else GenAI. On that path the experiment's `mlflow.experimentKind` tag
  is not read (3.17 derives the kind from the switch), and no server option or environment variable
  sets the default. The experiment list links to `#/experiments/<id>` with no parameter, so opening
  the UI and clicking the experiment lands on the GenAI overview in a browser that never used the switch.
- The runs table shows the columns this browser last used for the experiment, else Source, Models
  and Dataset; the pipeline's view (the experiment's shared view state tag, `dashboard.VIEW_TAG`) is
  applied only from a link that names it (`dashboard.runs_page`).
A redirect of `/` cannot help: the UI's routes live in the URL's fragment, which the server never
sees, and the list's link would still open the GenAI pages. So the page MLflow serves at `/` carries
one script more, run before MLflow's own: in a browser that has not chosen, it sets the switch to
model training (and keeps the assistant panel from opening itself over the table); for each
experiment with the pipeline's view it sets the runs table's columns and order to that view, once
per version of the view, so that columns a person picks afterwards stay (and so does a person's
switch). Everything else is `mlflow ui` as it is, with all its options, its store set-up and its
security middleware: the wrapper changes only the app its uvicorn serves (MLflow's default server;
`--gunicorn-opts` and `--waitress-opts` would serve MLflow's app unchanged).

It takes no files. Any local user can reach the port, and MLflow's defaults would write what they send
into the checkout: its artifact proxy (`PUT /api/2.0/mlflow-artifacts/artifacts/...`, on by default,
into ./mlartifacts) and its UI's upload (`POST /ajax-api/2.0/mlflow/upload-artifact`, into the run's
artifact folder, <checkout>/mlartifacts/... for the pipeline's runs): a way to plant a params file. So
the proxy is off (`--no-serve-artifacts`, before ARGS) and the upload answers 403. What the UI shows is
unchanged: the pipeline logs its artifacts itself, beside the store (file://, tasks/tracking/runs.py),
and the UI reads them from there (`/get-artifact`). A server that takes uploads is `make mlflow-server`,
its artifacts outside the checkout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tasks.core.layout import ROOT
from tasks.tracking.dashboard import VIEW_TAG

MLFLOW_APP = "mlflow.server.fastapi_app:app"  # what `mlflow ui` hands uvicorn
FACTORY = "tasks.tracking.ui:create_app"  # (not __name__: "__main__" under python -m)
UPLOAD_VIEW = "serve_upload_artifact"  # POST /ajax-api/2.0/mlflow/upload-artifact (mlflow/server/__init__.py)
# The browser storage MLflow 3.17's UI reads (its useLocalStorage and LocalStorageUtils keys; values
# JSON), as a browser that has not chosen gets it here: the model-training pages, and the assistant
# panel as if MLflow had opened it once already (it opens itself on the first page otherwise, over a
# third of the runs table; its button stays).
DEFAULTS = {"mlflow.workflowType_v1": "machine_learning", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True}
RUNS_TABLE_KEY = 'MLflowLocalStorage-1.1-ExperimentPage-["{id}"]-ReactComponentState'

_SCRIPT = """<script>/* lockstep: the training runs table by default (tasks/tracking/ui.py) */
(({defaults, views, runsTableKey}) => {
  try {
    const store = window.localStorage;
    for (const [key, value] of Object.entries(defaults)) {
      if (store.getItem(key) === null) store.setItem(key, JSON.stringify(value));
    }
    for (const [id, view] of Object.entries(views)) {
      const key = runsTableKey.replace("{id}", id), seen = "lockstep.view." + id, version = JSON.stringify(view);
      if (store.getItem(seen) === version) continue;
      store.setItem(key, JSON.stringify({...JSON.parse(store.getItem(key) || "{}"), ...view}));
      store.setItem(seen, version);
    }
  } catch (error) {
    console.warn("lockstep: the UI opens with MLflow's defaults", error);
  }
})(CONFIG);
</script>"""


def training_views(store_uri: str) -> dict[str, dict[str, Any]]:
    """Experiment id -> the pipeline's runs-table view, for every experiment of the store that has one."""
    # heavy: mlflow (~4 s); `--help` stays fast
    from mlflow import MlflowClient

    client, views, token = MlflowClient(tracking_uri=store_uri), {}, None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        for experiment in page:
            try:
                view = json.loads(experiment.tags[VIEW_TAG])
            except (KeyError, ValueError):  # no view of ours (another tool's experiment), or not ours to read
                continue
            if isinstance(view, dict):
                views[experiment.experiment_id] = view
        token = page.token
        if not token:
            return views


def landing_script(views: dict[str, dict[str, Any]]) -> str:
    """The script the page at `/` runs before MLflow's (the module's docstring says what and why)."""
    config = {"defaults": DEFAULTS, "views": views, "runsTableKey": RUNS_TABLE_KEY}
    return _SCRIPT.replace("CONFIG", json.dumps(config).replace("<", "\\u003c"))  # no "</script>" in the data


def _index() -> Any:
    """MLflow's index.html, with the landing script first in its head (serves `/`, MLflow's "serve" view)."""
    # heavy: mlflow.server (~5 s, with sqlalchemy), only when the UI starts
    from mlflow.server import app as flask_app
    from mlflow.server.constants import BACKEND_STORE_URI_ENV_VAR

    page = Path(flask_app.static_folder, "index.html").read_text()
    script = landing_script(training_views(os.environ[BACKEND_STORE_URI_ENV_VAR]))
    page = page.replace("<head>", f"<head>{script}", 1)
    # asked for again each time: the views change as experiments appear
    return flask_app.response_class(page, mimetype="text/html", headers={"Cache-Control": "no-cache"})


def create_app() -> Any:
    """MLflow's app (uvicorn's factory in each worker), its page at `/` served by `_index`."""
    # heavy: mlflow.server (~5 s, with sqlalchemy), only when the UI starts
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import app

    for view in ("serve", UPLOAD_VIEW):
        if view not in flask_app.view_functions:
            raise RuntimeError(f"MLflow's UI app has no {view!r} view: check tasks/tracking/ui.py")
    flask_app.view_functions["serve"] = _index
    flask_app.view_functions[UPLOAD_VIEW] = _no_uploads
    return app


def _no_uploads() -> Any:
    """The UI's artifact upload, refused: it would write into the checkout (the module's docstring)."""
    # heavy: mlflow.server (~5 s, with sqlalchemy), only when the UI starts
    from mlflow.server import app as flask_app

    message = "make ui takes no artifact uploads (they would land in the checkout): use make mlflow-server"
    body = json.dumps({"error_code": "PERMISSION_DENIED", "message": message})
    return flask_app.response_class(body, status=403, mimetype="application/json")


def main(argv: list[str]) -> None:
    """`mlflow ui <argv>`, serving `create_app`'s app."""
    # heavy: mlflow.server and its CLI (~5 s), only when the UI starts
    import mlflow.server
    from mlflow.cli import cli

    build = mlflow.server._build_uvicorn_command  # `mlflow ui` builds its uvicorn command line here

    def build_ours(opts: Any, host: str, port: int, workers: int, app: str, env_file: Any, factory: bool) -> list[str]:
        if app != MLFLOW_APP or factory:
            raise SystemExit(f"`make ui` serves MLflow's default app, not {app}: run `mlflow ui` for another")
        return build(opts, host, port, workers, FACTORY, env_file, is_factory=True)

    mlflow.server._build_uvicorn_command = build_ours
    # MLflow's background job runner (GenAI evaluation jobs) would start a consumer process per worker:
    # this UI browses training runs, as `make mlflow-server` does with it off too
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    # uvicorn's workers import this module from the project, wherever the command starts
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # no artifact proxy: it would take any local user's uploads into ./mlartifacts (the module's docstring)
    cli.main(["ui", "--no-serve-artifacts", *argv], prog_name="mlflow ui")


if __name__ == "__main__":
    main(sys.argv[1:])
