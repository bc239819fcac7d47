"""The code's shape, checked: layers import only downwards, no import cycles, short functions."""

from __future__ import annotations

import ast

from tests.support.code_graph import PACKAGES, ROOT, imports, module_path, project_modules

# Lower layers never import higher ones: the stages know nothing of the orchestrator or benchmarks.
LAYER = {"tasks": 0, "flows": 1, "stack": 2, "benchmarks": 2}
# Inside tasks/, the roles in the same order: what every stage shares, then determinism, the data
# stages, training, shipping, tracking, the tools; the stage runner (tasks.runner, tasks.__main__) on top.
ROLES = ("core", "determinism", "data", "train", "ship", "tracking", "tools")
ENTRY_MODULES = {"tasks.__main__", "tasks.runner"}
MAX_FUNCTION_LINES = 60


def _modules() -> list[str]:
    return [module for package in PACKAGES for module in project_modules(package)]


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        (module, dep)
        for module in _modules()
        for dep in imports(module)
        if LAYER[dep.split(".")[0]] > LAYER[module.split(".")[0]]
    ]
    assert not upward, f"imports of a higher layer: {upward}"


def _role(module: str) -> int:
    return len(ROLES) if module in ENTRY_MODULES else ROLES.index(module.split(".")[1])


def test_tasks_holds_role_packages_and_the_stage_runner_only() -> None:
    flat = {m for m in project_modules("tasks") if m.count(".") == 1} - ENTRY_MODULES
    packages = {p.name for p in (ROOT / "tasks").iterdir() if (p / "__init__.py").exists()}
    assert not flat, f"modules outside a role package: {sorted(flat)}"
    assert packages == set(ROLES), f"role packages {sorted(packages)}, expected {sorted(ROLES)}"


def test_no_role_in_tasks_imports_a_later_role() -> None:
    upward = [
        (module, dep)
        for module in project_modules("tasks")
        for dep in imports(module)
        if dep.startswith("tasks.") and _role(dep) > _role(module)
    ]
    assert not upward, f"imports of a later role (order: {', '.join(ROLES)}): {upward}"


def test_imports_have_no_cycles() -> None:
    """Lazy (in-function) imports count: a cycle through one still ties the two modules together."""
    state: dict[str, str] = {}  # module -> "visiting" | "done"
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "visiting"
        for dep in sorted(imports(module)):
            if state.get(dep) == "visiting":
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in _modules():
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_no_function_in_tasks_flows_or_stack_is_longer_than_60_lines() -> None:
    long = []
    for package in ("tasks", "flows", "stack"):
        for module in project_modules(package):
            tree = ast.parse(module_path(module).read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(
                            f"{module_path(module).relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
                        )
    assert not long, "split these: " + ", ".join(long)


def test_nothing_outside_tests_imports_from_tests() -> None:
    """Test helpers live in tests/support/; what benchmarks share with tests (fake published archives,
    the loopback file server) lives in benchmarks/, which tests may import."""
    importers = []
    for package in PACKAGES:
        for module in project_modules(package):
            for node in ast.walk(ast.parse(module_path(module).read_text())):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                importers += [(module, name) for name in names if name.split(".")[0] == "tests"]
    assert not importers, f"imports from tests/: {importers}"


# The one reviewed place that reads a pickle: an unpickler that resolves numpy's array builders and
# nothing else (the CIFAR batches; docs/trust-model.md). Anywhere else, a pickle from a file or a peer
# could name any function to call.
PICKLE_READER = "tasks.core.plain_pickle"
_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib"}
_PICKLE_LOADERS = {"load", "loads", "Unpickler"}


def _unpickles(node: ast.AST) -> str | None:
    """What in `node` reads a pickle (`pickle.loads`, `from pickle import Unpickler`, numpy's
    `allow_pickle=True`, `torch.load(weights_only=False)`), or None."""
    if isinstance(node, ast.Attribute) and node.attr in _PICKLE_LOADERS:
        if isinstance(node.value, ast.Name) and node.value.id in _PICKLE_MODULES:
            return f"{node.value.id}.{node.attr}"
    if isinstance(node, ast.ImportFrom) and (node.module or "") in _PICKLE_MODULES:
        loaders = [alias.name for alias in node.names if alias.name in _PICKLE_LOADERS | {"*"}]
        if loaders:
            return f"from {node.module} import {', '.join(loaders)}"
    if isinstance(node, ast.keyword) and node.arg in ("allow_pickle", "weights_only"):
        unsafe = node.value.value if isinstance(node.value, ast.Constant) else None
        if unsafe is not (node.arg == "weights_only"):
            return f"{node.arg}={ast.unparse(node.value)}"
    return None


def test_no_module_but_the_plain_pickle_reader_unpickles() -> None:
    found = [
        f"{module_path(module).relative_to(ROOT)}:{node.lineno} {what}"
        for package in PACKAGES
        for module in project_modules(package)
        if module != PICKLE_READER
        for node in ast.walk(ast.parse(module_path(module).read_text()))
        if (what := _unpickles(node)) is not None
    ]
    assert not found, "pickles read outside tasks/core/plain_pickle.py: " + ", ".join(found)
