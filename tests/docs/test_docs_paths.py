"""Every repository path README.md and docs/ name exists, and docs/index.md lists each package's modules."""

from __future__ import annotations

import glob
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from tests.support.doc_pages import FILE_SUFFIX, ROOT, all_snippets, commands, page_lines, prose

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


@cache
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
        for offset, command in commands(snippet):
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
    for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(readme)):
        if not m.group(1).startswith("http"):
            yield f"README.md:{prose(readme).count(chr(10), 0, m.start()) + 1}", m.group(1)


@cache
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
    for i, line in enumerate(page_lines(page)):
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
