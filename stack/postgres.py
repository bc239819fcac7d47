"""The stack's PostgreSQL server (Debian's), which holds MLflow's, Prefect's and the sweeps' databases
and the pipeline lock's; how it starts and stops, as the stack's other servers do (stack/servers.py).

As root it runs as the `postgres` system user, who owns only its own folder, `pg/`; the stack's folder
is its owner's alone otherwise (`lock_folder`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

from stack import logins
from stack.state import (
    DATABASES,
    LOCK_DATABASE,
    STACK_DIR_ENV,
    START_TIMEOUT_S,
    USER,
    Stack,
    StackError,
    write_secret,
)


class Postgres:
    """Debian's PostgreSQL server. It refuses to run as root: as root, it runs as the `postgres`
    system user that Debian's package creates, and owns only its own folder, `pg/`."""

    name = "postgres"

    def __init__(self, stack: Stack) -> None:
        self.stack, self.dir = stack, stack.root / "pg"
        self.data, self.log = self.dir / "data", self.dir / "postgres.log"

    def running(self) -> bool:
        return self.data.exists() and self._ctl("status", check=False).returncode == 0

    def start(self) -> None:
        if not self.data.exists():
            self._init()
        self._allow_network_logins()  # also on a stack made before its narrow logins
        listen = "*" if self.stack.host in ("0.0.0.0", "::") else self.stack.host
        options = f"-c listen_addresses={listen} -p {self.stack.ports['postgres']} -c unix_socket_directories=''"
        self._ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(self.log), "-o", options)
        self._create_databases()

    def stop(self) -> None:
        if self.running():
            self._ctl("stop", "-w", "-m", "fast")

    def _init(self) -> None:
        owner = _server_user()
        if owner and (blocked := _unreachable(self.stack.root, owner)):
            raise StackError(
                f"postgres: the server runs as user {owner.pw_name} (it refuses root), who cannot enter {blocked}: "
                f"put the stack where it can ({STACK_DIR_ENV}=/srv/lockstep-stack, say), or run as another user"
            )
        self.dir.mkdir(mode=0o700, exist_ok=True)
        password = self.dir / "initdb-password"  # initdb reads it as the server's user; removed at once
        write_secret(password, self.stack.secret("pg-password") + "\n")  # mode 0600 from its first byte
        try:
            for path in (self.dir, password):
                os.chmod(path, 0o700 if path.is_dir() else 0o600)
                if owner:
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                USER,
                "--auth=scram-sha-256",
                f"--pwfile={password}",
                "--no-locale",
                "-E",
                "UTF8",
            )
        finally:
            password.unlink(missing_ok=True)

    def _allow_network_logins(self) -> None:
        """Beyond loopback (`--host 0.0.0.0`, a team's address) the server must also accept password
        logins from the network (stack/logins.py: which login may reach which database). Lines already
        there are kept."""
        if self.stack.host in ("127.0.0.1", "localhost", "::1"):
            return
        hba = self.data / "pg_hba.conf"
        present = hba.read_text().splitlines()
        with open(hba, "a") as out:
            out.writelines(f"{line}\n" for line in logins.hba_lines() if line not in present)

    def _create_databases(self) -> None:
        # optional: psycopg (~0.6 s), only when the stack's database is set up
        import psycopg

        # this stack's password file by name: a PGPASSFILE in the environment may be another stack's
        where = {
            "host": self.stack.client_host,
            "port": self.stack.ports["postgres"],
            "user": USER,
            "passfile": str(self.stack.secrets / "pgpass"),
        }
        with psycopg.connect(dbname="postgres", autocommit=True, **where) as conn:
            present = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
            for database in (*DATABASES, LOCK_DATABASE):
                if database not in present:
                    conn.execute(f'CREATE DATABASE "{database}"')
            logins.make_logins(self.stack, conn)
        logins.give_sweep_tables(lambda dbname: psycopg.connect(dbname=dbname, autocommit=True, **where))

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run("pg_ctl", "-D", str(self.data), *args, check=check)

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        owner = _server_user()
        done = subprocess.run(
            [str(_pg_bin() / tool), *args],
            capture_output=True,
            text=True,
            user=owner.pw_uid if owner else None,
            group=owner.pw_gid if owner else None,
            cwd=self.dir,
            start_new_session=True,  # the server outlives `make stack`
        )
        if check and done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise StackError(f"postgres: {tool} {args[-1] if args else ''} failed: {last[0]} (log: {self.log})")
        return done


def _pg_bin() -> Path:
    """LOCKSTEP_PG_BIN, else the newest /usr/lib/postgresql/<version>/bin (Debian), else the PATH's."""
    if os.environ.get("LOCKSTEP_PG_BIN"):
        return Path(os.environ["LOCKSTEP_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    if which := shutil.which("pg_ctl"):
        return Path(which).parent
    raise StackError(
        "postgres: no PostgreSQL server found (pg_ctl): install Debian's `postgresql` package or set LOCKSTEP_PG_BIN"
    )


def _unreachable(path: Path, user: pwd.struct_passwd) -> Path | None:
    """The first folder on the way to `path` that `user` may not enter (search permission), if any."""
    for folder in reversed([path, *path.parents]):
        if not folder.exists():
            return None
        info = folder.stat()
        bit = (
            stat.S_IXUSR if info.st_uid == user.pw_uid else stat.S_IXGRP if info.st_gid == user.pw_gid else stat.S_IXOTH
        )
        if not info.st_mode & bit:
            return folder
    return None


def lock_folder(root: Path) -> None:
    """The stack's folder: its owner's alone (object data, logs, secrets). As root, PostgreSQL runs as
    the `postgres` user, whose group may pass through it to `pg/` (search, not list)."""
    owner = _server_user()
    try:
        if owner:
            os.chown(root, -1, owner.pw_gid)
        os.chmod(root, 0o710 if owner else 0o700)
    except OSError as error:
        raise StackError(f"{root}: cannot make the stack's folder private ({error.strerror})") from None


def _server_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise StackError("postgres: it refuses to run as root and there is no `postgres` user to run it as") from None
