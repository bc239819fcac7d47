"""What the network costs (issue 67, point 7): the pipeline on a trainer of the bed, its servers on
another host, against the same pipeline on the servers' own host, same data, same commit.

    python -m tests.hosts.bench [--repeats 2] [--json benchmarks/results/many-hosts.json]   # = make bench-hosts

Root only (network and mount namespaces, tests/support/hosts.py); not collected by pytest and in no test
tier. The team is tests/support/team.py's, with its tiny project (2 epochs, one quantized variant).
`services` plays the one-host team: it runs `python -m flows.pipeline --force` from its own clone with
the stack's env (MLflow, Prefect, S3 and PostgreSQL on its own address, no link crossed); trainer-a runs
the same command from its clone, every request crossing the bed's veth links and bridge. The two run
in turns (services, trainer-a, services, ...), each `--force` so that every stage runs; the row is the
median of each and their ratio. The machine's CPU is shared by every host of the bed: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support.hosts import Bed, remove_leftovers, why_unavailable
from tests.support.team import CLIENT_DIR, HOSTS, join, make_team, push_data

ONE_HOST_ENV = ". .stack/env; "  # on `services`: the env file `python -m stack up` wrote in its clone


def measure(repeats: int) -> dict[str, object]:
    remove_leftovers()
    with Bed(HOSTS) as bed, tempfile.TemporaryDirectory(prefix="lockstep-bench-hosts-") as workdir:
        team = make_team(bed, Path(workdir))
        push_data(team)
        join(team, ["trainer-a"])
        services, trainer = bed.host("services"), bed.host("trainer-a")
        where = {"services": (services, ONE_HOST_ENV), "trainer-a": (trainer, team.client_env())}
        for host, env in where.values():
            host.run(env + "dvc pull data.dvc")
        seconds: dict[str, list[float]] = {name: [] for name in where}
        for _ in range(repeats):
            for name, (host, env) in where.items():
                started = time.monotonic()
                host.run(env + "python -m flows.pipeline --force", timeout=1800)
                seconds[name].append(round(time.monotonic() - started, 2))
    one_host, two_hosts = statistics.median(seconds["services"]), statistics.median(seconds["trainer-a"])
    return {
        "what": "python -m flows.pipeline --force, the team stack's servers on services; tiny project "
        "(tests/support/team.py PROJECT), digits",
        "one_host_s": seconds["services"],
        "across_hosts_s": seconds["trainer-a"],
        "one_host_median_s": one_host,
        "across_hosts_median_s": two_hosts,
        "ratio": round(two_hosts / one_host, 3),
        "client_dir": CLIENT_DIR,
        "setup_s": team.timings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hosts.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per host, in turns (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the row here")
    args = parser.parse_args(argv)
    why = why_unavailable()
    if why:
        print(f"error: the bed cannot be made here: {why}", file=sys.stderr)
        return 2
    row = measure(args.repeats)
    print(
        f"pipeline, one host {row['one_host_median_s']} s, across hosts {row['across_hosts_median_s']} s "
        f"(ratio {row['ratio']}; runs {row['one_host_s']} vs {row['across_hosts_s']})"
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
