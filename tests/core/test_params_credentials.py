"""Issue 35, points 8 and 9: credentials never reach params.yaml. A URL-valued key (`data.mirror`,
`data.url`, `train.pretrained_url`) holding user info or a secret-named query parameter, and a
`sweep.storage` holding a password, are refused at validation: exit 2, one line naming the key and
where credentials go instead, the secret itself masked, nothing written (params.yaml and dvc.lock
are committed; MLflow and Prefect record every param)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.core.cli import one_line
from tasks.core.config.base import ConfigError
from tasks.core.config.yaml_io import load_params, set_params
from tests.conftest import copy_project, run, write_params

SECRET = "s3cr3t-Value-42"
SHA = "0" * 64
URL_KEYS = {  # every URL-valued key, with what it needs beside it to be valid
    "data.mirror": {},
    "data.url": {"data": {"source": "imagefolder", "sha256": SHA}},
    "train.pretrained_url": {"train": {"pretrained_sha256": SHA}},
}
LEAKY = [
    f"https://user:{SECRET}@data.example/x.tgz",
    f"https://{SECRET}@data.example/x.tgz",  # a token as the user name (GitHub, GitLab)
    f"https://user:{SECRET}@data.example",
    f"file://user:{SECRET}@localhost/srv/x.tgz",
    f"https://data.example/x.tgz?access_token={SECRET}",
    f"https://data.example/x.tgz?page=2&Password={SECRET}",
    f"https://bucket.example/x.tgz?X-Amz-Signature={SECRET}",  # a presigned URL: a credential, for a while
    f"https://data.example/x.tgz#token={SECRET}",
]


def _with(key: str, value: str) -> dict:
    section, leaf = key.split(".")
    override = {section: dict(URL_KEYS[key].get(section, {}))}
    override[section][leaf] = value
    for other, values in URL_KEYS[key].items():
        override.setdefault(other, {}).update(values)
    return override


@pytest.mark.parametrize("key", URL_KEYS)
@pytest.mark.parametrize("url", LEAKY)
def test_a_url_key_with_credentials_is_refused_naming_the_key_and_where_they_go(
    tmp_path: Path, key: str, url: str
) -> None:
    path = write_params(tmp_path / "params.yaml", _with(key, url))
    with pytest.raises(ConfigError) as raised:
        load_params(path)
    line = one_line(str(raised.value))  # the error line every entry point prints (and logs)
    assert raised.value.exit_code == 2
    assert f"{key}: credentials in a URL" in line, line
    assert "LOCKSTEP_DATA_TOKEN" in line and "LOCKSTEP_DATA_AUTH" in line and "~/.netrc" in line, line
    assert SECRET not in line, line


@pytest.mark.parametrize("key", URL_KEYS)
@pytest.mark.parametrize(
    "url",
    [
        "https://data.example/x.tgz",
        "https://data.example/team@2024/x.tgz?format=tgz",  # an @ in the path is no user info
        "file:///srv/data/x.tgz",
        "http://127.0.0.1:8000/x.tgz#part",
    ],
)
def test_a_url_key_without_credentials_is_accepted(tmp_path: Path, key: str, url: str) -> None:
    params = load_params(write_params(tmp_path / "params.yaml", _with(key, url)))
    section, leaf = key.split(".")
    assert getattr(getattr(params, section), leaf) == url


def test_an_override_with_credentials_leaves_params_yaml_as_it_was(tmp_path: Path) -> None:
    path = write_params(tmp_path / "params.yaml", {})
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="data.mirror: credentials in a URL"):
        set_params(path, {"data.mirror": f"https://user:{SECRET}@mirror.example/"})
    assert path.read_bytes() == before


def test_a_stage_with_a_credential_in_data_mirror_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    mirror = f"https://user:{SECRET}@mirror.invalid/datasets"  # digits never fetches it: only validation stops it
    repo = copy_project(tmp_path / "repo", {"data": {"mirror": mirror}})
    done = run(["python", "-m", "tasks", "download"], repo, check=False)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "data.mirror: credentials in a URL" in done.stderr and "~/.netrc" in done.stderr, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert not (repo / "data").exists() and not (repo / "dvc.lock").exists()
    assert run(["git", "status", "--porcelain"], repo).stdout == ""


@pytest.mark.parametrize(
    "storage",
    [
        f"postgresql://optuna@db:5432/optuna?password={SECRET}",
        f"postgresql+psycopg://db/optuna?user=optuna&password={SECRET}",
        f"mysql+pymysql://optuna@db/optuna?passwd={SECRET}",
        f"postgresql://db/optuna?sslpassword={SECRET}",
        f"postgresql://optuna:{SECRET}@db:5432/optuna",
        # percent-escaped, as psycopg decodes them (issue 66, point 5)
        f"postgresql://db/optuna?pass%77ord={SECRET}",
        f"postgresql://db/optuna?%70%61%73%73%77%6f%72%64={SECRET}",
        f"postgresql://db/optuna?PASS%57ORD={SECRET}",
        f"postgresql://db/optuna?pass%2577ord={SECRET}",
        f"postgresql://optuna%3A{SECRET}@db/optuna",  # `user:password` with its colon escaped
    ],
)
def test_a_sweep_storage_with_a_password_anywhere_is_refused(tmp_path: Path, storage: str) -> None:
    path = write_params(tmp_path / "params.yaml", {"sweep": {"storage": storage}})
    with pytest.raises(ConfigError) as raised:
        load_params(path)
    line = one_line(str(raised.value))
    assert "sweep.storage: a password in a URL" in line and "LOCKSTEP_SWEEP_STORAGE" in line, line
    assert SECRET not in line, line


@pytest.mark.parametrize(
    "storage",
    [
        "postgresql://optuna@db:5432/optuna",  # the password from ~/.pgpass
        "postgresql://optuna@db/optuna?sslmode=verify-full&sslkey=/home/me/.pg/key.pem&passfile=/home/me/.pgpass",
        "sqlite:///artifacts/sweep/optuna.db",
    ],
)
def test_a_sweep_storage_without_a_password_is_accepted(tmp_path: Path, storage: str) -> None:
    assert load_params(write_params(tmp_path / "params.yaml", {"sweep": {"storage": storage}})).sweep.storage == storage


# Issue 66, point 5: a name spelled with percent-escapes is the name the server reads (`pass%77ord` is
# psycopg's `password`, `%74oken` the web server's `token`), and some hosts put the secret in the path.
TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"  # a GitHub token's shape
ENCODED = [
    f"https://data.example/x.tgz?%74oken={SECRET}",
    f"https://data.example/x.tgz?page=2&pass%77ord={SECRET}",
    f"https://data.example/x.tgz?%2574oken={SECRET}",  # encoded twice: decoded until stable
    f"https://data.example/x.tgz?X-Amz-Si%67nature={SECRET}",
    f"https://data.example/x.tgz#%61ccess_token={SECRET}",
]
IN_PATH = [
    f"https://hooks.slack.com/services/T0000/B0000/{SECRET}",
    f"https://discord.com/api/webhooks/123456/{SECRET}",
    f"https://api.telegram.org/bot123456:{SECRET}/getFile",
    f"https://hooks.slack.com/%73ervices/T0000/B0000/{SECRET}",  # the path's escapes decoded first
    f"https://HOOKS.SLACK.COM/services/T0000/B0000/{SECRET}",
    f"https://raw.example/{TOKEN}/x.tgz",
]


@pytest.mark.parametrize("key", URL_KEYS)
@pytest.mark.parametrize("url", ENCODED + IN_PATH)
def test_a_url_key_with_an_encoded_or_path_credential_is_refused(tmp_path: Path, key: str, url: str) -> None:
    path = write_params(tmp_path / "params.yaml", _with(key, url))
    with pytest.raises(ConfigError) as raised:
        load_params(path)
    line = one_line(str(raised.value))
    assert raised.value.exit_code == 2
    assert f"{key}: credentials in a URL" in line, line
    assert SECRET not in line and TOKEN not in line, line


@pytest.mark.parametrize(
    "url",
    [
        "https://data.example/x%20y.tgz?name=a%20b&format=tgz",  # escapes that name nothing secret
        "https://hooks.slack.com/",  # the host alone holds nothing
        "https://discord.com/api/guilds/123",
    ],
)
def test_a_url_with_harmless_escapes_is_accepted(tmp_path: Path, url: str) -> None:
    assert load_params(write_params(tmp_path / "params.yaml", _with("data.mirror", url))).data.mirror == url
