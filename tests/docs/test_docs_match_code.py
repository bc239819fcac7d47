"""README.md and docs/*.md checked against the code: every item a reader may copy must still work.

What is extracted from the pages (code spans, indented and fenced code blocks; prose for links):

- make targets (`make <target>`), the make settings given with them (`make stack STACK_HOST=...`),
  and `ARGS` given to a target whose command takes none; the Makefile's own rule that such a target
  refuses ARGS (TAKES_NO_ARGS), and README.md's list of the targets that take them;
- `python -m <module>` commands: the module exists, its sub-command exists, and every flag appears
  in the module's `--help` (run in-process in two interpreters, HELP_DRIVER); a
  `make <target> ARGS="--flag"` is checked against the module that target runs;
- params keys (`train.lr`, `--set a.b=c`, `-S a.b=c`, YAML snippets, the key tables of
  docs/params.md, which must also list every key) against the pydantic models in
  tasks/core/config/; a dotted name that is no key must be one the shipped code writes (an MLflow
  tag such as `checks.verdict`);
- environment variables (`LOCKSTEP_*` and every other NAME_LIKE_THIS in code): some code of the
  project (tasks/, flows/, stack/, benchmarks/, tests/, docs/hooks/, the Makefile, .ci/) names it,
  or READ_ELSEWHERE says which program reads it;
- `uv add` / `pip install` of a package pyproject.toml declares already;
- repository paths (`tasks/core/lock.py`, `tests/determinism/golden/`, `tasks.tracking.ui`, a file
  named alone, links from README.md) exist, except the few made at run time (RUNTIME_PATHS, each
  with its reason);
- the module table of docs/index.md lists exactly the modules each package holds;
- figures: a measured number (see `test_every_figure_is_rendered_or_dated`) carries its date.

A failure names the page, the line and the stale item.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from tasks.core.config.params import Params

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the code that reads an environment variable or defines a name can be.
CODE_DIRS = ("tasks", "flows", "stack", "benchmarks", "tests", "docs/hooks", ".ci", ".dvc/plots")
CODE_FILES = ("Makefile", "dvc.yaml", "params.yaml", "pyproject.toml", "mkdocs.yml", ".dvc/config")
# The code that writes MLflow tags and result files (not the tests, which name wrong keys on purpose).
SHIPPED_DIRS = ("tasks", "flows", "stack")
PROJECT_PACKAGES = ("tasks", "flows", "stack", "benchmarks", "tests")

# Paths a page may name that are not in the repository, each with its reason.
RUNTIME_PATHS = {
    "artifacts": "every stage's outputs, written by the pipeline",
    "data": "the raw snapshot, written by the download stage (tracked by data.dvc, not git)",
    "mlflow.db": "the local MLflow store, made by the first run",
    "mlartifacts": "the local MLflow artifacts, made by the first run",
    "mlflow-server.db": "make mlflow-server's store",
    "mlruns": "MLflow's old file store, named only to say it is not used",
    ".venv": "built by make from uv.lock",
    ".cache": "downloaded archives",
    ".stack": "make stack's state",
    ".prefect": "Prefect's local state",
    "dvc_plots": "written by make plots",
    "test-artifacts": "screenshots the tests keep",
    ".dvc/tmp": "DVC's own state (locks)",
    ".dvc/config.local": "written by make stack-join",
    "benchmarks/results/bench.md": "make bench's table, written beside bench.json and not committed (.gitignore)",
}
# Pages whose files named alone (`harness.py`) are in one folder.
PAGE_FOLDERS = {"docs/benchmarks.md": "benchmarks"}
# Environment variables that no code of the project names, read by the program the page talks about.
READ_ELSEWHERE = {
    "PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES": "Prefect's runner.auto_install_dependencies, advised off",
    "NCCL_NVLS_ENABLE": "read by NCCL: the page says to set it for bitwise GPU runs",
}


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # 1-based line of the snippet's start
    text: str
    block: bool  # a code block (else an inline code span)
    lang: str = ""

    def where(self, offset: int = 0) -> str:
        line = self.line + self.text.count("\n", 0, offset)
        return f"{self.page.relative_to(ROOT)}:{line}"


# --- reading the pages -------------------------------------------------------------------------


@functools.cache
def _lines(page: Path) -> tuple[str, ...]:
    return tuple(page.read_text(encoding="utf-8").splitlines())


@functools.cache
def _blocks(page: Path) -> tuple[tuple[Snippet, ...], frozenset[int]]:
    """Fenced and indented code blocks, and the (0-based) line numbers they cover."""
    lines = _lines(page)
    blocks: list[Snippet] = []
    covered: set[int] = set()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\w*)", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
            blocks.append(Snippet(page, i + 2, "\n".join(lines[i + 1 : end]), True, fence.group(3)))
            covered.update(range(i, end + 1))
            i = end + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()) and not _in_list(lines, i):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            blocks.append(Snippet(page, i + 1, "\n".join(line[4:] for line in lines[i:end]), True))
            covered.update(range(i, end))
            i = end
            continue
        i += 1
    return tuple(blocks), frozenset(covered)


def _in_list(lines: tuple[str, ...], i: int) -> bool:
    """An indented line after a list item is the item's continuation, not code."""
    for j in range(i - 1, -1, -1):
        if lines[j].strip():
            return bool(re.match(r"^\s*([-*+]|\d+\.)\s", lines[j])) and not lines[j].startswith("    ")
    return False


def _prose(page: Path) -> str:
    """The page with its code blocks blanked (line numbers kept)."""
    _, covered = _blocks(page)
    return "\n".join("" if i in covered else line for i, line in enumerate(_lines(page)))


def snippets(page: Path) -> list[Snippet]:
    blocks, _ = _blocks(page)
    prose = _prose(page)
    spans = [
        Snippet(page, prose.count("\n", 0, m.start()) + 1, m.group(2), False)
        for m in re.finditer(r"(`+)((?:(?!\1).)+?)\1", prose, re.S)
        if "\n\n" not in m.group(2)
    ]
    return [*blocks, *spans]


def all_snippets() -> Iterator[Snippet]:
    for page in PAGES:
        yield from snippets(page)


def _commands(snippet: Snippet) -> Iterator[tuple[int, str]]:
    """Each line of a snippet as a command, its comment dropped, with the line's offset."""
    offset = 0
    for line in snippet.text.split("\n"):
        yield offset, re.split(r"\s#\s|\s#$|^#", line)[0] if snippet.block else line
        offset += len(line) + 1


# --- make --------------------------------------------------------------------------------------


@functools.cache
def makefile() -> tuple[dict[str, str], set[str], set[str]]:
    """The Makefile's targets with their recipes, its variables, and the targets that refuse ARGS."""
    text = (ROOT / "Makefile").read_text()
    targets: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        rule = re.match(r"^([a-zA-Z0-9_-]+):(?!=)", line)
        if rule:
            name = rule.group(1)
            targets[name] = ""
        elif line.startswith("\t") and name:
            targets[name] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            name = None
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M))
    guard = re.search(r"^TAKES_NO_ARGS\s*:?=\s*(.*)$", text, re.M)
    return targets, variables, set(guard.group(1).split()) if guard else set()


def make_items() -> Iterator[tuple[str, str, str, dict[str, str]]]:
    """(where, target, ARGS, settings) for each `make` command on the pages."""
    for snippet in all_snippets():
        for offset, command in _commands(snippet):
            for m in re.finditer(r"(?<![\w/-])make((?:\s+[A-Za-z_-][\w-]*(?:=(?:\"[^\"]*\"|'[^']*'|\S+))?)+)", command):
                words = re.findall(r"[A-Za-z_-][\w-]*(?:=(?:\"[^\"]*\"|'[^']*'|\S+))?", m.group(1))
                target = words[0] if "=" not in words[0] else "help"
                settings = dict(w.split("=", 1) for w in words if "=" in w)
                args = settings.pop("ARGS", "").strip("\"'")
                yield snippet.where(offset + m.start()), target, args, settings


def test_every_make_target_and_setting_exists() -> None:
    targets, variables, _ = makefile()
    stale = []
    for where, target, _, settings in make_items():
        if target not in targets and not target.startswith("<"):
            stale.append(f"{where}: make {target}: no such target")
        stale += [f"{where}: make {target} {name}=: no such setting" for name in settings if name not in variables]
    assert not stale, "\n".join(stale)


def test_args_are_given_only_to_targets_that_use_them() -> None:
    targets, _, refusing = makefile()
    using = {name for name, recipe in targets.items() if "$(ARGS)" in recipe}
    stale = [
        f"{where}: make {target} ARGS={args!r}: {target} takes no ARGS"
        for where, target, args, _ in make_items()
        if args and target in targets and target not in using
    ]
    assert not stale, "\n".join(stale)
    # every target with a recipe either passes ARGS on or refuses them (TAKES_NO_ARGS)
    silent = {name for name, recipe in targets.items() if recipe and name not in using | refusing}
    old_names = {"repro", "serve"}  # they only say the new names, and exit 2
    assert not silent - old_names, f"targets that ignore ARGS without saying so: {sorted(silent - old_names)}"


def test_readme_lists_the_targets_that_take_args() -> None:
    targets, _, refusing = makefile()
    using = {name for name, recipe in targets.items() if "$(ARGS)" in recipe}
    text = (ROOT / "README.md").read_text()
    said = re.search(r"^`ARGS=\"\.\.\.\"` .*?(?=\n\n)", text, re.S | re.M)
    assert said, 'README.md: no paragraph starting `ARGS="..."` that says which targets take ARGS'
    named = set(re.findall(r"`([a-z][a-z0-9-]*)`", said.group(0)))
    assert named & set(targets) == using, f"README says {sorted(named & set(targets))}, the Makefile {sorted(using)}"
    assert refusing, "the Makefile has no TAKES_NO_ARGS list"


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")
    }
    return subprocess.run(["make", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_target_given_args_it_ignores_says_so() -> None:
    # refused while the Makefile is read: nothing is built or run first, whatever the environment's state
    done = _make("lint", "ARGS=--fix")
    assert done.returncode == 2, done
    assert "make lint takes no ARGS" in done.stderr, done.stderr
    assert not done.stdout, done.stdout
    # a target that takes ARGS still gets them (-n: shown, not run)
    shown = _make("-n", "bench", "ARGS=--smoke")
    assert shown.returncode == 0 and "-m benchmarks --smoke" in shown.stdout, shown


# --- python -m ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PyCommand:
    where: str
    module: str
    words: tuple[str, ...]


def _module_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    if "*" in module:  # `python -m tasks.tools.*`: some
        return bool(glob.glob(str(path)))
    if module.split(".")[0] in PROJECT_PACKAGES:
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None


def py_commands() -> Iterator[PyCommand]:
    for snippet in all_snippets():
        for offset, command in _commands(snippet):
            for m in re.finditer(r"python[\d.]*\s+-m\s+([A-Za-z_][\w.]*[\w*])([^;&|)`]*)", command):
                words = tuple(_words(m.group(2)))
                yield PyCommand(snippet.where(offset + m.start()), m.group(1), words)
    targets, _, _ = makefile()
    for where, target, args, _ in make_items():
        found = re.search(r"-m ([\w.]+)((?: [a-z]\w*)?)", targets.get(target, ""))  # the module, its sub-command
        if args and found:
            yield PyCommand(where, found.group(1), (*found.group(2).split(), *_words(args)))


def _words(text: str) -> Iterator[str]:
    """A command's arguments, placeholders (`<run id>`) and optional brackets dropped, up to a `->`."""
    text = re.sub(r"<[^>]*>", "X", text)
    for word in text.replace("[", " ").replace("]", " ").split():
        if word == "->":
            return
        if word not in {"...", "=", "X"} and re.match(r"^[-\w./:~@'\"]", word):
            yield word


# Each module's --help, in-process, in one interpreter for many modules: they share imports (a
# subprocess per module took 45 s on a busy 2-core machine). SystemExit is the end of a --help.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
found = {}
for module, sub in json.loads(sys.argv[1]):
    sys.argv = [module, *([sub] if sub else []), "--help"]
    text, code = io.StringIO(), 1
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
        except Exception as error:
            text.write(repr(error))
    found[module + " " + sub] = [code, text.getvalue()]
sys.stdout = sys.__stdout__
print(json.dumps(found))
"""
# Modules whose --help imports torch: a process of their own, beside the others.
HEAVY_HELP = ("tasks.tools.gpu_check",)


def help_texts(keys: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, str]]:
    groups = [[k for k in keys if k[0] in HEAVY_HELP], [k for k in keys if k[0] not in HEAVY_HELP]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "LOCKSTEP_"))}

    def run(group: list[tuple[str, str]]) -> dict[str, list[Any]]:
        argv = [sys.executable, "-c", HELP_DRIVER, json.dumps(group)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    with ThreadPoolExecutor(max_workers=2) as pool:
        found = {k: v for part in pool.map(run, [g for g in groups if g]) for k, v in part.items()}
    return {(module, sub): tuple(found[f"{module} {sub}"]) for module, sub in keys}  # type: ignore[misc]


def _flags(text: str) -> set[str]:
    """The flags a --help declares: in its usage, and at the start of its option lines (not in prose)."""
    usage = text.split("\n\n")[0]
    flags = set(re.findall(r"\[(--?[A-Za-z][\w-]*)", usage)) | set(
        re.findall(r"(?<=\s)(--?[A-Za-z][\w-]*) [A-Z]", usage)
    )
    for line in text.splitlines():
        declared = re.match(r"^\s+(--?[A-Za-z][\w-]*(?:[ =][^,\s]+)?(?:, --?[A-Za-z][\w-]*(?:[ =][^,\s]+)?)*)", line)
        if declared:
            flags |= set(re.findall(r"(?:^|, )(--?[A-Za-z][\w-]*)", declared.group(1)))
    return flags


# Commands that hand the options they do not know to another program, which checks them.
PASS_THROUGH = {
    ("flows.sweep", "scheduler"): "other options go to `dask scheduler`",
    ("flows.sweep", "worker"): "other options go to `dask worker`",
}


def _sub(command: PyCommand) -> str:
    first = next((w for w in command.words if not w.startswith("-")), "")
    return first if re.fullmatch(r"[a-z][a-z_]*", first) else ""


def _checked(commands: list[PyCommand]) -> list[PyCommand]:
    return [c for c in commands if c.module.split(".")[0] in PROJECT_PACKAGES and "*" not in c.module]


def test_every_python_module_command_and_flag_exists() -> None:
    commands = list(py_commands())
    stale = [f"{c.where}: python -m {c.module}: no such module" for c in commands if not _module_exists(c.module)]
    # a command with neither flags nor a sub-command needs no --help: its module exists
    checked = [c for c in _checked(commands) if _module_exists(c.module) and c.words]
    wanted = sorted({(c.module, "") for c in checked} | {(c.module, _sub(c)) for c in checked})
    helps = help_texts(wanted)
    for c in checked:
        code, top = helps[(c.module, "")]
        if code != 0:
            stale.append(f"{c.where}: python -m {c.module} --help exited {code}: {top[-300:]}")
            continue
        sub = _sub(c)
        choices = re.search(r"\{([\w,-]+)\}", top.split("\n\n")[0])
        if sub and choices and sub not in choices.group(1).split(","):
            stale.append(f"{c.where}: python -m {c.module} {sub}: no such sub-command ({choices.group(1)})")
            continue
        known = _flags(top) | (_flags(helps[(c.module, sub)][1]) if sub and helps[(c.module, sub)][0] == 0 else set())
        stale += [
            f"{c.where}: python -m {c.module}{' ' + sub if sub else ''} {w}: no such flag"
            for w in c.words
            if w.startswith("-")
            and w.split("=")[0] not in known
            and not re.fullmatch(r"-\d.*", w)
            and (c.module, sub) not in PASS_THROUGH
        ]
    assert not stale, "\n".join(stale)


# --- params keys -------------------------------------------------------------------------------

SECTIONS = tuple(Params.model_fields)
FILE_SUFFIX = re.compile(r"\.(py|dvc|json|md|ya?ml|csv|onnx|png|lock|npy|pt2|html|db|txt|data|safetensors|h|cpp)$")


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
        for offset, command in _commands(snippet):
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
    for i, line in enumerate(_lines(page)):
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


@functools.cache
def code_text(folders: tuple[str, ...] = CODE_DIRS) -> str:
    parts = [(ROOT / name).read_text(errors="replace") for name in CODE_FILES if (ROOT / name).is_file()]
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".sh", ".cpp", ".h", ".toml", ".yaml", ".ini", ""}:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


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
    import tomllib

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


@functools.cache
def _top_level() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.iterdir()) | {p.split("/")[0] for p in RUNTIME_PATHS}


def _runtime(path: str) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in RUNTIME_PATHS)


def _exists(path: str) -> bool:
    path = re.sub(r"<[^>]*>", "*", path.rstrip("/").split("#")[0].split(":")[0])
    braces = re.search(r"\{([^}]*)\}", path)
    if braces:
        return all(_exists(path[: braces.start()] + part + path[braces.end() :]) for part in braces.group(1).split(","))
    return bool(glob.glob(str(ROOT / path))) or (ROOT / path).exists()


def path_items() -> Iterator[tuple[str, str]]:
    word = re.compile(r"(?<![\w/.$~-])(\.?[\w-]+(?:[./][\w*<>{},-]+)*/?)(?![\w(])")
    for snippet in all_snippets():
        for offset, command in _commands(snippet):
            for m in word.finditer(command):
                token = m.group(1)
                first = re.split(r"[/]", token)[0]
                if "/" not in token and not FILE_SUFFIX.search(token):
                    continue
                if first not in _top_level() or token.startswith(("http", "tcp", "tls")):
                    continue
                yield snippet.where(offset + m.start()), token
            for m in re.finditer(r"(?<![\w.])((?:tasks|flows|stack|benchmarks)(?:\.\w+)+)(?![\w/(])", command):
                module = m.group(1)
                if not FILE_SUFFIX.search(module):
                    yield snippet.where(offset + m.start()), module.replace(".", "/") + "{.py,/__init__.py}"
            for m in re.finditer(r"(?<![\w/.-])([\w-]+\.(?:py|cpp|h))(?![\w/])", command):
                folder = PAGE_FOLDERS.get(snippet.page.relative_to(ROOT).as_posix())
                if folder:  # on this page a file named alone is in this folder
                    yield snippet.where(offset + m.start()), f"{folder}/{m.group(1)}"
                elif m.group(1) not in _file_names():  # a file named alone (`cpu_mode.py`): somewhere in the repo
                    yield snippet.where(offset + m.start()), "**/" + m.group(1)
    readme = ROOT / "README.md"
    for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _prose(readme)):
        if not m.group(1).startswith("http"):
            yield f"README.md:{_prose(readme).count(chr(10), 0, m.start()) + 1}", m.group(1)


@functools.cache
def _file_names() -> frozenset[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return frozenset(Path(p).name for p in listed if (ROOT / p).exists())


def _module_or_package(path: str) -> bool:
    if path.startswith("**/"):
        return False
    if path.endswith("{.py,/__init__.py}"):
        stem = path.removesuffix("{.py,/__init__.py}")
        # a module, a package, or a name inside a module (tasks.tracking.dashboard.VIEW_TAG)
        return any(_exists(p) for p in (stem + ".py", stem + "/__init__.py", stem.rsplit("/", 1)[0] + ".py"))
    return _exists(path)


def test_every_repository_path_exists() -> None:
    items = list(path_items())
    stale = [
        f"{where}: {path}: not in the repository"
        for where, path in items
        if not _runtime(path) and not _module_or_package(path)
    ]
    assert not stale, "\n".join(sorted(set(stale)))
    # the allowlist stays small and true: each entry is named on a page, and git tracks none of it
    unused = {p for p in RUNTIME_PATHS if not any(path == p or path.startswith(p + "/") for _, path in items)}
    tracked = subprocess.run(["git", "ls-files", *RUNTIME_PATHS], cwd=ROOT, capture_output=True, text=True).stdout
    assert not unused, f"RUNTIME_PATHS entries no page names: {sorted(unused)}"
    assert not tracked, f"RUNTIME_PATHS entries git tracks: {tracked}"


def test_index_lists_each_packages_modules() -> None:
    page = ROOT / "docs" / "index.md"
    wrong = []
    for i, line in enumerate(_lines(page)):
        row = re.match(r"^\| `((?:tasks/)?\w+)/?` \| (.*) \|$", line)
        if not row or not (ROOT / row.group(1) / "__init__.py").exists():
            continue
        folder = ROOT / row.group(1)
        listed = {name.rstrip("/").removesuffix(".py") for name in re.findall(r"`([\w./]+)`", row.group(2))}
        present = {p.stem for p in folder.glob("*.py") if p.stem not in {"__init__", "__main__"}}
        present |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        sources = {p.name for p in folder.glob("*") if p.suffix in {".cpp", ".h"}}  # named if the row likes
        if row.group(1) in {"stack", "benchmarks"}:
            continue  # described, not listed
        for name in sorted(listed - present - sources):
            wrong.append(f"docs/index.md:{i + 1}: {row.group(1)}/{name}: no such module")
        for name in sorted(present - listed):
            wrong.append(f"docs/index.md:{i + 1}: {row.group(1)}/{name}: in the package, not in the table")
    assert not wrong, "\n".join(wrong)


# --- figures -----------------------------------------------------------------------------------

# A measured figure: a time, a ratio or a share, or an approximate size (see the test's docstring).
FIGURE = re.compile(
    r"(?<![\w.×/+-])(?:(~|about |About |≈ ?)?(\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?) "
    r"(ms|µs|s|min|minutes|seconds|hours)"
    r"|(~|about |About |≈ ?)?(\d+\.\d+(?:\s?[-–]\s?\d+(?:\.\d+)?)?)(×|x|%| times)"
    r"|(~|about |About |≈ ?)(\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?)(×|x|%| KB| MB| GB| KiB| MiB| GiB))(?![\w²])"
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Words just before a number that make it a bound, a setting or a goal rather than a measurement.
NOT_MEASURED = re.compile(
    r"(≤|≥|<|>|\bat most|\bat least|\bup to|\bno more than|\btargets?\b|\bbudgets?\b|\blimit|\bdefault"
    r"|\btimeout|\bevery|\bwithin|\bbound|\bafter)[^.;]{0,30}$",
    re.I,
)
# ... or just after it (`10 s apart`, `300 s by default`).
NOT_MEASURED_AFTER = re.compile(r"^[^.;,]{0,12}\b(apart|idle|by default|of keepalives)\b")


def _figure_text(page: Path) -> list[str]:
    """The page's lines as the figure check reads them: code spans blanked (values, commands, messages),
    code blocks reduced to their comments (where a measured time may hide: `# first start ~25 s`)."""
    _, covered = _blocks(page)
    shown = []
    for i, line in enumerate(_lines(page)):
        if i in covered:
            comment = re.search(r"\s#\s(.*)$", line)
            shown.append(comment.group(1) if comment else "")
        else:
            shown.append(re.sub(r"`[^`]*`", "``", line))
    return shown


def _units(page: Path) -> Iterator[tuple[int, list[int], str]]:
    """Paragraphs, list items, table rows (with the paragraph before the table: its caption) and code
    comments, each as (first line, its line numbers, the text a date may stand in)."""
    lines = _figure_text(page)
    _, covered = _blocks(page)
    unit: list[int] = []
    caption = header = ""
    for i, line in enumerate([*lines, ""]):
        single = i in covered or line.startswith(("|", "#"))
        starts = single or not line.strip() or re.match(r"^\s*([-*+]|\d+\.) ", line)
        if starts and unit:
            text = "\n".join(lines[j] for j in unit)
            yield unit[0], unit, text
            caption, unit = text, []
        if line.startswith("|") and not (i > 0 and lines[i - 1].startswith("|")):
            header = line  # a table's first row: its header
        if single and line.strip():
            yield i, [i], line + ("\n" + header + "\n" + caption if line.startswith("|") else "")
        elif line.strip():
            unit.append(i)


def _rendered(page: Path) -> set[int]:
    """Lines a docs hook writes at build time: between `<!-- name: ... -->` and `<!-- /name -->`."""
    lines, inside, opened = _lines(page), set(), None
    for i, line in enumerate(lines):
        marker = re.match(r"^<!-- (/?)([\w-]+)", line.strip())
        if marker and not marker.group(1) and any(f"<!-- /{marker.group(2)}" in later for later in lines[i:]):
            opened = marker.group(2)
        elif marker and marker.group(1) and marker.group(2) == opened:
            opened = None
        if opened:
            inside.add(i)
    return inside


def _after(lines: list[str], j: int, end: int) -> str:
    """What follows a figure: the rest of its line and the next one (`300 s by` / `default`)."""
    return lines[j][end:] + " " + (lines[j + 1] if j + 1 < len(lines) else "")


def figure_items() -> Iterator[tuple[str, str]]:
    for page in PAGES:
        lines = _figure_text(page)

        heading, rendered = "", _rendered(page)
        for first, members, context in _units(page):
            if first in rendered:
                continue
            if lines[first].startswith("#") and first not in _blocks(page)[1]:
                heading = lines[first]
            if DATE.search(context) or DATE.search(heading):
                continue
            for j in members:
                for m in FIGURE.finditer(lines[j]):
                    if NOT_MEASURED.search(lines[j][: m.start()]) or NOT_MEASURED_AFTER.search(
                        _after(lines, j, m.end())
                    ):
                        continue
                    yield f"{page.relative_to(ROOT)}:{j + 1}", m.group(0).strip()


def test_every_figure_is_rendered_or_dated() -> None:
    """A measured figure on a page must say when it was measured, or come from benchmarks/results/.

    A figure is a time (`2 s`, `16-23 s`, `4 min`), a ratio or a share with decimals (`1.25×`,
    `99.1%`), or anything approximate (`about 2×`, `~25 s`, `about 7 GB`). It is accepted when
    - a date (YYYY-MM-DD) stands in its paragraph, list item or table row, in its table's header row
      or the paragraph just before its table, or in the heading of its section (`### Measured
      2026-11-24 on ...`);
    - a bound, setting or goal precedes it in its clause (≤, ≥, at most, up to, target, budget,
      limit, default, timeout, every, within, after) or follows it (`10 s apart`, `300 s by
      default`): that is a number the code sets, not one it measured;
    - it is a value in a code span or a command (`--timeout 60`); code comments are read;
    - it is rendered at build time from benchmarks/results/ (the page holds a marker, not the number).
    Integers with × or % (`16×` the data, `50%` of weights) are settings, not figures.
    """
    stale = [f"{where}: {figure}: a figure with no date where it stands" for where, figure in figure_items()]
    assert not stale, f"{len(stale)} undated figures:\n" + "\n".join(stale)
