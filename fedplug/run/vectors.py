"""A model's state as one flat vector, the unit every aggregator works on.

Layout: every parameter (``named_parameters()`` order), then every floating-point
buffer (BatchNorm running statistics). Integer buffers such as BatchNorm's
``num_batches_tracked`` are not part of the federated state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def state_tensors(model: nn.Module) -> list[Tensor]:
    """The tensors that make up the federated state, in vector order."""
    buffers = [buffer for buffer in model.buffers() if buffer.is_floating_point()]
    return [*model.parameters(), *buffers]


def num_elements(model: nn.Module) -> int:
    return sum(tensor.numel() for tensor in state_tensors(model))


def model_to_vector(model: nn.Module) -> Tensor:
    """A detached float32 copy of the model's state."""
    return torch.cat([tensor.detach().reshape(-1).float() for tensor in state_tensors(model)])


@torch.no_grad()
def vector_to_model(vector: Tensor, model: nn.Module) -> None:
    """Load a flat vector into the model in place."""
    offset = 0
    for tensor in state_tensors(model):
        count = tensor.numel()
        tensor.copy_(vector[offset : offset + count].view_as(tensor))
        offset += count
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} elements, the model's state has {offset}")


def split_like(vector: Tensor, named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Views of the leading part of ``vector`` shaped like each tensor of ``named``."""
    out: dict[str, Tensor] = {}
    offset = 0
    for name, tensor in named.items():
        count = tensor.numel()
        out[name] = vector[offset : offset + count].view(tensor.shape)
        offset += count
    return out


def tensors_num_bytes(tensors: dict[str, Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def move_tensors(value: Any, device: Any) -> Any:
    """``value`` (a tensor, or dicts and lists of them) with every tensor on ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: move_tensors(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [move_tensors(item, device) for item in value]
    return value


def all_finite(vector: Tensor) -> bool:
    """No NaN or infinity in ``vector``: one pass of ``aminmax`` (NaN propagates to both,
    an infinity is the minimum or the maximum), without a model-sized boolean tensor."""
    if vector.numel() == 0:
        return True
    low, high = torch.aminmax(vector)
    return bool(torch.isfinite(low) & torch.isfinite(high))
