"""A fresh project's first `make run`, as a new user starts it, and built once per test run (the
`first_make_runs` fixture, tests/conftest.py): twice at the same moment, by a user with secrets in the
environment, in a git remote URL and in a param. One cold pipeline serves two modules:
tests/reliability/test_two_make_runs.py (one run waits for the other; no secret reaches MLflow) and
tests/flows/test_e2e.py (the flow's first run leaves what `dvc repro` leaves)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex
from typing import Any

from tasks.core.config.params import STAGES
from tests.conftest import SHARED_PROJECT, copy_project, merge, run, subprocess_env, with_environment

ALL_STAGES = f"stages run: {', '.join(STAGES)}"  # what the run that ran every stage prints


@dataclass(frozen=True)
class TwoRuns:
    """A project on which `make run` was started twice at the same moment (tracking on)."""

    repo: Path
    runs: list[subprocess.CompletedProcess[str]]
    secrets: dict[str, str]  # where -> value

    def ran_all(self) -> str:
        """The output of the run that ran every stage (the other waited, then found nothing to do)."""
        ran = [done.stdout for done in self.runs if ALL_STAGES in done.stdout]
        assert len(ran) == 1, [f"exit {done.returncode}: {done.stdout[-3000:]}" for done in self.runs]
        return ran[0]

    def record(self) -> dict[str, Any]:
        """As JSON, for the xdist workers that did not build it."""
        runs = [{"args": done.args, "returncode": done.returncode, "stdout": done.stdout} for done in self.runs]
        return {"repo": str(self.repo), "runs": runs, "secrets": self.secrets}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TwoRuns:
        runs = [subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], "") for r in record["runs"]]
        return cls(Path(record["repo"]), runs, record["secrets"])


def two_make_runs(base: Path) -> TwoRuns:
    """`make run` twice at once in a fresh copy in `base`, with secrets where a user keeps them."""
    places = (
        *("LOCKSTEP_API_TOKEN", "MY_DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "GRAFANA_AUTH"),
        *("git remote", "data.mirror"),
    )
    secrets = {where: f"s3cr3t-{token_hex(12)}" for where in places}
    # user:pw@ in a URL param is refused (tests/core/test_params_credentials.py); a token as a path segment
    # passes validation and must be masked wherever the param goes. Digits never fetches the mirror.
    mirror = f"https://mirror.invalid/token/{secrets['data.mirror']}/datasets"
    # the shared project's params: tests/flows/test_e2e.py compares this copy's dvc.lock with that project's
    repo = with_environment(copy_project(base / "repo", merge(SHARED_PROJECT, {"data": {"mirror": mirror}})))
    run(["git", "remote", "add", "origin", f"https://oauth2:{secrets['git remote']}@git.invalid/team/repo.git"], repo)
    env = subprocess_env(**{name: value for name, value in secrets.items() if name.isupper()})
    procs = [
        subprocess.Popen(
            ["make", "run"], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    runs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        runs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return TwoRuns(repo, runs, secrets)
