"""Stage 1 — download: ingest a data source into `data/` (format in tasks/data/formats.py).

Sources (`data.source`): the registry tasks/core/config/data.py `SOURCES` names them (with what each
is, needs, and its training recipe); each registers its loader here, `@LOADERS.register(name)`:
    digits         scikit-learn's 8x8 digits; ships inside scikit-learn, so it works offline
    mnist, fashion_mnist, cifar10, cifar100
                   the published files, URLs and md5 checksums of torchvision's dataset classes,
                   fetched by tasks/core/fetch.py (retries, resume, verify, lock) and read by those classes
    imagefolder    class sub-folders: a local folder or archive (`data.path`), or an archive URL
                   with its sha256 (`data.url`, `data.sha256`)

Downloads land in a cache outside data/ (`cache_dir`); data/ is replaced in one atomic step only
after everything was fetched, verified and decoded, so a failure at any point leaves it as it was.
Every download, archive and image is held to the limits in `data` (size, deadline, extracted size,
ratio and member count, pixels per image, decoded bytes); credentials come from the environment
or ~/.netrc (tasks/core/credentials.py), so that params.yaml and dvc.lock need not hold them.
Train and test parts of the published datasets are concatenated (train first) and their row ranges
recorded in meta.json (`published_splits`), so that the split stage can keep the published test set.
"""

from __future__ import annotations

import filecmp
import gzip
import importlib.util
import logging
import posixpath
import shutil
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import numpy as np

from tasks.core.atomic import atomic_dir, scratch_dir
from tasks.core.config.data import SOURCES, DataConfig
from tasks.core.credentials import AUTH_ENV, TOKEN_ENV, Auth
from tasks.core.errors import ExpectedFailure, Refused
from tasks.core.fetch import Checksum, Retry, fetch, verify
from tasks.core.plain_pickle import NotPlainData, load_plain
from tasks.core.redact import SECRET_NAME, redact
from tasks.core.registry import Implementations
from tasks.data.archive import ArchiveLimits, extract, is_archive
from tasks.data.folders import ImageLimits, ingest_folder
from tasks.data.formats import PublishedSplits, RawDataset, RawSnapshot, open_raw, read_raw, write_raw

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadResult:
    source: str
    num_images: int
    num_classes: int
    image_shape: tuple[int, ...]
    files: dict[str, str] = field(default_factory=dict)  # verified input file -> "algorithm:hexdigest"
    skipped_files: int = 0  # imagefolder: files without an image extension


@dataclass
class Context:
    """What a source's loader gets: the `data` section, its cache folder, and `fetch` / `extract`, which
    hold every download and archive to the section's limits and record what was verified."""

    cfg: DataConfig
    cache: Path  # this source's download cache folder
    retry: Retry
    auth: Auth
    files: dict[str, str] = field(default_factory=dict)  # filled with what was fetched and verified
    skipped_files: int = 0

    def fetch(self, name: str, published: list[str], checksum: Checksum) -> Path:
        """`name` from the mirror if one is set (else the published base URLs), verified, cached."""
        bases = [self.cfg.mirror] if self.cfg.mirror else published
        urls = [f"{base.rstrip('/')}/{name}" for base in bases]
        path = fetch(urls, self.cache / name, checksum, self.retry, self.cfg.max_download_bytes, self.auth)
        self.files[name] = f"{checksum.algorithm}:{checksum.hexdigest}"
        return path

    def extract(self, archive: Path, dest: Path) -> Path:
        cfg = self.cfg
        limits = ArchiveLimits(cfg.max_extracted_bytes, cfg.max_compression_ratio, cfg.max_archive_files)
        return extract(archive, dest, limits)


# Each source of SOURCES writes the snapshot into the folder it is given (through tasks/data/formats.py:
# `write_raw` for one in memory, `ingest_folder` for one streamed), fetching through `ctx` (mirror, retries,
# limits, credentials, the receipt's list of verified files).
LOADERS: Implementations[Callable[[Context, Path], None]] = Implementations(SOURCES)


def in_memory(load: Callable[[Context], RawDataset]) -> Callable[[Context, Path], None]:
    """A source small enough to hold in memory (at most CIFAR's 184 MB), written in one go."""
    return lambda ctx, out_dir: write_raw(load(ctx), out_dir)


@LOADERS.register("digits")
@in_memory
def _digits(ctx: Context) -> RawDataset:
    # scikit-learn ships the UCI digits in its package, and `load_digits` is np.loadtxt of that gzip'd
    # CSV (64 pixels, then the label, a row an image). The file is read here the same way, without
    # importing scikit-learn: its import (scipy and all) was 1.2 s of a 3-s re-read of the source on the
    # Intel Xeon, ~4 s on the AMD EPYC (2026-12-04), paid by every download of the default dataset.
    # tests/data/test_data_stages.py holds the result to `load_digits`'.
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or spec.origin is None:
        raise ExpectedFailure("the digits source needs scikit-learn installed (it ships the images)")
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", "rt", encoding="utf-8") as csv:
        table = np.loadtxt(csv, delimiter=",")
    # Pixel values are counts 0..16 of a 4x4 block; rescale exactly onto the common 0..255 range.
    images = np.rint(table[:, :-1].reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)[..., np.newaxis]
    return RawDataset(
        images=images,
        labels=table[:, -1].astype(np.int64),
        classes=[str(name) for name in range(10)],
        source="digits",
    )


def _mnist_like(dataset_class: str) -> Callable[[Context], RawDataset]:
    def load(ctx: Context) -> RawDataset:
        # heavy: torchvision loads torch (~4 s), only for a torchvision source; the data stages run without torch
        import torchvision.datasets

        cls = getattr(torchvision.datasets, dataset_class)
        with scratch_dir(ctx.cache, "unpacked") as scratch:  # a killed read's copy: removed by the next
            raw_folder = scratch / cls.__name__ / "raw"  # where torchvision's class looks
            raw_folder.mkdir(parents=True)
            for name, md5 in cls.resources:
                archive = ctx.fetch(name, cls.mirrors, Checksum("md5", md5))
                with gzip.open(archive, "rb") as src, open(raw_folder / name.removesuffix(".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            parts = [cls(scratch, train=train, download=False) for train in (True, False)]
            images = np.concatenate([part.data.numpy() for part in parts])[..., np.newaxis]
            labels = np.concatenate([part.targets.numpy() for part in parts]).astype(np.int64)
            return RawDataset(images, labels, list(parts[0].classes), ctx.cfg.source, _train_then_test(parts))

    return load


def _cifar(dataset_class: str) -> Callable[[Context], RawDataset]:
    def load(ctx: Context) -> RawDataset:
        # heavy: torchvision loads torch (~4 s), only for a torchvision source; the data stages run without torch
        import torchvision.datasets

        cls = getattr(torchvision.datasets, dataset_class)  # its URL, md5s and file names; it reads nothing
        base_url = cls.url.rsplit("/", 1)[0]
        archive = ctx.fetch(cls.filename, [base_url], Checksum("md5", cls.tgz_md5))
        with scratch_dir(ctx.cache, "unpacked") as scratch:  # a killed read's copy: removed by the next
            ctx.extract(archive, scratch / "x")
            folder = scratch / "x" / cls.base_folder
            # The batches are pickles: decoded by tasks/core/plain_pickle.py, which rebuilds arrays and
            # calls nothing else (torchvision's own reader would `pickle.load` them).
            parts = [_cifar_part(folder, files) for files in (cls.train_list, cls.test_list)]
            verify(folder / cls.meta["filename"], Checksum("md5", cls.meta["md5"]))
            meta = _plain(folder / cls.meta["filename"])
            images = np.concatenate([images for images, _ in parts])
            labels = np.concatenate([labels for _, labels in parts]).astype(np.int64)
            n_train = len(parts[0][1])
            splits: PublishedSplits = {"train": (0, n_train), "test": (n_train, len(labels))}
            classes = [str(name) for name in meta[cls.meta["key"]]]
            return RawDataset(images, labels, classes, ctx.cfg.source, splits)

    return load


def _cifar_part(folder: Path, files: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """One published part's images (N, 32, 32, 3) and labels, from its batches, each md5-checked."""
    images, labels = [], []
    for name, md5 in files:
        verify(folder / name, Checksum("md5", md5))
        entry = _plain(folder / name)
        images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(np.asarray(entry["labels"] if "labels" in entry else entry["fine_labels"]))
    return np.concatenate(images), np.concatenate(labels)


def _plain(batch: Path) -> Any:
    try:
        return load_plain(batch.read_bytes())
    except NotPlainData as exc:
        where = f"{batch.parent.name}/{batch.name}"
        raise Refused(f"{where}: {exc} (a CIFAR batch holds arrays, lists and names only)") from None


def _train_then_test(parts: list[Sized]) -> PublishedSplits:
    """The rows of the published train and test parts, concatenated in that order."""
    n_train, n_test = (len(part) for part in parts)
    return {"train": (0, n_train), "test": (n_train, n_train + n_test)}


LOADERS.register("mnist")(in_memory(_mnist_like("MNIST")))
LOADERS.register("fashion_mnist")(in_memory(_mnist_like("FashionMNIST")))
LOADERS.register("cifar10")(in_memory(_cifar("CIFAR10")))
LOADERS.register("cifar100")(in_memory(_cifar("CIFAR100")))


@LOADERS.register("imagefolder")
def _imagefolder(ctx: Context, out_dir: Path) -> None:
    """Streamed block by block (user folders can be any size)."""
    cfg = ctx.cfg
    archive = _imagefolder_archive(ctx)
    with scratch_dir(ctx.cache, "unpacked") as scratch:  # a killed read's extracted archive: removed by the next
        folder = Path(cfg.path or "") if archive is None else ctx.extract(archive, scratch / "x")
        limits = ImageLimits(cfg.max_image_pixels, cfg.max_dataset_bytes)
        found = ingest_folder(folder, out_dir, cfg.channels or 3, cfg.image_size, "imagefolder", limits)
    ctx.skipped_files = len(found.skipped)


def _imagefolder_archive(ctx: Context) -> Path | None:
    """The verified archive to extract (fetched when `data.url`), or None for a local folder."""
    cfg = ctx.cfg
    if cfg.url is not None:
        assert cfg.sha256 is not None  # DataConfig requires it with url
        name = _file_name(cfg.url)
        # one folder per content hash: two URLs with the same file name never share a cache entry
        dest, checksum = ctx.cache / cfg.sha256[:16] / name, Checksum("sha256", cfg.sha256)
        archive = fetch([cfg.url], dest, checksum, ctx.retry, cfg.max_download_bytes, ctx.auth)
        ctx.files[name] = f"sha256:{cfg.sha256}"
        return archive
    local = Path(cfg.path or "")
    if not local.exists():
        raise ExpectedFailure(f"data.path: {local} does not exist")
    if local.is_dir():
        return None
    if not is_archive(local):
        raise ExpectedFailure(f"data.path: {local} is neither a folder nor an archive (.tar.gz, .zip, ...)")
    if cfg.sha256 is not None:
        verify(local, Checksum("sha256", cfg.sha256))
        ctx.files[local.name] = f"sha256:{cfg.sha256}"
    return local


def _file_name(url: str) -> str:
    """The archive's file name: the URL path's last segment, never its query (a signed URL's token
    would otherwise name a cache file and the receipt's entry)."""
    name = posixpath.basename(unquote(urlsplit(url).path))
    if not name or name in (".", "..") or not name.isprintable() or "\\" in name:
        raise ExpectedFailure(f"data.url: {redact(url)} does not end in a file name (e.g. .../flowers.tar.gz)")
    return name


def _holds_credentials(url: str) -> bool:
    """User info, or a query or fragment parameter named like a secret (`?token=`, `&X-Amz-Signature=`)."""
    try:
        parts = urlsplit(url)
        names = [name for name, _ in parse_qsl(f"{parts.query}&{parts.fragment}")]
    except ValueError:
        return False
    return "@" in parts.netloc or any(SECRET_NAME.search(name) or "sig" in name.lower() for name in names)


def _warn_about_credentials_in_params(cfg: DataConfig) -> None:
    for key, url in (("data.mirror", cfg.mirror), ("data.url", cfg.url)):
        if url and _holds_credentials(url):  # params.yaml, dvc.lock and git hold them now
            log.warning(
                "%s carries credentials, which params.yaml and dvc.lock record; set %s or %s, or use ~/.netrc",
                key,
                TOKEN_ENV,
                AUTH_ENV,
            )


def download(
    cfg: DataConfig,
    out_dir: Path,
    cache_dir: Path,
    retry: Retry | None = None,
    check: Callable[[RawSnapshot], None] | None = None,
) -> DownloadResult:
    """Ingest `cfg.source` into `out_dir`, replacing any previous snapshot atomically.

    `check` sees the new snapshot before it replaces the old one, and refuses it by raising (the
    data checks, tasks/data/checks.py). Raises ExpectedFailure (a DownloadError for network and checksum
    failures, DataRefused for a refused snapshot) with a message naming the file, URL or check;
    `out_dir` is then exactly as it was.
    """
    ctx = _context(cfg, cache_dir, retry)
    with atomic_dir(Path(out_dir)) as staging:
        LOADERS[cfg.source](ctx, staging)
        if check is not None:
            check(open_raw(staging))
    written = read_raw(out_dir)  # read back: what later stages will see
    return DownloadResult(
        source=written.source,
        num_images=len(written.labels),
        num_classes=len(written.classes),
        image_shape=tuple(written.images.shape[1:]),
        files=dict(ctx.files),
        skipped_files=ctx.skipped_files,
    )


def source_unchanged(cfg: DataConfig, out_dir: Path, cache_dir: Path, retry: Retry | None = None) -> bool:
    """Whether `cfg.source`, read again now, gives the snapshot in `out_dir` byte for byte.

    The scheduled re-read's question, asked before anything is recorded: most nights the answer is
    yes, and then nothing is replaced, checked or tracked (the checks are for a snapshot that would
    replace the one there, tasks/data/checks.py). The new snapshot is staged in the download cache,
    never beside `out_dir`, and removed whatever the answer (a killed re-read's, by the next one);
    `out_dir` is only read. Raises as `download` does when the source cannot be read.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return False
    ctx = _context(cfg, cache_dir, retry)
    with scratch_dir(ctx.cache, "reread") as staging:
        LOADERS[cfg.source](ctx, staging)
        return _same_files(staging, out_dir)


def _context(cfg: DataConfig, cache_dir: Path, retry: Retry | None) -> Context:
    retry = retry or Retry(attempts=cfg.retries + 1, timeout_s=cfg.timeout_s, deadline_s=cfg.deadline_s)
    _warn_about_credentials_in_params(cfg)
    cache = Path(cache_dir) / cfg.source
    cache.mkdir(parents=True, exist_ok=True)
    return Context(cfg, cache, retry, Auth.from_environment([cfg.mirror, cfg.url]))


def _same_files(a: Path, b: Path) -> bool:
    """The same relative paths under `a` and `b`, each a regular file with the same bytes."""
    listed = [sorted(p.relative_to(root) for p in root.rglob("*")) for root in (a, b)]
    if listed[0] != listed[1]:
        return False
    for rel in listed[0]:
        one, other = a / rel, b / rel
        if one.is_symlink() or other.is_symlink():  # a loader writes none, and data/ should hold none
            return False
        if one.is_dir() and other.is_dir():
            continue
        if not (one.is_file() and other.is_file()) or not filecmp.cmp(one, other, shallow=False):
            return False
    return True
