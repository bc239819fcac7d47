"""Scripts the many-hosts tests run on a host of the bed (`python -c SCRIPT args`), in the stack's
client environment: what a host sees of the servers, asked from that host."""

# Run on the laptop: what the MLflow server and its S3 store hold of the train stage's runs on a host
# (argv[1]) that started in a window (argv[2], argv[3]: ms since the epoch).
MLFLOW_CHECK = """
import json, os, sys
from mlflow import MlflowClient
from stack.servers import s3_client
from stack.state import MLFLOW_BUCKET, open_stack
from pathlib import Path

client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep")
host, since_ms, until_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = client.search_runs(
    [experiment.experiment_id],
    f"tags.`lockstep.stage` = 'train' and tags.host = '{host}' and attributes.start_time >= {since_ms} "
    f"and attributes.start_time <= {until_ms}",
)
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

# Run on the laptop: the flow runs the Prefect server holds that started in a window (argv: ms since
# the epoch) (the client sends the auth string, and for the filter's POST Prefect's client fetches the
# CSRF token itself).
PREFECT_CHECK = """
import json, sys
from prefect.client.orchestration import get_client
since, until = int(sys.argv[1]) / 1000, int(sys.argv[2]) / 1000
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs()
print(json.dumps([
    {"id": str(r.id), "name": r.name, "state": r.state_type.value, "deployment_id": str(r.deployment_id or "")}
    for r in runs if r.start_time and since <= r.start_time.timestamp() <= until
]))
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

# Run on the laptop: the MLflow runs started since argv[1] (ms), and the md5 of each train run's best
# checkpoint as MLflow holds it (the name of that file in the DVC remote, if it was pushed).
RUNS_SINCE = """
import hashlib, json, sys, tempfile
from mlflow import MlflowClient
client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep")
found = []
for run in client.search_runs([experiment.experiment_id], f"attributes.start_time >= {sys.argv[1]}", max_results=500):
    tags = run.data.tags
    item = {"stage": tags.get("lockstep.stage"), "parent": tags.get("mlflow.parentRunId"), "host": tags.get("host"),
            "commit": tags.get("git.commit"), "dirty": tags.get("git.dirty"), "status": run.info.status,
            "start": run.info.start_time, "end": run.info.end_time}
    # what finished training has a checkpoint: not a failed or killed run, not a pruned sweep trial's
    if item["stage"] == "train" and item["status"] == "FINISHED" and tags.get("sweep.state") != "pruned":
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run.info.run_id, "checkpoints/best.safetensors", tmp)
            with open(path, "rb") as weights:
                item["best_md5"] = hashlib.md5(weights.read()).hexdigest()
    found.append(item)
print(json.dumps(found))
"""

# Run on a trainer, in a clone: hold the pipeline lock (argv: holder, wait_s, seconds to hold).
HOLD = """
import sys, time
from tasks.core.lock import PipelineBusy, pipeline_lock
try:
    with pipeline_lock(sys.argv[1], wait_s=float(sys.argv[2])):
        print("held", flush=True)
        time.sleep(float(sys.argv[3]))
except PipelineBusy as busy:
    print(f"busy: {busy}", flush=True)
"""
