"""Bad params.yaml: exit code 2, a one-line message naming the key, never a traceback, nothing written.

Property-based (hypothesis): the faults are drawn from the pydantic models themselves (every key of
every section, its type and its bounds), so a new key is covered without touching this file. Each
example runs the entry points' `main()` in this process (`python -m tasks`, and `python -m
flows.pipeline`, which `make run` runs); tests/core/test_config.py runs both as real processes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import string
import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import flows.pipeline
import tasks.__main__
import tasks.runner
from tasks.core.config.params import Params
from tasks.core.config.yaml_io import load_params
from tests.conftest import ROOT

BASE = yaml.safe_load((ROOT / "params.yaml").read_text())
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    out = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_leaves(annotation, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


LEAVES = _leaves(Params)
SECTIONS = [
    name
    for name, field in Params.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
]


def _kinds(annotation: Any) -> tuple[set[type], set[Any], bool]:
    """(python types accepted, literal values accepted, None accepted) for a field's annotation."""
    types, literals, optional = set(), set(), False
    for arg in (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, type(int | None))
        else (annotation,)
    ):
        if arg is type(None):
            optional = True
        elif typing.get_origin(arg) is typing.Literal:
            literals |= set(typing.get_args(arg))
        elif typing.get_origin(arg) is tuple:
            types.add(list)
        else:
            types.add(arg)
    return types, literals, optional


def _accepts_type(field: FieldInfo, key: str, value: Any) -> bool:
    types, literals, optional = _kinds(field.annotation)
    if value is None:
        return optional
    if any(type(value) is type(v) and value == v for v in literals):
        return True
    if literals and not types:  # a pure Literal; else (`int | "auto"`) the value may be of the other branch
        return False
    types = {typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t for t in types}
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int):
        return int in types or float in types or key == "data.image_size"  # one int: a square
    if isinstance(value, float):
        return float in types
    return any(isinstance(value, t) for t in types if t is not bool)


YAML_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.text(string.ascii_letters + string.digits + " .:-", max_size=12),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.integers()),
)


def _out_of_range(field: FieldInfo) -> list[Any]:
    """Values of the right type that break a bound or a pattern of `field`."""
    types, literals, _ = _kinds(field.annotation)
    bad: list[Any] = []
    step = 1 if int in types and float not in types else 1e-3
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Gt):
            bad += [rule.gt, rule.gt - step]
        elif isinstance(rule, annotated_types.Ge):
            bad.append(rule.ge - step)
        elif isinstance(rule, annotated_types.Lt):
            bad += [rule.lt, rule.lt + step]
        elif isinstance(rule, annotated_types.Le):
            bad.append(rule.le + step)
        elif isinstance(rule, annotated_types.MinLen):
            bad.append("")
        elif getattr(rule, "pattern", None):
            bad += [text for text in ("", " ", "x y", "::") if not re.fullmatch(rule.pattern, text)]
    if literals:
        bad += ["not-an-option", *(f"{v}x" for v in literals if isinstance(v, str))]
    if float in types:
        bad += [float("inf"), float("nan")]
    return bad


def _set(doc: dict, key: str, value: Any) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return doc


@st.composite
def bad_documents(draw: st.DrawFn) -> tuple[str, str | None]:
    """(params.yaml text, the key its message must name, or None for a YAML syntax error)."""
    fault = draw(st.sampled_from(["unknown key", "wrong type", "out of range", "malformed YAML"]))
    if fault == "unknown key":
        section = draw(st.sampled_from([None, *SECTIONS]))
        name = draw(st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True))
        known = Params.model_fields if section is None else Params.model_fields[section].annotation.model_fields
        assume(name not in known)
        key = name if section is None else f"{section}.{name}"
        return yaml.safe_dump(_set(BASE, key, draw(YAML_VALUES))), key
    key = draw(st.sampled_from(sorted(LEAVES)))
    if fault == "wrong type":
        value = draw(YAML_VALUES.filter(lambda v: not _accepts_type(LEAVES[key], key, v)))
        return yaml.safe_dump(_set(BASE, key, value)), key
    if fault == "out of range":
        choices = _out_of_range(LEAVES[key])
        assume(choices)
        return yaml.safe_dump(_set(BASE, key, draw(st.sampled_from(choices)))), key
    lines = (ROOT / "params.yaml").read_text().splitlines()
    at = draw(st.integers(0, len(lines) - 1))
    broken = draw(st.sampled_from(["key: [1, 2", "key: {a: 1", "\tkey: 1", "  - : :", 'key: "open', "key: *nowhere"]))
    text = "\n".join([*lines[:at], broken, *lines[at:]]) + "\n"
    try:
        yaml.safe_load(text)
    except yaml.YAMLError:
        return text, None
    assume(False)
    raise AssertionError("unreachable")


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in sorted(folder.rglob("*"))}


def _never_run(*args: Any) -> None:
    raise AssertionError("params passed validation: the pipeline would have run on the repository")


def _run_main(entry: str, params: Path, workdir: Path) -> tuple[int, str]:
    """`main()` run from `workdir`, its MLflow store there too: the stages write relative to the
    working directory and MLflow at the project root, where other xdist workers' tests write too."""
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.chdir(workdir)
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
        # tripwires, should validation let bad params through: never run anything on the repository
        patch.setattr(flows.pipeline, "_run_with_local_api", _never_run)
        patch.setattr(tasks.runner, "run_stage", _never_run)
        if entry == "tasks":
            code = tasks.__main__.main(["train", "--params", str(params)])
        else:
            code = flows.pipeline.main(["--params", str(params)])
    return code, err.getvalue()


@pytest.mark.parametrize("entry", ["tasks", "flows.pipeline"])
@SETTINGS
@given(case=bad_documents())
def test_bad_params_exit_2_with_one_line_naming_the_key(
    entry: str, case: tuple[str, str | None], tmp_path: Path
) -> None:
    text, key = case
    params = tmp_path / "params.yaml"
    params.write_text(text)
    workdir = tmp_path / "project"
    workdir.mkdir(exist_ok=True)
    before = _snapshot(tmp_path)
    code, err = _run_main(entry, params, workdir)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {params}: "), err  # one line, naming the file
    assert "Traceback" not in err
    if key is None:
        assert re.search(r"not valid YAML at line|line \d+: YAML aliases", err), err
    else:
        assert re.search(rf"\b{re.escape(key)}\b", err), (key, err)
    assert _snapshot(tmp_path) == before  # nothing written, beside params.yaml or in the project
    assert not any(workdir.iterdir())
    assert params.read_text() == text


def test_every_number_has_an_upper_bound() -> None:
    """A hostile or mistyped number (a run record on a shared server, `epochs: 10**12`) is refused
    by validation, never reaches torch as an OverflowError or a week of training."""
    unbounded = [
        key
        for key, field in LEAVES.items()
        if _kinds(field.annotation)[0] & {int, float}
        and not any(isinstance(rule, (annotated_types.Lt, annotated_types.Le)) for rule in field.metadata)
    ]
    assert not unbounded, f"numbers without an upper bound: {unbounded}"


@SETTINGS
@given(key=st.sampled_from(sorted(LEAVES)), data=st.data())
def test_in_range_values_of_the_right_type_are_accepted(key: str, data: st.DataObject, tmp_path: Path) -> None:
    """The strictness does not refuse good input: numbers inside their bounds validate."""
    types, _, _ = _kinds(LEAVES[key].annotation)
    assume(types & {int, float} and not types & {list, str})
    bounds = {
        type(rule).__name__: getattr(rule, type(rule).__name__.lower())
        for rule in LEAVES[key].metadata
        if isinstance(rule, (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le))
    }
    low = bounds.get("Ge", bounds.get("Gt", -1000))
    high = bounds.get("Le", bounds.get("Lt", 1000))
    if float in types:
        value = data.draw(st.floats(low, high, exclude_min="Gt" in bounds, exclude_max="Lt" in bounds))
    else:
        value = data.draw(st.integers(low + ("Gt" in bounds), min(high, 10**6) - ("Lt" in bounds)))
    doc = _set(BASE, key, value)
    if key.startswith("split."):  # the three fractions must still sum to 1
        assume(0 < value < 1)
        other = "test" if key != "split.test" else "val"
        doc = _set(doc, f"split.{other}", 0.0)
        # the fractions alone: split also holds `published` (a bool, which sum() would count as 1) and `assign`
        third = next(k for k in ("train", "val", "test") if k not in (key.split(".")[1], other))
        rest = 1 - value - doc["split"][third]
        assume(0 < rest < 1)
        doc = _set(doc, f"split.{other}", rest)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert getattr(load_params(path), key.split(".")[0]) is not None


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  lr: 0.1\n  epochs: 3\n  lr: 0.2\n")
    code, err = _run_main("tasks", params, tmp_path)  # run from the file's folder: named as typed there
    assert code == 2 and err == "error: params.yaml: lr: given twice (lines 2 and 4); keep one\n"


@pytest.mark.parametrize("entry", ["tasks", "flows.pipeline"])
def test_deep_nesting_is_refused_naming_the_line(entry: str, tmp_path: Path) -> None:
    """814 bytes of nested lists ran PyYAML's recursive composer out of stack: a RecursionError, its
    traceback 3,000 lines. The loader refuses nesting past MAX_YAML_DEPTH; params.yaml nests 6."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  lr: " + "[" * 400 + "]" * 400 + "\n")
    code, err = _run_main(entry, params, tmp_path)
    assert (
        code == 2
        and err == "error: params.yaml: line 2: nested more than 32 levels deep; params.yaml needs far fewer\n"
    )


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        (b"seed: 1\n\xff\xfe", "not UTF-8 text"),
        (None, "cannot be read: Is a directory"),
        (b"- a\n- b\n", "expected a mapping of sections, got list"),
        (b"train: 5\n", "train: Input should be a valid dictionary"),
        (b"train:\n  epochs: true\n", "train.epochs: Input should be a valid integer or 'auto' (got True)"),
        (b"train:\n  lr: .inf\n", "train.lr: Input should be a finite number"),
        (b"1: x\nnull: y\n", "1: Keys should be strings (got 1); None: Keys should be strings (got None)"),
    ],
)
def test_unreadable_and_odd_files(tmp_path: Path, content: bytes | None, shown: str) -> None:
    params = tmp_path / "params.yaml"
    params.mkdir() if content is None else params.write_bytes(content)
    code, err = _run_main("tasks", params, tmp_path)
    assert code == 2 and err.count("\n") == 1 and shown in err, err


def test_floats_without_a_dot_are_floats(tmp_path: Path) -> None:
    """`lr: 1e-3` (YAML 1.2; ruamel writes floats so) is 0.001, not the string PyYAML's 1.1 rules make it."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(BASE).replace("lr: auto", "lr: 1e-3"))
    assert load_params(params).train.lr == 0.001
