"""B3-deploy's arithmetic (benchmarks/deployment_noop.py): a run's seconds from the state history Prefect's
server keeps. The measurement itself serves the deployment and takes minutes: run by hand, its results in
benchmarks/results/deployment-noop.json."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prefect.client.schemas.objects import State
from prefect.states import Completed, Failed, Pending, Running, Scheduled

from benchmarks.deployment_noop import _seconds

T0 = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)


def _at(state: State, seconds: float) -> State:
    state.timestamp = T0 + timedelta(seconds=seconds)
    return state


def test_a_completed_run_is_timed_from_pending_and_from_running() -> None:
    # in any order, as the API may list them; Scheduled before Pending is the wait for serve's next poll
    history = [_at(Completed(), 9.5), _at(Scheduled(), 0.0), _at(Running(), 6.25), _at(Pending(), 4.0)]
    assert _seconds(history) == {"pending_to_completed_s": 5.5, "running_to_completed_s": 3.25}


def test_a_run_that_did_not_complete_is_no_figure() -> None:
    with pytest.raises(RuntimeError, match="did not complete: states"):
        _seconds([_at(Pending(), 0.0), _at(Running(), 1.0), _at(Failed(), 2.0)])
