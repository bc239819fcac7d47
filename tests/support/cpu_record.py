"""Each test's CPU-seconds, its test process's own and those of the processes it started and reaped:
a pytest plugin, and the table of what it wrote.

    make test-all ARGS="-p tests.support.cpu_record"      # writes test-artifacts/test-cpu-<worker>.json
    python -m tests.support.cpu_record [FOLDER] [--top N]  # CPU-seconds by module, then the costliest tests

`benchmarks.process_cpu` tells which kinds of process the tier's CPU goes to; this tells which tests spend
it. A child's CPU counts once the test process has waited for it (`getrusage(RUSAGE_CHILDREN)`): a server a
fixture stops by PID counts for the test during whose teardown it stopped (a module's last; a session
fixture's, the run's last), and a process that detaches (a DVC queue's workers, the stack's servers,
PostgreSQL) does not count at all. Each row's wall seconds cover its setup, call and teardown.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.core.atomic import write_text

FOLDER = Path(__file__).resolve().parents[2] / "test-artifacts"
_rows: list[tuple[str, float, float, float]] = []  # (test, wall s, own CPU s, reaped children's CPU s)


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    (own, children), started = _cpu(), time.monotonic()
    yield
    own_after, children_after = _cpu()
    wall = time.monotonic() - started
    _rows.append((item.nodeid, round(wall, 2), round(own_after - own, 2), round(children_after - children, 2)))


def _folder(config: pytest.Config) -> Path:
    return config.rootpath / FOLDER.name  # the run's test-artifacts/ (the project's: FOLDER)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, before any worker writes: no earlier run's files
        for stale in _folder(config).glob("test-cpu-*.json"):  # (a run on more workers left one more)
            stale.unlink()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _rows:
        folder = _folder(session.config)
        folder.mkdir(exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        write_text(folder / f"test-cpu-{worker}.json", json.dumps(_rows) + "\n")


def table(folder: Path, top: int) -> str:
    rows = [tuple(row) for path in sorted(folder.glob("test-cpu-*.json")) for row in json.loads(path.read_text())]
    if not rows:
        raise SystemExit(f"{folder}: no test-cpu-*.json (run the tests with -p tests.support.cpu_record)")
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for test, wall, own, children in rows:
        total = modules[test.split("::")[0]]
        total[0], total[1], total[2] = total[0] + own + children, total[1] + wall, total[2] + 1
    spent, in_children = sum(row[2] + row[3] for row in rows), sum(row[3] for row in rows)
    lines = [f"{len(rows)} tests: {spent:.0f} CPU-s ({in_children:.0f} in children)"]
    lines += ["", "| CPU-s | wall s | tests | module |", "| --: | --: | --: | --- |"]
    ranked = sorted(modules.items(), key=lambda item: -item[1][0])[:top]
    lines += [f"| {cpu:.0f} | {wall:.0f} | {count:.0f} | `{module}` |" for module, (cpu, wall, count) in ranked]
    lines += ["", "| CPU-s | wall s | test |", "| --: | --: | --- |"]
    costly = sorted(rows, key=lambda row: -(row[2] + row[3]))[:top]
    lines += [f"| {own + children:.0f} | {wall:.0f} | `{test}` |" for test, wall, own, children in costly]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.cpu_record", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=FOLDER, help="where the run wrote its files")
    parser.add_argument("--top", type=int, default=25, help="rows of each table (default 25)")
    args = parser.parse_args()
    print(table(args.folder, args.top))


if __name__ == "__main__":
    main()
