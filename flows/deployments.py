"""The pipeline as a service: a Prefect deployment with the retraining schedule from params.yaml.

    python -m flows.deployments serve            # `make schedule`: a Prefect server on 127.0.0.1:4200
                                                 # (unless PREFECT_API_URL names one) + the deployment
    python -m flows.deployments deploy --pool P  # for a work pool instead: workers run the flow

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

Prefect's own deployment concurrency limit is deliberately not used: with Prefect 3.8.8's default
in-memory lease storage, a limited deployment's runs were cancelled on start ("Deployment
concurrency slot lost during provisioning") on a local server with no other run in sight.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flows import prefect_env
from tasks.core.cli import exit_code
from tasks.core.config.params import is_params_key
from tasks.core.config.policy import API_OVERRIDABLE, REMOTE_KEYS
from tasks.core.config.service import OrchestrationConfig
from tasks.core.config.yaml_io import PARAMS_FILE, load_params
from tasks.core.errors import Refused
from tasks.core.layout import ROOT


def deployment_options(cfg: OrchestrationConfig) -> dict[str, Any]:
    """What the served and the work-pool deployment share."""
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
def local_server(host: str, port: int) -> Iterator[prefect_env.LocalServer]:
    """`prefect server start` on host:port for the block, answering; stopped on exit."""
    server = prefect_env.LocalServer(host, port, die_with_parent=True)  # also if serve is SIGKILLed
    try:
        server.wait()
        yield server
    finally:
        server.stop()


def serve(cfg: OrchestrationConfig) -> None:
    """Serve the deployment from this process until interrupted (runs execute in subprocesses)."""
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


def deploy(cfg: OrchestrationConfig, pool: str, name: str | None = None, allow: tuple[str, ...] = ()) -> str:
    """Register the deployment with a work pool (created as a locked `process` pool if missing); its
    workers run the flow from this checkout. `allow` (--allow-override) is stored in the deployment's
    own record, where the flow reads it. Returns the deployment's full name."""
    from prefect.client.orchestration import get_client

    from flows.pipeline import FLOW_NAME, pipeline

    with get_client(sync_client=True) as client:
        _ensure_locked_pool(client, pool)
    name = name or cfg.deployment
    # From this checkout's path: a process worker on this machine (or one with the same path
    # mounted) changes into it and imports the flow from there.
    source = pipeline.from_source(source=str(ROOT), entrypoint="flows/pipeline.py:pipeline")
    source.deploy(
        name=name,
        work_pool_name=pool,
        build=False,
        push=False,
        print_next_steps=False,
        job_variables={prefect_env.DEPLOYMENT_ALLOW_VARIABLE: ",".join(allow)},
        **deployment_options(cfg),
    )
    return f"{FLOW_NAME}/{name}"


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
        deployed = deploy(cfg, args.pool, args.name, tuple(args.allow_override))
        print(f"deployed {deployed}; start a worker: prefect worker start --pool {args.pool}")
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


def _print_how_to_connect(server: prefect_env.LocalServer) -> None:
    """Where the server is and how a client authenticates, without printing the secret."""
    auth = prefect_env.prefect_home() / prefect_env.AUTH_FILE
    where = f"in {auth}" if auth.exists() and auth.read_text().strip() == server.auth_string else "as you set it"
    print(
        f"Prefect server: {server.api_url.removesuffix('/api')}  (stopped with this process)\n"
        f"  it asks for its auth string (user:password), kept {where}; from another shell:\n"
        f'  export PREFECT_API_URL={server.api_url} PREFECT_API_AUTH_STRING="$(cat {auth})"',
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
