"""B3-deploy (issue 69.1): `prefect deployment run` of a trained project with nothing stale, in the worker's time.

    python -m benchmarks.deployment_noop [--work DIR] [--runs 5] [--out FILE]

In a copy of the repository's tracked files (benchmarks/pipeline_overhead.py `project_copy`, smoke params,
trained once), `make schedule`'s process (`python -m flows.deployments serve`: a Prefect server of the
project's own and the served deployment) takes runs of the deployment one after another, as
`prefect deployment run 'lockstep-pipeline/nightly'` starts them: first with `reingest: false` (nothing
is stale and nothing is re-read: the flow asks DVC once and records the run), then with the deployment's
own default `reingest: true` (the scheduled night: the source is read again, gives data/ byte for byte,
and no stage runs: flows/pipeline_flow.py `_source_unchanged`). The runs alternate between the two.

A run's seconds come from its Prefect states, as the server recorded them: Pending (serve has taken
it and starts its process) to Completed is the worker's time for it, the figure the issue's 5 s is
for; Running to Completed is the flow function's own part. The rest of Pending is Python, Prefect's
engine and the flow module's imports in the new process.

Results go to `--out` (default benchmarks/results/deployment-noop.json), one entry per machine kind and day.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, ROOT, machine, median
from benchmarks.pipeline_overhead import project_copy
from flows.local_server import AUTH_FILE, free_port, wait_until_healthy
from tasks.core.atomic import write_text
from tasks.core.config.yaml_io import load_params
from tasks.core.processes import stop_group

OUT = RESULTS / "deployment-noop.json"
SERVE_TIMEOUT_S = 180  # a cold server migrates its database first (flows/prefect_env.py)
RUN_TIMEOUT_S = 300


def _serve(project: Path, env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "flows.deployments", "serve", "--port", str(port)],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its server and flow-run processes go with its group at the end
        )


def _seconds(states: list[Any]) -> dict[str, float]:
    """Pending -> Completed and Running -> Completed, from a flow run's state history."""
    at = {state.type.value: state.timestamp for state in sorted(states, key=lambda s: s.timestamp)}
    if at.get("COMPLETED") is None:
        raise RuntimeError(f"the flow run did not complete: states {[s.type.value for s in states]}")
    return {
        "pending_to_completed_s": round((at["COMPLETED"] - at["PENDING"]).total_seconds(), 2),
        "running_to_completed_s": round((at["COMPLETED"] - at["RUNNING"]).total_seconds(), 2),
    }


def _wait_for_deployment(client: Any, name: str, serve: subprocess.Popen[bytes]) -> None:
    """Serve registers the deployment once its server answers."""
    # Prefect loads once `measure` has pointed this process at the served API (it reads settings on import)
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while True:
        try:
            client.read_deployment_by_name(name)
            return
        except ObjectNotFound:
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError(f"{name} was not served within {SERVE_TIMEOUT_S} s (serve.log says why)") from None
            time.sleep(0.5)


def measure(work: Path, runs: int) -> dict[str, Any]:
    """`runs` deployment runs of each kind, alternated, after one untimed run of each; their seconds."""
    project, env = project_copy(work, smoke=True)
    home = work / "prefect-home"
    port = free_port()
    env = {**env, "PREFECT_HOME": str(home)}
    serve = _serve(project, env, port, work / "serve.log")
    try:
        api = f"http://127.0.0.1:{port}/api"
        wait_until_healthy(f"{api}/health", serve, SERVE_TIMEOUT_S)
        # this process is the `prefect deployment run` client (a command's own, so its environment may be
        # changed): Prefect reads its settings when it loads
        auth = (home / AUTH_FILE).read_text().strip()
        os.environ.update({"PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth})
        # Prefect loads only now, after the environment above: it reads its settings on import
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment

        name = f"lockstep-pipeline/{load_params(project / 'params.yaml').orchestration.deployment}"
        found: dict[str, list[dict[str, float]]] = {"reingest_false": [], "reingest_true": []}
        with get_client(sync_client=True) as client:
            _wait_for_deployment(client, name, serve)
            for round_ in range(runs + 1):
                for key, reingest in (("reingest_false", False), ("reingest_true", True)):
                    flow_run = run_deployment(
                        name, parameters={"reingest": reingest}, timeout=RUN_TIMEOUT_S, poll_interval=1
                    )
                    seconds = _seconds(client.read_flow_run_states(flow_run.id))
                    if round_:  # the first of each kind is the warm-up: untimed
                        found[key].append(seconds)
                    print(key, seconds, flush=True)
    finally:
        stop_group(serve)  # serve stops its server as it exits
    return {
        key: {
            "runs": rows,
            "median_pending_to_completed_s": median([r["pending_to_completed_s"] for r in rows]),
            "median_running_to_completed_s": median([r["running_to_completed_s"] for r in rows]),
        }
        for key, rows in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deployment_noop", description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench-deployment-noop")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each kind (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    entry = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "how": "python -m benchmarks.deployment_noop (module docstring)",
        **measure(work, args.runs),
    }
    report = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    report["rows"].append(entry)
    write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in entry.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
