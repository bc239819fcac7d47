"""Issue 18, in-process: one redaction for every line that leaves a process, params that cannot blow
up, and overrides from the API that cannot point the pipeline at another machine. (The servers'
auth, CSRF and CORS: test_served_deployment.py and reliability/test_server_binds.py; downloads and datasets:
test_security_data.py and test_security_credentials.py; reproduce: test_reproduce_security.py.)"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core.cli import exit_code
from tasks.core.config.base import ConfigError
from tasks.core.config.policy import refuse_remote_overrides
from tasks.core.config.yaml_io import load_params, load_yaml
from tasks.core.errors import ExpectedFailure
from tasks.core.redact import MASK, install, redact, redact_tree
from tests.conftest import ROOT

SECRET = "s3cr3t-Value-42"


@pytest.mark.parametrize(
    "leaky",
    [
        f"https://user:{SECRET}@data.example/x.tgz",
        # a password holding ' or @ (legal, and urlsplit reads up to the last @): all of it masked
        f"postgresql://mlflow:'{SECRET}@db.internal:5432/mlflow",
        f"MLFLOW_TRACKING_URI=http://alice:Pa@{SECRET}@127.0.0.1:9/ is unreachable",
        f"https://data.example/x.tgz?auth={SECRET}&page=2",
        f"https://data.example/x.tgz?jwt={SECRET}",
        f"https://app.example/callback#access_token={SECRET}&state=1",
        f"https://data.example/api/token/{SECRET}/x.tgz",
        f"https://api.telegram.org/bot123456:{SECRET}/sendMessage",
        "https://hooks.example/services/T0000/B0000/XxYyZz0123456789AbCdEf",  # a token as a path segment
        f"requests.get(url, headers={{'Authorization': 'Bearer {SECRET}'}})",
        f"Authorization: Basic {SECRET}",
    ],
)
def test_redaction_masks_credentials_wherever_they_sit(leaky: str) -> None:
    masked = redact(leaky)
    assert MASK in masked and SECRET not in masked and "XxYyZz0123456789AbCdEf" not in masked, masked


def test_redaction_keeps_digests_run_ids_and_plain_text_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, sha = "0123456789abcdef0123456789abcdef", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    text = f"mlflow-artifacts:/1/{run_id}/artifacts https://h.example/{sha}.tar.gz Token validation; Basic settings"
    assert redact(text) == text
    monkeypatch.setenv("GRAFANA_AUTH", SECRET)  # an env var named *_AUTH is a secret
    assert redact(f"sent {SECRET}") == f"sent {MASK}"


def test_params_tree_masks_secret_keys_and_urls() -> None:
    tree = {"data": {"mirror": f"https://u:{SECRET}@m.example/d", "retries": 4}, "api_key": SECRET, "seed": 42}
    assert redact_tree(tree) == {
        "data": {"mirror": "https://***@m.example/d", "retries": 4},
        "api_key": MASK,
        "seed": 42,
    }


def test_every_log_record_and_traceback_is_redacted() -> None:
    install()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("prefect.flow_runs.test-redaction")  # any library's logger, Prefect's too
    logger.addHandler(handler)
    try:
        logger.warning("fetching %s", f"https://u:{SECRET}@data.example/x.tgz")
        try:
            raise ConnectionError(f"cannot reach https://data.example/x?token={SECRET}")
        except ConnectionError:
            logger.exception("download failed")
    finally:
        logger.removeHandler(handler)
    assert SECRET not in out.getvalue() and "https://***@data.example/x.tgz" in out.getvalue(), out.getvalue()
    assert "ConnectionError: cannot reach https://data.example/x?token=***" in out.getvalue()


def test_an_error_line_is_one_line_and_masked(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise ExpectedFailure(f"https://u:{SECRET}@h.example/a\nforged: line")

    assert exit_code(body) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and SECRET not in err and "forged: line" in err, err

    def controls() -> int:  # what else ends a line (str.splitlines, a terminal) or rewrites one: escaped
        raise ExpectedFailure("HTTP 404 Not Found\x0berror: checksum OK\x1b[2K\x85forged\x1c line\u2028\u202e")

    assert exit_code(controls) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err, err
    assert err == "error: HTTP 404 Not Found\\x0berror: checksum OK\\x1b[2K\\x85forged\\x1c line\\u2028\\u202e\n", err


def test_yaml_aliases_are_refused_at_once(tmp_path: Path) -> None:
    # nine levels of nine aliases: a billion values if expanded
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    params = tmp_path / "params.yaml"
    params.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"params.yaml: line 2: YAML aliases \(\*a0\) are not accepted"):
        load_params(params)
    assert time.monotonic() - started < 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed: " + "9" * 4400, "line 1: a number of 4400 digits"),
        ("determinism:\n  num_threads: 99999999999", "determinism.num_threads: Input should be less than or equal"),
        ("data:\n  timeout_s: 1e300", "data.timeout_s: Input should be less than or equal"),
        ("train:\n  epochs: 1000000", "train.epochs: Input should be less than or equal to 10000"),
        ("train:\n  nproc_per_node: 100000", "train.nproc_per_node: Input should be less than or equal"),
        ("train:\n  device: cuda:99999999999", "train.device: String should match pattern"),
    ],
)
def test_numbers_out_of_bounds_are_config_errors(tmp_path: Path, text: str, message: str) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_params(params)


def test_exponent_floats_are_numbers() -> None:
    assert load_yaml("a: 1.5e3\nb: 1e-3\nc: .5E2\nd: 12\ne: 1_000") == {
        "a": 1500.0,
        "b": 0.001,
        "c": 50.0,
        "d": 12,
        "e": 1000,
    }


def test_a_params_file_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="bytes; a params file is at most 1048576"):
        load_params(params)


def test_a_huge_seed_is_exit_2_not_a_traceback(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("seed: " + "4" * 4400 + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "tasks", "train", "--params", str(params)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "a number of 4400 digits" in done.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        {"train.rdzv_endpoint": "attacker.example:29500"},
        {"train.nnodes": 2},
        {"data.url": "https://attacker.example/x.tgz", "data.sha256": "0" * 64},
        {"data.mirror": "https://attacker.example"},
        {"data": {"source": "imagefolder", "path": "/"}},  # a whole section
    ],
)
def test_overrides_that_reach_the_network_are_refused_from_the_api(overrides: dict) -> None:
    with pytest.raises(ConfigError, match="reach the network or other machines"):
        refuse_remote_overrides(overrides, frozenset())


def test_an_operator_can_allow_a_remote_override() -> None:
    refuse_remote_overrides({"data.mirror": "https://mirror.internal", "train.lr": 0.1}, {"data.mirror"})
    with pytest.raises(ConfigError, match="data.url"):
        refuse_remote_overrides({"data.url": "https://x.example/a.tgz"}, {"data.mirror"})


def test_the_flow_refuses_a_params_file_outside_the_project() -> None:
    from flows.run_params import inside_project

    assert inside_project("params.yaml") == "params.yaml"
    for outside in ("../params.yaml", "/etc/passwd", "tests/../../x.yaml"):
        with pytest.raises(ConfigError, match="is outside the project"):
            inside_project(outside)


@pytest.mark.parametrize(
    "leaky",
    [
        f"https://data.example/x.tgz?%74oken={SECRET}",
        f"postgresql://db/optuna?pass%77ord={SECRET}",
        f"https://data.example/x.tgz?%2574oken={SECRET}&page=2",
        f"fetching ?pass%77ord={SECRET} failed",  # a query string outside a full URL
        f"https://data.example/api/%74oken/{SECRET}/x.tgz",
        f"https://hooks.slack.com/services/T0000/B0000/{SECRET}",
        "https://hooks.slack.com/services/T0000/B0000/abcdefghijklmnopqrstuvwx",  # one case: not random-looking
        "https://discord.com/api/webhooks/123456/abcdefghijklmnopqrstuvwxyz-abcdefghijkl",
        "https://api.telegram.org/bot123456:abcdefghijklmnop/sendMessage",
        f"https://hooks.slack.com/%73ervices/T0000/B0000/{SECRET}",
        "see https://raw.example/ghp_a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6q7r8/x.tgz",
    ],
)
def test_redaction_decodes_percent_escapes_and_masks_secrets_where_known_hosts_put_them(leaky: str) -> None:
    """Issue 66, point 5: the log masking reads names as the server does, and paths as known hosts use them."""
    masked = redact(leaky)
    for secret in (SECRET, "abcdefghijklmnopqrstuvwx", "abcdefghijklmnop", "a1b2c3d4e5f6g7h8i9j0"):
        assert secret not in masked, masked
    assert MASK in masked, masked
