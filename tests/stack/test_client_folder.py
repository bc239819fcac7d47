"""`python -m stack client DIR` (issue 67): what another host needs to use the stack, and nothing more.

The folder it writes is that host's LOCKSTEP_STACK_DIR: `python -m stack join` there makes the stack
the clone's DVC remote and writes the environment file to source. Its use across hosts, with the
servers running, is tests/hosts/test_many_hosts.py; here, with no server, what it holds.
"""

from __future__ import annotations

import json
import shlex
import stat
import subprocess
import sys
from pathlib import Path

from dvc.config import Config

from stack.state import open_stack
from tests.conftest import ROOT, copy_project, run


def _stack_cli(*args: str, stack_dir: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "stack", "--dir", str(stack_dir), *args], cwd, check=False)


def test_the_client_folder_holds_the_client_secrets_only_and_joins_a_clone(tmp_path: Path) -> None:
    stack = open_stack(
        tmp_path / "stack", "127.0.0.2"
    )  # made (ports, secrets), no server started; any address but a wildcard
    made = _stack_cli("client", str(tmp_path / "client"), stack_dir=stack.root)
    assert made.returncode == 0, made.stderr
    client = tmp_path / "client"
    held = sorted(str(path.relative_to(client)) for path in client.rglob("*"))
    assert held == [
        "secrets",
        "secrets/aws-credentials",
        "secrets/mlflow-password",
        "secrets/pg-lock-pass",  # the pipeline lock's login, which reaches only its own database
        "secrets/pg-sweep-pass",  # the sweeps' login: the Optuna database only (stack/logins.py)
        "secrets/prefect-auth",
        "state.json",
    ]
    for path in client.rglob("*"):  # private from the first byte, folders included
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    everything = "".join(path.read_text() for path in client.rglob("*") if path.is_file())
    for server_only in ("pg-password", "mlflow-flask-secret"):  # the database's superuser, the server's session key
        assert stack.secret(server_only) not in everything, server_only

    # on the other host: a clone joins with the client folder alone (the stack's own folder is elsewhere)
    repo = copy_project(tmp_path / "repo")
    joined = _stack_cli("join", str(repo), stack_dir=client, cwd=repo)
    assert joined.returncode == 0, joined.stderr
    section = Config(dvc_dir=str(repo / ".dvc"), validate=False).load_one("local")["remote"]["stack"]
    assert section["endpointurl"] == f"http://127.0.0.2:{stack.ports['s3']}"
    assert section["credentialpath"] == str(client / "secrets" / "aws-credentials")
    env = (client / "env").read_text()
    assert f"MLFLOW_TRACKING_URI=http://127.0.0.2:{stack.ports['mlflow']}\n" in env
    assert f"$(cat {client / 'secrets' / 'mlflow-password'})" in env  # the file's name, not the password
    assert stack.secret("mlflow-password") not in env
    # the sweeps' Optuna storage: the sweep login, its password file by name (the superuser's is not here)
    sweep_pass = client / "secrets" / "pg-sweep-pass"
    assert (
        f"LOCKSTEP_SWEEP_STORAGE='postgresql+psycopg://lockstep_sweep@127.0.0.2:{stack.ports['postgres']}/optuna" in env
    )
    assert f"?passfile={sweep_pass}" in env, env
    assert json.loads((client / "state.json").read_text())["host"] == "127.0.0.2"


def test_a_stack_on_every_interface_has_no_address_to_give_clients(tmp_path: Path) -> None:
    stack = open_stack(tmp_path / "stack", "0.0.0.0")
    refused = _stack_cli("client", str(tmp_path / "client"), stack_dir=stack.root)
    assert refused.returncode != 0
    assert "--host <this host's address>" in refused.stderr, refused.stderr
    assert not (tmp_path / "client").exists()


def test_the_environment_file_runs_nothing_its_paths_hold(tmp_path: Path) -> None:
    """`source .stack/env` runs only the secret files' `$(cat ...)`: a stack folder whose path holds `$(...)`
    or a double quote is a value, not a command (each value is shell-quoted)."""
    root = tmp_path / 'stack $(touch ran) "quoted'
    env_file = open_stack(root, "127.0.0.2").root / "env.sh"
    env_file.write_text(open_stack(root, "127.0.0.2").env_file_text())
    shown = "; ".join(f'echo "${name}"' for name in ("LOCKSTEP_STACK_DIR", "PGPASSFILE", "PREFECT_API_AUTH_STRING"))
    (root / "secrets").mkdir(exist_ok=True)
    (root / "secrets" / "prefect-auth").write_text("lockstep:from-the-file")
    done = subprocess.run(
        ["bash", "-c", f". {shlex.quote(str(env_file))}; {shown}"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(root), str(root / "secrets" / "pgpass"), "lockstep:from-the-file"]
    assert not (tmp_path / "ran").exists()
