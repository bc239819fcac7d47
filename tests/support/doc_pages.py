"""README.md and docs/*.md read as the docs tests (tests/docs/) read them: pages, code spans and
blocks, the commands in them, the Makefile's targets, and the project's code as text.

What the tests check, each in its own module of tests/docs/:

- make targets (`make <target>`), the make settings given with them (`make stack STACK_HOST=...`),
  and `ARGS` given to a target whose command takes none; the Makefile's own rule that such a target
  refuses ARGS (TAKES_NO_ARGS), and README.md's list of the targets that take them;
- `python -m <module>` commands: the module exists, its sub-command exists, and every flag appears
  in the module's `--help` (test_docs_commands.py); a
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

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the code that reads an environment variable or defines a name can be.
CODE_DIRS = ("tasks", "flows", "stack", "benchmarks", "tests", "docs/hooks", ".ci", ".dvc/plots")
CODE_FILES = ("Makefile", "dvc.yaml", "params.yaml", "pyproject.toml", "mkdocs.yml", ".dvc/config")
# The code that writes MLflow tags and result files (not the tests, which name wrong keys on purpose).
SHIPPED_DIRS = ("tasks", "flows", "stack")
PROJECT_PACKAGES = ("tasks", "flows", "stack", "benchmarks", "tests")

FILE_SUFFIX = re.compile(r"\.(py|dvc|json|md|ya?ml|csv|onnx|png|lock|npy|pt2|html|db|txt|data|safetensors|h|cpp)$")


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


@functools.cache
def page_lines(page: Path) -> tuple[str, ...]:
    return tuple(page.read_text(encoding="utf-8").splitlines())


@functools.cache
def code_blocks(page: Path) -> tuple[tuple[Snippet, ...], frozenset[int]]:
    """Fenced and indented code blocks, and the (0-based) line numbers they cover."""
    lines = page_lines(page)
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


def prose(page: Path) -> str:
    """The page with its code blocks blanked (line numbers kept)."""
    _, covered = code_blocks(page)
    return "\n".join("" if i in covered else line for i, line in enumerate(page_lines(page)))


def snippets(page: Path) -> list[Snippet]:
    blocks, _ = code_blocks(page)
    text = prose(page)
    spans = [
        Snippet(page, text.count("\n", 0, m.start()) + 1, m.group(2), False)
        for m in re.finditer(r"(`+)((?:(?!\1).)+?)\1", text, re.S)
        if "\n\n" not in m.group(2)
    ]
    return [*blocks, *spans]


def all_snippets() -> Iterator[Snippet]:
    for page in PAGES:
        yield from snippets(page)


def commands(snippet: Snippet) -> Iterator[tuple[int, str]]:
    """Each line of a snippet as a command, its comment dropped, with the line's offset."""
    offset = 0
    for line in snippet.text.split("\n"):
        yield offset, re.split(r"\s#\s|\s#$|^#", line)[0] if snippet.block else line
        offset += len(line) + 1


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
        for offset, command in commands(snippet):
            for m in re.finditer(r"(?<![\w/-])make((?:\s+[A-Za-z_-][\w-]*(?:=(?:\"[^\"]*\"|'[^']*'|\S+))?)+)", command):
                words = re.findall(r"[A-Za-z_-][\w-]*(?:=(?:\"[^\"]*\"|'[^']*'|\S+))?", m.group(1))
                target = words[0] if "=" not in words[0] else "help"
                settings = dict(w.split("=", 1) for w in words if "=" in w)
                args = settings.pop("ARGS", "").strip("\"'")
                yield snippet.where(offset + m.start()), target, args, settings


@functools.cache
def code_text(folders: tuple[str, ...] = CODE_DIRS) -> str:
    parts = [(ROOT / name).read_text(errors="replace") for name in CODE_FILES if (ROOT / name).is_file()]
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".sh", ".cpp", ".h", ".toml", ".yaml", ".ini", ""}:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)
