"""Several "hosts" on one machine: a bed of Linux namespaces that share nothing but a private network.

    with Bed(["services", "trainer-a", "laptop"]) as bed:
        bed.host("trainer-a").run(["git", "clone", f"git://{bed.host('services').address}/lockstep.git", "."])

Each host is a network namespace with one veth into a bridge that lives in a namespace of its own
(the bed's "switch"), on a /24 that exists only there: no host has a default route, so a packet for
any address but loopback and the bed's own cannot leave it (checked: `routes()`). Every command a
host runs gets a private mount, UTS and IPC namespace set up the same way each time, so the host sees:

- its own disk (`<bed>/<name>/`) as the project path (`ROOT`, where `.venv` scripts' shebangs
  point), `$HOME`, `/tmp`, `/var/tmp` (DVC's site cache) and `/dev/shm`: its own files, caches and
  state, and no other host's (the bed's folder lies under the `/tmp` it covers);
- the checkout's `.venv`, and the interpreter it was made from where that sits under `$HOME`,
  read-only at their own paths: built once, shared, never written (and whatever else `share()`
  names: the portable op's compiled library, tests/support/team.py);
- its own hostname, and an /etc/hosts naming every host of the bed (torchrun and gloo resolve
  hostnames to pick their address).

Processes a host leaves running (servers) live in its network namespace; `close()` ends every one
of them (SIGTERM, SIGKILL after a grace period), then deletes the namespaces (their links go with
them) and the folder. Names carry the bed's PID (`lsbed-<pid>-<host>`), so that a bed whose process
died without closing is found and removed by the next one (`remove_leftovers`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import ROOT

PREFIX = "lsbed"
SUBNET = "10.67.0"  # .1 is left unused; hosts from .2, in the order given. A /24 only the bed's links carry.
VENV = ROOT / ".venv"
HOME = Path("/root") if os.geteuid() == 0 else Path.home()
GRACE_S = 15  # how long a host's processes get to exit on SIGTERM before SIGKILL
PATH = f"{VENV / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BedUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`/`unshare`, or the kernel refuses)."""


class Host:
    def __init__(self, bed: Bed, name: str, address: str) -> None:
        self.bed, self.name, self.address = bed, name, address
        self.netns = f"{bed.prefix}-{name}"
        self.disk = bed.base / name  # what this host sees as its own files (for logs when a test fails)

    @property
    def project(self) -> Path:
        return self.disk / "project"

    def _prefix(self, venv: bool) -> list[str]:
        """`ip netns exec` + `unshare` + the mounts that make this host's view of the filesystem."""
        disk = self.disk
        lines = ["set -e", f"hostname {self.name}", f"mount --bind {disk / 'hosts'} /etc/hosts"]

        def bind(source: Path | str, target: Path | str, read_only: bool = False) -> None:
            lines.append(f"mount --rbind {shlex.quote(str(source))} {shlex.quote(str(target))}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(str(target))}")

        # Read-only shares are mounted inside the host's own folders first, then those folders over
        # the real paths (recursively, carrying the shares): once ROOT or $HOME is covered, the
        # originals can no longer be named.
        for shared in self.bed.shared_under_home:
            inside = disk / "home" / shared.relative_to(HOME)
            if shared.is_dir():
                lines.append(f"mkdir -p {shlex.quote(str(inside))}")
            else:  # a file is mounted over an empty one, in a folder of the host's own
                lines.append(f"mkdir -p {shlex.quote(str(inside.parent))} && touch {shlex.quote(str(inside))}")
            bind(shared, inside, read_only=True)
        if venv:  # not for the `git clone` into the empty project folder, which must find it empty
            lines.append(f"mkdir -p {shlex.quote(str(self.project / '.venv'))}")
            bind(VENV, self.project / ".venv", read_only=True)
        # The folders each host has of its own, over the real paths. The project may lie under one of
        # them (a CI clone in /tmp, a checkout in $HOME): then it is mounted inside that host folder
        # first, and carried over with it, as the shares are.
        own = [(disk / "home", HOME), (disk / "var-tmp", Path("/var/tmp")), (disk / "shm", Path("/dev/shm"))]
        own.append((disk / "tmp", Path("/tmp")))  # last: the bed's folder lies under /tmp, and this hides it
        under = next(((mine, real) for mine, real in own if ROOT.is_relative_to(real)), None)
        project_at = under[0] / ROOT.relative_to(under[1]) if under else ROOT
        lines.append(f"mkdir -p {shlex.quote(str(project_at))}")
        bind(self.project, project_at)
        for mine, real in own:
            bind(mine, real)
        lines.append(f"cd {shlex.quote(str(ROOT))}")
        script = "\n".join(lines) + '\nexec "$@"'
        unshare = ["unshare", "--mount", "--uts", "--ipc", "--propagation", "private"]
        return ["ip", "netns", "exec", self.netns, *unshare, "sh", "-c", script, "sh"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A login's environment, not the test process's (whose PREFECT_HOME, tmp paths... name its own files)."""
        env = {
            "PATH": PATH,
            "HOME": str(HOME),
            "USER": "root" if os.geteuid() == 0 else os.environ.get("USER", ""),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            # as in tests/support/cpu_pin.py: two cores, several processes; waiting passively changes no result
            "OMP_WAIT_POLICY": "PASSIVE",
            "MLFLOW_WORKERS": "1",
            "GIT_TERMINAL_PROMPT": "0",
            # no Prefect server kept after a run on a host (flows/kept_server.py): the bed's outlive no test
            "LOCKSTEP_PREFECT_SERVER_IDLE_S": "0",
        }
        for key in ("PYTHONDONTWRITEBYTECODE", "CI"):
            if key in os.environ:
                env[key] = os.environ[key]
        return {**env, **(extra or {})}

    def run(
        self,
        cmd: list[str] | str,
        *,
        check: bool = True,
        timeout: float = 600,
        env: dict[str, str] | None = None,
        venv: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` on this host (a string runs in `sh -c`), from its project folder; on failure with
        `check`, raise with its output. `timeout` bounds it: a hung command fails the test."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        done = subprocess.run(
            [*self._prefix(venv), *argv],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and done.returncode != 0:
            shown = f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
            raise AssertionError(f"{self.name}: {' '.join(argv)[:300]} exited {done.returncode}\n{shown}")
        return done

    def clone(self, url: str) -> None:
        """`git clone url .` into this host's project folder, as its first user would. The empty
        `.venv` mount point an earlier command of the bed left there is removed first (git clones only
        into an empty folder); the clone ignores `.venv`, and later commands mount it again."""
        self.run(f"rmdir .venv 2>/dev/null || true; git clone -q {shlex.quote(url)} .", venv=False)

    def start(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A long-running process on this host (a server), its output in `log` on the host's disk
        (a path inside the host, under its /tmp). `close()` ends it with the host's other processes."""
        target = self.disk / "tmp" / Path(log).relative_to("/tmp")
        with open(target, "ab") as out:
            return subprocess.Popen(
                [*self._prefix(True), *cmd], env=self.env(env), stdout=out, stderr=subprocess.STDOUT
            )

    def pids(self) -> list[int]:
        return _netns_pids(self.netns)


class Bed:
    """Hosts on a private network, made on entry and removed on exit (also when the block fails)."""

    def __init__(self, names: list[str]) -> None:
        self.prefix = f"{PREFIX}-{os.getpid()}"
        self.switch = f"{self.prefix}-switch"
        self.base = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp"))
        self.hosts = {name: Host(self, name, f"{SUBNET}.{index}") for index, name in enumerate(names, start=2)}
        # The interpreter the venv was made from, if it sits under $HOME (pyenv's): each host gets its
        # own $HOME, so it is mounted into it read-only, at its own path.
        home = Path((VENV / "pyvenv.cfg").read_text().split("home = ", 1)[1].splitlines()[0]).resolve()
        base_prefix = home.parent if home.name == "bin" else home
        self.shared_under_home = [base_prefix] if base_prefix.is_relative_to(HOME) else []
        self.setup_s = 0.0

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def share(self, path: Path) -> None:
        """A file or folder under $HOME that every host sees read-only at its own path, from the next
        command on: something built once on this machine (the portable op's library), never written."""
        if not path.is_relative_to(HOME):
            raise ValueError(f"{path}: only what lies under {HOME} can be shared (each host has its own $HOME)")
        self.shared_under_home.append(path)

    def __enter__(self) -> Bed:
        started = time.monotonic()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        for host in self.hosts.values():
            for folder in ("project", "home", "tmp", "var-tmp", "shm"):
                (host.disk / folder).mkdir(parents=True)
            for folder in ("tmp", "var-tmp", "shm"):
                (host.disk / folder).chmod(0o1777)  # as the real ones: PostgreSQL's user writes there too
            (host.disk / "hosts").write_text(hosts_file)
            _ip("netns", "add", host.netns)
            # both ends made directly in their namespaces: no link of the bed ever appears on the machine's own
            port = f"v-{host.name}"[:15]
            _ip("link", "add", "eth0", "netns", host.netns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def routes(self, name: str) -> list[str]:
        """The host's routing table: only the bed's subnet (no default route, nothing else reachable)."""
        return _ip("-n", self.host(name).netns, "route", "show").splitlines()

    def close(self) -> None:
        """End every process of the bed's hosts, delete its namespaces (their links go with them) and
        its folder. Safe to call twice and on a half-made bed."""
        remove_netns([h.netns for h in self.hosts.values()] + [self.switch])
        shutil.rmtree(self.base, ignore_errors=True)


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise BedUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def existing_netns() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_netns(names: list[str]) -> None:
    """SIGTERM every process in these namespaces, SIGKILL what is left after GRACE_S, then delete them."""
    started = time.monotonic()
    present = set(existing_netns())
    names = [name for name in names if name in present]
    procs = _processes([pid for name in names for pid in _netns_pids(name)])
    called = {proc.pid: _name(proc) for proc in procs}
    ended: dict[str, float] = {}  # the slowest to end on SIGTERM, for the tests' timings
    signalled = time.monotonic()
    for proc in procs:  # all at once: servers stop side by side, and their clients' connections close
        _signal(proc, signal.SIGTERM)

    def gone(proc: psutil.Process) -> None:
        ended[called[proc.pid]] = round(time.monotonic() - signalled, 2)

    _, alive = psutil.wait_procs(procs, timeout=GRACE_S, callback=gone)
    killed = [_name(proc) for proc in alive]
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=GRACE_S)
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
    slowest = dict(sorted(ended.items(), key=lambda item: -item[1])[:5])
    LAST_REMOVAL.update(
        {"processes": len(procs), "killed": killed, "seconds": round(time.monotonic() - started, 3), "netns": names,
         "slowest_to_end_s": slowest}
    )  # fmt: skip


LAST_REMOVAL: dict[str, Any] = {}  # what the last `remove_netns` ended, for the tests' timings and reports


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return str(proc.pid)


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def remove_leftovers() -> list[str]:
    """The namespaces and folders of beds whose process is gone (a crashed or killed test run): removed."""
    pattern = re.compile(rf"^{PREFIX}-(\d+)-")
    stale = [name for name in existing_netns() if (m := pattern.match(name)) and not psutil.pid_exists(int(m[1]))]
    remove_netns(stale)
    for folder in Path("/tmp").glob(f"{PREFIX}-*-*"):
        if (m := pattern.match(folder.name)) and not psutil.pid_exists(int(m[1])):
            shutil.rmtree(folder, ignore_errors=True)
            stale.append(str(folder))
    return stale


def why_unavailable() -> str | None:
    """Why a bed cannot be made here, or None: tried for real (a namespace made and deleted)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "git"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        done = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--mount", "--uts", "--ipc", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            return f"unshare --mount --uts --ipc in a network namespace failed: {done.stderr.strip()}"
    except BedUnavailable as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30)
    return None


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a host's log, for a failing test's message."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({path}: {exc.strerror})"


def as_json_lines(done: subprocess.CompletedProcess[str]) -> Any:
    """The last line of a command's stdout, as JSON (the check scripts print one)."""
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])
