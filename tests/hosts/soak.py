"""A week of nights, compressed (issue 67, point 5): scheduled retrains on the bed while the data grows and
faults strike, then the checks a team would make after a week.

    python -m tests.hosts.soak [--nights 5] [--seed 1] [--json benchmarks/results/soak.json]   # = make soak ARGS=...

Root only (network and mount namespaces, tests/support/hosts.py); not collected by pytest (no test_
prefix) and in no test tier: it takes minutes (docs/many-hosts.md, "Soak"). The team is
tests/support/team.py's; the project trains on an image folder on the laptop (`data.source: imagefolder`,
`orchestration.reingest: false`). Each night the folder grows; the laptop, the data owner, snapshots it
(`dvc repro --force --single-item download`: the source's params did not change, its files did), pushes
it and commits `data.dvc` and `dvc.lock` (workers cannot read its folder: they find the download stage
up to date and pull its outputs); the operator moves the commit to the git server; the laptop redeploys
(`deploy --git`) and starts the night's run. On seeded nights a fault of point 4 strikes
(tests/support/faults.py); a failed push or run is recorded with its message and retried, RETRIES at
most. Then the checks (`_verify`); exit 0 only if all pass. The bed is removed at the end, also on
failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.hosts.fault_scripts import TRAINING
from tests.hosts.remote_scripts import DVC_BUCKET_LIST
from tests.support import faults
from tests.support.digits import write_digits
from tests.support.hosts import HOME, Bed, remove_leftovers, why_unavailable
from tests.support.team import CLIENT_DIR, FINAL, HOSTS, POOL, Pool, Team, join, make_team, start_runs, wait_final

TRAINERS = ["trainer-a", "trainer-b"]
IMAGES = HOME / "soak-images"  # on the laptop (each host has its own $HOME)
FIRST, GROWTH = 30, 6  # images per class the first night, and added each night after
RETRIES = 2  # new runs of a night after a failed one; a night still failing then is the soak's failure
RUN_TIMEOUT_S = 900  # one pipeline run, waiting for the lock included
FAULTS = ("link_cut", "postgres_restart", "s3_down")
LOST_LOCK = "the connection holding the pipeline lock was lost"  # tasks/core/lock.py
MODEL = "lockstep-classifier"
PROJECT: dict[str, Any] = {
    "data": {"source": "imagefolder", "path": str(IMAGES), "channels": 1},
    # small_cnn and a few epochs: each night's model differs a little, so some win and some lose
    "train": {"model": "small_cnn", "epochs": 8},
    "compress": {"variants": ["static_int8"]},
    "orchestration": {"cron": None, "reingest": False},
}
GIT = "git -c user.name=data-owner -c user.email=owner@lockstep.invalid"

# Run on the laptop: each flow run's state type, name and message (argv), one GET each, no Prefect import.
STATE = """
import base64, json, os, sys, urllib.request
auth = base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode()
out = []
for flow_run_id in sys.argv[1:]:
    ask = urllib.request.Request(f"{os.environ['PREFECT_API_URL']}/flow_runs/{flow_run_id}")
    ask.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(ask, timeout=30) as answer:
        state = json.load(answer)["state"]
    out.append({"type": state["type"], "name": state["name"], "message": state.get("message") or ""})
print(json.dumps(out))
"""

# Run on the laptop: every registered version with its source run, the pipeline run above it (and its
# flow run), the train run beside it (and its best checkpoint's md5); the champion; each flow run's
# MLflow run statuses; the RUNNING runs.
REGISTRY = """
import hashlib, json, sys, tempfile
from mlflow import MlflowClient
client = MlflowClient()
experiment = client.get_experiment_by_name("lockstep").experiment_id
runs = {r.info.run_id: r for r in client.search_runs([experiment], max_results=5000)}
def flow_run(run):
    parent = runs.get(run.data.tags.get("mlflow.parentRunId", ""))
    return (parent or run).data.tags.get("lockstep.flow_run")
by_flow_run = {}
for run in runs.values():
    by_flow_run.setdefault(flow_run(run) or "none", []).append(run.info.status)
versions = []
for v in sorted(client.search_model_versions(f"name='{sys.argv[1]}'"), key=lambda v: int(v.version)):
    run = runs.get(v.run_id)
    parent_id = run.data.tags.get("mlflow.parentRunId") if run else None
    train = next((r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent_id
                  and r.data.tags.get("lockstep.stage") == "train"), None) if parent_id else None
    item = {"version": int(v.version), "run_status": run.info.status if run else "missing",
            "parent_status": runs[parent_id].info.status if parent_id in runs else "missing",
            "flow_run": flow_run(run) if run else None, "promotion": v.tags.get("promotion"),
            "verdict": v.tags.get("promotion.verdict", ""), "train_run": train.info.run_id if train else None,
            "train_status": train.info.status if train else "missing",
            "data_md5": train.data.tags.get("data.md5") if train else None}
    if train and train.info.status == "FINISHED":
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(train.info.run_id, "checkpoints/best.safetensors", tmp)
            item["best_md5"] = hashlib.md5(open(path, "rb").read()).hexdigest()
    versions.append(item)
champion = client.get_registered_model(sys.argv[1]).aliases.get("champion")
running = [r for r, run in runs.items() if run.info.status == "RUNNING"]
print(json.dumps({"versions": versions, "champion": int(champion) if champion else None,
                  "running": running, "by_flow_run": by_flow_run}))
"""

# Run on the laptop: every flow run the Prefect server holds, and its state type.
FLOW_RUNS = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print(json.dumps({str(r.id): r.state_type.value for r in client.read_flow_runs(limit=200)}))
"""


def _try_ask(team: Team, script: str, *args: str) -> Any:
    """`team.ask`, or None while a server does not answer (PostgreSQL restarting, a link down)."""
    try:
        return team.ask("laptop", script, *args)
    except (AssertionError, ValueError, subprocess.TimeoutExpired):
        return None


def _until(what: str, check: Any, timeout_s: float, every_s: float = 2) -> Any:
    """`check()`'s first truthy value, polled until `timeout_s` (then AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not after {timeout_s} s")


def _worker_log(pool: Pool, host: str) -> Path:
    return pool.team.bed.host(host).disk / "tmp" / f"worker-{host}.log"


def _runner(pool: Pool, flow_run: str) -> str | None:
    """The trainer running the flow run: its worker's log carries the run's output, which links to it
    (`View at .../flow-run/<id>`). Both workers log `submitting flow run`: the loser's is aborted."""
    for host in TRAINERS:
        log = _worker_log(pool, host)
        if log.exists() and f"flow-run/{flow_run}" in log.read_text(errors="replace"):
            return host
    return None


def _keep_workers(pool: Pool) -> None:
    """Start again a worker that exited (Prefect's worker gives up after failed polls, e.g. while cut off)."""
    for host in TRAINERS:
        if host not in pool.workers or pool.workers[host].poll() is not None:
            pool.workers.pop(host, None)
            pool.start_worker(host)


def _strike(team: Team, pool: Pool, fault: str, flow_run: str, since_ms: int) -> dict[str, Any]:
    """`fault` while the run trains; undone in a `finally`; what was seen."""
    bed = team.bed
    host = _until("a worker takes the run", lambda: _runner(pool, flow_run), 300)
    # the train stage's MLflow run exists from the stage's start: strike then (a train stage lasts seconds)
    train = _until(f"training on {host}", lambda: _try_ask(team, TRAINING, host, str(since_ms)), 600, 1)
    offset = _worker_log(pool, host).stat().st_size
    seen: dict[str, Any] = {"fault": fault, "host": host, "train_run_at_strike": train[0]}
    started = time.monotonic()
    try:
        if fault == "link_cut":
            faults.cut_link(bed, host)
        else:
            seen["restart_s"] = round(faults.restart_postgres(bed), 1)
        # the run stops by itself when its lock's session is gone; the server marks it Crashed (heartbeats)
        final = _until("the struck run ends", lambda: _final(team, flow_run), 420)
        seen["ended_after_s"] = round(time.monotonic() - started, 1)
    finally:
        if fault == "link_cut":
            faults.restore_link(bed, host)
        else:
            faults.start_missing_servers(bed)
    with open(_worker_log(pool, host), "rb") as log:
        log.seek(offset)
        seen["lost_lock_logged"] = LOST_LOCK in log.read().decode(errors="replace")
    return {**seen, **final}


def _final(team: Team, flow_run: str) -> dict[str, str] | None:
    states = _try_ask(team, STATE, flow_run)
    return states[0] if states and states[0]["type"] in FINAL else None


def _grow(laptop_disk: Path, night: int, seed: int) -> int:
    """The laptop's image folder on `night`: FIRST + GROWTH x (night - 1) digits per class, in an order the
    seed fixes (so a night's folder holds the night before's, plus some). Written from here, onto the
    laptop's own disk, as its owner copies photos in. Returns the number of images."""
    from sklearn.datasets import load_digits

    labels = load_digits().target
    order = list(range(len(labels)))
    random.Random(seed).shuffle(order)
    per_class = FIRST + GROWTH * (night - 1)
    chosen = [i for c in range(10) for i in [j for j in order if labels[j] == c][:per_class]]
    write_digits(laptop_disk / IMAGES.relative_to(HOME), chosen)
    return len(chosen)


def _night(team: Team, pool: Pool, night: int, fault: str | None, seed: int, branch: str) -> dict[str, Any]:
    laptop, env = team.bed.host("laptop"), team.client_env()
    record: dict[str, Any] = {"night": night, "fault": fault, "flow_runs": [], "failures": []}
    started = time.monotonic()
    record["images"] = _grow(laptop.disk / "home", night, seed)
    laptop.run(env + "dvc repro --force --single-item download", timeout=600)
    if fault == "s3_down":
        faults.stop_s3_gateway(team.bed)
        try:
            pushed = laptop.run(env + "dvc push", check=False)
        finally:
            faults.start_missing_servers(team.bed)
        said = (pushed.stdout + pushed.stderr).strip().splitlines()
        line = next((s for s in said if faults.s3_endpoint(team.bed) in s), said[-1] if said else "")
        record["failures"].append({"what": "dvc push", "exit": pushed.returncode, "message": line.strip()[:300]})
    laptop.run(env + "dvc push")  # after a fault: the retry, which must push everything
    record["data_md5"] = re.search(r"md5: (\w+\.dir)", laptop.run("cat data.dvc").stdout)[1]
    laptop.run(f"{GIT} add data.dvc dvc.lock && {GIT} commit -q -m 'data: night {night}, {record['images']} images'")
    commit = laptop.run("git rev-parse HEAD").stdout.strip()
    # the operator: the commit onto the git server (over ssh on a real team; here, into its bare repository)
    bare = team.bed.host("services").disk / "home" / "git" / "lockstep.git"
    subprocess.run(["git", "-C", str(laptop.project), "push", "-q", str(bare), f"HEAD:refs/heads/{branch}"], check=True)
    deployed = laptop.run(env + f"python -m flows.deployments deploy --pool {POOL} --git")
    assert f"at {commit[:12]}" in deployed.stdout, deployed.stdout
    record["commit"] = commit
    for attempt in range(1 + RETRIES):
        _keep_workers(pool)
        since_ms = int(time.time() * 1000)
        (flow_run,) = start_runs(team, 1)
        if attempt == 0 and fault in ("link_cut", "postgres_restart"):
            seen = _strike(team, pool, fault, flow_run, since_ms)
            state = seen["type"]
        else:
            (run,) = wait_final(team, [flow_run], pool, timeout_s=RUN_TIMEOUT_S)
            state, seen = run["state"], (_try_ask(team, STATE, flow_run) or [{}])[0]
        record["flow_runs"].append({"id": flow_run, "state": state, "host": _runner(pool, flow_run)})
        if state == "COMPLETED":
            break
        record["failures"].append({"what": "flow run", "flow_run": flow_run, **seen})
    record["minutes"] = round((time.monotonic() - started) / 60, 2)
    return record


def _key(md5: str) -> str:
    return f"files/md5/{md5[:2]}/{md5[2:]}"  # where DVC 3 keeps an object in its remote


def _check(checks: list[dict[str, Any]], name: str, problems: list[str]) -> None:
    checks.append({"check": name, "ok": not problems, "problems": problems[:20]})


def _verify(team: Team, nights: list[dict[str, Any]], registry: dict[str, Any]) -> list[dict[str, Any]]:
    """The week's checks, each {check, ok, problems}; fills each night's outcome and champion, and
    `registry` with what the registry and MLflow held."""
    checks: list[dict[str, Any]] = []
    reg = team.ask("laptop", REGISTRY, MODEL)
    registry.update(reg)
    by_flow_run = {v["flow_run"]: v for v in reg["versions"]}
    problems, champion = [], None
    for night in nights:
        last = night["flow_runs"][-1] if night["flow_runs"] else {"state": "none", "id": None}
        version = by_flow_run.get(last["id"])
        if last["state"] != "COMPLETED" or version is None or version["promotion"] not in ("promoted", "kept"):
            problems.append(f"night {night['night']}: {last['state']}, version {version}")
            night["outcome"] = f"FAILED ({last['state']})"
            continue
        why = re.search(r"\(([^()]*)\)$", version["verdict"]) or re.search(r": (.*)$", version["verdict"])
        if version["promotion"] == "promoted":
            champion = version["version"]
            night["outcome"] = f"promoted v{champion} ({why[1] if why else '?'})"
        else:
            night["outcome"] = f"kept v{champion} (v{version['version']}: {why[1] if why else '?'})"
            if f"champion stays v{champion})" not in version["verdict"]:
                problems.append(f"v{version['version']} kept, not against v{champion}: {version['verdict']}")
        if len(night["flow_runs"]) != len([f for f in night["failures"] if f["what"] == "flow run"]) + 1:
            problems.append(f"night {night['night']}: a failed run was not recorded")
        if any(f["what"] == "dvc push" and f["exit"] == 0 for f in night["failures"]):
            problems.append(f"night {night['night']}: dvc push exited 0 with the S3 gateway down")
        night["champion"] = champion
        night["verdict"] = version["verdict"]
    _check(checks, "every night promoted or kept with its reason, failures retried", problems)

    soak_runs = {r["id"] for n in nights for r in n["flow_runs"] if r["state"] == "COMPLETED"}
    problems = [
        f"v{v['version']}: run {v['run_status']}, pipeline {v['parent_status']}, train {v['train_status']}"
        for v in reg["versions"]
        if {v["run_status"], v["parent_status"], v["train_status"]} != {"FINISHED"} or v["flow_run"] not in soak_runs
    ]
    if reg["champion"] != champion:
        problems.append(f"the champion alias is v{reg['champion']}, the nights say v{champion}")
    if len(reg["versions"]) != len(soak_runs):
        problems.append(f"{len(reg['versions'])} versions for {len(soak_runs)} completed runs")
    _check(checks, "registry history = MLflow runs (FINISHED, one version per completed night)", problems)

    keys = set(team.ask("laptop", DVC_BUCKET_LIST))
    promoted = [v for v in reg["versions"] if v["promotion"] == "promoted"]
    wanted = [(f"v{v['version']} best.safetensors", v.get("best_md5", "")) for v in promoted]
    wanted += [(f"night {n['night']} data", n["data_md5"]) for n in nights if n.get("data_md5")]
    problems = [f"{what}: {md5} not in the remote" for what, md5 in wanted if _key(md5) not in keys]
    night_data = {n.get("data_md5") for n in nights}
    problems += [
        f"v{v['version']} trained on {v['data_md5']}, no night's data"
        for v in promoted
        if v["data_md5"] not in night_data
    ]
    _check(checks, "every champion's weights and every night's data in the DVC remote", problems)

    _check(checks, "every champion reproduces bit for bit on the laptop", _reproduce(team, promoted))

    failed = {f["flow_run"] for n in nights for f in n["failures"] if f["what"] == "flow run"}
    problems = [f"MLflow run {run} RUNNING" for run in reg["running"]]
    for flow_run in failed:  # a run that failed mid-way: what it had not finished was marked KILLED
        statuses = reg["by_flow_run"].get(flow_run, [])
        if statuses and "KILLED" not in statuses and "FAILED" not in statuses:
            problems.append(f"failed flow run {flow_run}'s MLflow runs: {statuses}")
    states = team.ask("laptop", FLOW_RUNS)
    problems += [f"flow run {fr} {state}" for fr, state in states.items() if state not in FINAL]
    _check(checks, "nothing left RUNNING (MLflow runs, flow runs)", problems)
    return checks


def _reproduce(team: Team, champions: list[dict[str, Any]]) -> list[str]:
    """`make reproduce` of each champion's train run on the laptop, the data from the DVC remote: the
    laptop's own DVC cache (it made the snapshots) is moved aside meanwhile."""
    laptop, problems = team.bed.host("laptop"), []
    laptop.run("mv .dvc/cache /tmp/laptop-dvc-cache")
    try:
        for v in champions:
            out = f"/tmp/reproduce-v{v['version']}.json"
            args = shlex.quote(f"{v['train_run']} --json {out}")
            done = laptop.run(team.client_env() + f"make reproduce ARGS={args}", check=False, timeout=900)
            path = laptop.disk / "tmp" / Path(out).name
            report = json.loads(path.read_text()) if path.exists() else {}
            v["reproduce"] = report.get("verdict", f"exit {done.returncode}")
            if done.returncode != 0 or v["reproduce"] != "identical" or "DVC remote" not in report.get("data_from", ""):
                problems.append(f"v{v['version']} ({v['train_run']}): {v['reproduce']}, {done.stdout[-300:]}")
    finally:
        laptop.run("rm -rf .dvc/cache && mv /tmp/laptop-dvc-cache .dvc/cache")
    return problems


def soak(nights: int, seed: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    # each fault once where the week is long enough, never on the first night (which makes the first champion)
    struck = rng.sample(range(2, nights + 1), min(len(FAULTS), nights - 1))
    plan = dict(zip(struck, rng.sample(FAULTS, len(FAULTS)), strict=False))
    started = time.monotonic()
    result: dict[str, Any] = {"nights": [], "checks": [], "seed": seed, "faults": plan, "machine": _machine()}
    with Bed(HOSTS) as bed:
        team = make_team(bed, workdir, PROJECT)
        laptop = bed.host("laptop")
        laptop.clone(team.git_url)
        laptop.run(f"export LOCKSTEP_STACK_DIR={CLIENT_DIR}; python -m stack join")
        join(team, TRAINERS)
        branch = laptop.run("git symbolic-ref --short HEAD").stdout.strip()
        result["setup_s"] = round(time.monotonic() - started, 1)
        pool = Pool(team)
        try:
            for night in range(1, nights + 1):
                print(f"soak: night {night} ({plan.get(night) or 'no fault'})", flush=True)
                try:
                    result["nights"].append(_night(team, pool, night, plan.get(night), seed, branch))
                except AssertionError as failed:  # a night that did not end: recorded, and the week stops
                    result["nights"].append({"night": night, "fault": plan.get(night), "error": str(failed)[-3000:]})
                    break
            try:
                nights_done = [n for n in result["nights"] if "error" not in n]
                result["checks"] = _verify(team, nights_done, result.setdefault("registry", {}))
            except AssertionError as failed:  # a server that did not answer the checks
                result["checks"].append({"check": "the checks ran", "ok": False, "problems": [str(failed)[-2000:]]})
        finally:
            pool.stop()
    if any("error" in n for n in result["nights"]):
        result["checks"].append({"check": "every night ran to its end", "ok": False, "problems": ["see nights"]})
    result["total_minutes"] = round((time.monotonic() - started) / 60, 1)
    result["ok"] = bool(result["checks"]) and all(c["ok"] for c in result["checks"])
    return result


def _machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count()}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| night | images | fault | flow runs | outcome | champion | min |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in result["nights"]:
        runs = ", ".join(f"{r['state'].lower()} ({r['host'] or '?'})" for r in n.get("flow_runs", []))
        fault = n.get("fault") or ""
        if any(f["what"] == "dvc push" for f in n.get("failures", [])):
            fault += " (push failed, retried)"
        outcome = n.get("outcome") or n.get("error", "")[:80]
        champion = f"v{n['champion']}" if n.get("champion") else ""
        cells = [n["night"], n.get("images", ""), fault, runs, outcome, champion, n.get("minutes", "")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += ["", *(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}" for c in result["checks"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hosts.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=5, help="scheduled retrains (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="which images, which fault on which night")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    if not 1 <= args.nights <= 30:
        parser.error("--nights: 1 to 30")
    why = why_unavailable()
    if why:
        print(f"soak: the multi-host bed cannot be made here: {why}", file=sys.stderr)
        return 2
    remove_leftovers()
    # SIGTERM as Ctrl-C: the bed's `with` removes its namespaces and processes either way
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="lockstep-soak-") as workdir:
        result = soak(args.nights, args.seed, Path(workdir))
    print(table(result))
    verdict = "ok" if result["ok"] else "FAILED"
    print(f"soak: {args.nights} nights, seed {args.seed}, {result['total_minutes']} min: {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
