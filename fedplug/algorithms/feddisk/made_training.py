"""Training MADEs, vectorised over models: K MADEs that share one connectivity (FedDisk's
clients) train at once, their parameters stacked along a leading axis and every layer
computed with one batched matrix product. Each model still sees only its own data, its
own mini-batch order and its own Adam state, so K stacked models follow exactly the
trajectories K separate runs would; one model is the special case K = 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.algorithms.feddisk.made import MADE


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
