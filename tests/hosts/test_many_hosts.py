"""The team's day across hosts that share nothing but a network (issue 67; the bed: tests/support/hosts.py).

`services` runs the team stack (`python -m stack up --host <its address>`: PostgreSQL, SeaweedFS's
S3, MLflow with basic auth, Prefect with its auth string) and a read-only git daemon; the laptop and
the trainers get the code from it with `git clone`, the stack's client folder from the operator
(`python -m stack client`), and use only the documented commands:

- the laptop: `git clone`, `python -m stack join`, `dvc repro download`, `dvc push`;
- trainer-a: `git clone`, `python -m stack join`, `dvc pull`, `python -m flows.pipeline`, `dvc push`;
- then the laptop finds the run, its params, its lineage and its artifacts on the MLflow server (the
  artifacts in S3, none on trainer-a's disk), the flow run on the Prefect server, and every file of
  the data and of trainer-a's pipeline outputs in the DVC remote.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from tests.hosts.conftest import Team, free_address_port
from tests.support.hosts import Host, as_json_lines

pytestmark = pytest.mark.slow

# Run on the laptop: what the MLflow server and its S3 store hold of the train stage's runs.
MLFLOW_CHECK = """
import json, os
from mlflow import MlflowClient
from stack.servers import s3_client
from stack.state import MLFLOW_BUCKET, open_stack
from pathlib import Path

client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep")
runs = client.search_runs([experiment.experiment_id], "tags.`lockstep.stage` = 'train'")
run = runs[0]
store = s3_client(open_stack(Path(os.environ["LOCKSTEP_STACK_DIR"])))
keys = [o["Key"] for page in store.get_paginator("list_objects_v2").paginate(Bucket=MLFLOW_BUCKET)
        for o in page.get("Contents", [])]
print(json.dumps({
    "runs": len(runs), "run_id": run.info.run_id, "status": run.info.status,
    "artifact_uri": run.info.artifact_uri, "params": run.data.params, "tags": run.data.tags,
    "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)],
    "s3_keys_of_run": [k for k in keys if run.info.run_id in k],
}))
"""

# Run on the laptop: the names of every object in the DVC remote's bucket.
DVC_BUCKET_LIST = """
import json, os
from pathlib import Path
from stack.servers import s3_client
from stack.state import DVC_BUCKET, open_stack
store = s3_client(open_stack(Path(os.environ["LOCKSTEP_STACK_DIR"])))
pages = store.get_paginator("list_objects_v2").paginate(Bucket=DVC_BUCKET)
print(json.dumps([o["Key"] for page in pages for o in page.get("Contents", [])]))
"""

# Run on the laptop: the flow runs the Prefect server holds (the client sends the auth string, and
# for the filter's POST Prefect's client fetches the CSRF token itself).
PREFECT_CHECK = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs()
print(json.dumps([{"name": r.name, "state": r.state_type.value, "flow_id": str(r.flow_id)} for r in runs]))
"""


LISTEN = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(60)
peer, address = server.accept()
peer.sendall(address[0].encode())
"""

# Bounded: 50 tries, 0.1 s apart, while the listener starts.
ASK = """
import socket, sys, time
for _ in range(50):
    try:
        peer = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
        break
    except OSError:
        time.sleep(0.1)
print(peer.recv(64).decode())
"""


def _python(host: Host, env: str, script: str) -> subprocess.CompletedProcess[str]:
    """`script` run by the host's python in the stack's client environment (`env`, a shell prefix)."""
    return host.run(["sh", "-c", env + 'exec python -c "$1"', "sh", script])


def test_the_bed_keeps_hosts_apart(team: Team) -> None:
    bed = team.bed
    for name in bed.hosts:
        # the bed's subnet only: no default route, so nothing a host sends can leave the bed
        assert [route.split()[0] for route in bed.routes(name)] == ["10.67.0.0/24"], bed.routes(name)
    laptop, trainer = bed.host("laptop"), bed.host("trainer-a")
    laptop.run("echo only-on-the-laptop > /tmp/mark && echo home > ~/mark")
    seen = trainer.run("cat /tmp/mark ~/mark 2>&1; hostname; touch .venv/planted 2>&1", check=False)
    assert "only-on-the-laptop" not in seen.stdout and "No such file" in seen.stdout, seen.stdout
    assert "trainer-a" in seen.stdout and "Read-only file system" in seen.stdout, seen.stdout
    # over the network, by name: a listener on trainer-b answers trainer-a with the address it came from
    port = free_address_port(bed.host("trainer-b"))
    listener = bed.host("trainer-b").start(["python", "-c", LISTEN, str(port)], "/tmp/listener.log")
    assert trainer.run(["python", "-c", ASK, "trainer-b", str(port)]).stdout.strip() == trainer.address
    listener.wait(timeout=30)


def test_the_servers_want_credentials_and_the_git_remote_is_read_only(team: Team) -> None:
    stranger = team.bed.host("trainer-b")
    services = team.bed.host("services")
    state = json.loads((services.project / ".stack" / "state.json").read_text())  # the ports (not secret)
    base = f"http://{services.address}"
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n    urllib.request.urlopen(sys.argv[1], timeout=10); print(200)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code)"
    )
    mlflow = f"{base}:{state['ports']['mlflow']}/api/2.0/mlflow/experiments/search?max_results=1"
    prefect = f"{base}:{state['ports']['prefect']}/api/admin/version"
    assert stranger.run(["python", "-c", probe, mlflow]).stdout.strip() == "401"
    assert stranger.run(["python", "-c", probe, prefect]).stdout.strip() == "401"
    laptop = team.bed.host("laptop")
    laptop.run(["git", "clone", "-q", team.git_url, "/tmp/probe"], venv=False)
    commit = "git -c user.name=a -c user.email=a@b.invalid commit -q --allow-empty -m x"
    pushed = laptop.run(f"cd /tmp/probe && {commit} && git push -q origin HEAD", check=False)
    assert pushed.returncode != 0 and "access denied" in pushed.stderr.lower(), pushed.stderr


def test_a_trainer_runs_the_pipeline_from_git_and_the_stack_alone(team: Team) -> None:
    laptop, trainer = team.bed.host("laptop"), team.bed.host("trainer-a")
    env = team.client_env()

    # the laptop: clone, join the stack's S3 as the DVC remote, make the data snapshot and push it
    started = time.monotonic()
    laptop.clone(team.git_url)
    laptop.run(f"export LOCKSTEP_STACK_DIR={'/root/lockstep-stack'}; python -m stack join")
    laptop.run(env + "dvc repro download && dvc push")
    assert laptop.run("git status --porcelain -- data.dvc").stdout == "", "the snapshot is not the committed one"
    team.timings["laptop_clone_download_push_s"] = round(time.monotonic() - started, 3)

    # trainer-a: the code from git (never a shared path), the data from the DVC remote, then the pipeline
    started = time.monotonic()
    trainer.clone(team.git_url)
    assert trainer.run("git rev-parse HEAD").stdout.strip() == team.commit
    trainer.run("export LOCKSTEP_STACK_DIR=/root/lockstep-stack; python -m stack join")
    pulled = trainer.run(env + "dvc pull data.dvc")
    assert "data" in pulled.stdout and trainer.run("ls data").stdout.strip(), pulled.stdout
    team.timings["trainer_clone_pull_s"] = round(time.monotonic() - started, 3)
    started = time.monotonic()
    trainer.run(env + "python -m flows.pipeline", timeout=900)
    team.timings["trainer_pipeline_s"] = round(time.monotonic() - started, 3)
    trainer.run(env + "dvc push")
    lock = yaml.safe_load(trainer.run("cat dvc.lock").stdout)

    # nothing of MLflow's or Prefect's on trainer-a's disk: every record went to the servers
    for local in ("mlflow.db", "mlruns", "mlartifacts"):
        assert not (trainer.project / local).exists(), local
    assert not (trainer.disk / "home" / ".prefect" / "prefect.db").exists()

    # the laptop sees the run on the MLflow server: params, lineage, artifacts (in S3)
    seen = as_json_lines(_python(laptop, env, MLFLOW_CHECK))
    assert seen["runs"] == 1 and seen["status"] == "FINISHED", seen
    assert seen["tags"]["host"] == "trainer-a" and seen["tags"]["git.commit"] == team.commit, seen["tags"]
    assert seen["tags"]["git.dirty"] == "false", seen["tags"]
    assert seen["params"]["train.epochs"] == "2", seen["params"]
    assert seen["artifact_uri"].startswith("mlflow-artifacts:/"), seen["artifact_uri"]
    assert seen["artifacts"] and seen["s3_keys_of_run"], seen

    # ... the flow run on the Prefect server
    flow_runs = as_json_lines(_python(laptop, env, PREFECT_CHECK))
    assert [run["state"] for run in flow_runs] == ["COMPLETED"], flow_runs

    # ... and in the DVC remote every file of the data and of trainer-a's pipeline outputs
    keys = set(as_json_lines(_python(laptop, env, DVC_BUCKET_LIST)))
    hashes = {out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}
    data_dvc = yaml.safe_load(laptop.run("cat data.dvc").stdout)
    hashes |= {out["md5"] for out in data_dvc["outs"]}
    missing = [h for h in hashes if f"files/md5/{h[:2]}/{h[2:]}" not in keys]
    assert not missing, (missing, sorted(keys)[:20])
    status = laptop.run(env + "dvc status --cloud data.dvc")
    assert "in sync" in status.stdout, status.stdout
