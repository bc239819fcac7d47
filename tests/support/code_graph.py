"""The project's own import graph, read from the source (nothing is imported): what dvc.yaml's code
deps and the layering tests check against."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "flows", "stack", "benchmarks")


def module_path(module: str) -> Path:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py"


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def imports(module: str) -> frozenset[str]:
    """The project modules `module` imports, at module level or inside functions (a lazy import is
    still a dependency), leaving out imports made for type checkers only."""
    tree = ast.parse(module_path(module).read_text())
    guarded = [node for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking_only(node)]
    skipped = {id(inner) for node in guarded for inner in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            package = ROOT / node.module.replace(".", "/")
            named = {f"{node.module}.{alias.name}" for alias in node.names}
            # `from tasks.core import layout`: the names are modules (else names in a module)
            modules = {name for name in named if (ROOT / (name.replace(".", "/") + ".py")).exists()}
            found |= modules if package.is_dir() and modules else {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES}
    return frozenset(found - {module})


def closure(*modules: str) -> set[str]:
    """`modules` and every project module they import, directly or not."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports(module)
    return seen


def project_modules(package: str) -> list[str]:
    """Every module in `package` and its sub-packages, as dotted names (a package's `__init__` left out)."""
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / package).rglob("*.py")
        if path.stem != "__init__"
    )
