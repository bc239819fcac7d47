"""`train.pretrained`: torchvision's published weights by name, fetched and checked offline (issue 37, point 2).

No machine here holds torchvision's real files, so each part is shown where it can be real:
- the lookup is torchvision's own registry: the real URL and the hash prefix in its file name;
- a file served from loopback under that real name, whose bytes are not torchvision's, is refused;
- the whole path (the mirror, the downloader, its cache, the hash check, the fit, the lineage, the file
  given to an offline machine) runs on weights made here, published in a torchvision `WeightsEnum` of
  their own (the one stand-in: torchvision's registry answers with it for the test's model).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from benchmarks.httpserver import FileServer
from tasks.core.config.train import TrainConfig
from tasks.core.fetch import DownloadError
from tasks.train.models import build_model
from tasks.train.pretrained import PretrainedError, load_pretrained, published_weights
from tests.support.published_weights import publish

SMALL = {"num_classes": 5, "size": [16, 16]}  # greyscale 16x16, 5 classes
PIN = "f37072fd" + "0" * 56  # a full sha256 consistent with resnet18 IMAGENET1K_V1's name (not its file)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, SMALL["num_classes"], [0.5], [0.25], SMALL["size"])


def test_a_name_resolves_to_torchvision_s_published_url_and_hash() -> None:
    url, prefix = published_weights("resnet18", "IMAGENET1K_V1")
    assert url == "https://download.pytorch.org/models/resnet18-f37072fd.pth" and prefix == "f37072fd"
    assert published_weights("resnet18", "DEFAULT") == (url, prefix)
    assert published_weights("mobilenet_v3_small", "IMAGENET1K_V1")[1] == "047dcff4"
    with pytest.raises(PretrainedError, match=r"NOPE is not a weights name of resnet18 \(DEFAULT, IMAGENET1K_V1\)"):
        published_weights("resnet18", "NOPE")


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"model": "resnet9", "pretrained": "IMAGENET1K_V1"}, "resnet9 has no published weights"),
        ({"model": "resnet18", "pretrained": "imagenet"}, "should match pattern"),
        (
            {"model": "resnet18", "pretrained": "IMAGENET1K_V1", "pretrained_url": "https://example.org/w.pth"},
            "give one",
        ),
        ({"model": "resnet18", "pretrained_mirror": "https://mirror.example.org/models"}, "set pretrained"),
    ],
)
def test_bad_settings_name_the_key(train: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**train)


def test_a_file_under_the_published_name_with_other_bytes_is_refused(tmp_path: Path) -> None:
    model = _model("resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with FileServer() as server:
        server.add("/models/resnet18-f37072fd.pth", b"not torchvision's resnet18" * 100)
        mirror = server.url_for("/models")
        cfg = TrainConfig(model="resnet18", pretrained="IMAGENET1K_V1", pretrained_mirror=mirror, pretrained_sha256=PIN)
        with pytest.raises(DownloadError, match=f"checksum mismatch for resnet18-f37072fd.pth: expected {PIN}"):
            load_pretrained(cfg, model, tmp_path / "cache")
    assert not (tmp_path / "cache" / "weights" / "resnet18-f37072fd.pth").exists()  # nothing kept under its name
    planted = tmp_path / "resnet18-f37072fd.pth"  # and given to an offline machine
    planted.write_bytes(b"not torchvision's resnet18")
    offline = TrainConfig(
        model="resnet18", pretrained="IMAGENET1K_V1", pretrained_path=str(planted), pretrained_sha256=PIN
    )
    with pytest.raises(PretrainedError, match=f"but train.pretrained_sha256 is {PIN}; not loaded"):
        load_pretrained(offline, model, tmp_path / "cache")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, str]:
    """mobilenet_v3_small weights published under a torchvision-style name, at a host nobody answers."""
    return publish(monkeypatch, "http://127.0.0.1:9/models")


def test_published_weights_come_through_the_mirror_once_are_checked_and_fit(
    published: tuple[bytes, str], tmp_path: Path
) -> None:
    data, name = published
    digest = hashlib.sha256(data).hexdigest()
    with FileServer() as server:
        server.add(f"/mirror/{name}", data)
        mirror = server.url_for("/mirror")
        cfg = TrainConfig(
            model="mobilenet_v3_small", pretrained="IMAGENET1K_V1", pretrained_mirror=mirror, pretrained_sha256=digest
        )
        first = load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")
        again = load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")  # from the cache
        assert server.count(f"/mirror/{name}") == 1
    assert first is not None and first == again
    assert first.sha256 == digest  # the whole digest in the lineage, not only the published prefix
    assert first.source == f"{server.url_for('/mirror')}/{name} (mobilenet_v3_small IMAGENET1K_V1)"
    # 1000 ImageNet classes -> 5, 3 channels -> 1 (summed): the head and the first conv refitted
    assert "classifier.3.weight" in first.reinitialised
    cached = tmp_path / "cache" / "weights" / name
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == digest

    # an offline machine given the file: no server, the same weights and lineage
    model = _model("mobilenet_v3_small")
    offline = TrainConfig(
        model="mobilenet_v3_small", pretrained="DEFAULT", pretrained_path=str(cached), pretrained_sha256=digest
    )
    loaded = load_pretrained(offline, model, tmp_path / "other-cache")
    assert loaded is not None and loaded.sha256 == digest and not (tmp_path / "other-cache").exists()
    reference = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(model.net.features[1].block[0][0].weight, reference["features.1.block.0.0.weight"])


def test_a_full_sha256_given_beside_the_name_is_checked_too(published: tuple[bytes, str], tmp_path: Path) -> None:
    data, name = published
    given = tmp_path / name
    given.write_bytes(data)
    pin = name[-12:-4] + "0" * 56  # consistent with the published name, not the file
    cfg = TrainConfig(
        model="mobilenet_v3_small", pretrained="IMAGENET1K_V1", pretrained_path=str(given), pretrained_sha256=pin
    )
    with pytest.raises(PretrainedError, match=f"but train.pretrained_sha256 is {pin}"):
        load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")


# --- issue 66, point 2: the full 256-bit digest, and no plain http for weights -----------------------


@pytest.mark.parametrize("key", ["pretrained_mirror", "pretrained_path"])
def test_a_mirror_or_a_file_for_published_weights_needs_their_full_sha256(key: str) -> None:
    """The file name's 8 hex digits are 32 bits: ~2^32 hashes forge weights a mirror serves or a file holds."""
    value = "https://mirror.example.org/models" if key == "pretrained_mirror" else "resnet18-f37072fd.pth"
    with pytest.raises(ValidationError, match=f"pretrained_sha256: required with {key}: torchvision's file name"):
        TrainConfig(model="resnet18", pretrained="IMAGENET1K_V1", **{key: value})
    assert TrainConfig(model="resnet18", pretrained="IMAGENET1K_V1", **{key: value}, pretrained_sha256=PIN)


@pytest.mark.parametrize(
    ("key", "extra"),
    [("pretrained_mirror", {"pretrained": "IMAGENET1K_V1"}), ("pretrained_url", {})],
)
def test_plain_http_for_weights_is_refused_except_on_loopback(key: str, extra: dict) -> None:
    given = {"model": "resnet18", "pretrained_sha256": PIN, **extra}
    for url in ("http://mirror.example.org/models", "http://10.0.0.7/w.pth", "http://127.0.0.1.example.org/w"):
        with pytest.raises(ValidationError, match=f"{key}: plain http:// for weights: use https://"):
            TrainConfig(**given, **{key: url})
    for url in ("https://mirror.example.org/models", "http://127.0.0.1:8000/m", "http://localhost/m", "http://[::1]/m"):
        assert TrainConfig(**given, **{key: url})


def test_a_mirror_download_is_checked_against_the_full_digest_and_nothing_unverified_is_kept(
    published: tuple[bytes, str], tmp_path: Path
) -> None:
    """A file that passes the name's 32-bit check but not the pinned digest: refused while it downloads, not
    kept in the cache under the published name (where a later run would have reused it on the prefix alone)."""
    data, name = published
    pin = name[-12:-4] + "0" * 56
    with FileServer() as server:
        server.add(f"/mirror/{name}", data)
        mirror = server.url_for("/mirror")
        cfg = TrainConfig(
            model="mobilenet_v3_small", pretrained="IMAGENET1K_V1", pretrained_mirror=mirror, pretrained_sha256=pin
        )
        with pytest.raises(DownloadError, match=f"checksum mismatch for {name}: expected {pin}, got "):
            load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")
        assert not (tmp_path / "cache" / "weights" / name).exists()

        # a pin that cannot be the published file (another prefix): refused before any request
        cfg = cfg.model_copy(update={"pretrained_sha256": "0" * 64})
        with pytest.raises(PretrainedError, match=f"train.pretrained_sha256 is {'0' * 64}, but torchvision publishes"):
            load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")
        assert server.count(f"/mirror/{name}") == 1


def test_pretrained_max_bytes_is_bounded_and_a_device_is_refused_unread(tmp_path: Path) -> None:
    """`pretrained_path: /dev/zero` with a huge bound filled memory; now a device or FIFO is never read, and
    the bound itself stays within what a machine holds (the bytes are read into memory to be hashed once)."""
    with pytest.raises(ValidationError, match="pretrained_max_bytes"):
        TrainConfig(pretrained_path="w.pth", pretrained_sha256="0" * 64, pretrained_max_bytes=1 << 40)
    cfg = TrainConfig(pretrained_path="/dev/zero", pretrained_sha256="0" * 64, pretrained_max_bytes=256 << 20)
    with pytest.raises(PretrainedError, match="^/dev/zero: not a regular file"):
        load_pretrained(cfg, _model("small_cnn"), tmp_path)
