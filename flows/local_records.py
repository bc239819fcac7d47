"""A flow run's task runs, waited for until the process's own Prefect server has recorded them.

Prefect 3 records task runs from events: the flow's process sends each state change over a
websocket, and the server's task-run recorder writes it a moment later, from a queue in memory. A
team's server goes on recording after the process is gone. The server a command starts for itself
(flows/prefect_env.py `local_api`) is stopped as the process ends, and what it had not recorded by
then is lost: in one CI run (2026-12-05) the last task of a `make run` with nothing to do was left
without its final state, once no heartbeat thread held the run's end for up to a second any more.
So such a command waits here, after its flow returns and before the server stops: one query when
all is recorded (the usual case), and a bounded wait otherwise.
"""

from __future__ import annotations

import logging
import time
from uuid import UUID

from tasks.core.redact import redact

log = logging.getLogger(__name__)

# A recorder that has not caught up within this is stuck, not slow (it writes each event as it comes:
# the server's task-run recorder batch size is 1 by default); the run's results stand either way.
RECORD_WAIT_S = 10.0
POLL_S = 0.05


def wait_recorded(flow_run_id: UUID, task_runs: int, timeout_s: float = RECORD_WAIT_S) -> bool:
    """Block until the server in PREFECT_API_URL holds at least `task_runs` task runs of the flow run,
    every one in a final state. False, with a warning naming what is missing, if it does not in `timeout_s`."""
    # Prefect loads where a server is talked to (this module is imported after a flow ran)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    of_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        while True:
            try:
                runs = client.read_task_runs(flow_run_filter=of_this_run)
            except Exception as exc:  # the server gone or failing: the run's results stand, its record may not
                log.warning("Prefect's record of flow run %s could not be checked: %s", flow_run_id, redact(str(exc)))
                return False
            unfinished = sorted(run.name for run in runs if run.state is None or not run.state.is_final())
            if len(runs) >= task_runs and not unfinished:
                return True
            if time.monotonic() >= deadline:
                log.warning(
                    "Prefect's record of flow run %s is incomplete: after %.1f s its server holds %d of %d task runs"
                    "%s; the run's results are not affected",
                    flow_run_id,
                    timeout_s,
                    len(runs),
                    task_runs,
                    f", unfinished: {', '.join(unfinished)}" if unfinished else "",
                )
                return False
            time.sleep(POLL_S)
