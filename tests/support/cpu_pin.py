"""A pytest plugin, loaded first (`-p tests.support.cpu_pin` in pyproject's addopts): pins params.yaml's default
determinism.cpu before any other plugin imports numpy or torch (pytest-randomly imports numpy), so the
stages tests run in this process compute as a stage process does. xdist workers inherit it."""

from tasks.determinism import cpu_mode

cpu_mode.pin_env("portable")
