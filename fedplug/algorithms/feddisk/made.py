"""MADE: a masked autoencoder that is an autoregressive density model (natural ordering,
one fixed connectivity, Bernoulli outputs), with every random draw from an explicit
``torch.Generator``.

    MADE: Masked Autoencoder for Distribution Estimation.
    Mathieu Germain, Karol Gregor, Iain Murray, Hugo Larochelle.
    ICML 2015, arXiv:1502.03509.

The degrees and masks: docs/algorithms.md, "FedDisk: MADE".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.errors import ConfigError


class MaskedLinear(nn.Linear):
    """A linear layer whose weight is multiplied by a fixed binary mask.

    Args:
        in_features: input width.
        out_features: output width.
        mask: ``[out_features, in_features]`` tensor of 0/1 (stored as a buffer, so it is
            saved with the state dict but is not a trainable parameter).
        generator: source of the initial weights, drawn uniformly from
            ``[-1/sqrt(in_features), 1/sqrt(in_features)]`` as ``nn.Linear`` does.
    """

    mask: Tensor

    def __init__(
        self, in_features: int, out_features: int, mask: Tensor, generator: torch.Generator
    ) -> None:
        super().__init__(in_features, out_features)
        if tuple(mask.shape) != (out_features, in_features):
            raise ConfigError(
                f"MaskedLinear mask has shape {tuple(mask.shape)}, expected "
                f"({out_features}, {in_features})"
            )
        self.register_buffer("mask", mask.to(torch.float32))
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.weight.copy_(
                torch.rand(self.weight.shape, generator=generator) * 2 * bound - bound
            )
            self.bias.copy_(torch.rand(self.bias.shape, generator=generator) * 2 * bound - bound)

    def reset_parameters(self) -> None:
        """No-op: ``nn.Linear.__init__`` would draw from torch's global generator; the
        weights are drawn from the explicit generator in ``__init__`` instead."""

    def forward(self, inputs: Tensor) -> Tensor:
        return F.linear(inputs, self.weight * self.mask, self.bias)


def made_degrees(
    input_dim: int, hidden_sizes: Sequence[int], generator: torch.Generator
) -> list[Tensor]:
    """Degrees of every layer's units: ``[inputs (1..D), hidden_1, ..., hidden_L]``.

    Hidden layer l draws its degrees uniformly from ``[min(previous degrees), D - 1]``
    (for the first hidden layer the minimum input degree is 1).
    """
    degrees = [torch.arange(1, input_dim + 1)]
    for size in hidden_sizes:
        low = int(degrees[-1].min()) if len(degrees) > 1 else 1
        degrees.append(torch.randint(low, input_dim, (size,), generator=generator))
    return degrees


def made_masks(degrees: Sequence[Tensor]) -> list[Tensor]:
    """The masks of every layer from the unit degrees; the last one is the output mask.

    Hidden: ``M[k, j] = m_l(k) >= m_{l-1}(j)``; output: ``M[d, k] = d > m_L(k)``.
    """
    masks = [
        (current[:, None] >= previous[None, :]).to(torch.float32)
        for previous, current in pairwise(degrees)
    ]
    output_degrees = degrees[0]
    masks.append((output_degrees[:, None] > degrees[-1][None, :]).to(torch.float32))
    return masks


class MADE(nn.Module):
    """A Bernoulli MADE with natural input ordering.

    Args:
        input_dim: D, the number of (flattened) input dimensions; at least 2.
        hidden_sizes: widths of the hidden layers (default ``(30,)``: one hidden layer of
            30 units, the FedDisk paper's MNIST setting).
        generator: draws the hidden degrees (the connectivity) and the initial weights.
            Default ``None`` uses a fresh generator seeded with 0, so two MADEs built with
            the same arguments are identical.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_sizes: Sequence[int] = (30,),
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if input_dim < 2:
            raise ConfigError(
                f"MADE needs at least 2 input dimensions to be autoregressive, got {input_dim}"
            )
        if len(hidden_sizes) == 0 or any(int(size) < 1 for size in hidden_sizes):
            raise ConfigError(
                f"MADE hidden_sizes must be a non-empty list of positive widths, got "
                f"{list(hidden_sizes)}"
            )
        if generator is None:
            generator = torch.Generator().manual_seed(0)
        self.input_dim = int(input_dim)
        self.hidden_sizes = tuple(int(size) for size in hidden_sizes)
        degrees = made_degrees(self.input_dim, self.hidden_sizes, generator)
        masks = made_masks(degrees)
        widths = [self.input_dim, *self.hidden_sizes, self.input_dim]
        self.layers = nn.ModuleList(
            MaskedLinear(widths[index], widths[index + 1], mask, generator)
            for index, mask in enumerate(masks)
        )
        self.register_buffer("hidden_degrees", degrees[1])

    @property
    def linear_layers(self) -> list[MaskedLinear]:
        """The masked layers, input side first."""
        return [layer for layer in self.layers if isinstance(layer, MaskedLinear)]

    @property
    def masks(self) -> list[Tensor]:
        """The layers' masks, ``[out, in]`` each, the output mask last."""
        return [layer.mask for layer in self.linear_layers]

    def forward(self, inputs: Tensor) -> Tensor:
        """Bernoulli logits ``[B, D]``; output d depends only on inputs before d."""
        hidden = inputs.reshape(inputs.shape[0], -1)
        for layer in self.layers[:-1]:
            hidden = torch.relu(layer(hidden))
        return self.layers[-1](hidden)

    def conditional_probabilities(self, inputs: Tensor) -> Tensor:
        """``p(x_d = 1 | x_{<d})`` for every d, shape ``[B, D]`` (the sigmoid of the logits)."""
        return torch.sigmoid(self(inputs))

    def observed_probabilities(self, inputs: Tensor) -> Tensor:
        """``p(x_d | x_{<d})`` of the observed value, ``[B, D]``.

        For binary inputs this is ``p`` where ``x_d = 1`` and ``1 - p`` where ``x_d = 0``;
        for inputs in [0, 1] it is ``p^x (1 - p)^(1 - x)``, i.e. ``exp(-BCE_d)``. Their
        product over d is the model's likelihood of x.
        """
        flat = inputs.reshape(inputs.shape[0], -1)
        return torch.exp(-F.binary_cross_entropy_with_logits(self(flat), flat, reduction="none"))

    def nll(self, inputs: Tensor) -> Tensor:
        """Negative log-likelihood in nats of each input, ``[B]``: the binary
        cross-entropy with logits summed over dimensions. Inputs must lie in [0, 1]."""
        flat = inputs.reshape(inputs.shape[0], -1)
        return F.binary_cross_entropy_with_logits(self(flat), flat, reduction="none").sum(dim=1)


def independent_bernoulli_nll(x_train: Tensor, x_test: Tensor, smoothing: float = 1.0) -> Tensor:
    """NLL ``[B]`` of ``x_test`` under independent per-dimension Bernoullis fitted to
    ``x_train`` (the baseline a MADE must beat).

    Args:
        x_train: ``[N, D]`` inputs in [0, 1] to fit the means on.
        x_test: ``[B, D]`` inputs to score.
        smoothing (default 1.0): Laplace smoothing, ``p_d = (sum x_d + s) / (N + 2 s)``,
            so a dimension that is always 0 in training gets a finite log-likelihood.
    """
    train = x_train.reshape(x_train.shape[0], -1).double()
    test = x_test.reshape(x_test.shape[0], -1).double()
    means = (train.sum(dim=0) + smoothing) / (train.shape[0] + 2 * smoothing)
    log_likelihood = test * torch.log(means) + (1 - test) * torch.log1p(-means)
    return -log_likelihood.sum(dim=1).float()


@torch.no_grad()
def mean_nll(model: MADE, inputs: Tensor, batch_size: int = 2048) -> float:
    """Mean NLL of ``inputs`` under ``model``, evaluated in chunks without gradients."""
    if inputs.shape[0] == 0:
        raise ValueError("cannot evaluate the NLL of an empty set of inputs")
    total = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        total += float(model.nll(inputs[start : start + batch_size]).sum())
    return total / inputs.shape[0]
