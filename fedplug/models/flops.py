"""Counting a model's compute and size for the cost model.

FedGSP's cost model (Zeng et al., "Heterogeneous Federated Learning via Grouped
Sequential-to-Parallel Training", DASFAA 2022, arXiv:2201.12515, eq. 15-17) turns FLOPs
per training sample into compute time and the model's size into communication time and
traffic. This module measures both from the model itself.

FLOPs are counted as 2 x multiply-adds of the forward pass's ``Linear`` and convolution
(``Conv1d/2d/3d``) layers, the layers that dominate every model in
:mod:`fedplug.models.zoo`; bias additions, activations, pooling, normalisation and
operations outside those modules are not counted. Training is estimated as 3 x forward:
the backward pass computes a gradient with respect to both the layer's input and its
weights, each a product as large as the forward one (the usual estimate, e.g. Kaplan et
al., "Scaling Laws for Neural Language Models", 2020, arXiv:2001.08361, "C = 6N" per
token = 3 x the 2N forward FLOPs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _multiply_adds(module: nn.Module, output: Tensor) -> int:
    """Multiply-adds ``module`` spent to produce ``output``."""
    if isinstance(module, nn.Linear):
        # Each output element is a dot product of length in_features.
        return output.numel() * module.in_features
    if isinstance(module, _CONVOLUTIONS):
        # Each output element is a dot product over its group's input channels and the kernel.
        kernel = math.prod(module.kernel_size)
        return output.numel() * (module.in_channels // module.groups) * kernel
    return 0


def flops_per_sample(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Forward FLOPs (2 x multiply-adds of Linear and convolution layers) for one sample.

    Args:
        model: the model; its training flags and BatchNorm running statistics are left
            exactly as they were (the count runs in eval mode under ``torch.no_grad``).
        input_shape: the shape of one sample, without the batch dimension.

    Returns:
        The FLOP count of one forward pass of a single sample of zeros.
    """
    counted: list[int] = []

    def count(module: nn.Module, inputs: Any, output: Tensor) -> None:
        counted.append(_multiply_adds(module, output))

    handles = [
        module.register_forward_hook(count)
        for module in model.modules()
        if isinstance(module, (nn.Linear, *_CONVOLUTIONS))
    ]
    # Eval mode so that BatchNorm neither updates its running statistics nor rejects a
    # batch of one; the flags are restored afterwards.
    training_flags = {module: module.training for module in model.modules()}
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), dtype=torch.float32, device=device))
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in training_flags.items():
            module.training = flag
    return 2 * sum(counted)


def training_flops_per_sample(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """FLOPs of one training sample: forward plus backward, estimated as 3 x forward.

    Args:
        model: the model (left unchanged).
        input_shape: the shape of one sample, without the batch dimension.
    """
    return 3 * flops_per_sample(model, input_shape)


def model_num_bytes(model: nn.Module) -> int:
    """Bytes of the model's floating-point parameters and buffers.

    Counts the floating-point entries of ``model.state_dict()``, i.e. exactly the flat
    vector the engines send between server and clients (BatchNorm's integer
    ``num_batches_tracked`` is not part of it).
    """
    return sum(
        tensor.numel() * tensor.element_size()
        for tensor in model.state_dict().values()
        if tensor.is_floating_point()
    )
