"""MkDocs hook: the tables of the extension points, rendered from their registries (tasks/core/registry.py).

A page holds a table of one registry between two marker comments:

    <!-- registry: train.augment -->
    (anything: a hand-written copy is replaced, so the built page never drifts from the code)
    <!-- /registry -->

and the build replaces the markers and what lies between them with the table made from the registry's
entries, as they are in this checkout (TABLES names them, by the params key an entry is named in). An
unknown name or a marker left open fails the build. The registries live in tasks/core/config/, which
imports pydantic and nothing heavy: the hook imports them from the checkout the docs are built in.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"<!-- registry: (?P<name>[\w.]+) -->(?P<between>.*?)(?P<end><!-- /registry -->|\Z)", re.DOTALL)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    if "<!-- registry:" not in markdown:
        return markdown
    _importable(Path(config["config_file_path"]).resolve().parent)

    def table(match: re.Match[str]) -> str:
        name = match["name"]
        if not match["end"]:
            raise PluginError(
                f"registries hook: {page.file.src_uri}: <!-- registry: {name} --> has no <!-- /registry -->"
            )
        if name not in TABLES:
            raise PluginError(
                f"registries hook: {page.file.src_uri}: no registry table {name!r} (one of {sorted(TABLES)})"
            )
        return TABLES[name]().rstrip("\n")

    return MARKER.sub(table, markdown)


def _importable(root: Path) -> None:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _augment_presets() -> str:
    from tasks.core.config.data import SOURCES
    from tasks.core.config.train import AUGMENT_PRESETS

    def auto_for(name: str) -> str:
        users = [f"`{source}`" for source, entry in SOURCES.items() if name in _augments(entry.recipe)]
        return ", ".join(users) or "-"

    rows = [
        (
            f"`{name}`",
            preset.summary,
            "yes" if preset.shifts else "no",
            "yes" if preset.mirrors else "no",
            auto_for(name),
        )
        for name, preset in AUGMENT_PRESETS.items()
    ]
    return _table(("`augment`", "what happens to each training image", "`random_shift`", "`hflip`", "`auto` of"), rows)


def _augments(recipe: Any) -> set[str]:
    return {recipe.augment, *([recipe.greyscale_augment] if recipe.greyscale_augment else [])}


def _sources() -> str:
    from tasks.core.config.data import SOURCES

    rows = [(f"`{name}`", source.summary, source.needs) for name, source in SOURCES.items()]
    return _table(("source", "what", "needs"), rows)


def _source_recipes() -> str:
    from tasks.core.config.data import SOURCES

    rows = []
    for name, source in SOURCES.items():
        recipe = source.recipe
        augment = f"`{recipe.augment}`"
        if recipe.greyscale_augment:
            augment = f"`{recipe.greyscale_augment}` with `data.channels: 1`, else {augment}"
        rows.append(
            (
                f"`{name}`",
                f"`{recipe.model}`",
                _from_data(recipe.epochs, recipe.epochs),
                _from_data(recipe.lr, recipe.lr),
                "yes" if recipe.hflip else "no",
                augment,
                _from_data(recipe.early_stop_patience, recipe.early_stop_patience or "no"),
                _from_data(recipe.class_balance, f"`{recipe.class_balance}`"),
                _from_data(recipe.keep, f"`{recipe.keep}`"),
            )
        )
    columns = (
        "source",
        "model",
        "epochs",
        "learning rate",
        "mirroring",
        "augment",
        "early stop",
        "class balance",
        "kept epoch",
    )
    return _table(columns, rows)


def _from_data(value: object, shown: object) -> object:
    """A recipe's cell: `shown`, or what the train stage does with a value left to the data."""
    from tasks.core.config.data import FROM_DATA

    return "from the data" if value == FROM_DATA else shown


def _models() -> str:
    from tasks.core.config.train import MODELS

    rows = [(f"`{name}`", model.summary) for name, model in MODELS.items()]
    rows.append(
        ("any torchvision classifier", "by its name (`resnet18`, `mobilenet_v3_small`, ...; TORCHVISION_MODELS)")
    )
    return _table(("`model`", "what"), rows)


def _variants() -> str:
    from tasks.core.config.ship import COMPRESSION_VARIANTS

    return _table(("variant", "how"), [(f"`{name}`", v.summary) for name, v in COMPRESSION_VARIANTS.items()])


def _formats() -> str:
    from tasks.core.config.ship import EXPORT_FORMATS

    rows = [(f"`{name}`", f"`{fmt.file}`", fmt.summary) for name, fmt in EXPORT_FORMATS.items()]
    return _table(("format", "file (artifacts/export/)", "what"), rows)


def _notify_formats() -> str:
    from tasks.core.config.service import NOTIFY_FORMATS

    return _table(("`notify.format`", "what it posts"), [(f"`{n}`", f.summary) for n, f in NOTIFY_FORMATS.items()])


# Each table by the params key its registry's entries are named in (Registry.key; recipes: the sources').
TABLES: dict[str, Callable[[], str]] = {
    "train.augment": _augment_presets,
    "data.source": _sources,
    "data.source.recipes": _source_recipes,
    "train.model": _models,
    "compress.variants": _variants,
    "export.formats": _formats,
    "orchestration.notify.format": _notify_formats,
}
