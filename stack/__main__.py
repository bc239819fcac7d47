"""python -m stack up | down | status | env | join | client DIR | restart NAME  (see stack/__init__.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows import prefect_env, prefect_settings
from stack import postgres, servers
from stack.state import (
    DVC_BUCKET,
    DVC_REMOTE,
    FLOW_HEARTBEAT_S,
    LOCK_PASSFILE,
    REGION,
    STACK_DIR_ENV,
    SWEEP_PASSFILE,
    Stack,
    StackError,
    open_stack,
    stack_dir,
    write_secret,
)
from tasks.core.cli import exit_code
from tasks.core.layout import ROOT


def up(stack: Stack) -> list[str]:
    """Start every server that is not running, in dependency order; the names started."""
    postgres.lock_folder(stack.root)  # a stack made before its folder was private gets it now
    started = []
    for server in (kind(stack) for kind in servers.SERVERS):
        if not server.running():
            server.start()
            started.append(server.name)
    _write_env_file(stack)
    # Prefect's zombie detection (flows/prefect_env.py): the server's half; the heartbeats are the
    # client environment's (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, stack/state.py)
    prefect_env.ensure_zombie_automation(f"{stack.url('prefect')}/api", stack.secret("prefect-auth"), FLOW_HEARTBEAT_S)
    return started


def down(stack: Stack) -> None:
    for server in (kind(stack) for kind in reversed(servers.SERVERS)):
        server.stop()


def join(stack: Stack, project: Path) -> None:
    """Make the stack's bucket `project`'s default DVC remote, in .dvc/config.local (not committed):
    its address and the path of the credentials file, no key."""
    # heavy: dvc (~0.7 s), only for `join`; the stack's other commands stay fast
    from dvc.config import Config

    config = Config(dvc_dir=str(project / ".dvc"), validate=False)
    with config.edit("local") as conf:
        conf.setdefault("remote", {})[DVC_REMOTE] = {
            "url": f"s3://{DVC_BUCKET}",
            "endpointurl": stack.url("s3"),
            "credentialpath": str(stack.secrets / "aws-credentials"),
            "region": REGION,
        }
        conf.setdefault("core", {})["remote"] = DVC_REMOTE
    _write_env_file(stack)  # on another host, the client folder (`client`) has none until it joins


# What a host other than the stack's own needs to use it: where it answers, the S3 keys (DVC's
# credentialpath), the MLflow login and the Prefect auth string. Not the PostgreSQL password (the
# database's superuser: only the servers need it), nor the servers' own keys. The narrow logins
# (stack/logins.py) reach one database each: the pipeline lock's (LOCK_PASSFILE) may take the lock
# shared by every host that runs pipelines, the sweeps' (SWEEP_PASSFILE) may read and write the
# Optuna studies, nothing else.
CLIENT_SECRETS = ("aws-credentials", "mlflow-password", "prefect-auth", LOCK_PASSFILE, SWEEP_PASSFILE)


def client(stack: Stack, dest: Path) -> None:
    """A folder to copy to a team member's or a worker's host (scp, a secrets manager): its
    LOCKSTEP_STACK_DIR there, for `python -m stack join` and `source $LOCKSTEP_STACK_DIR/env`."""
    if stack.host in ("0.0.0.0", "::"):
        raise StackError(
            f"the stack binds {stack.host}, which tells no other host where to connect: make it with "
            "`--host <this host's address>` for clients on other hosts"
        )
    (dest / "secrets").mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in (dest, dest / "secrets"):
        folder.chmod(0o700)
    write_secret(dest / "state.json", (stack.root / "state.json").read_text())  # no secret; private all the same
    for name in CLIENT_SECRETS:
        write_secret(dest / "secrets" / name, (stack.secrets / name).read_text())


def _write_env_file(stack: Stack) -> None:
    write_secret(stack.env_file, stack.env_file_text())


def _status(stack: Stack) -> str:
    rows = []
    for server in (kind(stack) for kind in servers.SERVERS):
        where = f"port {stack.ports[server.name]}"
        rows.append(f"{server.name:9} {'running' if server.running() else 'stopped':8} {where}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__)
    parser.add_argument("--dir", type=Path, help="the stack's folder (default: $LOCKSTEP_STACK_DIR or .stack)")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the servers (made on first use) and print the client environment")
    start.add_argument("--host", help="address the servers bind to (default 127.0.0.1; set on first use)")
    commands.add_parser("down", help="stop the servers; their data stays")
    commands.add_parser("status", help="which servers run, on which ports")
    commands.add_parser("env", help="print the environment file's path and contents")
    joining = commands.add_parser("join", help="make the stack the DVC remote of a project (.dvc/config.local)")
    joining.add_argument("project", nargs="?", type=Path, default=Path.cwd())
    bundle = commands.add_parser("client", help="write what another host needs to use the stack (copy it there)")
    bundle.add_argument("dest", type=Path, help="a new folder: that host's LOCKSTEP_STACK_DIR")
    restart = commands.add_parser("restart", help="stop and start one server")
    restart.add_argument("name", choices=[kind.name for kind in servers.SERVERS])
    args = parser.parse_args(argv)
    prefect_settings.configure()  # for `up`'s Prefect client (the zombie automation) and the servers it starts
    return exit_code(lambda: _run(args), context="stack: ")


def _run(args: argparse.Namespace) -> int:
    root = (args.dir or stack_dir()).resolve()
    if args.command != "up" and not (root / "state.json").exists():
        print(f"no stack in {root} (start one with `make stack`)", file=sys.stderr)
        return 1
    stack = open_stack(root, getattr(args, "host", None))
    if args.command == "up":
        started = up(stack)
        join(stack, ROOT)
        print(_status(stack))
        print(f"started: {', '.join(started) or 'none (all were running)'}")
        print(f"DVC remote '{DVC_REMOTE}' (default) set in {ROOT / '.dvc' / 'config.local'}")
        print(f"\n{stack.env_file_text()}\nsource {stack.env_file}")
    elif args.command == "down":
        down(stack)
        print(_status(stack))
    elif args.command == "status":
        print(_status(stack))
    elif args.command == "env":
        print(f"# {stack.env_file}\n{stack.env_file_text()}", end="")
    elif args.command == "join":
        join(stack, args.project.resolve())
        print(f"{args.project}: DVC remote '{DVC_REMOTE}' = s3://{DVC_BUCKET} at {stack.url('s3')} (default)")
        print(f"source {stack.env_file}")
    elif args.command == "client":
        client(stack, args.dest.resolve())
        print(f"{args.dest}: copy it to the other host, then there, in the project's clone:")
        print(f"  export {STACK_DIR_ENV}=<where it landed>; python -m stack join; source ${STACK_DIR_ENV}/env")
    else:
        kind = next(kind for kind in servers.SERVERS if kind.name == args.name)
        kind(stack).stop()
        kind(stack).start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
