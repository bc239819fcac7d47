"""How hard a check dataset is: a linear model on raw pixels against a small CNN, trained and tested on it."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.synthetic_images.datasets import generate
from tasks.determinism.bootstrap import start


def _linear_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> dict:
    """Multinomial logistic regression on standardised raw pixels: what a model without spatial structure gets."""
    # torch and scikit-learn load only to check a dataset: generating and writing one needs numpy alone
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    t0 = time.perf_counter()
    scaler = StandardScaler().fit(x_train.reshape(len(x_train), -1).astype(np.float32))
    features = [scaler.transform(x.reshape(len(x), -1).astype(np.float32)) for x in (x_train, x_test)]
    # C = 0.01: the best of 1, 0.1, 0.01 and 0.001 on glyphs and garments (shapes: 10-14% at all four).
    model = LogisticRegression(C=0.01, max_iter=1000).fit(features[0], y_train)
    return {"linear_acc": float((model.predict(features[1]) == y_test).mean()), "linear_s": time.perf_counter() - t0}


def _pooled_cnn(channels: int, classes: int, width: int = 32):  # -> torch.nn.Module (torch imported lazily)
    """A CIFAR-style small CNN: four conv blocks with three 2x2 pools, so that its view (~40 px) takes in a
    whole object; small_cnn (one pool, ~10 px) sees corners and strokes, not shapes."""
    # torch and scikit-learn load only to check a dataset: generating and writing one needs numpy alone
    from torch import nn

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    w = width
    return nn.Sequential(
        *(block(channels, w), nn.MaxPool2d(2), block(w, 2 * w), nn.MaxPool2d(2)),
        *(block(2 * w, 4 * w), nn.MaxPool2d(2), block(4 * w, 4 * w)),
        *(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes)),
    )


def _cnn_accuracy(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, epochs: int, model_name: str
) -> dict:
    """`model_name` (pooled_cnn, or a tasks.train.models name) trained with params.yaml's recipe, plain
    PyTorch on the CPU."""
    # torch and scikit-learn load only to check a dataset: generating and writing one needs numpy alone
    import torch
    import torch.nn.functional as F

    from tasks.train.models import Classifier, build_model, predict

    train = torch.from_numpy(x_train).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(y_train)
    pixels = train.float().div(255)
    mean, std, classes = pixels.mean((0, 2, 3)).tolist(), pixels.std((0, 2, 3)).tolist(), int(y_train.max()) + 1
    if model_name == "pooled_cnn":
        model = Classifier(_pooled_cnn(len(mean), classes), mean, std)
    else:
        model = build_model(model_name, classes, mean, std, list(x_train.shape[1:3]))
    # params.yaml's train section: SGD lr 0.05, momentum 0.9, weight decay 5e-4, cosine, batch 64,
    # label smoothing 0.1, random shift 1 px.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for batch in torch.randperm(len(train)).split(64):
            dy, dx = torch.randint(-1, 2, (2,)).tolist()  # one random shift per batch, zero-filled
            x = torch.roll(F.pad(train[batch].float().div(255), (1, 1, 1, 1)), (dy, dx), (2, 3))[..., 1:-1, 1:-1]
            loss = F.cross_entropy(model(x), labels[batch], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
    train_s = time.perf_counter() - t0
    logits = predict(model, x_test.transpose(0, 3, 1, 2).copy(), torch.device("cpu"), 256)
    accuracy = float((logits.argmax(1).numpy() == y_test).mean())
    return {"model": model_name, "cnn_acc": accuracy, "cnn_train_s": train_s, "epochs": epochs}


def difficulty(
    name: str,
    train_per_class: int = 500,
    test_per_class: int = 100,
    epochs: int = 15,
    seed: int = 0,
    model: str = "pooled_cnn",
    threads: int = 2,
) -> dict:
    """Test accuracy of a linear model on pixels and of a CNN, trained on `train_per_class` images a class.

    The test images are the numbers after the training ones: unseen. A dataset with real structure
    separates the two clearly; one that a CNN gets entirely right is too easy to tell models apart.
    """
    start(seed, threads, strict=False)  # as every process starts (tasks/determinism/bootstrap.py); warn-only
    t0 = time.perf_counter()
    x_train, y_train, _ = generate(name, train_per_class, seed)
    x_test, y_test, _ = generate(name, test_per_class, seed, start=train_per_class)
    result = {"dataset": name, "train": len(y_train), "test": len(y_test), "threads": threads}
    result["generate_s"] = time.perf_counter() - t0
    result |= _linear_accuracy(x_train, y_train, x_test, y_test)
    result |= _cnn_accuracy(x_train, y_train, x_test, y_test, epochs, model)
    return result
