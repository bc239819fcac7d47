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
from torchvision.models._api import Weights, WeightsEnum

from benchmarks.httpserver import FileServer
from tasks.core.config.train import TrainConfig
from tasks.data.fetch import DownloadError
from tasks.train.models import build_model
from tasks.train.pretrained import PretrainedError, load_pretrained, published_weights

SMALL = {"num_classes": 5, "size": [16, 16]}  # greyscale 16x16, 5 classes


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
        cfg = TrainConfig(model="resnet18", pretrained="IMAGENET1K_V1", pretrained_mirror=server.url_for("/models"))
        with pytest.raises(
            DownloadError, match=r"checksum mismatch for resnet18-f37072fd.pth: expected f37072fd\.\.\."
        ):
            load_pretrained(cfg, model, tmp_path / "cache")
    assert not (tmp_path / "cache" / "weights" / "resnet18-f37072fd.pth").exists()  # nothing kept under its name
    planted = tmp_path / "resnet18-f37072fd.pth"  # and given to an offline machine
    planted.write_bytes(b"not torchvision's resnet18")
    offline = TrainConfig(model="resnet18", pretrained="IMAGENET1K_V1", pretrained_path=str(planted))
    with pytest.raises(PretrainedError, match=r"but torchvision publishes f37072fd\.\.\.; not loaded"):
        load_pretrained(offline, model, tmp_path / "cache")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.fixture
def published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, str]:
    """mobilenet_v3_small weights made here (ImageNet's shapes, a torch state dict as torchvision saves
    them), published under a torchvision-style name whose hash prefix is theirs, at a host nobody answers."""
    import torchvision

    torch.manual_seed(1)
    buffer = io.BytesIO()
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), buffer)
    data = buffer.getvalue()
    name = f"mobilenet_v3_small-{hashlib.sha256(data).hexdigest()[:8]}.pth"

    class Published(WeightsEnum):
        IMAGENET1K_V1 = Weights(url=f"http://127.0.0.1:9/models/{name}", transforms=None, meta={})
        DEFAULT = IMAGENET1K_V1

    real = torchvision.models.get_model_weights
    monkeypatch.setattr(
        torchvision.models,
        "get_model_weights",
        lambda model: Published if model == "mobilenet_v3_small" else real(model),
    )
    return data, name


def test_published_weights_come_through_the_mirror_once_are_checked_and_fit(
    published: tuple[bytes, str], tmp_path: Path
) -> None:
    data, name = published
    digest = hashlib.sha256(data).hexdigest()
    with FileServer() as server:
        server.add(f"/mirror/{name}", data)
        cfg = TrainConfig(
            model="mobilenet_v3_small", pretrained="IMAGENET1K_V1", pretrained_mirror=server.url_for("/mirror")
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
    offline = TrainConfig(model="mobilenet_v3_small", pretrained="DEFAULT", pretrained_path=str(cached))
    loaded = load_pretrained(offline, model, tmp_path / "other-cache")
    assert loaded is not None and loaded.sha256 == digest and not (tmp_path / "other-cache").exists()
    reference = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(model.net.features[1].block[0][0].weight, reference["features.1.block.0.0.weight"])


def test_a_full_sha256_given_beside_the_name_is_checked_too(published: tuple[bytes, str], tmp_path: Path) -> None:
    data, name = published
    given = tmp_path / name
    given.write_bytes(data)
    cfg = TrainConfig(
        model="mobilenet_v3_small", pretrained="IMAGENET1K_V1", pretrained_path=str(given), pretrained_sha256="0" * 64
    )
    with pytest.raises(PretrainedError, match=r"but train.pretrained_sha256 is 0{64}"):
        load_pretrained(cfg, _model("mobilenet_v3_small"), tmp_path / "cache")
