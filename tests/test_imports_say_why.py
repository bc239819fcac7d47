"""Every import inside a function in tasks/, flows/, stack/ and benchmarks/ says why it comes late
(issue 68: "where an import must come later, one line says why"): a comment on its line, or on the
line just above; a block of consecutive imports may share one comment above its first line.
`if TYPE_CHECKING:` imports are not run and need no reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "flows", "stack", "benchmarks")
Import = ast.Import | ast.ImportFrom


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _late_imports(tree: ast.Module) -> list[Import]:
    """Import statements run when a function is called (not those under `if TYPE_CHECKING:`)."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, Import) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def _says_why(node: Import, lines: list[str], ends: dict[int, Import]) -> bool:
    """A comment on the import's lines, or above it (climbing through the imports of its block, whose
    groups ruff separates with a blank line)."""
    while True:
        if any("#" in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
            return True
        above = node.lineno - 1
        if above >= 1 and lines[above - 1].strip().startswith("#"):
            return True
        while above >= 1 and not lines[above - 1].strip() and above - 1 in ends:  # a blank line between groups
            above -= 1
        if above not in ends:  # not part of a block of imports
            return False
        node = ends[above]


def unexplained() -> list[str]:
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines()
            ends = {n.end_lineno: n for n in ast.walk(tree) if isinstance(n, Import) and n.end_lineno}
            missing += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                for node in _late_imports(tree)
                if not _says_why(node, lines, ends)
            ]
    return missing


def test_every_late_import_says_why() -> None:
    missing = unexplained()
    assert not missing, "imports inside functions without a comment saying why they come late:\n" + "\n".join(missing)


def test_the_check_finds_an_unexplained_import() -> None:
    source = (
        "import os\n\n\ndef f():\n    # heavy: torch\n    import torch\n    import numpy\n\n    from tasks import x\n"
        "    y = 1\n    import json\n"
    )
    tree = ast.parse(source)
    lines = source.splitlines()
    ends = {n.end_lineno: n for n in ast.walk(tree) if isinstance(n, Import) and n.end_lineno}
    verdict = {n.lineno: _says_why(n, lines, ends) for n in _late_imports(tree)}
    assert verdict == {6: True, 7: True, 9: True, 11: False}
