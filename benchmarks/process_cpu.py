"""Where a command's CPU goes, process by process: `python -m benchmarks.process_cpu --out FILE -- CMD...`
runs CMD and samples every process on the machine twice a second, then writes the CPU-seconds of
CMD's process tree by role (a stage process, a Prefect server, a DVC command...) and, apart, what the
machine spent outside it (kernel threads, the sandbox's own agents), against the busy seconds of
/proc/stat over the same time.

Why a sampler of our own: the full test tier runs ~1,100 processes, most of them Python, in network
namespaces and under xdist, pytest, DVC, Prefect and torchrun. py-spy profiles one process tree's
stacks, not CPU per process over a whole run, and BSD process accounting (`acct`) names a process by
its 15-character `comm` ("python"), which cannot tell a stage from a server. A process is read from
/proc/PID/stat (utime + stime, its threads included, not its children) at each sample, so one that
lives under half a second is missed: its cost is in the gap between the roles' sum and the busy
seconds. docs/tests.md ("Where the CPU goes") has what it found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.core.atomic import write_text

TICKS = os.sysconf("SC_CLK_TCK")
PERIOD_S = 0.5

# (pattern on the command line, role): the first that matches names a process. Order matters: a
# Prefect server is started by `python -m prefect`, a stage by `python -m tasks`.
ROLES: tuple[tuple[str, str], ...] = (
    (r"exec\(eval\(sys\.stdin", "pytest-xdist worker (in-process tests)"),
    (r"-m pytest|/pytest ", "pytest"),
    (r"prefect server start", "Prefect server"),
    (r"prefect\.engine|prefect\.runner|prefect worker|/bin/prefect ", "Prefect engine, worker or command"),
    (r"mlflow server|mlflow/server|scoring_server|-m mlflow|/bin/mlflow ", "MLflow server or command"),
    (r"qemu-aarch64", "arm64 emulator (qemu)"),
    (r"torch\.distributed\.run|/torchrun ", "torchrun launcher"),
    (r"-m tasks\.train\.launcher", "train launcher (DDP rank)"),
    (r"-m tasks (\w+)", r"stage process: \1"),
    (r"-m tasks\.tools\.(\w+)", r"tool: \1"),
    (r"-m flows\.sweep|distributed\.cli|dask", "sweep (coordinator, Dask)"),
    (r"-m flows\.(\w+)", r"flow: \1"),
    (r"multiprocessing", "multiprocessing child (DataLoader, spawn)"),
    (r"/bin/dvc |^dvc ", "DVC command"),
    (r"-m benchmarks", "benchmarks"),
    (r"-m stack", "team stack command"),
    (r"postgres", "PostgreSQL"),
    (r"/weed ", "SeaweedFS"),
    (r"chrom", "Chromium"),
    (r"python[0-9.]* -c", "python -c scripts (determinism checks...)"),
    (r"python", "other Python"),
)


@dataclass
class Process:
    command: str
    parent: int
    cpu_s: float = 0.0  # since it started, or since the run did for one that was running before
    before_s: float = 0.0  # what it had spent when the run started (0 for one the run saw start)


@dataclass
class Samples:
    processes: dict[tuple[int, int], Process] = field(default_factory=dict)  # (pid, start tick)
    started_tick: int = 0  # the run's start, in /proc/PID/stat's unit (clock ticks since boot)
    busy_s: float = 0.0  # /proc/stat's non-idle time over the run, all cores
    wall_s: float = 0.0


def role(command: str) -> str:
    for pattern, name in ROLES:
        found = re.search(pattern, command)
        if found:
            return found.expand(name)
    return command.split(" ")[0].rsplit("/", 1)[-1] or "kernel thread"


def _busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _sample(samples: Samples) -> None:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            rest = stat[stat.rfind(")") + 2 :].split()
            key, spent = (int(name), int(rest[19])), (int(rest[11]) + int(rest[12])) / TICKS
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            command = command.strip()[:300]
            if key not in samples.processes:
                before = spent if key[1] < samples.started_tick else 0.0
                samples.processes[key] = Process(command, int(rest[1]), before_s=before)
            elif command:  # read again: a process first seen between fork and exec is named by what it became
                samples.processes[key].command = command
            samples.processes[key].cpu_s = spent - samples.processes[key].before_s
        except (OSError, ValueError, IndexError):
            continue  # a process that ended between the listing and the read: its last sample stands


def run_sampled(command: list[str]) -> tuple[int, Samples]:
    """Run `command`, sampling the machine's processes until it ends; its exit code and the samples."""
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    samples, done = Samples(started_tick=int(uptime_s * TICKS)), threading.Event()

    def loop() -> None:
        while not done.is_set():
            _sample(samples)
            done.wait(PERIOD_S)

    started, busy = time.monotonic(), _busy_ticks()
    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    code = subprocess.call(command)
    done.set()
    sampler.join()
    _sample(samples)
    samples.wall_s, samples.busy_s = time.monotonic() - started, (_busy_ticks() - busy) / TICKS
    return code, samples


def summary(samples: Samples, root: int) -> dict:
    """CPU-seconds by role for the process tree below `root` (the sampler: a child is recognised by its
    parent's pid) and, apart, for every other process; with the run's wall and busy seconds."""
    ours_pids = {root}
    for (pid, _), process in sorted(samples.processes.items(), key=lambda item: item[0][1]):  # by start
        if process.parent in ours_pids:
            ours_pids.add(pid)
    ours: dict[str, list[float]] = {}
    others: dict[str, list[float]] = {}
    sampler_s = 0.0
    for (pid, _), process in samples.processes.items():
        if pid == root:
            sampler_s += process.cpu_s
            continue
        table = ours if pid in ours_pids else others
        entry = table.setdefault(role(process.command), [0.0, 0])
        entry[0] += process.cpu_s
        entry[1] += 1

    def ranked(table: dict[str, list[float]]) -> list[dict]:
        rows = sorted(table.items(), key=lambda item: -item[1][0])
        return [{"role": name, "cpu_s": round(cpu, 1), "processes": int(n)} for name, (cpu, n) in rows]

    return {
        "wall_s": round(samples.wall_s, 1),
        "busy_cpu_s": round(samples.busy_s, 1),
        "cores": os.cpu_count(),
        "command_tree_cpu_s": round(sum(cpu for cpu, _ in ours.values()), 1),
        "outside_cpu_s": round(sum(cpu for cpu, _ in others.values()), 1),
        "sampler_cpu_s": round(sampler_s, 1),
        "command_tree": ranked(ours),
        "outside": ranked(others)[:15],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the summary, as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run: give it after --")
    code, samples = run_sampled(command)
    report = summary(samples, os.getpid())
    report["command"], report["exit_code"] = command, code
    write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(f"{report['command_tree_cpu_s']} CPU-s in the command's processes, {report['busy_cpu_s']} busy: {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
