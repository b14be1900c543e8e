"""The global model of a run: which device it lives on and how it is initialised."""

from __future__ import annotations

from typing import Any

import torch

from fedplug.data.federation import Federation
from fedplug.errors import ConfigError
from fedplug.registry import Registry


def resolve_device(name: str) -> torch.device:
    """The device ``train.device`` names, a CUDA one with its index: tensors moved to
    ``cuda`` live on ``cuda:0`` (the current device), and the two must compare equal."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device is {name!r} but this machine has no CUDA device; use 'cpu' or 'auto'")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def build_model(train_config: Any, registry: Registry, federation: Federation, device: torch.device) -> torch.nn.Module:
    """The model, initialised from ``train_config.seed`` without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(train_config.seed)
        model = registry.build("models", train_config.model, federation.input_shape, federation.num_classes)
    return model.to(device)
