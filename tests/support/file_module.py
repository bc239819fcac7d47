"""A Python file that is not in a package (a docs hook, a vendoring script) imported by its path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
