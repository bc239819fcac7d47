"""The stack's narrow PostgreSQL logins: what a host that is not the stack's own may log in as.

The superuser's password (`pg-password`, `pgpass`) stays on the stack's host: the servers use it.
A host that runs pipelines or sweeps gets a login that reaches one database and nothing else:

- `lockstep_lock` (the pipeline lock, tasks/core/lock.py): connects to `pipeline_lock`, where it
  takes an advisory lock; it reads no table.
- `lockstep_sweep` (a sweep's Optuna study, flows/sweep.py): owns the `optuna` database, where
  Optuna makes and writes its tables. Only the sweep's coordinator uses it: trials run on the workers
  get their parameters with the task and never touch the study.

Each login's password is a libpq password file in the stack's secrets (made with the stack; added
to an older stack on `up`), named by its URL's `passfile=`: the URL holds a path, no secret.
"""

from __future__ import annotations

from typing import Any

from stack.state import (
    DATABASES,
    LOCK_DATABASE,
    LOCK_PASSFILE,
    LOCK_USER,
    SWEEP_DATABASE,
    SWEEP_PASSFILE,
    SWEEP_USER,
    USER,
    Stack,
    ensure_login_passwords,
)

# (login, its one database, its password file)
LOGINS = ((LOCK_USER, LOCK_DATABASE, LOCK_PASSFILE), (SWEEP_USER, SWEEP_DATABASE, SWEEP_PASSFILE))


def password(stack: Stack, passfile: str) -> str:
    return (stack.secrets / passfile).read_text().strip().rsplit(":", 1)[1]


def hba_lines() -> list[str]:
    """pg_hba.conf lines for logins from the network: the stack's user anywhere, each narrow login to
    its own database only."""
    return [f"host all {USER} all scram-sha-256"] + [
        f"host {database} {user} all scram-sha-256" for user, database, _ in LOGINS
    ]


def make_logins(stack: Stack, conn: Any) -> None:
    """Create (or reset the password of) each narrow login, as the superuser on `conn` (autocommit):
    no database is open to PUBLIC, each login may connect to its own. PostgreSQL lets every role
    connect to every database unless told otherwise."""
    # optional: psycopg (~0.6 s), only when the stack's database is set up
    from psycopg import sql

    ensure_login_passwords(stack)
    for user, _, passfile in LOGINS:
        secret = sql.Literal(password(stack, passfile))
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone()
        verb = "ALTER" if exists else "CREATE"
        conn.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(user), secret))
    for database in ("postgres", "template1", *DATABASES, LOCK_DATABASE):
        conn.execute(sql.SQL("REVOKE CONNECT ON DATABASE {} FROM PUBLIC").format(sql.Identifier(database)))
    for user, database, _ in LOGINS:
        grant = "GRANT CONNECT ON DATABASE {} TO {}"
        conn.execute(sql.SQL(grant).format(sql.Identifier(database), sql.Identifier(user)))
    # The sweep login owns its database (PostgreSQL 15: the owner may create tables in its `public`
    # schema) and the tables a stack made before it had left to the superuser.
    owner = sql.Identifier(SWEEP_USER)
    conn.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(SWEEP_DATABASE), owner))


def give_sweep_tables(connect: Any) -> None:
    """The tables in the sweep database not yet the sweep login's (made by the superuser on a stack older
    than the login): handed to it, their sequences with them. `connect(dbname)`: a superuser connection."""
    # optional: psycopg (~0.6 s), only when the stack's database is set up
    from psycopg import sql

    with connect(SWEEP_DATABASE) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tableowner <> %s", (SWEEP_USER,)
        ).fetchall()
        for (table,) in rows:
            conn.execute(
                sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.Identifier(table), sql.Identifier(SWEEP_USER))
            )
