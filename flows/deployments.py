"""The pipeline as a service: a Prefect deployment with the retraining schedule from params.yaml.

    python -m flows.deployments serve            # `make schedule`: a Prefect server on 127.0.0.1:4200
                                                 # (unless PREFECT_API_URL names one) + the deployment
    python -m flows.deployments deploy --pool P  # for a work pool instead: workers run the flow
    python -m flows.deployments deploy --pool P --git   # workers on other hosts: code from git, data from DVC

then, from another shell (with PREFECT_API_URL=http://127.0.0.1:4200/api):

    prefect deployment run 'lockstep-pipeline/nightly' --watch
    prefect deployment run 'lockstep-pipeline/nightly' --param force=true
    prefect deployment run 'lockstep-pipeline/nightly' --params '{"overrides": {"train.lr": 0.01}}'

A run started through the API may change only the keys on tasks/core/config/policy.py's
API_OVERRIDABLE (the optimisation recipe and seeds), with `overrides` or a `params_file` that differs
from params.yaml; `--allow-override KEY` adds keys: for `serve`, in its own environment, which its
runs inherit; for `deploy`, in the deployment's own record, which the flow reads through the API.
`deploy` makes its pool lock a run's job variables out (`locked_job_template`): a run cannot set
the worker's environment or command. Whoever holds the API's auth string can still rewrite a
deployment (its pull steps) or the pool: on a process pool that is code execution as the worker's
user (docs/operations-and-retraining.md, "What a Prefect client can do").

Both variants register the same deployment (`deployment_options`): the flow's signature is the
parameter schema (Prefect refuses a run whose parameters do not fit it), and `reingest` from
`orchestration`, so that every run of the deployment re-reads the source. At most one pipeline runs
at a time: the serve process starts one flow run at a time, and every flow run holds the project's
pipeline lock (tasks/core/lock.py), so runs from workers, `make run` or `dvc repro` wait too.

`deploy --git [REMOTE]` is for workers that share no disk with this checkout: the
deployment's pull steps, run by the worker before each flow run, clone the commit from the git
remote (Prefect's `git_clone`) and pull the data from the DVC remote (`git_pull_steps`); the flow
run then pushes what it made (tasks/core/remote.py), under the pipeline lock, before the worker deletes
its temporary checkout. The data is pulled by a pull step rather than by the flow: the step runs
before any code of the commit is imported and before the run is Running, so an unreachable remote
crashes the run with the step's error and nothing started; it is part of the deployment's record,
the same for every worker of the pool; and `python -m flows.pipeline` at a prompt is unchanged.

Prefect's own deployment concurrency limit is deliberately not used: with Prefect 3.8.8's default
in-memory lease storage, a limited deployment's runs were cancelled on start ("Deployment
concurrency slot lost during provisioning") on a local server with no other run in sight.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows import prefect_env, prefect_settings, project_server
from flows.local_server import AUTH_FILE, LocalServer, prefect_home
from tasks.core.cli import exit_code
from tasks.core.config.params import is_params_key
from tasks.core.config.policy import API_OVERRIDABLE, REMOTE_KEYS
from tasks.core.config.service import OrchestrationConfig
from tasks.core.config.yaml_io import PARAMS_FILE, load_params
from tasks.core.errors import Refused
from tasks.core.layout import ROOT


def deployment_options(cfg: OrchestrationConfig) -> dict[str, Any]:
    """What the served and the work-pool deployment share."""
    # Prefect (and the flow) load after main's prefect_settings.configure: Prefect reads its settings then
    from prefect.schedules import Cron

    return {
        "schedules": [Cron(cfg.cron, timezone=cfg.timezone)] if cfg.cron else [],
        "parameters": {"reingest": cfg.reingest},
        "enforce_parameter_schema": True,
        "description": "download -> stats -> preprocess -> train -> evaluate -> compress -> export; "
        "DVC skips what is up to date",
        "tags": ["lockstep"],
    }


@contextmanager
def local_server(host: str, port: int) -> Iterator[LocalServer]:
    """`prefect server start` on host:port for the block, answering; stopped on exit. While it runs, the
    project's other commands (`make run`, `make sweep`) run against it (flows/project_server.py)."""
    server = LocalServer(host, port, die_with_parent=True)  # also if serve is SIGKILLed
    home = prefect_home()
    try:
        server.wait()
        project_server.record(home, host, server.port, server.proc.pid, server.auth_string)
        yield server
    finally:
        project_server.forget(home, server.proc.pid)
        server.stop()


def serve(cfg: OrchestrationConfig) -> None:
    """Serve the deployment from this process until interrupted (runs execute in subprocesses)."""
    # Prefect (and the flow) load after main's prefect_settings.configure: Prefect reads its settings then
    from prefect import serve as prefect_serve

    from flows.pipeline import pipeline

    # limit=1: a second run waits in Prefect (Scheduled, then Late) instead of starting a process
    # that would only wait for the pipeline lock.
    prefect_serve(pipeline.to_deployment(name=cfg.deployment, **deployment_options(cfg)), limit=1)


def locked_job_template() -> dict[str, Any]:
    """The base job template of the pools `deploy` makes: a flow run can set nothing the worker uses.

    Prefect merges a flow run's job variables over its deployment's and starts the process with the
    result (env, command, working_dir on a process pool), and its server checks a run's variables
    against this schema only. So the schema declares one variable, the deployment's allow-list, which
    no job configuration uses; `additionalProperties: false` refuses every other (HTTP 422, dotted
    `env.X` keys too). The job configuration has no placeholders and no `env`: a run made without
    that check (POST /flow_runs/) still cannot reach the process, since the worker merges a run's
    `env` only into an `env` mapping the template has. The flow-run process gets the worker's own
    environment, and the default command (`python -m prefect.engine`)."""
    return {
        "job_configuration": {"stream_output": True},
        "variables": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                prefect_env.DEPLOYMENT_ALLOW_VARIABLE: {
                    "type": "string",
                    "default": "",
                    "title": "lockstep allow-list",
                    "description": "Keys runs of this deployment may override beyond the default list "
                    "(python -m flows.deployments deploy --allow-override); the flow reads the deployment's "
                    "value, and refuses a run that sets its own",
                }
            },
        },
    }


class PoolNotLocked(Refused):
    """The work pool lets a flow run set job variables the worker applies (env, command, ...)."""


def _ensure_locked_pool(client: Any, pool: str) -> None:
    """Create `pool` (type process) with `locked_job_template()`, or refuse one that differs from it."""
    # Prefect (and the flow) load after main's prefect_settings.configure: Prefect reads its settings then
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        existing = client.read_work_pool(pool)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=locked_job_template()))
        print(f"created work pool {pool!r} (type process; flow runs may set no job variables)")
        return
    template = existing.base_job_template or {}
    if template == locked_job_template():
        return
    offered = sorted(set(template.get("variables", {}).get("properties", {})) - {prefect_env.DEPLOYMENT_ALLOW_VARIABLE})
    what = f"lets a flow run set {', '.join(offered)}" if offered else "is not the one deploy makes"
    raise PoolNotLocked(
        f"work pool {pool}: its base job template {what} (variables.properties); expected only "
        f"{prefect_env.DEPLOYMENT_ALLOW_VARIABLE}, additionalProperties false and no placeholders "
        "(flows/deployments.py locked_job_template): deploy to a new pool name, which deploy creates so"
    )


def deploy(
    cfg: OrchestrationConfig,
    pool: str,
    name: str | None = None,
    allow: tuple[str, ...] = (),
    git: GitSource | None = None,
) -> str:
    """Register the deployment with a work pool (created as a locked `process` pool if missing). Its
    workers run the flow from this checkout, or with `git`, from a clone of that commit made by the
    deployment's pull steps (git_pull_steps). `allow` (--allow-override) is stored in the
    deployment's own record, where the flow reads it. Returns the deployment's full name."""
    # Prefect (and the flow) load after main's prefect_settings.configure: Prefect reads its settings then
    from prefect.client.orchestration import get_client

    from flows.pipeline import FLOW_NAME, pipeline

    with get_client(sync_client=True) as client:
        _ensure_locked_pool(client, pool)
    name = name or cfg.deployment
    job_variables = {prefect_env.DEPLOYMENT_ALLOW_VARIABLE: ",".join(allow)}
    if git is None:
        # From this checkout's path: a process worker on this machine (or one with the same path
        # mounted) changes into it and imports the flow from there.
        source = pipeline.from_source(source=str(ROOT), entrypoint="flows/pipeline.py:pipeline")
        source.deploy(
            name=name,
            work_pool_name=pool,
            build=False,
            push=False,
            print_next_steps=False,
            job_variables=job_variables,
            **deployment_options(cfg),
        )
        return f"{FLOW_NAME}/{name}"
    # The flow's parameter schema from this checkout, which is the commit (checked by resolve_git):
    # `from_source(GitRepository)` would clone it once more here just to import it.
    deployment = pipeline.to_deployment(
        name=name, work_pool_name=pool, job_variables=job_variables, **deployment_options(cfg)
    )
    deployment.storage = _git_storage(git)
    deployment.entrypoint = ENTRYPOINT
    deployment.apply(work_pool_name=pool)
    return f"{FLOW_NAME}/{name}"


# --------------------------------------------------------------------------- code from git, data from DVC

ENTRYPOINT = "flows/pipeline.py:pipeline"
# Run by the worker in the fresh clone: the stack's S3 bucket as the default DVC remote (from the
# client folder in the worker's LOCKSTEP_STACK_DIR; the keys stay in that folder), then the data and
# whatever outputs of the commit's dvc.lock the remote holds (the stages they belong to are then up
# to date). `python` and `dvc` are the worker's: start it with the project's .venv first on PATH.
DATA_STEP = "python -m stack join\ndvc pull --allow-missing"


@dataclass(frozen=True)
class GitSource:
    url: str  # what the workers clone (git://, ssh://, https://), never a path on this machine
    commit: str  # full sha, on that remote


def git_pull_steps(source: GitSource) -> list[dict[str, Any]]:
    """The deployment's pull steps: Prefect's git_clone of the commit, then the data (DATA_STEP) in
    the clone. A Prefect 3.8 process worker runs them in a new temporary folder per flow run (its
    workspace supervisor, before the engine starts), starts the flow in the clone, and deletes the
    folder when the run ends: nothing of a run stays on the worker's disk."""
    return [
        {
            "prefect.deployments.steps.git_clone": {
                "id": "clone",
                "repository": source.url,
                "commit_sha": source.commit,
            }
        },
        {
            "prefect.deployments.steps.run_shell_script": {
                "directory": "{{ clone.directory }}",
                "script": DATA_STEP,
                "stream_output": True,
            }
        },
    ]


def _git_storage(source: GitSource) -> Any:
    """Prefect's git storage (what `from_source` stores) whose pull steps also fetch the data."""
    # Prefect (and the flow) load after main's prefect_settings.configure: Prefect reads its settings then
    from prefect.runner.storage import GitRepository

    class GitWithData(GitRepository):
        def to_pull_step(self) -> list[dict[str, Any]]:  # type: ignore[override]
            return git_pull_steps(source)

    return GitWithData(url=source.url, commit_sha=source.commit)


class GitSourceRefused(Refused):
    """--git names something a worker on another host could not fetch, or a commit it would not find."""


def _git(root: Path, *args: str, timeout_s: float = 60) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise GitSourceRefused(f"--git: git {args[0]} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout.strip()


def resolve_git(remote: str, root: Path = ROOT) -> GitSource:
    """`remote` (a remote's name, e.g. origin, or a URL) and this checkout's commit, as the workers will
    fetch them: a network URL; a clean checkout (the deployment's schedule and parameter schema are
    read from it); a commit the remote has (a ref there points at it or after it)."""
    is_name = "://" not in remote and ":" not in remote and "/" not in remote and not Path(remote).exists()
    url = _git(root, "remote", "get-url", remote) if is_name else remote
    if url.startswith(("/", ".", "file:")) or Path(url).exists():
        raise GitSourceRefused(
            f"--git: {url} is a path on this machine; workers on other hosts clone over the network "
            "(git://, ssh://, https://): name that remote's URL"
        )
    commit = _git(root, "rev-parse", "HEAD")
    if _git(root, "status", "--porcelain", "--untracked-files=no"):
        raise GitSourceRefused(
            f"--git: this checkout has changes that commit {commit[:12]} has not: workers run the commit, "
            "and the deployment's schedule and parameters are read here; commit and push them first"
        )
    heads = [line.split()[0] for line in _git(root, "ls-remote", url, timeout_s=120).splitlines() if line.strip()]
    if commit not in heads and not any(_has_ancestor(root, sha, commit) for sha in heads):
        raise GitSourceRefused(f"--git: commit {commit[:12]} is not on {url}: push it first, workers fetch it there")
    return GitSource(url, commit)


def _has_ancestor(root: Path, head: str, commit: str) -> bool:
    """Whether `commit` is in the history of `head` (a remote ref's commit, if this clone has it)."""
    ask = ["git", "merge-base", "--is-ancestor", commit, head]
    return subprocess.run(ask, cwd=root, capture_output=True, timeout=60).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.deployments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default=PARAMS_FILE, help="params file (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve the deployment (starting a local server if needed)")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="the local server's address (default: %(default)s)")
    serve_cmd.add_argument("--port", type=int, default=4200, help="the local server's port (default: %(default)s)")
    deploy_cmd = commands.add_parser("deploy", help="register the deployment with a work pool")
    deploy_cmd.add_argument("--pool", required=True, help="work pool name (created as type process if missing)")
    deploy_cmd.add_argument("--name", help="deployment name (default: orchestration.deployment)")
    deploy_cmd.add_argument(
        "--git",
        nargs="?",
        const="origin",
        metavar="REMOTE",
        help="workers clone this checkout's commit from this git remote (a name or URL; default: origin) and "
        "pull the data from the DVC remote, instead of running this checkout's path",
    )
    for command in (serve_cmd, deploy_cmd):
        command.add_argument(
            "--allow-override",
            metavar="KEY",
            action="append",
            default=[],
            type=_params_key,
            help="let runs started through the API change this key (or every key of a section), beyond "
            f"{', '.join(sorted(API_OVERRIDABLE))}; repeatable. Keys that reach the network or other "
            f"machines ({', '.join(REMOTE_KEYS)}) and gates (checks, export), promotion and notification "
            "keys are refused without it",
        )
    args = parser.parse_args(argv)
    prefect_settings.configure()  # before Prefect loads
    return exit_code(lambda: _run(args))


def _params_key(text: str) -> str:
    if not is_params_key(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a key or section of params.yaml (e.g. train.lr, checks)")
    return text


def _run(args: argparse.Namespace) -> int:
    cfg = load_params(ROOT / args.params).orchestration
    if os.environ.get("PREFECT_API_URL"):  # a server of the user's: refuse in one line if it will not have us
        prefect_env.check_api()
    if args.command == "deploy":
        git = resolve_git(args.git) if args.git else None
        deployed = deploy(cfg, args.pool, args.name, tuple(args.allow_override), git)
        origin = f" from {git.url} at {git.commit[:12]}" if git else ""
        print(f"deployed {deployed}{origin}; start a worker: prefect worker start --pool {args.pool}")
        return 0
    # inherited by the flow runs this process serves (the Runner applies no job variables)
    os.environ[prefect_env.ALLOW_OVERRIDES_ENV] = ",".join(args.allow_override)
    if os.environ.get("PREFECT_API_URL"):
        serve(cfg)
        return 0
    with local_server(args.host, args.port) as server:
        os.environ["PREFECT_API_URL"] = server.api_url
        os.environ["PREFECT_API_AUTH_STRING"] = server.auth_string  # for this process and its flow runs
        _print_how_to_connect(server)
        serve(cfg)  # returns on Ctrl-C / SIGTERM; the server is stopped after it, never before
    return 0


def _print_how_to_connect(server: LocalServer) -> None:
    """Where the server is and how a client authenticates, without printing the secret."""
    auth = prefect_home() / AUTH_FILE
    where = f"in {auth}" if auth.exists() and auth.read_text().strip() == server.auth_string else "as you set it"
    print(
        f"Prefect server: {server.api_url.removesuffix('/api')}  (stopped with this process)\n"
        f"  it asks for its auth string (user:password), kept {where}; from another shell:\n"
        f'  export PREFECT_API_URL={server.api_url} PREFECT_API_AUTH_STRING="$(cat {auth})"',
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
