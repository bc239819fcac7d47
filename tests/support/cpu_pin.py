"""A pytest plugin, loaded first (`-p tests.support.cpu_pin` in pyproject's addopts): prepares this process as
an entry point does (tasks/determinism/bootstrap.py `prepare`) for params.yaml's default determinism.cpu,
before any other plugin imports numpy or torch (pytest-randomly imports numpy), so the stages tests run in
this process compute as a stage process does. xdist workers and the tests' subprocesses inherit it."""

import os

from tasks.determinism import bootstrap

# The suite runs three xdist workers on two cores, each starting processes that compute on two threads:
# OpenMP's threads (torch's pool, portable mode's products too) spin for a while when they wait for a peer
# (`prepare`'s short spin, GOMP_SPINCOUNT), and a peer that lost its core to another worker's process
# keeps them spinning. Waiting passively hands those cycles to the other tests (a tenth of the CPU of the
# training tests); how threads wait changes no result. `prepare` has no passive setting and leaves the
# wait to one chosen before it, so it is chosen here, first; inherited by subprocesses.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
bootstrap.prepare("portable")
