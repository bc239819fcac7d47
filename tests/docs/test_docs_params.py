"""The params keys, environment variables and packages README.md and docs/ name are the code's."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Iterator
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from tasks.core.config.params import Params
from tests.support.doc_pages import (
    FILE_SUFFIX,
    ROOT,
    SHIPPED_DIRS,
    Snippet,
    all_snippets,
    code_text,
    commands,
    page_lines,
)

# Environment variables that no code of the project names, read by the program the page talks about.
SECTIONS = tuple(Params.model_fields)
READ_ELSEWHERE = {
    "PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES": "Prefect's runner.auto_install_dependencies, advised off",
    "NCCL_NVLS_ENABLE": "read by NCCL: the page says to set it for bitwise GPU runs",
}


# --- params keys -------------------------------------------------------------------------------


def params_key_exists(key: str) -> bool:
    if key.startswith("sweep.space."):  # its keys are train's keys (`sweep.space.train.lr`)
        return params_key_exists(key.removeprefix("sweep.space."))
    model: Any = Params
    for part in key.split("."):
        fields = getattr(model, "model_fields", None)
        if part == "*" or fields is None:
            return True  # any key (`determinism.*`), or a free-form mapping's
        names = fnmatch.filter(fields, part)  # `train.pretrained_*`
        if not names:
            return False
        annotation = fields[names[0]].annotation
        candidates = [annotation, *get_args(annotation)]
        models = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        mappings = [a for a in candidates if a is dict or getattr(a, "__origin__", None) is dict]
        model = models[0] if models else (dict if mappings else None)
        if model is None:
            return part == key.split(".")[-1]
    return True


def _named_in_code(key: str) -> bool:
    """A dotted name the code writes (an MLflow tag such as `checks.verdict`, a gates.json key): quoted."""
    code = code_text(SHIPPED_DIRS)
    prefix, _, leaf = key.rpartition(".")
    built = re.search(rf"f[\"']{re.escape(prefix)}\.\{{", code) and re.search(rf"[\"']{re.escape(leaf)}[\"']", code)
    return bool(re.search(rf"[\"'`]{re.escape(key)}[\"'`]", code) or built)  # or f"determinism.{k}" with k "torch"


def params_items() -> Iterator[tuple[str, str]]:
    pattern = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_*][\w*]*)+)(?![\w/(-])")
    for snippet in all_snippets():
        if snippet.lang in {"yaml", "yml"}:
            yield from _yaml_keys(snippet)
            continue
        for offset, command in commands(snippet):
            for m in pattern.finditer(command):
                key = m.group(1)
                if FILE_SUFFIX.search(key) or (ROOT / key).exists():
                    continue
                yield snippet.where(offset + m.start()), key
    yield from _params_page_keys()


def _yaml_keys(snippet: Snippet) -> Iterator[tuple[str, str]]:
    try:
        tree = yaml.safe_load(snippet.text)
    except yaml.YAMLError:
        return
    if not isinstance(tree, dict) or not set(tree) <= set(SECTIONS):
        return

    def walk(node: Any, prefix: str) -> Iterator[str]:
        yield prefix
        if isinstance(node, dict) and not prefix.startswith("sweep.space"):
            for key, value in node.items():
                yield from walk(value, f"{prefix}.{key}")

    for section, value in tree.items():
        for key in walk(value, section):
            line = next((i for i, text in enumerate(snippet.text.split("\n")) if key.split(".")[-1] + ":" in text), 0)
            yield f"{snippet.page.relative_to(ROOT)}:{snippet.line + line}", key


def _params_page_keys() -> Iterator[tuple[str, str]]:
    """docs/params.md's tables: `key` in the first column, under the heading of its section."""
    page = ROOT / "docs" / "params.md"
    section, header = "", ""
    for i, line in enumerate(page_lines(page)):
        heading = re.match(r"^#{2,3} (.*)", line)
        if heading:
            named = re.fullmatch(r"`([\w.]+)`", heading.group(1).strip())
            section = named.group(1) if named else (section if line.startswith("###") else "")
        elif line.startswith("| ") and not line.startswith(("| `", "| --")):
            header = line.split("|")[1].strip()
        elif section and header == "key" and line.startswith("| `"):
            for key in re.findall(r"`([\w.]+)`", line.split("|")[1]):
                yield f"docs/params.md:{i + 1}", f"{section}.{key}"


def test_every_params_key_exists() -> None:
    stale = [
        f"{where}: {key}: not a key of params.yaml (nor a name the code writes)"
        for where, key in params_items()
        if not params_key_exists(key) and not _named_in_code(key)
    ]
    assert not stale, "\n".join(stale)


def test_params_page_describes_every_key() -> None:
    named = {key for _, key in _params_page_keys()}

    def keys(model: Any, prefix: str) -> Iterator[str]:
        for name, field in getattr(model, "model_fields", {}).items():
            nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
            yield from keys(field.annotation, f"{prefix}.{name}") if nested else [f"{prefix}.{name}"]

    missing = [key for section in SECTIONS for key in keys(Params.model_fields[section].annotation, section)]
    missing = [key for key in missing if key not in named]
    assert not missing, f"docs/params.md has no row for: {missing}"


# --- environment variables ---------------------------------------------------------------------


def test_every_environment_variable_is_read_by_the_code() -> None:
    code = set(re.findall(r"\w+", code_text()))
    stale = []
    for snippet in all_snippets():
        for m in re.finditer(r"(?<![\w$.-])([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)(?![\w.(-])", snippet.text):
            name = m.group(1)
            if name not in READ_ELSEWHERE and name not in code:
                stale.append(f"{snippet.where(m.start())}: {name}: no code names it")
    assert not stale, "\n".join(sorted(set(stale)))


def test_no_page_asks_to_install_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = [*project["project"]["dependencies"], *sum(project.get("dependency-groups", {}).values(), [])]
    names = {re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in declared}
    stale = [
        f"{snippet.where(m.start())}: uv add {m.group(1)}: pyproject.toml declares it already"
        for snippet in all_snippets()
        for m in re.finditer(r"\b(?:uv add|pip install)\s+([\w.-]+)", snippet.text)
        if m.group(1).lower().replace("_", "-") in names
    ]
    assert not stale, "\n".join(stale)


# --- paths -------------------------------------------------------------------------------------
