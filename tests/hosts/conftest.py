"""The multi-host bed (tests/support/hosts.py) and the team on it (tests/support/team.py), made once per
test process: every module of tests/hosts/ is one xdist unit of work (tests/conftest.py), so one worker
makes one bed and one stack for all of them.

The fixtures are package-scoped (tests/hosts/ is a package for that alone): the bed and its servers go
when the package's last test ends, not when the worker's session does. Session-scoped, a worker that
took other modules after the bed kept its PostgreSQL, MLflow, Prefect and SeaweedFS running, idle,
for the rest of the run (the last eight minutes of a 25-minute one, 2026-12-04)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT
from tests.support.hosts import LAST_REMOVAL, Bed, remove_leftovers, why_unavailable
from tests.support.team import (
    HOSTS,
    Pool,
    Team,
    Trained,
    deploy,
    join,
    make_team,
    push_data,
    run_by_hand,
    write_timings,
)

TIMINGS = ROOT / "test-artifacts" / "many-hosts-timings.json"


@pytest.fixture(scope="package")
def bed() -> Iterator[Bed]:
    why = why_unavailable()
    if why:
        if os.environ.get("CI") == "true":  # CI is root: a bed that cannot be made there is a failure
            pytest.fail(f"the multi-host bed cannot be made: {why}")
        pytest.skip(f"the multi-host bed needs network and mount namespaces: {why}")
    remove_leftovers()  # namespaces and folders of a bed whose test run was killed
    with Bed(HOSTS) as made:
        yield made


@pytest.fixture(scope="package")
def team(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    made = make_team(bed, tmp_path_factory.mktemp("hosts"))
    try:
        yield made
    finally:
        # Not `python -m stack down`, which stops the servers one after another (11 s here): the bed
        # sends every process of every host SIGTERM at once (PostgreSQL's smart shutdown then ends as
        # its clients go), SIGKILL after a grace period, and removes the namespaces and the folder.
        bed.close()
        made.timings["bed_teardown_s"] = LAST_REMOVAL.get("seconds", 0.0)
        made.timings["processes_ended"] = LAST_REMOVAL.get("processes", 0)
        made.timings["processes_killed"] = LAST_REMOVAL.get("killed", [])
        made.timings["slowest_to_end_s"] = LAST_REMOVAL.get("slowest_to_end_s", {})
        write_timings(made, TIMINGS)


@pytest.fixture(scope="package")
def data_pushed(team: Team) -> Team:
    """The laptop: clone, join the stack's S3 as the DVC remote, make the data snapshot and push it."""
    push_data(team)
    return team


@pytest.fixture(scope="package")
def trainers(team: Team) -> Team:
    """trainer-a and trainer-b: clones of the served commit, joined to the stack."""
    join(team, ["trainer-a", "trainer-b"])
    return team


@pytest.fixture(scope="package")
def trained(data_pushed: Team, trainers: Team) -> Trained:
    """trainer-a ran the pipeline by hand (dvc pull, python -m flows.pipeline, dvc push)."""
    return run_by_hand(data_pushed, "trainer-a")


@pytest.fixture(scope="module")
def pool(data_pushed: Team, trainers: Team) -> Iterator[Pool]:
    """The laptop deployed the pipeline from git; a worker on trainer-a serves the pool (the tests
    start others)."""
    made = deploy(data_pushed)
    made.start_worker("trainer-a")
    try:
        yield made
    finally:
        made.stop()
