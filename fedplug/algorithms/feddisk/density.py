"""FedDisk's density models, phase 1 steps 1-2: each client's local MADE, the global MADE
trained by FedAvg with its stopping rule, the shared input scaling, the random streams and
the phase's traffic. Details: docs/algorithms.md, "FedDisk: density models".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedplug.components import PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import DataError

from .made import MADE
from .made_training import (
    PaddedSets,
    stack_mades,
    stacked_mean_nll,
    train_epochs_stacked,
    train_made_stacked,
)

if TYPE_CHECKING:
    from .config import FedDiskConfig

BYTES_PER_PARAMETER = 4


# ------------------------------------------------------------------------ inputs


def torch_generator(rng: np.random.Generator) -> torch.Generator:
    """A torch generator seeded by one draw from ``rng``."""
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def flat_inputs(client_id: int, train_x: Tensor) -> Tensor:
    """Client ``client_id``'s training inputs as float32 ``[n_k, D]``.

    Raises:
        DataError: the client has fewer than 2 training samples (a validation split needs
            one and the MADE's training one).
    """
    num_samples = int(train_x.shape[0])
    if num_samples < 2:
        raise DataError(
            f"FedDisk needs at least 2 training samples per client; client {client_id} has "
            f"{num_samples}; use fewer clients"
        )
    return train_x.reshape(num_samples, -1).to(torch.float32)


def input_range(inputs: Tensor) -> tuple[float, float]:
    """``(min, max)`` of one client's inputs: the two scalars it shares so that every
    party maps inputs into [0, 1] the same way."""
    return float(inputs.min()), float(inputs.max())


def unit_interval_bounds(
    ranges: Sequence[tuple[float, float]], source: str
) -> tuple[float, float] | None:
    """The global ``(low, high)`` of the clients' ``(min, max)`` ranges, or ``None`` when
    every input already lies in [0, 1] (then inputs are used as they are).

    Args:
        ranges: every client's :func:`input_range`.
        source: what the inputs are, for error messages (``"dataset 'mnist'"``).

    Raises:
        DataError: the inputs are constant or not finite.
    """
    low = min(low for low, _ in ranges)
    high = max(high for _, high in ranges)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise DataError(f"{source} has non-finite inputs")
    if low >= 0.0 and high <= 1.0:
        return None
    if high <= low:
        raise DataError(f"{source} has constant inputs")
    return low, high


def to_unit_interval(inputs: Tensor, bounds: tuple[float, float] | None) -> Tensor:
    """``(x - low) / (high - low)`` with the global ``bounds`` (``None``: unchanged)."""
    if bounds is None:
        return inputs
    low, high = bounds
    return (inputs - low) / (high - low)


def unit_interval_inputs(federation: Federation) -> list[Tensor]:
    """Every client's flattened float32 ``train_x`` ``[n_k, D]``, mapped into [0, 1].

    Kept as they are when all values already lie in [0, 1]; otherwise one affine map with
    the global min and max over all clients.

    Raises:
        DataError: a client has fewer than 2 training samples, or the inputs are constant
            or not finite.
    """
    flat = [flat_inputs(client.client_id, client.train_x) for client in federation.clients]
    bounds = unit_interval_bounds(
        [input_range(x) for x in flat], f"dataset {federation.dataset_name!r}"
    )
    return [to_unit_interval(x, bounds) for x in flat]


def validation_split(
    num_samples: int, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle ``range(num_samples)`` and split it into (train, validation) indices; the
    validation part holds ``round(fraction * num_samples)`` indices, at least one, and at
    least one index stays for training."""
    order = rng.permutation(num_samples)
    num_validation = min(max(round(fraction * num_samples), 1), num_samples - 1)
    return order[num_validation:], order[:num_validation]


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s trainable parameters sent as float32 (buffers excluded)."""
    return BYTES_PER_PARAMETER * sum(parameter.numel() for parameter in model.parameters())


def made_phase_cost(rounds: int, num_clients: int, model_bytes: int) -> PhaseCost:
    """Traffic of ``rounds`` global MADE rounds with every client taking part:
    ``bytes_up = rounds K B`` and ``bytes_down = (rounds + 1) K B`` (see the module
    docstring for the extra download)."""
    return PhaseCost(
        rounds=rounds,
        bytes_up=rounds * num_clients * model_bytes,
        bytes_down=(rounds + 1) * num_clients * model_bytes,
    )


# ------------------------------------------------------------------- the MADEs


def average_state_dicts(
    states: Sequence[dict[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """``sum_k (weights_k / sum weights) state_k`` for every floating-point entry; other
    entries (the MADE's integer degrees) are taken from the first state. Masks are
    identical across clients, so averaging leaves them unchanged."""
    total = float(sum(weights))
    averaged = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            averaged[key] = first.clone()
            continue
        mean = sum(weight / total * state[key].double() for weight, state in zip(weights, states))
        averaged[key] = torch.as_tensor(mean).to(first.dtype)
    return averaged


def global_made_round(
    global_model: MADE,
    train_inputs: Sequence[Tensor],
    config: FedDiskConfig,
    generators: Sequence[torch.Generator],
) -> list[dict[str, Tensor]]:
    """The clients' half of one global MADE round (step 2): client k starts from
    ``global_model``, trains ``config.global_local_epochs`` epochs on ``train_inputs[k]``
    with a fresh Adam state, shuffling with ``generators[k]`` (which advances), and
    returns its model's ``state_dict()``. All clients at once, vectorised."""
    client_models = [copy.deepcopy(global_model) for _ in train_inputs]
    train_epochs_stacked(
        client_models,
        train_inputs,
        lr=config.made_lr,
        batch_size=config.made_batch_size,
        epochs=config.global_local_epochs,
        generators=generators,
    )
    return [model.state_dict() for model in client_models]


def client_validation_nlls(model: MADE, validation_inputs: Sequence[Tensor]) -> list[float]:
    """Mean validation NLL of ``model`` on each client's validation split: what every
    client reports after receiving a global model."""
    stack = stack_mades([model] * len(validation_inputs))
    return stacked_mean_nll(stack, PaddedSets(validation_inputs))


def federated_nll(nlls: Sequence[float], client_sizes: Sequence[int]) -> float:
    """``sum_k (n_k / n) NLL_k``: the server's federated validation NLL from the clients'
    reports, added in client order."""
    total = float(sum(client_sizes))
    return sum(size / total * nll for size, nll in zip(client_sizes, nlls))


def federated_validation_nll(
    model: MADE, validation: PaddedSets, client_sizes: Sequence[int]
) -> float:
    """``sum_k (n_k / n) NLL_k``: the n_k-weighted mean of the clients' mean validation
    NLLs of ``model`` (data set k of ``validation`` is client k's validation split)."""
    stack = stack_mades([model] * len(client_sizes))
    return federated_nll(stacked_mean_nll(stack, validation), client_sizes)


@dataclass
class GlobalMadeStopping:
    """The server's stopping rule of step 2: stop after the first round whose federated
    validation NLL is not at most the one before (a rise, or NaN from a diverged round),
    or after ``max_rounds`` rounds; keep the model from before the rise.

    Args:
        max_rounds: ``config.global_rounds``.
        initial_nll: the federated validation NLL of the initial model.
    """

    max_rounds: int
    initial_nll: float
    history: list[float] = field(init=False)
    """Federated validation NLL of the initial model and after every round."""

    def __post_init__(self) -> None:
        self.history = [self.initial_nll]

    def record(self, nll: float) -> None:
        """Take the federated validation NLL of the model the latest round produced."""
        self.history.append(nll)

    @property
    def rounds(self) -> int:
        """Rounds run, the one that showed a rise included."""
        return len(self.history) - 1

    @property
    def rose(self) -> bool:
        """The latest round's model is worse than the one before: keep that one instead."""
        return self.rounds > 0 and not self.history[-1] <= self.history[-2]

    @property
    def finished(self) -> bool:
        return self.rose or self.rounds >= self.max_rounds


def train_global_made(
    template: MADE,
    train_inputs: Sequence[Tensor],
    validation_inputs: Sequence[Tensor],
    client_sizes: Sequence[int],
    config: FedDiskConfig,
    generators: Sequence[torch.Generator],
) -> tuple[MADE, int, list[float]]:
    """Fit the global MADE by FedAvg with every client taking part (step 2).

    Each round every client starts from the global model, trains
    ``config.global_local_epochs`` epochs (:func:`global_made_round`), and the server
    averages with weights ``client_sizes[k] / sum``. Training stops as
    :class:`GlobalMadeStopping` says; the model with the lowest federated validation NLL
    is kept.

    Returns the kept model, the number of rounds run, and the federated validation NLL
    of the initial model and after every round.
    """
    global_model = copy.deepcopy(template)
    validation = PaddedSets(validation_inputs)
    stopping = GlobalMadeStopping(
        config.global_rounds, federated_validation_nll(global_model, validation, client_sizes)
    )
    kept_state = copy.deepcopy(global_model.state_dict())
    while not stopping.finished:
        states = global_made_round(global_model, train_inputs, config, generators)
        global_model.load_state_dict(average_state_dicts(states, client_sizes))
        stopping.record(federated_validation_nll(global_model, validation, client_sizes))
        if not stopping.rose:
            kept_state = copy.deepcopy(global_model.state_dict())
    global_model.load_state_dict(kept_state)
    return global_model, stopping.rounds, stopping.history


def made_features(model: MADE, inputs: Tensor, kind: Literal["predicted", "observed"]) -> Tensor:
    """The vector v(x) the classifier sees (see :attr:`FedDiskConfig.made_features`)."""
    with torch.no_grad():
        if kind == "observed":
            return model.observed_probabilities(inputs)
        return model.conditional_probabilities(inputs)


# ------------------------------------------------------------- each client's share


@dataclass(frozen=True)
class PhaseOneSeeds:
    """Phase 1's randomness: one seed for the MADE every party starts from, and a root
    from which each client's own stream derives (:meth:`client_rng`), so that a client's
    draws depend on the run's generator and its id only, not on the other clients."""

    template: int
    """Seeds the shared MADE template: its connectivity and its initial weights."""
    clients: int
    """Root of every client's stream."""

    @classmethod
    def draw(cls, rng: np.random.Generator) -> PhaseOneSeeds:
        """The two seeds, drawn from ``rng`` (``numpy.random.default_rng(config.seed)``
        when the loss transform runs phase 1)."""
        return cls(template=int(rng.integers(2**62)), clients=int(rng.integers(2**62)))

    def client_rng(self, client_id: int) -> np.random.Generator:
        """Client ``client_id``'s stream: its validation split, then the seeds of its
        local-MADE, global-round and classifier generators (:func:`client_density_data`)."""
        return np.random.default_rng([self.clients, client_id])


@dataclass
class ClientDensityData:
    """What one client holds in phase 1 (it never leaves the client)."""

    inputs: Tensor
    """All training inputs, flattened and in [0, 1], ``[n_k, D]``, in sample order."""
    train: Tensor
    """The part the MADEs train on."""
    validation: Tensor
    """The part that early-stops them (step 1) and scores the global model (step 2)."""
    local_generator: torch.Generator
    """Shuffles the local MADE's mini-batches."""
    global_generator: torch.Generator
    """Shuffles the client's mini-batches in every global round (it advances across rounds)."""
    classifier_generator: torch.Generator
    """Initialises the classifier D and shuffles its mini-batches."""

    @property
    def num_samples(self) -> int:
        return int(self.inputs.shape[0])


def client_density_data(
    inputs: Tensor, config: FedDiskConfig, rng: np.random.Generator
) -> ClientDensityData:
    """One client's share of phase 1 from its [0, 1] inputs and its stream ``rng``
    (:meth:`PhaseOneSeeds.client_rng`)."""
    train, validation = validation_split(int(inputs.shape[0]), config.validation_fraction, rng)
    return ClientDensityData(
        inputs=inputs,
        train=inputs[torch.as_tensor(train, device=inputs.device)],
        validation=inputs[torch.as_tensor(validation, device=inputs.device)],
        local_generator=torch_generator(rng),
        global_generator=torch_generator(rng),
        classifier_generator=torch_generator(rng),
    )


def made_template(input_dim: int, config: FedDiskConfig, seeds: PhaseOneSeeds) -> MADE:
    """The MADE every party starts from, on the CPU. One connectivity and one
    initialisation are shared by every MADE: the global model's must match across
    clients, and sharing it with the local ones keeps differences between v_g and v_l
    down to what the data made of them."""
    generator = torch.Generator().manual_seed(seeds.template)
    return MADE(input_dim, (config.made_hidden,), generator=generator)


def train_local_mades(
    template: MADE, clients: Sequence[ClientDensityData], config: FedDiskConfig
) -> list[MADE]:
    """Step 1 for each client of ``clients``: a copy of ``template`` trained on the
    client's data and early-stopped on its validation split (vectorised over clients)."""
    models = [copy.deepcopy(template) for _ in clients]
    train_made_stacked(
        models,
        [client.train for client in clients],
        [client.validation for client in clients],
        lr=config.made_lr,
        batch_size=config.made_batch_size,
        max_epochs=config.made_max_epochs,
        patience=config.patience,
        generators=[client.local_generator for client in clients],
    )
    return models


# ------------------------------------------------------------ MADE parameters


def made_parameters(model: MADE) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` by name (what travels; masks do not)."""
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


def load_made_parameters(model: MADE, parameters: Mapping[str, Tensor]) -> MADE:
    """Copy ``parameters`` into ``model`` and return it.

    Raises:
        ValueError: a name is missing or extra, or a shape differs (the message says
            which).
    """
    expected = dict(model.named_parameters())
    if set(parameters) != set(expected):
        raise ValueError(f"sent MADE parameters {sorted(parameters)}, expected {sorted(expected)}")
    with torch.no_grad():
        for name, parameter in expected.items():
            value = parameters[name]
            if tuple(value.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"sent MADE parameter {name!r} of shape {tuple(value.shape)}, expected "
                    f"{tuple(parameter.shape)}"
                )
            parameter.copy_(value.to(parameter.device))
    return model
