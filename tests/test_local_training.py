"""The client loop's pieces: the fused SGD update against torch.optim.SGD."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedplug.run.local_training import FusedSGD


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def _train(model: nn.Module, optimizer, steps: int, unused: nn.Parameter | None = None) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(6, 5, generator=generator)
        y = torch.randint(0, 3, (6,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.0, 0.01), (0.5, 0.1)]
)
def test_fused_sgd_trains_bit_identically_to_torch_sgd(momentum: float, weight_decay: float) -> None:
    reference, fused = _model(0), _model(0)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.3, momentum=momentum, weight_decay=weight_decay), 5)
    _train(fused, FusedSGD(fused.parameters(), lr=0.3, momentum=momentum, weight_decay=weight_decay), 5)

    for expected, actual in zip(reference.parameters(), fused.parameters(), strict=True):
        assert torch.equal(expected, actual)
    assert not torch.equal(reference[0].weight, _model(0)[0].weight)  # it did train


def test_fused_sgd_skips_parameters_without_a_gradient_as_torch_does() -> None:
    model = _model(1)
    idle = nn.Parameter(torch.ones(3))
    before = idle.detach().clone()
    _train(model, FusedSGD([*model.parameters(), idle], lr=0.1, momentum=0.9, weight_decay=0.5), 3)

    assert torch.equal(idle, before)
