"""The laptop's part of the team's day (issue 67; the bed: tests/support/hosts.py).

The laptop has a clone of the project, the stack's client folder, and nothing from the trainers but
what they put on the servers. With the documented `make` targets it rebuilds trainer-a's training
run byte for byte from the MLflow server and the DVC remote alone (`make reproduce`), and scores
images with the registry's champion, from the command line (`make predict`) and over HTTP
(`make serve-model`). The `make` targets run as a user runs them: the `.venv` the bed shares is
read-only, and its stamp is named by the lock's content, so a fresh clone does not rebuild it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import time

import psutil
import pytest

from tests.hosts.remote_scripts import MLFLOW_CHECK
from tests.support.hosts import tail
from tests.support.team import Trained
from tests.tools.test_predict import write_split_pngs

pytestmark = pytest.mark.slow

PHOTOS = 24  # images the laptop scores (from the test split, so that their classes are known)

# Run on the laptop: the registered model's version the champion alias points at (argv[1]: its name).
CHAMPION = """
import sys
from mlflow import MlflowClient
print(MlflowClient().get_model_version_by_alias(sys.argv[1], "champion").version)
"""

# Run on the laptop: POST the image files (argv[2:]) to the model server (argv[1]) as the docs say
# (one `image` column, each row a file's bytes in base64) once it answers /ping (bounded: 120 s).
POST = """
import base64, json, sys, time, urllib.request
base = sys.argv[1]
for _ in range(240):
    try:
        urllib.request.urlopen(base + "/ping", timeout=5).close()
        break
    except OSError:
        time.sleep(0.5)
rows = [[base64.b64encode(open(path, "rb").read()).decode()] for path in sys.argv[2:]]
body = json.dumps({"dataframe_split": {"columns": ["image"], "data": rows}}).encode()
ask = urllib.request.Request(base + "/invocations", data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(ask, timeout=120) as answer:
    print(json.dumps([p["class"] for p in json.load(answer)["predictions"]]))
"""


def _trainer_a_run(trained: Trained) -> str:
    """The id of trainer-a's train stage run, as the laptop finds it on the MLflow server."""
    seen = trained.team.ask("laptop", MLFLOW_CHECK, "trainer-a", str(trained.since_ms), str(trained.until_ms))
    assert seen["runs"] == 1 and seen["status"] == "FINISHED", seen
    return seen["run_id"]


def test_the_laptop_reproduces_a_trainers_run_from_the_servers_alone(trained: Trained) -> None:
    team = trained.team
    laptop, env = team.bed.host("laptop"), team.client_env()
    run_id = _trainer_a_run(trained)
    # The laptop made the data snapshot, so its DVC cache holds it; moved aside for the rebuild, the
    # data version must come from the DVC remote (as on a laptop that never had it).
    laptop.run("mv .dvc/cache /tmp/laptop-dvc-cache")
    try:
        started = time.monotonic()
        done = laptop.run(env + f'make reproduce ARGS="{run_id} --json /tmp/reproduce.json"', check=False, timeout=900)
        team.timings["laptop_reproduce_s"] = round(time.monotonic() - started, 3)
    finally:
        laptop.run("rm -rf .dvc/cache && mv /tmp/laptop-dvc-cache .dvc/cache")
    assert "uv sync" not in done.stdout, "make rebuilt the environment of a fresh clone"
    report = json.loads((laptop.disk / "tmp" / "reproduce.json").read_text())
    assert done.returncode == 0 and report["verdict"] == "identical", (done.stdout[-3000:], done.stderr[-3000:])
    assert report["run_id"] == run_id and report["data_from"] == "DVC remote 'stack'", report
    assert {c["name"] for c in report["weights"]} == {"best.safetensors", "last.safetensors"}, report["weights"]
    assert all(c["identical"] and c["rebuilt"] == c["logged"] for c in report["weights"]), report["weights"]
    assert report["code"] == f"git commit {team.commit}", report["code"]  # the clone's own branch holds it


def test_the_laptop_scores_and_serves_the_registrys_champion(trained: Trained) -> None:
    team = trained.team
    laptop, env = team.bed.host("laptop"), team.client_env()
    # the user's own images: the test split trainer-a made, as PNG files in the laptop's home
    photos = write_split_pngs(team.bed.host("trainer-a").project, laptop.disk / "home" / "photos")
    files = sorted(p for p in photos.rglob("*.png"))[:PHOTOS]
    for extra in sorted(photos.rglob("*.png"))[PHOTOS:]:
        extra.unlink()
    inside = [f"/root/photos/{p.relative_to(photos)}" for p in files]
    version = team.python("laptop", CHAMPION, "lockstep-classifier").stdout.strip()

    scored = laptop.run(env + 'make predict ARGS="/root/photos --out /tmp/scores.csv"', timeout=300)
    assert f"lockstep-classifier v{version}: {PHOTOS} of {PHOTOS} images scored" in scored.stdout, scored.stdout
    with open(laptop.disk / "tmp" / "scores.csv", newline="") as f:
        rows = {row["path"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == sorted(inside) and not any(row["error"] for row in rows.values()), rows
    right = sum(rows[path]["class"] == path.split("/")[-2] for path in inside)
    assert right >= PHOTOS // 2, f"the champion got {right} of {PHOTOS}: not the trained model"

    # `make serve-model` on the laptop's loopback: the same champion, the same answers as predict
    server = laptop.start(["sh", "-c", env + "exec make serve-model MODEL_PORT=5001"], "/tmp/serve-model.log")
    try:
        served = team.ask("laptop", POST, "http://127.0.0.1:5001", *inside)
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{tail(laptop.disk / 'tmp' / 'serve-model.log')}") from None
    finally:
        _stop(server)
    assert served == [rows[path]["class"] for path in inside]


def _stop(server: subprocess.Popen[bytes]) -> None:
    """End `make serve-model` and what it started (MLflow's server and its workers), bounded."""
    try:
        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker its parent ended first
            proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=15)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=15)
