"""params.yaml read (hardened YAML, validated into `Params`) and written (overrides, comments kept)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tasks.core.atomic import write_text
from tasks.core.config.base import ConfigError, shown
from tasks.core.config.params import Params

PARAMS_FILE = "params.yaml"
MAX_PARAMS_BYTES = 1 << 20
# Lists and mappings nested deeper than this are refused: params.yaml nests 6 levels at most (the
# document, sweep, space, a key, its choices, one choice), dvc.lock (also read by `load_yaml`) 8.
# PyYAML composes recursively: 814 bytes of `[[[...` ran out of stack, a RecursionError whose
# traceback was 3,000 lines.
MAX_YAML_DEPTH = 32

# The tags pydantic puts in an error's location for the branch of a union that failed
# (`epochs: int | "auto"` fails as train.epochs.constrained-int and train.epochs.literal['auto'];
# `variants: [names] | "auto"` as compress.variants.tuple[literal[...],...].0 and ...literal['auto','all']).
_UNION_BRANCH = re.compile(r"^(constrained-\w+|literal\[.*\]|tuple\[.*\]|int|bool|str|float)$")


def _merge_union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One error per key: a union's failed branches become one message ("... or 'auto'"). Where one
    branch failed inside the value (a list's item: compress.variants.0), that is the one the value
    was meant for: the other branches' errors on the whole value are left out."""
    merged: dict[tuple, dict[str, Any]] = {}
    from_branch: set[tuple] = set()
    for error in errors:
        loc = tuple(part for part in error["loc"] if not (isinstance(part, str) and _UNION_BRANCH.match(part)))
        if loc != tuple(error["loc"]):
            from_branch.add(loc)
        if loc in merged and loc != tuple(error["loc"]):
            merged[loc]["msg"] += " or " + error["msg"].removeprefix("Input should be ")
        else:
            merged.setdefault(loc, {**error, "loc": loc})

    def inside(loc: tuple) -> bool:
        return any(len(other) > len(loc) and other[: len(loc)] == loc for other in from_branch)

    return [error for loc, error in merged.items() if not (loc in from_branch and inside(loc))]


def _format_error(error: dict[str, Any]) -> str:
    key = ".".join(shown(part) for part in error["loc"])
    got = error.get("input")
    value = "" if isinstance(got, dict) or error["type"] == "missing" else f" (got {shown(got)})"
    message = error["msg"].removeprefix("Value error, ")
    # checks across sections (e.g. export.candidates against compress.variants) name their keys themselves
    return f"{key}: {message}{value}" if key else f"{message}{value}"


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last),
    aliases (`*name`): nine nested aliases expand a few lines into a billion values ("billion
    laughs"), and params.yaml has no need for them; and nesting deeper than `MAX_YAML_DEPTH`."""

    _depth = 0  # of the node being composed: the document's top node is composed at 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        line = event.start_mark.line + 1 if event.start_mark else "?"
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"line {line}: YAML aliases (*{shown(event.anchor, 40)}) are not accepted; write the value out"
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise ConfigError(
                f"line {line}: nested more than {MAX_YAML_DEPTH} levels deep; params.yaml needs far fewer"
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise ConfigError(f"{shown(key)}: given twice (lines {seen[key]} and {line}); keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 floats with an exponent (`1e-3`, which ruamel also writes, and `1.5e3`): PyYAML's 1.1
# rules read them as strings unless the exponent has a sign, which strict validation would then refuse.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
MAX_NUMBER_DIGITS = 40  # far beyond any bound below; Python refuses over 4,300 digits with a ValueError


def _bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    if len(node.value) > MAX_NUMBER_DIGITS:
        raise ConfigError(f"line {node.start_mark.line + 1}: a number of {len(node.value)} digits; no key takes one")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def load_yaml(text: str) -> Any:
    """YAML as params.yaml is read (safe, duplicate keys refused, `1e-3` a float); raises yaml.YAMLError."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ConfigError (one line, naming the file and key) on bad input."""
    return parse_params(read_params_text(path), path)


def read_params_text(path: str | Path = PARAMS_FILE) -> str:
    """A params file's text, read once (ConfigError, naming the file, if it is missing, too big or not
    UTF-8). A run that must act on exactly what it checked reads it here once and hands the text on."""
    path, name = Path(path), _named(path)
    try:
        with path.open("rb") as stream:  # one open: the size checked is the size of what is read
            data = stream.read(MAX_PARAMS_BYTES + 1)
            size = os.fstat(stream.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(f"{name}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot be read: {exc.strerror}") from None
    if len(data) > MAX_PARAMS_BYTES:
        raise ConfigError(f"{name}: {max(size, len(data))} bytes; a params file is at most {MAX_PARAMS_BYTES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name}: not UTF-8 text (byte {exc.start})") from None


def parse_params(text: str, path: str | Path = PARAMS_FILE) -> Params:
    """`text` (a params file's, read by `read_params_text`) parsed and validated; errors name `path`."""
    name = _named(path)
    return _validate(_parse(text, name), name)


def _named(path: str | Path) -> Path:
    """The file as its user names it in an error: relative to the working directory when inside it
    (the flow reads `<project>/params.yaml`; the person who typed `make run` knows it as params.yaml)."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        return Path(path)


def _parse(text: str, path: Path) -> Any:
    try:
        return load_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:  # a backstop: the loader refuses deep nesting first, naming the line
        raise ConfigError(f"{path}: not valid YAML: nested too deeply to read") from None


def _validate(raw: Any, path: Path) -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        # one line, every problem on it: entry points print it as their one error line
        raise ConfigError(
            f"{path}: " + "; ".join(_format_error(err) for err in _merge_union_branches(exc.errors()))
        ) from None


def with_overrides(path: str | Path, overrides: dict[str, Any]) -> tuple[str, Params]:
    """params.yaml with `overrides` ({"train.lr": 0.01}, as `dvc exp run -S train.lr=0.01`) applied:
    the new text (comments, quotes and order kept) and its validated params.
    Raises ConfigError naming the key for an unknown key or a bad value."""
    return text_with_overrides(read_params_text(path), overrides, path)


def text_with_overrides(
    text: str, overrides: dict[str, Any] | None, path: str | Path = PARAMS_FILE
) -> tuple[str, Params]:
    """`with_overrides` on a params file's `text` (read once by the caller); errors name `path`."""
    from ruamel.yaml import YAML, RoundTripRepresenter  # round-trip YAML (DVC's own): keeps comments and order

    name = _named(path)
    params = parse_params(text, path)  # the file as it is must be valid too
    if not overrides:
        return text, params

    # None written as `null` (params.yaml's style), by a representer of its own: ruamel's add_representer
    # changes the class it is called on for the whole process, and DVC writes dvc.lock with that class:
    # after a `--set`, a flow's dvc.lock said `null` where `dvc repro` writes nothing.
    class NullRepresenter(RoundTripRepresenter):
        pass

    NullRepresenter.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    rt = YAML()
    rt.Representer = NullRepresenter
    rt.preserve_quotes = True
    doc = rt.load(text)
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"{name}: {key}: no such key (in overrides)")
        # A value from the API is JSON of any depth: refused before ruamel writes it (recursively) where
        # the loader would refuse the text it makes (the document and the key's sections take the rest).
        levels = MAX_YAML_DEPTH - len(parents) - 1
        if _deeper_than(value, levels):
            raise ConfigError(f"{name}: {key}: a value nested more than {levels} levels deep (in overrides)")
        node[leaf] = value
    out = io.StringIO()
    rt.dump(doc, out)
    return out.getvalue(), _validate(_parse(out.getvalue(), name), name)


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether `value` nests lists or mappings more than `levels` deep (a scalar or [] is 1 level).
    It looks no deeper than `levels` + 1: the check must not itself run out of stack."""
    if levels < 1:
        return True
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return any(_deeper_than(child, levels - 1) for child in children)


def set_params(path: str | Path, overrides: dict[str, Any]) -> Params:
    """Write `overrides` into params.yaml, validated first (a bad one leaves the file untouched).

    The file stays the one record of what ran: DVC decides staleness from it, so a run with other
    values must write them there first, as `dvc exp run -S` does.
    """
    text, params = with_overrides(path, overrides)
    write_text(Path(path), text)
    return params
