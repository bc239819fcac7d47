"""The six registries (tasks/core/registry.py) hold together: each entry has its implementation and each
implementation its entry, the recipes name what exists, a wrong name is a config error that lists the
registry, and every docs table of one renders from it. dvc.yaml's code deps of the implementing modules
are tests/flows/test_dvc_yaml.py's; the worked examples of adding one are test_worked_examples.py's."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from tasks.core.config.base import ConfigError
from tasks.core.config.data import SOURCES
from tasks.core.config.service import NOTIFY_FORMATS
from tasks.core.config.ship import COMPRESSION_VARIANTS, EXPORT_FORMATS
from tasks.core.config.train import AUGMENT_PRESETS, MODELS, TORCHVISION_MODELS
from tasks.core.config.yaml_io import load_params
from tasks.core.registry import Implementations, Registry
from tests.conftest import ROOT, write_params
from tests.support.file_module import load_file

REGISTRIES: dict[str, Registry] = {
    "train.augment": AUGMENT_PRESETS,
    "data.source": SOURCES,
    "train.model": MODELS,
    "compress.variants": COMPRESSION_VARIANTS,
    "export.formats": EXPORT_FORMATS,
    "orchestration.notify.format": NOTIFY_FORMATS,
}


def _implementations() -> list[Implementations]:
    from flows.notify import PAYLOADS
    from tasks.data.download import LOADERS
    from tasks.ship.compress import BUILDERS
    from tasks.ship.formats import WRITERS
    from tasks.train.augment import POLICIES
    from tasks.train.models import ARCHITECTURES

    return [POLICIES, LOADERS, ARCHITECTURES, BUILDERS, WRITERS, PAYLOADS]


def test_every_entry_has_its_implementation_and_every_implementation_its_entry() -> None:
    implementations = _implementations()
    assert {id(impl.registry) for impl in implementations} == {id(r) for r in REGISTRIES.values()}
    for impl in implementations:
        assert impl.missing() == [], f"{impl.registry.key}: no implementation of {impl.missing()}"
        assert set(impl) <= set(impl.registry), f"{impl.registry.key}: implemented, not registered"
        assert set(impl.elsewhere) <= set(impl.registry)
    for key, registry in REGISTRIES.items():
        assert registry.key == key and registry, key
        assert all(getattr(entry, "summary", "").strip() for entry in registry.values()), f"{key}: a summary is empty"


def test_an_implementation_of_a_name_not_registered_is_refused_at_import() -> None:
    from tasks.train.augment import POLICIES

    with pytest.raises(KeyError, match="'sepia' is not in the train.augment registry: add its entry first"):
        POLICIES.register("sepia")(lambda size: None)
    assert "sepia" not in POLICIES


def test_each_recipe_names_a_model_and_presets_that_exist() -> None:
    for name, source in SOURCES.items():
        recipe = source.recipe
        assert recipe.model in MODELS or recipe.model in TORCHVISION_MODELS, name
        assert recipe.augment in AUGMENT_PRESETS and recipe.augment_for(1) in AUGMENT_PRESETS, name


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"train": {"augment": "sepia"}}, "train.augment"),
        ({"data": {"source": "sepia"}}, "data.source"),
        ({"compress": {"variants": ["sepia"]}}, "compress.variants.0"),
        ({"export": {"formats": ["onnx", "sepia"]}}, "export.formats.1"),
        ({"orchestration": {"notify": {"format": "sepia"}}}, "orchestration.notify.format"),
    ],
)
def test_a_name_not_in_its_registry_is_a_config_error_listing_the_registry(
    tmp_path: Path, override: dict, key: str
) -> None:
    path = write_params(tmp_path / "params.yaml", override)
    with pytest.raises(ConfigError) as caught:
        load_params(path)
    registry = REGISTRIES[re.sub(r"\.\d+$", "", key)]
    listed = ", ".join(repr(name) for name in registry)
    assert f"{key}: Input should be " in str(caught.value) and "(got sepia)" in str(caught.value)
    assert all(repr(name) in str(caught.value) for name in registry), listed


def _hook() -> ModuleType:
    return load_file(ROOT / "docs/hooks/registries.py", "registries_hook")


def test_every_registry_has_a_docs_table_that_lists_its_entries_and_the_pages_name_real_tables() -> None:
    hook = _hook()
    assert set(REGISTRIES) <= set(hook.TABLES)
    for key, registry in REGISTRIES.items():
        table = hook.TABLES[key]()
        assert all(f"`{name}`" in table for name in registry), key
    shown = set()
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        opened = re.findall(r"<!-- registry: ([\w.]+) -->", text)
        assert len(opened) == text.count("<!-- /registry -->"), f"{page.name}: a registry marker left open"
        assert set(opened) <= set(hook.TABLES), f"{page.name}: {sorted(set(opened) - set(hook.TABLES))}"
        shown |= set(opened)
    extending = (ROOT / "docs/extending.md").read_text()
    assert set(hook.TABLES) <= set(re.findall(r"<!-- registry: ([\w.]+) -->", extending)), "docs/extending.md"
    assert shown == set(hook.TABLES)
