"""Scripts the fault tests run on a host of the bed (`python -c SCRIPT args`), in the stack's client
environment: what the servers hold after a fault, asked from that host."""

# Run on the laptop, polled: the train runs of host argv[1] started since argv[2] (ms) and their
# status, through MLflow's REST API (no MLflow import: ~0.1 s a poll, not seconds of the CPU the
# pipeline needs). An empty list until the experiment exists.
TRAINING = """
import base64, json, os, sys, urllib.error, urllib.request
base = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
login = f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ['MLFLOW_TRACKING_PASSWORD']}"
headers = {"Authorization": "Basic " + base64.b64encode(login.encode()).decode(), "Content-Type": "application/json"}
def call(path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(base + path, data=data, headers=headers), timeout=30) as answer:
        return json.load(answer)
try:
    experiment = call("/api/2.0/mlflow/experiments/get-by-name?experiment_name=lockstep")["experiment"]["experiment_id"]
except urllib.error.HTTPError:
    print("[]")
    raise SystemExit(0)
where = f"tags.`lockstep.stage` = 'train' and tags.host = '{sys.argv[1]}' and attributes.start_time >= {sys.argv[2]}"
runs = call("/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment], "filter": where}).get("runs", [])
print(json.dumps([run["info"]["status"] for run in runs]))
"""

# Run on the laptop: every run of the pipeline's experiment started since argv[1] (ms): stage, host,
# status, why it was marked KILLED, its flow run; the md5 of each finished train run's best checkpoint
# (a pruned sweep trial's has none).
# Then every RUNNING run of the experiment, whenever it started, and each registered version's
# promotion decision.
RUNS = """
import hashlib, json, sys, tempfile
from mlflow import MlflowClient
client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep").experiment_id
runs = []
for run in client.search_runs([experiment], f"attributes.start_time >= {sys.argv[1]}", max_results=1000):
    tags = run.data.tags
    item = {"id": run.info.run_id, "stage": tags.get("lockstep.stage"), "host": tags.get("host"),
            "owner_host": tags.get("lockstep.owner.host"), "status": run.info.status,
            "parent": tags.get("mlflow.parentRunId"), "flow_run": tags.get("lockstep.flow_run"),
            "killed_reason": tags.get("lockstep.killed_reason"), "start": run.info.start_time}
    # a pruned sweep trial's train run (tasks/runner.py) finishes with no checkpoint
    if item["stage"] == "train" and item["status"] == "FINISHED" and tags.get("sweep.state") != "pruned":
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run.info.run_id, "checkpoints/best.safetensors", tmp)
            with open(path, "rb") as weights:
                item["best_md5"] = hashlib.md5(weights.read()).hexdigest()
    runs.append(item)
running = [run.info.run_id for run in client.search_runs([experiment], "attributes.status = 'RUNNING'")]
versions = [{"name": v.name, "version": v.version, "promotion": v.tags.get("promotion")}
            for v in client.search_model_versions()]
print(json.dumps({"runs": runs, "running": running, "versions": versions}))
"""

# Run on a trainer: N files of distinct bytes (argv: folder, count, a nonce) for `dvc add`, and the md5
# of each (the names DVC gives them in the remote).
FILES = """
import hashlib, json, os, sys
folder, count, nonce = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.makedirs(folder)
sums = []
for index in range(count):
    data = f"{nonce} file {index}".encode() * (100 + index)
    with open(os.path.join(folder, f"part-{index:03}.bin"), "wb") as out:
        out.write(data)
    sums.append(hashlib.md5(data).hexdigest())
print(json.dumps(sums))
"""
