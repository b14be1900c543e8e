"""Data, model and training loop of the plain Flower baseline (loaded once per process).

The benchmark driver writes the federation to one ``torch.save`` file (every client's
training tensors and the central test set) and names it in ``FLOWER_PLAIN_DATA``; each
Ray actor memory-maps it once, on its first message, and keeps it in this module.
``FLOWER_PLAIN_THREADS``, when set, fixes each process's torch threads on import (the
driver sets 1 for the client actors).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.models.zoo import CNNMnistConfig, MLPConfig, build_cnn_mnist, build_mlp

DATA_VARIABLE = "FLOWER_PLAIN_DATA"
THREADS_VARIABLE = "FLOWER_PLAIN_THREADS"
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10

if os.environ.get(THREADS_VARIABLE):
    torch.set_num_threads(int(os.environ[THREADS_VARIABLE]))

_DATA: dict[str, Any] = {}
_MODELS: dict[str, nn.Module] = {}


def _data() -> dict[str, Any]:
    if not _DATA:
        path = os.environ.get(DATA_VARIABLE)
        if not path:
            raise RuntimeError(
                f"set {DATA_VARIABLE} to the data file written by bench_vs_flower.py"
            )
        _DATA.update(torch.load(path, mmap=True, weights_only=True))
    return _DATA


def client_data(partition_id: int) -> tuple[Tensor, Tensor]:
    """The training inputs and labels of client ``partition_id``."""
    data = _data()
    return data["train_x"][partition_id], data["train_y"][partition_id]


def test_data() -> tuple[Tensor, Tensor]:
    """The central MNIST test set."""
    data = _data()
    return data["test_x"], data["test_y"]


def build_model(name: str, seed: int = 0) -> nn.Module:
    """``mlp`` or ``cnn_mnist`` from fedplug's zoo, initialised from ``seed`` (as fedplug does)."""
    builders = {"mlp": (build_mlp, MLPConfig()), "cnn_mnist": (build_cnn_mnist, CNNMnistConfig())}
    builder, config = builders[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(config, INPUT_SHAPE, NUM_CLASSES)


def cached_model(name: str) -> nn.Module:
    """One model per process, reused for every message (its weights are overwritten)."""
    if name not in _MODELS:
        _MODELS[name] = build_model(name)
    return _MODELS[name]


def train_epoch(
    model: nn.Module, x: Tensor, y: Tensor, batch_size: int, lr: float, seed: int
) -> int:
    """One epoch of plain mini-batch SGD in a random order drawn from ``seed``."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    steps = 0
    for batch_ids in torch.split(order, batch_size):
        loss = F.cross_entropy(model(x[batch_ids]), y[batch_ids])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on ``x, y``."""
    model.eval()
    correct, total_loss = 0, 0.0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        total_loss += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    model.train()
    return correct / len(y), total_loss / len(y)
