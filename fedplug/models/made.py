"""MADE: a masked autoencoder that is an autoregressive density model.

    MADE: Masked Autoencoder for Distribution Estimation.
    Mathieu Germain, Karol Gregor, Iain Murray, Hugo Larochelle.
    ICML 2015, arXiv:1502.03509.

A MADE is an autoencoder whose weight matrices are multiplied by fixed binary masks so
that output ``d`` sees only inputs ``1 .. d-1`` (natural ordering, 1-based), which makes
its outputs the conditionals of the factorisation
``p(x) = prod_d p(x_d | x_{<d})``. With one hidden layer of H units (paper section 4):

- input unit d has degree d (1 .. D);
- hidden unit k gets a degree m(k) drawn uniformly from [1, D - 1]; for further hidden
  layers from [min m^{l-1}, D - 1] so that no unit is left without inputs;
- hidden mask ``M^W[k, d] = 1 if m(k) >= d`` (a unit sees inputs up to its degree), and
  between hidden layers ``1 if m^l(k) >= m^{l-1}(j)``;
- output mask ``M^V[d, k] = 1 if d > m(k)`` (strictly greater: output d never sees x_d).

Outputs are Bernoulli logits: ``sigmoid(logits[:, d]) = p(x_d = 1 | x_{<d})``. The
negative log-likelihood is the binary cross-entropy summed over dimensions; it is also
well defined for inputs anywhere in [0, 1] (grey-level pixels), as the FedDisk paper uses
it. Only the natural ordering and one fixed connectivity are implemented (the paper's
order- and connectivity-agnostic training is not needed here).

Everything random (the degrees, the initial weights, the mini-batch order) comes from an
explicit ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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


# ------------------------------------------------------------------------------ training
#
# Training is vectorised over models: K MADEs that share one connectivity (FedDisk's
# clients) are trained at once, their parameters stacked along a leading axis and every
# layer computed with one batched matrix product. Each model still sees only its own
# data, its own mini-batch order and its own Adam state, so K stacked models follow
# exactly the trajectories K separate runs would; one model is the special case K = 1.


@dataclass
class MadeHistory:
    """What :func:`train_made` did: mean per-sample NLL (nats) of every epoch."""

    train_nll: list[float] = field(default_factory=list)
    validation_nll: list[float] = field(default_factory=list)
    best_epoch: int = -1
    """0-based epoch whose weights were restored (lowest validation NLL)."""

    @property
    def best_validation_nll(self) -> float:
        return self.validation_nll[self.best_epoch]


@dataclass
class RaggedBatch:
    """One step of K models over data sets of different sizes."""

    indices: Tensor
    """``[K, B]`` sample indices into each model's data (padding rows point at 0)."""
    weights: Tensor
    """``[K, B]``: ``1 / c_k`` on the c_k real rows of model k, 0 on padding, so
    ``sum(weights * loss)`` is the sum over models of each one's batch mean."""
    active: Tensor
    """``[K]`` bool: model k has a batch in this step."""


def ragged_batches(
    sizes: Sequence[int],
    batch_size: int,
    generators: Sequence[torch.Generator],
    enabled: Sequence[bool] | None = None,
) -> list[RaggedBatch]:
    """One epoch of shuffled mini-batches for K data sets at once.

    Model k draws ``torch.randperm(sizes[k], generator=generators[k])`` (nothing is drawn
    for a model that is not ``enabled``) and walks it in chunks of ``batch_size``; the
    epoch has as many steps as the largest data set needs, and a model whose chunks ran
    out is inactive in the remaining steps.
    """
    count = len(sizes)
    enabled = [True] * count if enabled is None else list(enabled)
    orders = [
        torch.randperm(size, generator=generator) if on else torch.zeros(0, dtype=torch.long)
        for size, generator, on in zip(sizes, generators, enabled)
    ]
    num_steps = max((math.ceil(len(order) / batch_size) for order in orders), default=0)
    batches = []
    for step in range(num_steps):
        indices = torch.zeros(count, batch_size, dtype=torch.long)
        weights = torch.zeros(count, batch_size)
        active = torch.zeros(count, dtype=torch.bool)
        for model, order in enumerate(orders):
            chunk = order[step * batch_size : (step + 1) * batch_size]
            if len(chunk) > 0:
                indices[model, : len(chunk)] = chunk
                weights[model, : len(chunk)] = 1.0 / len(chunk)
                active[model] = True
        batches.append(RaggedBatch(indices, weights, active))
    return batches


class PaddedSets:
    """K data sets of different sizes stored as one zero-padded ``[K, N_max, ...]``
    tensor, so a step gathers every model's mini-batch with one indexing operation."""

    def __init__(self, datasets: Sequence[Tensor]) -> None:
        self.sizes = [int(data.shape[0]) for data in datasets]
        self.data = torch.nn.utils.rnn.pad_sequence(list(datasets), batch_first=True)
        self._rows = torch.arange(len(self.sizes), device=self.data.device)[:, None]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def gather(self, indices: Tensor) -> Tensor:
        """``[K, B, ...]``: rows ``indices[k]`` of data set k."""
        return self.data[self._rows, indices.to(self.device)]


class StackedAdam:
    """Adam over parameters stacked along axis 0, one independent optimiser per slice.

    Same update as ``torch.optim.Adam`` (no weight decay, no amsgrad), except that each
    slice k keeps its own step count and only slices marked active move.
    """

    def __init__(
        self,
        parameters: Sequence[Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.parameters = list(parameters)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = torch.zeros(self.parameters[0].shape[0], dtype=torch.float64)
        self.first = [torch.zeros_like(p) for p in self.parameters]
        self.second = [torch.zeros_like(p) for p in self.parameters]

    @torch.no_grad()
    def step(self, active: Tensor) -> None:
        """Apply one step with the parameters' ``.grad`` to the ``active`` slices."""
        self.steps += active.cpu().double()
        steps = self.steps.clamp(min=1.0)
        step_size = (self.lr / (1.0 - self.beta1**steps)).float()
        correction2_sqrt = (1.0 - self.beta2**steps).sqrt().float()
        for parameter, first, second in zip(self.parameters, self.first, self.second):
            if parameter.grad is None:
                continue
            on = expand_slices(active, parameter)
            grad = parameter.grad
            first.copy_(torch.where(on, first.lerp(grad, 1.0 - self.beta1), first))
            second.copy_(
                torch.where(on, second * self.beta2 + (1.0 - self.beta2) * grad * grad, second)
            )
            denominator = second.sqrt() / expand_slices(correction2_sqrt, parameter) + self.eps
            update = first / denominator * expand_slices(step_size, parameter)
            parameter.sub_(torch.where(on, update, torch.zeros_like(update)))

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None


def expand_slices(values: Tensor, like: Tensor) -> Tensor:
    """View a ``[K]`` tensor as ``[K, 1, ..., 1]`` to broadcast against ``like``."""
    return values.to(like.device).view((-1,) + (1,) * (like.dim() - 1))


class StackedMLP:
    """K multilayer perceptrons of one shape as stacked tensors, computed together.

    Layer i of model k is ``h -> h @ (W_i[k] * M_i)^T + b_i[k]`` with ReLU between
    layers; ``M_i`` is a mask shared by all models (all ones when ``None``). A MADE is
    such a network with its masks; FedDisk's classifiers are plain ones.

    Args:
        weights: per layer, ``[K, out, in]``.
        biases: per layer, ``[K, out]``.
        masks: per layer, ``[out, in]`` or ``None``.
    """

    def __init__(
        self, weights: Sequence[Tensor], biases: Sequence[Tensor], masks: Sequence[Tensor | None]
    ) -> None:
        self.weights = [weight.detach().clone().requires_grad_() for weight in weights]
        self.biases = [bias.detach().clone().requires_grad_() for bias in biases]
        self.masks = list(masks)

    @classmethod
    def from_linear_layers(cls, models: Sequence[Sequence[nn.Linear]]) -> StackedMLP:
        """Stack K models given as their lists of linear (or masked linear) layers."""
        masks = [getattr(layer, "mask", None) for layer in models[0]]
        weights = [
            torch.stack([layers[i].weight.detach() for layers in models]) for i in range(len(masks))
        ]
        biases = [
            torch.stack([layers[i].bias.detach() for layers in models]) for i in range(len(masks))
        ]
        return cls(weights, biases, masks)

    @property
    def parameters(self) -> list[Tensor]:
        return [*self.weights, *self.biases]

    def logits(self, inputs: Tensor) -> Tensor:
        """``[K, B, out]``: model k applied to ``inputs[k]`` (``[K, B, in]``)."""
        hidden = inputs
        last = len(self.weights) - 1
        for index, (weight, bias, mask) in enumerate(zip(self.weights, self.biases, self.masks)):
            matrix = weight if mask is None else weight * mask
            hidden = torch.baddbmm(bias.unsqueeze(1), hidden, matrix.transpose(1, 2))
            if index < last:
                hidden = torch.relu(hidden)
        return hidden

    def state(self) -> list[Tensor]:
        """A detached copy of every stacked parameter."""
        return [parameter.detach().clone() for parameter in self.parameters]

    @torch.no_grad()
    def load_slices(self, state: Sequence[Tensor], which: Tensor) -> None:
        """Copy the slices ``which`` (``[K]`` bool) of ``state`` into the parameters."""
        for parameter, saved in zip(self.parameters, state):
            parameter.copy_(torch.where(expand_slices(which, parameter), saved, parameter))

    @torch.no_grad()
    def write_back(self, models: Sequence[Sequence[nn.Linear]]) -> None:
        """Copy slice k into the layers of ``models[k]``."""
        for index, layers in enumerate(models):
            for layer, weight, bias in zip(layers, self.weights, self.biases):
                layer.weight.copy_(weight[index])
                layer.bias.copy_(bias[index])


def stack_mades(models: Sequence[MADE]) -> StackedMLP:
    """Stack MADEs that share input size, hidden sizes and masks."""
    if len(models) == 0:
        raise ValueError("need at least one MADE to stack")
    first = models[0]
    for model in models[1:]:
        if (model.input_dim, model.hidden_sizes) != (first.input_dim, first.hidden_sizes) or any(
            not torch.equal(a, b) for a, b in zip(model.masks, first.masks)
        ):
            raise ValueError("stacked MADEs must share input size, hidden sizes and masks")
    return StackedMLP.from_linear_layers([model.linear_layers for model in models])


def stacked_nll(stack: StackedMLP, inputs: Tensor) -> Tensor:
    """``[K, B]`` per-sample NLL of MADE k on ``inputs[k]``."""
    return F.binary_cross_entropy_with_logits(stack.logits(inputs), inputs, reduction="none").sum(
        dim=2
    )


@torch.no_grad()
def stacked_mean_nll(stack: StackedMLP, sets: PaddedSets, chunk: int = 1024) -> list[float]:
    """Mean NLL of MADE k on data set k, for every k."""
    sizes = torch.tensor(sets.sizes)
    totals = torch.zeros(len(sets.sizes), dtype=torch.float64)
    for start in range(0, int(sizes.max()), chunk):
        rows = torch.arange(start, min(start + chunk, int(sizes.max())))
        present = rows[None, :] < sizes[:, None]
        nll = stacked_nll(stack, sets.gather(torch.where(present, rows[None, :], 0)))
        totals += (nll.cpu().double() * present).sum(dim=1)
    return [float(total) / size for total, size in zip(totals, sets.sizes)]


def _run_stacked_epoch(
    stack: StackedMLP,
    optimizer: StackedAdam,
    sets: PaddedSets,
    batch_size: int,
    generators: Sequence[torch.Generator],
    enabled: Sequence[bool],
) -> list[float]:
    """One epoch of every enabled MADE; returns each one's mean training NLL."""
    totals = torch.zeros(len(sets.sizes), dtype=torch.float64, device=sets.device)
    for batch in ragged_batches(sets.sizes, batch_size, generators, enabled):
        weights = batch.weights.to(sets.device)
        nll = stacked_nll(stack, sets.gather(batch.indices))
        optimizer.zero_grad()
        (nll * weights).sum().backward()
        optimizer.step(batch.active)
        totals += (nll.detach().double() * (weights > 0)).sum(dim=1)
    return [float(total) / size for total, size in zip(totals.cpu(), sets.sizes)]


def train_epochs_stacked(
    models: Sequence[MADE],
    datasets: Sequence[Tensor],
    *,
    lr: float,
    batch_size: int,
    epochs: int,
    generators: Sequence[torch.Generator],
) -> list[float]:
    """Train ``models[k]`` on ``datasets[k]`` (``[n_k, D]``) in place for ``epochs``
    epochs each, all at once, with a fresh Adam state (as FedAvg clients start every
    round).

    Returns each model's mean per-sample training NLL of the last epoch.
    """
    stack = stack_mades(models)
    optimizer = StackedAdam(stack.parameters, lr=lr)
    sets = PaddedSets(datasets)
    last = [math.nan] * len(models)
    for _ in range(epochs):
        last = _run_stacked_epoch(
            stack, optimizer, sets, batch_size, generators, [True] * len(models)
        )
    stack.write_back([model.linear_layers for model in models])
    return last


def train_made_stacked(
    models: Sequence[MADE],
    train_sets: Sequence[Tensor],
    validation_sets: Sequence[Tensor],
    *,
    lr: float,
    batch_size: int,
    max_epochs: int,
    patience: int,
    generators: Sequence[torch.Generator],
) -> list[MadeHistory]:
    """:func:`train_made` for K MADEs at once, each with its own early stopping.

    Model k trains on ``train_sets[k]``, is validated on ``validation_sets[k]`` and
    shuffles with ``generators[k]``; once it has gone ``patience`` epochs without a lower
    validation NLL it stops (its slice no longer moves and its generator is not drawn
    from), and at the end every model holds its best weights.
    """
    if any(int(data.shape[0]) == 0 for data in validation_sets):
        raise ValueError("every MADE needs at least one validation sample")
    stack = stack_mades(models)
    optimizer = StackedAdam(stack.parameters, lr=lr)
    train = PaddedSets(train_sets)
    validation = PaddedSets(validation_sets)
    histories = [MadeHistory() for _ in models]
    best_state = stack.state()
    best_nll = [math.inf] * len(models)
    running = [True] * len(models)
    for epoch in range(max_epochs):
        if not any(running):
            break
        train_nll = _run_stacked_epoch(stack, optimizer, train, batch_size, generators, running)
        validation_nll = stacked_mean_nll(stack, validation)
        improved = torch.zeros(len(models), dtype=torch.bool)
        for index, history in enumerate(histories):
            if not running[index]:
                continue
            history.train_nll.append(train_nll[index])
            history.validation_nll.append(validation_nll[index])
            if validation_nll[index] < best_nll[index]:
                best_nll[index] = validation_nll[index]
                history.best_epoch = epoch
                improved[index] = True
            elif epoch - history.best_epoch >= patience:
                running[index] = False
        if bool(improved.any()):
            best_state = [
                torch.where(expand_slices(improved, now), now, best)
                for now, best in zip(stack.state(), best_state)
            ]
    stack.load_slices(best_state, torch.ones(len(models), dtype=torch.bool))
    stack.write_back([model.linear_layers for model in models])
    return histories


@torch.no_grad()
def mean_nll(model: MADE, inputs: Tensor, batch_size: int = 2048) -> float:
    """Mean NLL of ``inputs`` under ``model``, evaluated in chunks without gradients."""
    if inputs.shape[0] == 0:
        raise ValueError("cannot evaluate the NLL of an empty set of inputs")
    total = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        total += float(model.nll(inputs[start : start + batch_size]).sum())
    return total / inputs.shape[0]


def train_epochs(
    model: MADE,
    x_train: Tensor,
    *,
    lr: float,
    batch_size: int,
    epochs: int,
    generator: torch.Generator,
) -> float:
    """Train ``model`` in place for ``epochs`` passes of shuffled mini-batches with Adam,
    starting from a fresh optimizer state (as a FedAvg client does every round).

    Returns the mean per-sample training NLL of the last epoch.
    """
    return train_epochs_stacked(
        [model], [x_train], lr=lr, batch_size=batch_size, epochs=epochs, generators=[generator]
    )[0]


def train_made(
    model: MADE,
    x_train: Tensor,
    x_val: Tensor,
    *,
    lr: float,
    batch_size: int,
    max_epochs: int,
    patience: int,
    generator: torch.Generator,
) -> MadeHistory:
    """Fit ``model`` in place with early stopping on the validation NLL.

    Args:
        model: the MADE to train (its best weights are loaded back at the end).
        x_train: ``[N, D]`` training inputs in [0, 1].
        x_val: ``[M, D]`` validation inputs in [0, 1] (M >= 1).
        lr: Adam learning rate. (Adam rather than the MADE paper's own optimiser settings:
            it converges in few epochs, which keeps FedDisk's phase 1 cheap.)
        batch_size: mini-batch size.
        max_epochs: most epochs to run.
        patience: stop after this many epochs without a lower validation NLL.
        generator: shuffles the mini-batches (``torch.randperm`` once per epoch).

    Returns:
        The per-epoch history; ``best_epoch`` is the epoch whose weights the model holds.
    """
    return train_made_stacked(
        [model],
        [x_train.reshape(x_train.shape[0], -1)],
        [x_val.reshape(x_val.shape[0], -1)],
        lr=lr,
        batch_size=batch_size,
        max_epochs=max_epochs,
        patience=patience,
        generators=[generator],
    )[0]
