"""The team stack (stack/, `make stack`), real and on 127.0.0.1: PostgreSQL 15, SeaweedFS's S3
server, an MLflow tracking server on both (with its basic-auth app) and a Prefect server on
PostgreSQL, started once for the module in a folder of its own and stopped by PID at the end.

A team's use of it, then the faults a team meets:

- the pipeline as a Prefect deployment (`serve` + `prefect deployment run`): runs, registry and flow
  runs land in PostgreSQL, artifacts and the DVC remote in S3, no credential anywhere else;
- a fresh clone `dvc pull`s from S3 and reproduces the train run byte for byte;
- the MLflow UI shows the run (headless Chromium, screenshot kept);
- the object store down during an artifact upload; wrong credentials for each service (PostgreSQL
  restarted during a run and the object store down during `dvc push` are the bed's, across hosts:
  tests/hosts/test_faults_hosts.py, as is a sweep's study in PostgreSQL, resumed by running the
  coordinator again: tests/hosts/test_sweep_hosts.py);
- the object store's other ports (master, volume server, filer, gRPC, admin): each refuses a client
  without the stack's credentials, and stays on loopback when the S3 port does not.

The data is an image folder (sklearn's digits as PNG files): a source whose files DVC pushes one by one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from stack.__main__ import down, join, up
from stack.servers import ObjectStore, s3_client
from stack.state import DVC_BUCKET, MLFLOW_BUCKET, Stack, open_stack
from tasks.core.processes import started_as
from tasks.tracking.dashboard import run_page
from tests.conftest import ROOT, commit_all, copy_project, listening, run, service, sha256
from tests.support.chromium import basic_auth_proxy, dom_and_screenshot
from tests.support.digits import write_digits
from tests.support.prefect_client import PrefectAPI, cron_far_from_now, wait_for_deployment

pytestmark = pytest.mark.slow

DEPLOYMENT = "lockstep-pipeline/nightly"
SCREENSHOT = ROOT / "test-artifacts" / "team-stack-train-run.png"


@dataclass
class Team:
    stack: Stack
    repo: Path  # the project; its default DVC remote is the stack's bucket
    env: dict[str, str]  # what `source .stack/env` gives a shell

    def secrets(self) -> list[str]:
        """Every generated credential's value (the object store's JWT keys: those of its last start)."""
        names = ("pg-password", "prefect-auth", "mlflow-password", "mlflow-flask-secret")
        keys = (self.stack.secrets / "aws-credentials").read_text()
        return [self.stack.secret(name) for name in names] + re.findall(r"= (\S+)", keys) + _jwt_keys(self.stack)


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    base = tmp_path_factory.mktemp("team")
    images = base / "digits-folder"
    write_digits(images, range(1797))
    repo = copy_project(
        base / "repo",
        {
            "data": {"source": "imagefolder", "path": str(images), "channels": 1},
            "compress": {"variants": ["static_int8"]},
            "export": {"formats": ["onnx"]},  # nothing here reads the pt2 copy (torch.export: ~2.7 CPU-s)
            "orchestration": {"cron": cron_far_from_now()},  # no nightly run beside the tests' own
        },
    )
    # As root, PostgreSQL runs as the `postgres` user, who must be able to enter the stack's folder:
    # pytest's own temporary folders are private to root.
    shared = Path(tempfile.mkdtemp(prefix="lockstep-team-stack-"))
    shared.chmod(0o711)
    stack = open_stack(shared / "stack")
    try:
        up(stack)
        join(stack, repo)  # what `make stack` does for the project it runs in
        env = stack.client_env()
        with pytest.MonkeyPatch.context() as patch:  # this process's MLflow client reads its login from there
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                patch.setenv(key, env[key])
            yield Team(stack, repo, env)
    finally:
        try:
            down(stack)
        finally:
            shutil.rmtree(shared, ignore_errors=True)


@dataclass(frozen=True)
class FirstRun:
    flow_run_id: str
    train_run: Any  # the train stage's MLflow run
    best_sha256: str  # its best checkpoint


@pytest.fixture(scope="module")
def first_run(team: Team) -> FirstRun:
    """`make schedule` on the stack's Prefect server, one `prefect deployment run`; then, as a team member
    does after a run worth keeping, `dvc push` and a commit of dvc.lock."""
    api = team.env["PREFECT_API_URL"]
    serve = [sys.executable, "-m", "flows.deployments", "serve"]
    log = team.repo.parent / "serve.log"
    with service(serve, team.repo, f"{api}/health", log, **team.env) as proc:
        wait_for_deployment(api, team.stack.secrets / "prefect-auth", DEPLOYMENT, proc, 180)
        done = run(
            ["prefect", "deployment", "run", DEPLOYMENT, "--watch", "--watch-timeout", "600"], team.repo, **team.env
        )
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout).group(1)
    run(["dvc", "push"], team.repo, **team.env)
    commit_all(team.repo, "the nightly run's data and pipeline state")
    best = sha256(team.repo / "artifacts" / "train" / "best.safetensors")
    return FirstRun(flow_run_id, _stage_runs(team, "train")[-1], best)


# --------------------------------------------------------------------------- helpers


def _mlflow(team: Team) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=team.env["MLFLOW_TRACKING_URI"])


def _stage_runs(team: Team, stage: str) -> list[Any]:
    """The stage's MLflow runs on the stack's server, oldest first."""
    client = _mlflow(team)
    experiment = client.get_experiment_by_name("lockstep")
    return client.search_runs(
        [experiment.experiment_id], f"tags.`lockstep.stage` = '{stage}'", order_by=["attributes.start_time ASC"]
    )


def _sql(team: Team, database: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    where = {"host": "127.0.0.1", "port": team.stack.ports["postgres"], "user": "lockstep"}
    with psycopg.connect(dbname=database, passfile=team.env["PGPASSFILE"], **where) as conn:
        return conn.execute(query, args).fetchall()


def _objects(team: Team, bucket: str) -> list[str]:
    pages = s3_client(team.stack).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def _pipeline(team: Team, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "flows.pipeline", *args], team.repo, check=False, **{**team.env, **env})


def _server_processes(stack: Stack) -> list[psutil.Process]:
    """The processes the stack started and recorded by PID (pids/*.json): all but PostgreSQL."""
    processes = []
    for pidfile in sorted(stack.pids.glob("*.json")):
        saved = json.loads(pidfile.read_text())
        proc = psutil.Process(saved["pid"])
        assert started_as(proc, saved["mark"]), pidfile
        processes.append(proc)
    return processes


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert lines[-1].startswith("error: "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[-1]


# --------------------------------------------------------------------------- a team's use


def test_a_deployment_run_keeps_runs_and_flow_runs_in_postgresql_and_files_in_s3(
    team: Team, first_run: FirstRun
) -> None:
    flow_run = PrefectAPI(team.env["PREFECT_API_URL"], team.env["PREFECT_API_AUTH_STRING"])(
        f"/flow_runs/{first_run.flow_run_id}"
    )
    assert flow_run["state"]["type"] == "COMPLETED"
    # each server keeps its records in its PostgreSQL database, not in a file of its own
    assert _sql(team, "prefect", "SELECT state_type FROM flow_run WHERE id = %s", first_run.flow_run_id) == [
        ("COMPLETED",)
    ]
    stages = {row[0] for row in _sql(team, "mlflow", "SELECT value FROM tags WHERE key = 'lockstep.stage'")}
    assert {"download", "stats", "preprocess", "train", "evaluate", "compress", "export"} <= stages
    assert ("champion",) in _sql(team, "mlflow", "SELECT alias FROM registered_model_aliases")
    assert (1, "promoted") in _sql(  # the first run's version, decided (later tests may register more)
        team, "mlflow", "SELECT version, value FROM model_version_tags WHERE key = 'promotion'"
    )
    # artifacts (through the server) and the data (DVC) are objects in S3
    assert any(key.endswith("/model.onnx") for key in _objects(team, MLFLOW_BUCKET))
    data_md5 = yaml.safe_load((team.repo / "data.dvc").read_text())["outs"][0]["md5"]
    assert f"files/md5/{data_md5[:2]}/{data_md5[2:]}" in _objects(team, DVC_BUCKET)  # the snapshot's listing
    # the data and the weights (outputs of other stages hold timings: a later forced run renews them)
    pushed = run(["dvc", "status", "-c", "data.dvc", "train"], team.repo, **team.env).stdout
    assert "Cache and remote 'stack' are in sync" in pushed, pushed
    # every server listens on loopback only
    postmaster = int((team.stack.root / "pg" / "data" / "postmaster.pid").read_text().split()[0])
    processes = [psutil.Process(postmaster), *_server_processes(team.stack)]
    sockets = set().union(*(listening(proc) for proc in processes))
    assert {f"127.0.0.1:{team.stack.ports[name]}" for name in ("postgres", "s3", "mlflow", "prefect")} <= sockets
    assert all(s.startswith("127.0.0.1:") for s in sockets), sockets
    # no credential in the project, its git history, or any MLflow record
    client = _mlflow(team)
    runs = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    records = [str(r.data.params) + str(r.data.tags) for r in runs]
    history = run(["git", "log", "-p", "--all"], team.repo).stdout
    files = [
        p.read_bytes().decode(errors="replace") for p in team.repo.rglob("*") if p.is_file() and ".git/" not in str(p)
    ]
    for secret in team.secrets():
        assert not any(secret in text for text in [*records, history, *files]), "a credential was written"


def test_a_fresh_clone_pulls_from_s3_and_reproduces_the_train_run_byte_for_byte(
    team: Team, first_run: FirstRun, tmp_path: Path
) -> None:
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(team.repo), str(clone)], tmp_path)
    run([sys.executable, "-m", "stack", "join"], clone, **team.env)  # `make stack-join`
    pulled = run(["dvc", "pull"], clone, **team.env)
    assert "fetched" in pulled.stdout or "added" in pulled.stdout, pulled.stdout
    assert "up to date" in run(["dvc", "status", "data.dvc"], clone, **team.env).stdout  # data/ as recorded
    done = run([sys.executable, "-m", "tasks.tools.reproduce", first_run.train_run.info.run_id], clone, **team.env)
    assert "best.safetensors byte-identical" in done.stdout, done.stdout
    assert first_run.best_sha256 in done.stdout


def test_the_mlflow_ui_shows_the_train_run_from_the_team_server(
    team: Team, first_run: FirstRun, tmp_path: Path
) -> None:
    train = first_run.train_run
    server, user, password = (
        team.env[k] for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    )
    with basic_auth_proxy(server, user, password) as url:
        page = f"{url}/{run_page(train.info.experiment_id, train.info.run_id)}"
        dom = dom_and_screenshot(page, tmp_path / "profile", SCREENSHOT)  # kept: test-artifacts/
    assert train.info.run_id in dom and "best_val_accuracy" in dom, dom[-2000:]
    assert f"{train.data.metrics['best_val_accuracy']:.4g}"[:5] in dom


# --------------------------------------------------------------------------- faults


def test_the_object_store_down_during_an_artifact_upload_fails_in_one_line_and_the_retry_logs_it(
    team: Team, first_run: FirstRun
) -> None:
    before = {p: sha256(p) for p in (team.repo / "artifacts" / "evaluate").rglob("*") if p.is_file()}
    store = ObjectStore(team.stack)
    store.stop()
    try:
        # MLflow's client retries a failing request 7 times over minutes by default: not here
        failed = run(
            [sys.executable, "-m", "tasks", "evaluate"],
            team.repo,
            check=False,
            **team.env,
            MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
            MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1",
        )
        line = _error_line(failed)
        assert "MLflow tracking store" in line and "evaluate stage's records" in line and "HTTP 500" in line, line
    finally:
        store.start()
    after = {p: sha256(p) for p in (team.repo / "artifacts" / "evaluate").rglob("*") if p.is_file()}
    assert after == before  # the stage's outputs: all there, unchanged
    run(["dvc", "repro", "--force", "--single-item", "evaluate"], team.repo, **team.env)  # the retry, as DVC runs it
    evaluate = _stage_runs(team, "evaluate")[-1]
    assert evaluate.info.status == "FINISHED"
    assert _mlflow(team).list_artifacts(evaluate.info.run_id), "the retry's artifacts"


@pytest.mark.parametrize("service_name", ["mlflow", "prefect", "postgres", "s3"])
def test_wrong_credentials_are_one_line_naming_the_service_and_no_secret(
    team: Team, first_run: FirstRun, service_name: str, tmp_path: Path
) -> None:
    wrong = "wrong-credential-0123456789"
    if service_name == "mlflow":
        done = _pipeline(team, MLFLOW_TRACKING_PASSWORD=wrong)
        expected = "MLflow tracking server"
    elif service_name == "prefect":
        done = _pipeline(team, PREFECT_API_AUTH_STRING=f"lockstep:{wrong}")
        expected = "Prefect server"
    elif service_name == "postgres":  # the sweep login with a wrong password file
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"*:*:*:lockstep_sweep:{wrong}\n")
        passfile.chmod(0o600)
        storage = team.env["LOCKSTEP_SWEEP_STORAGE"].split("?passfile=")[0] + f"?passfile={passfile}"
        done = run(
            [sys.executable, "-m", "flows.sweep"],
            team.repo,
            check=False,
            **{**team.env, "LOCKSTEP_SWEEP_STORAGE": storage},
        )
        expected = "sweep storage postgresql"
    else:  # a fresh clone whose S3 keys are wrong: reproduce cannot fetch the data
        clone = tmp_path / "clone"
        run(["git", "clone", "-q", str(team.repo), str(clone)], tmp_path)
        keys = tmp_path / "aws-credentials"
        keys.write_text(f"[default]\naws_access_key_id = LSWRONG\naws_secret_access_key = {wrong}\n")
        run(["dvc", "remote", "add", "--local", "-d", "stack", f"s3://{DVC_BUCKET}"], clone)
        for key, value in {"endpointurl": team.stack.url("s3"), "credentialpath": str(keys)}.items():
            run(["dvc", "remote", "modify", "--local", "stack", key, value], clone)
        done = run(
            [sys.executable, "-m", "tasks.tools.reproduce", first_run.train_run.info.run_id],
            clone,
            check=False,
            **team.env,
        )
        expected = "remote 'stack'"
    line = _error_line(done)
    assert expected in line and ("401" in line or "403" in line or "authentication failed" in line), line
    shown = done.stdout + done.stderr
    assert wrong not in shown and not any(secret in shown for secret in team.secrets())


# --------------------------------------------------------------------------- the object store's other ports

PROBE = "lockdown-probe"  # a folder of the MLflow bucket that only these tests use
REFUSED = {0, 401, 403, 404, 405}  # no connection, no credentials, no such API (SeaweedFS's HTTP APIs off)
GRPC_PORTS = ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc", "admin_grpc")
# an HTTP/2 client's first bytes (its preface and an empty SETTINGS frame): a gRPC server answers with SETTINGS
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
FORM = (  # a file upload as a browser sends it
    b'--lockdown\r\nContent-Disposition: form-data; name="file"; filename="posted.txt"\r\n'
    b"Content-Type: text/plain\r\n\r\nplanted\r\n--lockdown--\r\n"
)


def _jwt_keys(stack: Stack) -> list[str]:
    toml = stack.weed_config / "security.toml"
    return re.findall(r'^key = "([^"]+)"', toml.read_text(), re.M) if toml.exists() else []


def _http(method: str, url: str, body: bytes | None = None) -> int:
    """The status an anonymous request gets (0: no connection)."""
    request = urllib.request.Request(url, data=body, method=method)
    if body is FORM:
        request.add_header("Content-Type", "multipart/form-data; boundary=lockdown")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def _speaks_grpc(port: int, tls: bool = True, cert: tuple[Path, Path] | None = None) -> bool:
    """Whether the port answers an HTTP/2 (gRPC) client: in plain text, or over TLS with `cert` or none."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the client is the one checked
    context.set_alpn_protocols(["h2"])
    try:
        if cert:
            context.load_cert_chain(*cert)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw) if tls else raw as conn,
        ):
            conn.sendall(H2_PREFACE)
            frame = conn.recv(9)
    except OSError:  # ssl.SSLError included: the server refused the handshake
        return False
    return len(frame) > 3 and frame[3] == 0x04


def _file_id(stack: Stack, path: str, cwd: Path) -> str:
    """The volume file id of an object, asked of the filer as the stack's owner (`weed shell` with the
    stack's security.toml)."""
    ports = stack.ports
    shell = [
        *(str(Path(sys.executable).parent / "weed"), f"-config_dir={stack.weed_config}", "shell"),
        f"-master=127.0.0.1:{ports['master']}.{ports['master_grpc']}",
        f"-filer=127.0.0.1:{ports['filer']}.{ports['filer_grpc']}",
    ]
    done = subprocess.run(shell, input=f"fs.meta.cat {path}\n", capture_output=True, text=True, timeout=60, cwd=cwd)
    found = re.search(r'"fileId":\s*"([^"]+)"', done.stdout)
    assert found, (done.stdout[-2000:], done.stderr[-2000:])
    return found.group(1)


def _foreign_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate and key of someone else's making (another local user's)."""
    from distributed.security import Security

    made = Security.temporary()
    cert, key = folder / "foreign.pem", folder / "foreign-key.pem"
    cert.write_text(made.tls_client_cert)
    key.write_text(made.tls_client_key)
    return cert, key


def _anonymous_requests(stack: Stack, fid: str) -> dict[str, tuple[str, str, bytes | None]]:
    """What the review did through the non-S3 HTTP ports, and more of the same."""
    filer, master, volume, admin = (
        f"http://127.0.0.1:{stack.ports[name]}" for name in ("filer", "master", "volume", "admin")
    )
    folder, volume_id = f"{filer}/buckets/{MLFLOW_BUCKET}/{PROBE}", fid.split(",")[0]
    return {
        "filer: list the buckets": ("GET", f"{filer}/buckets/", None),
        "filer: read the object": ("GET", f"{folder}/kept.txt", None),
        "filer: PUT a file into the bucket": ("PUT", f"{folder}/put.txt", b"planted"),
        "filer: POST a file into the bucket": ("POST", f"{folder}/", FORM),
        "filer: delete recursively": ("DELETE", f"{folder}/?recursive=true", None),
        "filer: read a chunk through its proxy": ("GET", f"{filer}/?proxyChunkId={fid}", None),
        "master: assign a file id": ("GET", f"{master}/dir/assign", None),
        "master: grow volumes": ("POST", f"{master}/vol/grow?count=1", None),
        "master: look a volume up": ("GET", f"{master}/dir/lookup?volumeId={volume_id}", None),
        "volume server: write a file": (
            "POST",
            f"{volume}/{volume_id},{os.urandom(6).hex()}{os.urandom(4).hex()}",
            b"x",
        ),
        "volume server: read the object": ("GET", f"{volume}/{fid}", None),
        "volume server: delete it": ("DELETE", f"{volume}/{fid}", None),
        "admin: its API": ("GET", f"{admin}/api/cluster/topology", None),
    }


def test_the_object_store_serves_clients_on_its_s3_port_only(team: Team, tmp_path: Path) -> None:
    stack = team.stack
    s3 = s3_client(stack)
    s3.put_object(Bucket=MLFLOW_BUCKET, Key=f"{PROBE}/kept.txt", Body=b"kept")  # the S3 API with the stack's keys
    fid = _file_id(stack, f"/buckets/{MLFLOW_BUCKET}/{PROBE}/kept.txt", tmp_path)
    answered = {}
    for what, (method, url, body) in _anonymous_requests(stack, fid).items():
        if (status := _http(method, url, body)) not in REFUSED:
            answered[what] = status
    assert not answered, "; ".join(f"{what}: HTTP {status}" for what, status in answered.items())
    # gRPC: in plain text, over TLS without a certificate, with another one's: no answer
    foreign = _foreign_cert(tmp_path)
    for name in GRPC_PORTS:
        port = stack.ports[name]
        assert not _speaks_grpc(port, tls=False), f"{name}: plain gRPC answered"
        assert not _speaks_grpc(port), f"{name}: gRPC over TLS without a client certificate answered"
        assert not _speaks_grpc(port, cert=foreign), f"{name}: gRPC with a foreign certificate answered"
    own = (stack.weed_config / "grpc.pem", stack.weed_config / "grpc-key.pem")
    assert _speaks_grpc(stack.ports["filer_grpc"], cert=own)  # the probe hears a server that answers
    # nothing planted, nothing deleted; S3 still reads the object
    assert [key for key in _objects(team, MLFLOW_BUCKET) if key.startswith(f"{PROBE}/")] == [f"{PROBE}/kept.txt"]
    assert s3.get_object(Bucket=MLFLOW_BUCKET, Key=f"{PROBE}/kept.txt")["Body"].read() == b"kept"
    # its keys are in the secrets folder only
    logs = "".join(log.read_text(errors="replace") for log in stack.logs.iterdir())
    assert _jwt_keys(stack) and not any(key in logs for key in _jwt_keys(stack))


def test_the_object_store_keeps_its_other_ports_on_loopback_and_its_files_private(team: Team, tmp_path: Path) -> None:
    # files: the team's stack
    root = team.stack.root
    assert not root.stat().st_mode & 0o067, oct(root.stat().st_mode)  # as root, PostgreSQL's group may pass
    for folder in (root / "s3", team.stack.secrets, team.stack.weed_config):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    data = [
        p for p in (root / "s3").rglob("*") if p.is_file() and (p.suffix in (".dat", ".idx") or "filerldb2" in p.parts)
    ]
    assert data and not [p for p in data if p.stat().st_mode & 0o077]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in team.stack.weed_config.iterdir())
    # SeaweedFS logs into the stack's logs/, not into glog's files in /tmp (named by each process's PID)
    weeds = [proc.pid for proc in _server_processes(team.stack) if proc.name() == "weed"]
    assert weeds and not [p for pid in weeds for p in Path(tempfile.gettempdir()).glob(f"weed.*.{pid}")]
    log = team.stack.logs / "seaweedfs.log"
    assert re.search(r"^I\d{4} \d\d:\d\d:\d\d", log.read_text(), re.MULTILINE)
    # its built-in worker reaches the admin server (at the port it dials: stack/state.py ADMIN_GRPC_OFFSET),
    # about a second after the store answers
    deadline = time.monotonic() + 30
    while "Plugin worker connected" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "Plugin worker connected" in log.read_text(), log.read_text()[-3000:]
    # ports: an object store made with STACK_HOST=0.0.0.0 (its own folder; the rest of its stack not started)
    wide = open_stack(tmp_path / "wide", host="0.0.0.0")
    store = ObjectStore(wide)
    try:
        store.start()
        s3 = s3_client(wide)
        s3.put_object(Bucket=DVC_BUCKET, Key="round-trip", Body=b"trip")
        assert s3.get_object(Bucket=DVC_BUCKET, Key="round-trip")["Body"].read() == b"trip"
        sockets = set().union(*(listening(proc) for proc in _server_processes(wide)))
    finally:
        store.stop()
    inner = {name: port for name, port in wide.ports.items() if name not in ("postgres", "mlflow", "prefect")}
    loopback = {f"127.0.0.1:{inner[name]}" for name in inner if name not in ("s3", "s3_grpc")}
    assert loopback <= sockets, sockets
    elsewhere = sockets - loopback
    assert {int(s.rsplit(":", 1)[1]) for s in elsewhere} == {inner["s3"], inner["s3_grpc"]}, sockets
    assert not any(s.startswith("127.") for s in elsewhere), sockets  # S3 where STACK_HOST says
