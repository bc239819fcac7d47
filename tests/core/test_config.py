"""params.yaml is validated once: bad input is named, exits 2, and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.core.config.base import ConfigError
from tasks.core.config.params import STAGE_PARAMS, Params
from tasks.core.config.ship import COMPRESSION_VARIANTS, CompressConfig
from tasks.core.config.yaml_io import load_params
from tests.conftest import ROOT, run, write_params


def test_repository_params_are_valid_and_complete() -> None:
    params = load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    # every knob is spelled out in params.yaml, none left to hidden defaults
    assert set(raw) == set(Params.model_fields)
    for section, value in raw.items():
        if isinstance(value, dict):
            assert set(value) == set(type(getattr(params, section)).model_fields), section
    # and a file that leaves keys out gets what params.yaml says (docs/params.md's defaults), `auto`s included
    assert Params.model_validate({}) == params
    cifar = Params.model_validate({"data": {"source": "cifar10"}}).train
    assert (cifar.model, cifar.epochs, cifar.hflip, cifar.label_smoothing) == ("resnet9", 12, True, 0.1)


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ({"train": {"lrr": 0.1}}, "train.lrr", "Extra inputs are not permitted"),
        ({"bogus_section": 1}, "bogus_section", "Extra inputs are not permitted"),
        ({"train": {"lr": 0}}, "train.lr", "greater than 0"),
        ({"train": {"lr": -1}}, "train.lr", "greater than 0"),
        ({"train": {"epochs": "ten"}}, "train.epochs", "valid integer"),
        ({"train": {"optimizer": "adam"}}, "train.optimizer", "'sgd' or 'adamw'"),
        ({"train": {"device": "gpu"}}, "train.device", "should match pattern"),
        ({"split": {"train": 0.8, "val": 0.15, "test": 0.15}}, "split", "must sum to 1, got 1.1"),
        ({"split": {"val": 0}}, "split.val", "greater than 0"),
        ({"seed": -3}, "seed", "greater than or equal to 0"),
        ({"data": {"source": "imagenet"}}, "data.source", "'digits', 'mnist', 'fashion_mnist'"),
        ({"data": {"source": "mnist", "image_size": 32}}, "data", "image_size: only for source 'imagefolder'"),
        ({"data": {"source": "imagefolder"}}, "data", "needs exactly one of path (local) or url"),
        ({"data": {"source": "imagefolder", "url": "https://x.org/a.zip"}}, "data", "url needs sha256"),
        ({"data": {"source": "imagefolder", "path": "p", "sha256": "abc"}}, "data.sha256", "should match pattern"),
        ({"data": {"source": "imagefolder", "path": "p", "image_size": [0, 8]}}, "data.image_size", "positive"),
        ({"data": {"source": "imagefolder", "path": "p", "channels": 2}}, "data.channels", "1 or 3"),
        ({"data": {"mirror": "ftp://old.host/"}}, "data.mirror", "should match pattern"),
        ({"compress": {"variants": ["pruned_l1", "pruned_l1"]}}, "compress.variants", "lists a variant twice"),
        ({"compress": {"variants": ["fp16"]}}, "compress.variants.0", "'dynamic_int8', 'static_int8'"),
        ({"compress": {"variants": "everything"}}, "compress.variants", "'auto' or 'all' (got everything)"),
        ({"compress": {"variants": None}}, "compress.variants", "'auto' or 'all' (got None)"),
        ({"compress": {"latency_runs": 5}}, "compress.latency_runs", "greater than or equal to 20"),
        ({"compress": {"prune_amount": 1.0}}, "compress.prune_amount", "less than 1"),
        (
            {"export": {"candidates": ["qat_int8", "fp32"]}, "compress": {"variants": ["static_int8"]}},
            "export.candidates",
            "'qat_int8' is not built: add it to compress.variants (now ['static_int8'])",
        ),
        ({"export": {"candidates": ["fp32", "static_int8"]}}, "export.candidates", "fp32 must come last"),
        ({"export": {"candidates": []}}, "export.candidates", "at least 1 item"),
        ({"export": {"formats": ["pt2"]}}, "export.formats", "must include onnx"),
        ({"export": {"formats": ["onnx", "onnx"]}}, "export.formats", "lists an entry twice"),
        ({"export": {"variant": "static_int8"}}, "export", "variant and fallback were replaced by candidates"),
        ({"export": {"min_top1_agreement": 1.5}}, "export.min_top1_agreement", "less than or equal to 1"),
        ({"orchestration": {"cron": "every night"}}, "orchestration.cron", "should match pattern"),
        ({"orchestration": {"timezone": "Mars/Olympus"}}, "orchestration.timezone", "not an IANA time zone"),
        ({"orchestration": {"deployment": "night ly"}}, "orchestration.deployment", "should match pattern"),
        ({"orchestration": {"lock_wait_s": -1}}, "orchestration.lock_wait_s", "greater than or equal to 0"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(tmp_path: Path, override, key: str, fragment: str) -> None:
    path = write_params(tmp_path / "params.yaml", override)
    with pytest.raises(ConfigError) as caught:
        load_params(path)
    message = str(caught.value)
    assert f"{path}: {key}: " in message
    assert fragment in message


def test_a_list_of_variants_fails_on_the_item_alone(tmp_path: Path) -> None:
    # a list is what the key was given, so "should be 'auto' or 'all'" would only mislead
    path = write_params(tmp_path / "params.yaml", {"compress": {"variants": ["static_int8", "fp16"]}})
    with pytest.raises(ConfigError) as caught:
        load_params(path)
    assert str(caught.value) == (
        f"{path}: compress.variants.1: Input should be 'dynamic_int8', 'static_int8', 'qat_int8', 'pruned_l1' "
        "or 'pruned_ln' (got fp16)"
    )


@pytest.mark.parametrize(
    ("variants", "candidates", "built"),
    [
        ("auto", ["static_int8", "fp32"], ("static_int8",)),  # the defaults: one variant, not five
        ("auto", ["qat_int8", "static_int8", "fp32"], ("qat_int8", "static_int8")),
        ("auto", ["fp32"], ()),  # fp32 is the reference, always built
        ("all", ["static_int8", "fp32"], COMPRESSION_VARIANTS.names()),
        (["pruned_ln", "static_int8"], ["static_int8", "fp32"], ("pruned_ln", "static_int8")),
    ],
)
def test_compress_variants_resolve_once(tmp_path: Path, variants, candidates: list[str], built: tuple) -> None:
    override = {"compress": {"variants": variants}, "export": {"candidates": candidates}}
    params = load_params(write_params(tmp_path / "params.yaml", override))
    assert params.compress.variants == built
    logged = params.sections("compress")  # the compress stage's MLflow params (and DVC's, by name)
    assert logged["compress.variants"] == built and logged["export.candidates"] == tuple(candidates)
    # the model card's params, and a run rebuilt from them (tasks/tools/reproduce), hold the list
    assert Params.model_validate(params.model_dump(mode="json")).compress.variants == built


def test_repository_default_builds_only_what_can_ship() -> None:
    assert yaml.safe_load((ROOT / "params.yaml").read_text())["compress"]["variants"] == "auto"
    params = load_params(ROOT / "params.yaml")
    assert params.compress.variants == tuple(c for c in params.export.candidates if c != "fp32")


def test_compress_config_alone_resolves_all_but_not_auto() -> None:
    assert CompressConfig(variants="all").variants == COMPRESSION_VARIANTS.names()
    assert CompressConfig().variants == "auto"  # Params resolves it: it needs export.candidates
    assert CompressConfig().for_candidates(("pruned_l1", "fp32")).variants == ("pruned_l1",)
    assert CompressConfig(variants=("qat_int8",)).for_candidates(("static_int8", "fp32")).variants == ("qat_int8",)


def test_a_candidate_not_built_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    override = {"compress": {"variants": ["pruned_l1"]}, "export": {"candidates": ["static_int8", "fp32"]}}
    with pytest.raises(ConfigError) as caught:
        load_params(write_params(tmp_path / "params.yaml", override))
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith(
        "export.candidates: 'static_int8' is not built: add it to compress.variants (now ['pruned_l1']), "
        "set that to auto, or drop it from export.candidates"
    )


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "missing.yaml")
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_params(bad)


def test_every_stage_reads_known_sections() -> None:
    for stage, sections in STAGE_PARAMS.items():
        assert {s.split(".")[0] for s in sections} <= set(Params.model_fields), stage  # a section, or one key of one
        assert Params.model_validate({}).sections(stage), stage


@pytest.mark.parametrize("entry", [["-m", "tasks", "download"], ["-m", "flows.pipeline"]])
def test_entry_points_exit_2_and_write_nothing(tmp_path: Path, entry: list[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    write_params(repo / "params.yaml", {"train": {"lr": -0.5}})
    before = sorted(p.name for p in repo.iterdir())
    done = run(["python", *entry, "--params", str(repo / "params.yaml")], cwd=repo, check=False, PYTHONPATH=str(ROOT))
    assert done.returncode == 2, done.stderr
    # the file as the user at that prompt knows it, not its absolute path
    assert "error: params.yaml: train.lr: Input should be greater than 0 or 'auto' (got -0.5)" in done.stderr, (
        done.stderr
    )
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in repo.iterdir()) == before
