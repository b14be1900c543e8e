"""FedDisk: density-ratio sample weights from local and global MADE models.

    Federated Learning for distribution skewed data using sample weights.
    Hung Nguyen, Peiyuan Wu, J. Morris Chang. IEEE Transactions on Artificial
    Intelligence (2024), arXiv:2401.02586.

Client k minimises ``sum_i w_k(x_i) CE(f(w; x_i), y_i)`` with ``w_k(x) ~ p(x) / p_k(x)``,
``p = sum_k (n_k / n) p_k`` (paper eq. 3-11), which turns the sum of the local risks into
the risk under the global input distribution. Phase 1 (this module) estimates the weights
once, before training; phase 2 is FedAvg with the weighted loss
(:class:`FedDisk` is the loss transform, pair it with the ``fedavg`` aggregator).

Phase 1, :func:`compute_feddisk_weights` (paper sections 5.2-5.3, Algorithm 1):

1. Every client fits a local MADE (:mod:`fedplug.models.made`) to its flattened inputs,
   early-stopped on a validation split of its own training data.
2. All clients fit one global MADE by FedAvg (weights n_k / n, a few local epochs per
   round), stopping at the first round whose federated validation NLL (the n_k-weighted
   mean of the clients' validation NLLs) is higher than the round before; the model before
   the rise is kept. ``global_rounds`` caps the rounds.
3. Client k feeds each local sample through both MADEs, giving two D-vectors v_g(x)
   (pseudo-label 1) and v_l(x) (pseudo-label 0), and trains a binary classifier
   (one hidden layer of 100 ReLU units, 2-way softmax; SGD, lr 0.01, stopped when the
   loss stops decreasing significantly, paper 7.2.4) on the 2 n_k vectors. It is
   trained locally: no communication, so it adds no rounds.
4. ``w_k(x) = D(v_l(x)) / (1 - D(v_l(x)))`` (paper eq. 16) where ``D(.)`` is the
   classifier's probability of class 1, "comes from the global model". The class prior
   ratio is 1 since both classes hold n_k vectors. When the two MADEs agree the
   classifier cannot tell the classes apart, D = 1/2 and every weight is 1. The raw
   ratios are then normalised per client (``normalisation``, below).

Which "output vector" of a MADE is v(x)? Algorithm 1 and section 5.3 feed "the output
vector" of each MADE, described as "conditional probabilities for each element". The
network's output is ``p(x_d = 1 | x_{<d})`` for every d (the sigmoid of its logits), and
that is the default, ``made_features="predicted"``. The same section also says that
multiplying these probabilities would give p(x), which holds only for the probabilities
of the *observed* values ``p(x_d | x_{<d})``; ``made_features="observed"`` feeds those
instead (``exp(-BCE_d)``, i.e. ``p^x (1 - p)^(1 - x)`` for grey levels). We keep
"predicted" as the default because it is the literal network output and because, on a
two-client, two-mode check (each client holding 90% of one mode; true weights 0.56 and 5,
a gap of 4.4), both readings up-weighted the locally rare mode on every client and seed
but "predicted" by more: mean gap 3.5 against 2.7 with a long-trained classifier, 0.06
against 0.02 with the default classifier budget on these 400-sample clients.

Normalisation (``normalisation``). The authors' code min-max scales each client's ratios
to [0, 2] (``"minmax"``). We default to ``"mean"``: divide by the client's mean ratio and
clip to ``[clip_min, clip_max]``. Reasons: (a) ``E_{p_k}[p / p_k] = 1``, so mean-one
weights are the self-normalised importance-weighting estimate of the global risk and keep
the effective learning rate of the (mean-reduced) batch loss unchanged; (b) min-max always
sends one sample to weight 0 and one to weight 2 however alike the ratios are, so on a
client whose data already follow the global distribution it turns estimation noise into
a full [0, 2] spread, while mean normalisation leaves weights near 1 there; (c) clipping
bounds the variance a few extreme ratios would add.

Communication (``PhaseCost``). The MADE parameters travel as float32; the masks are not
sent (every party derives them from the shared seed). A global round sends the model down
to and up from every client: ``K x bytes`` each way. ``rounds`` counts the FedAvg rounds
run, including the one whose result showed the rise (its upload happened). Downloads are
``rounds + 1`` per client: the last aggregate must also reach the clients so they can
report its validation NLL (and, when the cap stops training, use it), so
``bytes_down = (rounds + 1) K bytes`` and ``bytes_up = rounds K bytes``; validation NLLs
are single scalars and not counted. Local MADEs and the classifiers never leave their
client. "Effective communication rounds" = MADE rounds (+ 0 classifier rounds).

FedDiskAb (paper section 6, :func:`compute_feddisk_ab_weights`): an oracle ablation that
trains the same classifier directly on client k's raw inputs (label 0) against n_k inputs
drawn without replacement from the pooled data of all clients (label 1); weights as in
step 4. It moves raw data, so it is for comparison only; its cost is reported as 0 rounds
with ``bytes_up = sum_k n_k D 4`` (every client's data pooled) and
``bytes_down = sum_k n_k D 4`` (each client receives n_k pooled inputs).

Inputs. A Bernoulli MADE needs inputs in [0, 1] (the paper normalises and clips all data
to [0, 1]). When the federation's inputs already lie there they are used as they are;
otherwise one affine map ``(x - lo) / (hi - lo)`` with the global min and max over all
clients (two scalars per client to share) brings them there.

Randomness and who runs what. Phase 1 draws two seeds from its generator
(:class:`PhaseOneSeeds`): one builds the MADE every party starts from (connectivity and
initial weights), the other is the root of one stream per client, keyed by its client id,
from which the client draws its validation split and the seeds of its three generators
(local MADE, global rounds, classifier). A client's draws therefore depend neither on the
other clients nor on where it runs. :func:`compute_feddisk_weights` is a composition of
client-side pieces (:func:`client_density_data`, :func:`train_local_mades`,
:func:`global_made_round`, :func:`client_validation_nlls`, :func:`client_sample_weights`)
and server-side ones (:func:`unit_interval_bounds`, :func:`average_state_dicts`,
:func:`federated_nll`, :class:`GlobalMadeStopping`, :func:`made_phase_cost`); the Flower
adapter (``fedplug.adapters.flower.density``) runs the same pieces, each node on its own
client, and so computes the same weights.

Caching. Phase 1 is a pure function of (federation, config, seed), so its result can be
computed once (the DVC pipeline runs it as its own stage) and stored as ``.npz``
(:func:`save_weights`, :func:`load_weights`) under :func:`cache_key`. A Federation carries
no partition id, so :func:`partition_fingerprint` hashes what identifies one: the client
count, every client's size and class counts, and a few inputs and labels of each client
(first, middle and last sample; these catch per-client feature noise too).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import skip_init

from fedplug.components import ComponentConfig, Context, LossTransform, PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import DataError, TrainingError
from fedplug.hookspecs import Register, hookimpl
from fedplug.models.made import (
    MADE,
    PaddedSets,
    StackedMLP,
    expand_slices,
    ragged_batches,
    stack_mades,
    stacked_mean_nll,
    train_epochs_stacked,
    train_made_stacked,
)

SAMPLE_WEIGHT_KEY = "sample_weight"
BYTES_PER_PARAMETER = 4
WEIGHTS_VERSION = 2
"""Part of :func:`cache_key`; raised whenever the same config and seed would give other
weights, so that weights cached by an older fedplug are recomputed rather than reused
(2: every client draws from its own stream, :class:`PhaseOneSeeds`)."""


# ---------------------------------------------------------------------------- configs


class SampleWeightConfig(ComponentConfig):
    """Fields shared by FedDisk and FedDiskAb: the discriminator and the normalisation."""

    classifier_hidden: int = Field(100, ge=1, le=4096)
    """Hidden ReLU units of the binary classifier D (default 100, paper 7.2.4)."""
    classifier_epochs: int = Field(5, ge=1, le=1000)
    """Most epochs D trains for (default 5); it stops earlier when the loss stops
    decreasing. On MNIST five epochs already separate feature-skewed clients' MADEs."""
    classifier_lr: float = Field(0.01, gt=0.0, le=10.0)
    """SGD learning rate of D (default 0.01, paper 7.2.4)."""
    classifier_batch_size: int = Field(100, ge=1, le=65536)
    """Mini-batch size of D's SGD."""
    classifier_tolerance: float = Field(0.01, ge=0.0, le=1.0)
    """D stops when an epoch lowers its mean loss by less than this fraction (default
    0.01): the paper stops "if the loss function is not significantly reduced"."""
    normalisation: Literal["mean", "minmax"] = "mean"
    """How each client's raw ratios become weights: ``"mean"`` (default) divides by their
    mean and clips to [clip_min, clip_max]; ``"minmax"`` scales them to [0, 2] as the
    authors' code does. See the module docstring for why mean is the default."""
    clip_min: float = Field(0.0, ge=0.0, le=1.0)
    """Lower clip of mean-normalised weights (default 0: no lower clip)."""
    clip_max: float = Field(5.0, ge=1.0, le=1e6)
    """Upper clip of mean-normalised weights (default 5: no sample counts more than five
    average ones)."""
    cache_dir: str | None = None
    """Folder where computed weights are cached as ``<cache_key>.npz`` (default None:
    compute in memory every time)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seeds phase 1 (default 0): validation splits, MADE connectivity and initial
    weights, mini-batch order, classifier initialisation, FedDiskAb's pooled sample."""

    @model_validator(mode="after")
    def _check_clip_bounds(self) -> SampleWeightConfig:
        if self.clip_min >= self.clip_max:
            raise ValueError(
                f"clip_min ({self.clip_min}) must be smaller than clip_max ({self.clip_max})"
            )
        return self


class FedDiskConfig(SampleWeightConfig):
    """FedDisk (Nguyen, Wu, Chang 2024): CE weighted by p(x)/p_k(x) estimated with MADEs."""

    name: Literal["feddisk"] = "feddisk"
    made_hidden: int = Field(30, ge=1, le=4096)
    """Hidden units of every MADE (default 30, the paper's MNIST setting; 400 FEMNIST,
    50 chest X-ray)."""
    made_lr: float = Field(0.01, gt=0.0, le=1.0)
    """Adam learning rate of MADE training, local and in the FedAvg rounds."""
    made_batch_size: int = Field(200, ge=1, le=65536)
    """MADE mini-batch size."""
    made_max_epochs: int = Field(10, ge=1, le=1000)
    """Most epochs of a local MADE (default 10; the paper allows 500 with early stopping).
    On MNIST (10 clients x 5k) 10 epochs keep all of phase 1 near 25 CPU-seconds, and
    the validation NLL is within about 3% of its 30-epoch value."""
    patience: int = Field(2, ge=1, le=1000)
    """Local MADEs stop after this many epochs without a lower validation NLL."""
    global_rounds: int = Field(10, ge=1, le=1000)
    """Most FedAvg rounds of the global MADE (it stops earlier when the federated
    validation NLL rises)."""
    global_local_epochs: int = Field(1, ge=1, le=100)
    """Local epochs per client in each global MADE round."""
    made_features: Literal["predicted", "observed"] = "predicted"
    """What the classifier sees of a MADE: ``"predicted"`` (default) the network's output
    p(x_d = 1 | x_<d); ``"observed"`` the conditional probability of each observed value,
    p(x_d | x_<d). See the module docstring."""
    validation_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of each client's training data held out to early-stop the MADEs."""


class FedDiskAbConfig(SampleWeightConfig):
    """FedDiskAb (oracle ablation of FedDisk): D trained on raw local vs pooled inputs."""

    name: Literal["feddisk_ab"] = "feddisk_ab"


# ------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FedDiskWeights:
    """Phase 1's result: one weight per local training sample of each client."""

    weights: list[np.ndarray]
    """``weights[k]`` is a float32 array of length n_k, in the order of client k's
    ``train_x``."""
    cost: PhaseCost


# ------------------------------------------------------------------------ helpers


def _torch_generator(rng: np.random.Generator) -> torch.Generator:
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


# ---------------------------------------------------------------- the classifier D


def make_classifier(input_dim: int, hidden: int, generator: torch.Generator) -> nn.Sequential:
    """D: ``input_dim -> hidden ReLU -> 2`` logits.

    The hidden layer is initialised from ``generator`` like ``nn.Linear`` (uniform in
    +-1/sqrt(fan_in)); the output layer starts at zero, so an untrained D says 1/2
    everywhere (weight 1) and every departure from weight 1 is learned from the data. With
    a random output layer, D's initial function would leak into the weights of clients
    whose local and global MADEs cannot be told apart.
    """
    # skip_init: nn.Linear's own initialisation would draw from torch's global generator.
    first = skip_init(nn.Linear, input_dim, hidden)
    output = skip_init(nn.Linear, hidden, 2)
    with torch.no_grad():
        bound = 1.0 / math.sqrt(input_dim)
        for parameter in (first.weight, first.bias):
            parameter.copy_(torch.rand(parameter.shape, generator=generator) * 2 * bound - bound)
        output.weight.zero_()
        output.bias.zero_()
    return nn.Sequential(first, nn.ReLU(), output)


def classifier_layers(classifier: nn.Sequential) -> list[nn.Linear]:
    """The two linear layers of a classifier built by :func:`make_classifier`."""
    return [cast(nn.Linear, classifier[0]), cast(nn.Linear, classifier[2])]


def train_classifiers(
    global_like: Sequence[Tensor],
    local_like: Sequence[Tensor],
    config: SampleWeightConfig,
    generators: Sequence[torch.Generator],
) -> list[nn.Sequential]:
    """Train one classifier D per client, all at once (vectorised over clients).

    Classifier k learns to tell the rows of ``global_like[k]`` (label 1) from those of
    ``local_like[k]`` (label 0) by plain SGD on the softmax cross-entropy (paper 7.2.4):
    at most ``config.classifier_epochs`` epochs, stopping once an epoch lowers its mean
    loss by less than ``config.classifier_tolerance`` of the previous epoch's.
    ``generators[k]`` draws its initial weights and its mini-batch order.
    """
    input_dim = global_like[0].shape[1]
    device = global_like[0].device
    classifiers = [
        make_classifier(input_dim, config.classifier_hidden, generator).to(device)
        for generator in generators
    ]
    layers = [classifier_layers(classifier) for classifier in classifiers]
    stack = StackedMLP.from_linear_layers(layers)
    inputs = PaddedSets([torch.cat([g, l]).detach() for g, l in zip(global_like, local_like)])
    labels = PaddedSets(
        [
            torch.cat(
                [
                    torch.ones(g.shape[0], dtype=torch.long, device=device),
                    torch.zeros(l.shape[0], dtype=torch.long, device=device),
                ]
            )
            for g, l in zip(global_like, local_like)
        ]
    )
    count = len(classifiers)
    previous = [math.inf] * count
    running = [True] * count
    for _ in range(config.classifier_epochs):
        if not any(running):
            break
        totals = torch.zeros(count, dtype=torch.float64, device=device)
        for batch in ragged_batches(
            inputs.sizes, config.classifier_batch_size, generators, running
        ):
            logits = stack.logits(inputs.gather(batch.indices))
            losses = F.cross_entropy(
                logits.reshape(-1, 2), labels.gather(batch.indices).reshape(-1), reduction="none"
            ).reshape(logits.shape[:2])
            weights = batch.weights.to(device)
            for parameter in stack.parameters:
                parameter.grad = None
            (losses * weights).sum().backward()
            with torch.no_grad():
                for parameter in stack.parameters:
                    if parameter.grad is not None:
                        step = expand_slices(batch.active, parameter) * parameter.grad
                        parameter.sub_(config.classifier_lr * step)
            totals += (losses.detach().double() * (weights > 0)).sum(dim=1)
        for index in range(count):
            if not running[index]:
                continue
            epoch_loss = float(totals[index]) / inputs.sizes[index]
            if previous[index] - epoch_loss < config.classifier_tolerance * previous[index]:
                running[index] = False
            previous[index] = epoch_loss
    stack.write_back(layers)
    for classifier in classifiers:
        classifier.eval()
    return classifiers


@torch.no_grad()
def density_ratios(classifier: nn.Module, inputs: Tensor) -> np.ndarray:
    """``D(v) / (1 - D(v))`` with ``D`` the softmax probability of class 1, computed as
    ``exp(z_1 - z_0)`` from the logits (clamped to e^+-30 so it stays finite)."""
    logits = classifier(inputs)
    log_ratio = (logits[:, 1] - logits[:, 0]).double().clamp(-30.0, 30.0)
    return torch.exp(log_ratio).cpu().numpy()


def normalise_weights(
    ratios: np.ndarray,
    method: Literal["mean", "minmax"],
    clip_min: float = 0.0,
    clip_max: float = 5.0,
) -> np.ndarray:
    """Turn one client's raw density ratios into sample weights (float32).

    Args:
        ratios: non-negative ratios, one per local sample.
        method: ``"mean"``: ``clip(r / mean(r), clip_min, clip_max)``; ``"minmax"``:
            ``2 (r - min r) / (max r - min r)``, in [0, 2].
        clip_min (default 0.0), clip_max (default 5.0): bounds of the ``"mean"`` weights.

    All-equal ratios give weights of 1 under both methods (min-max would divide by 0).

    Raises:
        TrainingError: a ratio is NaN, infinite or negative (training diverged).
    """
    values = np.asarray(ratios, dtype=np.float64)
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise TrainingError(
            "FedDisk's density ratios are not finite and non-negative: the classifier (or a "
            "MADE) diverged; lower classifier_lr or made_lr"
        )
    if values.size == 0:
        return values.astype(np.float32)
    low, high = float(values.min()), float(values.max())
    if high - low <= 1e-12 * max(abs(high), 1.0):
        return np.ones_like(values, dtype=np.float32)
    if method == "minmax":
        return (2.0 * (values - low) / (high - low)).astype(np.float32)
    return np.clip(values / values.mean(), clip_min, clip_max).astype(np.float32)


def client_weights(
    classifiers: Sequence[nn.Module], features: Sequence[Tensor], config: SampleWeightConfig
) -> list[np.ndarray]:
    """Step 4 for each client: classifier k's density ratios of ``features[k]``,
    normalised as ``config`` says (:func:`normalise_weights`)."""
    return [
        normalise_weights(
            density_ratios(classifier, inputs),
            config.normalisation,
            config.clip_min,
            config.clip_max,
        )
        for classifier, inputs in zip(classifiers, features)
    ]


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


# ------------------------------------------------------------- phase 1, piece by piece
#
# Phase 1 is cut along the line between clients and server, so that the built-in
# simulator (compute_feddisk_weights, all clients in one process) and the Flower adapter
# (fedplug.adapters.flower.density, one node per client) run the same functions: a
# node calls the client-side ones with its own client only.


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
        local_generator=_torch_generator(rng),
        global_generator=_torch_generator(rng),
        classifier_generator=_torch_generator(rng),
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


def client_sample_weights(
    local_models: Sequence[MADE],
    global_model: MADE,
    clients: Sequence[ClientDensityData],
    config: FedDiskConfig,
) -> list[np.ndarray]:
    """Steps 3-4 for each client of ``clients``: its classifier D on the two MADEs'
    features of its inputs, and the normalised weights of its samples."""
    local_features = [
        made_features(model, client.inputs, config.made_features)
        for model, client in zip(local_models, clients)
    ]
    global_features = [
        made_features(global_model, client.inputs, config.made_features) for client in clients
    ]
    classifiers = train_classifiers(
        global_features,
        local_features,
        config,
        [client.classifier_generator for client in clients],
    )
    return client_weights(classifiers, local_features, config)


# --------------------------------------------------------------------- phase 1


def compute_feddisk_weights(
    federation: Federation, config: FedDiskConfig, rng: np.random.Generator
) -> FedDiskWeights:
    """FedDisk's phase 1 (steps 1-4 of the module docstring) for every client.

    Args:
        federation: the clients; their ``train_x`` are flattened to D dimensions.
        config: the validated :class:`FedDiskConfig`.
        rng: the only source of randomness (:class:`PhaseOneSeeds` are drawn from it;
            client k's splits, mini-batch orders and classifier initialisation come from
            its own stream, keyed by its ``client_id``).

    Returns:
        The normalised weights of every client's training samples and the traffic of
        the global MADE rounds.
    """
    seeds = PhaseOneSeeds.draw(rng)
    inputs = unit_interval_inputs(federation)
    clients = [
        client_density_data(x, config, seeds.client_rng(client.client_id))
        for x, client in zip(inputs, federation.clients)
    ]
    sizes = [client.num_samples for client in clients]
    template = made_template(inputs[0].shape[1], config, seeds).to(inputs[0].device)
    local_models = train_local_mades(template, clients, config)
    global_model, rounds, _ = train_global_made(
        template,
        [client.train for client in clients],
        [client.validation for client in clients],
        sizes,
        config,
        [client.global_generator for client in clients],
    )
    weights = client_sample_weights(local_models, global_model, clients, config)
    cost = made_phase_cost(rounds, federation.num_clients, parameter_bytes(template))
    return FedDiskWeights(weights=weights, cost=cost)


def compute_feddisk_ab_weights(
    federation: Federation, config: FedDiskAbConfig, rng: np.random.Generator
) -> FedDiskWeights:
    """FedDiskAb: D trained on client k's raw inputs (label 0) against n_k inputs drawn
    without replacement from the pooled inputs of all clients (label 1); weights
    ``D(x) / (1 - D(x))`` of the local inputs, normalised as in FedDisk."""
    inputs = unit_interval_inputs(federation)
    sizes = np.array([x.shape[0] for x in inputs])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    input_dim = inputs[0].shape[1]
    pooled_sets = []
    for x in inputs:
        pooled_ids = rng.choice(total, size=x.shape[0], replace=False)
        owners = np.searchsorted(offsets, pooled_ids, side="right") - 1
        pooled = torch.empty_like(x)
        for owner in np.unique(owners):
            rows = np.flatnonzero(owners == owner)
            local_ids = torch.as_tensor(pooled_ids[rows] - offsets[owner], device=x.device)
            pooled[torch.as_tensor(rows, device=x.device)] = inputs[owner][local_ids]
        pooled_sets.append(pooled)
    classifiers = train_classifiers(
        pooled_sets, inputs, config, [_torch_generator(rng) for _ in inputs]
    )
    weights = client_weights(classifiers, inputs, config)
    raw_bytes = total * input_dim * BYTES_PER_PARAMETER
    return FedDiskWeights(weights=weights, cost=PhaseCost(0, raw_bytes, raw_bytes))


# --------------------------------------------------------------------- caching


def partition_fingerprint(federation: Federation) -> str:
    """A 16-hex-digit hash identifying a federation's split (see the module docstring):
    client count, each client's size and class counts, and its first, middle and last
    training input and label."""
    digest = hashlib.sha256()
    digest.update(np.int64(federation.num_clients).tobytes())
    for client in federation.clients:
        size = client.num_samples
        digest.update(np.array([client.client_id, size], dtype=np.int64).tobytes())
        digest.update(np.asarray(client.class_counts, dtype=np.int64).tobytes())
        picks = sorted({0, size // 2, size - 1}) if size > 0 else []
        for index in picks:
            digest.update(client.train_x[index].detach().cpu().to(torch.float32).numpy().tobytes())
            digest.update(np.int64(int(client.train_y[index])).tobytes())
    return digest.hexdigest()[:16]


def cache_key(
    dataset_name: str, partition_fingerprint: str, seed: int, config: SampleWeightConfig
) -> str:
    """File stem of the cached weights: ``<method>-<dataset>-<hash>``, where the hash
    covers the dataset, the partition fingerprint, the seed, every config field that
    changes the weights (all but ``cache_dir``) and :data:`WEIGHTS_VERSION`."""
    fields = config.model_dump(exclude={"cache_dir", "seed"})
    payload = json.dumps(
        {
            "dataset": dataset_name,
            "partition": partition_fingerprint,
            "seed": int(seed),
            "config": fields,
            "version": WEIGHTS_VERSION,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:20]
    safe_dataset = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset_name) or "dataset"
    return f"{config.name}-{safe_dataset}-{digest}"


def save_weights(path: str | Path, result: FedDiskWeights) -> None:
    """Write ``result`` to ``path`` (.npz), atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        f"weights_{index}": np.asarray(w, dtype=np.float32)
        for index, w in enumerate(result.weights)
    }
    arrays["num_clients"] = np.asarray(len(result.weights), dtype=np.int64)
    arrays["cost"] = np.array(
        [result.cost.rounds, result.cost.bytes_up, result.cost.bytes_down], dtype=np.int64
    )
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)  # type: ignore[arg-type]  # numpy stubs reject **dict
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_weights(path: str | Path) -> FedDiskWeights:
    """Read what :func:`save_weights` wrote.

    Raises:
        DataError: the file is missing, unreadable, or does not hold finite,
            non-negative weights; the message names the file.
    """
    path = Path(path)
    problem = f"cached FedDisk weights {str(path)!r} are unreadable or corrupt"
    advice = "; delete the file so that the weights are recomputed"
    try:
        with np.load(path, allow_pickle=False) as archive:
            num_clients = int(archive["num_clients"])
            cost = [int(value) for value in archive["cost"]]
            weights = [
                np.asarray(archive[f"weights_{k}"], dtype=np.float32) for k in range(num_clients)
            ]
    except FileNotFoundError:
        raise DataError(f"cached FedDisk weights {str(path)!r} do not exist") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise DataError(f"{problem} ({error}){advice}") from None
    if len(cost) != 3 or any(value < 0 for value in cost):
        raise DataError(f"{problem} (bad cost record {cost}){advice}")
    for index, client_weights in enumerate(weights):
        if (
            client_weights.ndim != 1
            or not np.all(np.isfinite(client_weights))
            or np.any(client_weights < 0)
        ):
            raise DataError(f"{problem} (client {index} weights are not finite and >= 0){advice}")
    return FedDiskWeights(weights=weights, cost=PhaseCost(*cost))


# ---------------------------------------------------------------- loss transforms


ComputeWeights = Callable[[Federation, Any, np.random.Generator], FedDiskWeights]


def sample_weight_context(weights: Tensor) -> Context:
    """The client context :meth:`SampleWeightedLoss.per_sample_loss` reads: the client's
    weights, one per training sample, in sample order."""
    return {SAMPLE_WEIGHT_KEY: weights}


class SampleWeightedLoss(LossTransform):
    """Cross-entropy times a per-sample weight fixed by a phase run in :meth:`prepare`.

    Args:
        config: a :class:`FedDiskConfig` or :class:`FedDiskAbConfig`.
        compute: phase 1, ``compute(federation, config, rng) -> FedDiskWeights``.
    """

    def __init__(self, config: SampleWeightConfig, compute: ComputeWeights) -> None:
        self.config = config
        self._compute = compute
        self.weights: list[Tensor] | None = None
        self.cost: PhaseCost | None = None

    def prepare(self, federation: Any) -> PhaseCost:
        """Run phase 1 (or load it from ``config.cache_dir``) and return its traffic.

        Raises:
            DataError: a cached file is corrupt or was computed for other client sizes.
        """
        result = self._cached_or_computed(federation)
        self.weights = [
            torch.as_tensor(w, dtype=torch.float32, device=federation.device)
            for w in result.weights
        ]
        self.cost = result.cost
        return result.cost

    def _cached_or_computed(self, federation: Federation) -> FedDiskWeights:
        config = self.config
        if config.cache_dir is None:
            return self._compute(federation, config, np.random.default_rng(config.seed))
        key = cache_key(
            federation.dataset_name, partition_fingerprint(federation), config.seed, config
        )
        path = Path(config.cache_dir) / f"{key}.npz"
        if path.exists():
            result = load_weights(path)
            sizes = [client.num_samples for client in federation.clients]
            self._check_sizes(result, sizes, source=f"cached FedDisk weights {str(path)!r}")
            return result
        result = self._compute(federation, config, np.random.default_rng(config.seed))
        save_weights(path, result)
        return result

    @staticmethod
    def _check_sizes(result: FedDiskWeights, sizes: list[int], source: str) -> None:
        held = [int(w.shape[0]) for w in result.weights]
        if held != sizes:
            raise DataError(
                f"{source} hold weights for {len(held)} clients with sizes {held[:5]}..., but "
                f"the federation has {len(sizes)} clients with sizes {sizes[:5]}...; delete "
                "the file so that the weights are recomputed"
            )

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        """``{"sample_weight": w_k}``, a float32 tensor of shape [n_k]."""
        if self.weights is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(federation) must run before round 0")
        return sample_weight_context(self.weights[client_id])

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        """``w_k[sample_ids] * CE``; a gather, so it runs under ``torch.func.vmap``."""
        weights = context[SAMPLE_WEIGHT_KEY]
        if weights.device != logits.device:  # restored from a checkpoint onto the CPU
            weights = weights.to(logits.device)
        sample_weights = weights.gather(0, sample_ids)
        return sample_weights * F.cross_entropy(logits, targets, reduction="none")

    def state_dict(self) -> dict[str, Any]:
        if self.weights is None or self.cost is None:
            return {}
        return {
            "sample_weights": [w.detach().cpu().clone() for w in self.weights],
            "cost": [self.cost.rounds, self.cost.bytes_up, self.cost.bytes_down],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.weights = [torch.as_tensor(w, dtype=torch.float32) for w in state["sample_weights"]]
        self.cost = PhaseCost(*(int(value) for value in state["cost"]))


class FedDisk(SampleWeightedLoss):
    """FedDisk's weighted cross-entropy (phase 1: :func:`compute_feddisk_weights`).

    Args:
        config: the validated :class:`FedDiskConfig`.
    """

    def __init__(self, config: FedDiskConfig) -> None:
        super().__init__(config, compute_feddisk_weights)


class FedDiskAb(SampleWeightedLoss):
    """FedDiskAb's weighted cross-entropy (phase 1: :func:`compute_feddisk_ab_weights`).

    Args:
        config: the validated :class:`FedDiskAbConfig`.
    """

    def __init__(self, config: FedDiskAbConfig) -> None:
        super().__init__(config, compute_feddisk_ab_weights)


@hookimpl
def fedplug_register_loss_transforms(register: Register) -> None:
    register("feddisk", FedDiskConfig, FedDisk)
    register("feddisk_ab", FedDiskAbConfig, FedDiskAb)
