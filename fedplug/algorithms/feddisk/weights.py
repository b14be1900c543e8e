"""FedDisk's sample weights: the classifier D and the weights it gives, phase 1 steps 3-4
(see :mod:`fedplug.algorithms.feddisk` for the method), and FedDiskAb's oracle version.

3. Client k feeds each local sample through both MADEs, giving two D-vectors v_g(x)
   (pseudo-label 1) and v_l(x) (pseudo-label 0), and trains a binary classifier
   (one hidden layer of 100 ReLU units, 2-way softmax; SGD, lr 0.01, stopped when the
   loss stops decreasing significantly, paper 7.2.4) on the 2 n_k vectors
   (:func:`train_classifiers`). It is trained locally: no communication, so it adds no
   rounds.
4. ``w_k(x) = D(v_l(x)) / (1 - D(v_l(x)))`` (paper eq. 16, :func:`density_ratios`) where
   ``D(.)`` is the classifier's probability of class 1, "comes from the global model".
   The class prior ratio is 1 since both classes hold n_k vectors. When the two MADEs
   agree the classifier cannot tell the classes apart, D = 1/2 and every weight is 1.
   The raw ratios are then normalised per client (:func:`normalise_weights`).

FedDiskAb (paper section 6, :func:`compute_feddisk_ab_weights`): an oracle ablation that
trains the same classifier directly on client k's raw inputs (label 0) against n_k inputs
drawn without replacement from the pooled data of all clients (label 1); weights as in
step 4. It moves raw data, so it is for comparison only; its cost is reported as 0 rounds
with ``bytes_up = sum_k n_k D 4`` (every client's data pooled) and
``bytes_down = sum_k n_k D 4`` (each client receives n_k pooled inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import skip_init

from fedplug.components import Context, PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import TrainingError
from fedplug.models.made import MADE, PaddedSets, StackedMLP, expand_slices, ragged_batches

from .density import (
    BYTES_PER_PARAMETER,
    ClientDensityData,
    made_features,
    torch_generator,
    unit_interval_inputs,
)

if TYPE_CHECKING:
    from .config import FedDiskAbConfig, FedDiskConfig, SampleWeightConfig

SAMPLE_WEIGHT_KEY = "sample_weight"
"""The loss context's key of a client's sample weights."""


def sample_weight_context(weights: Tensor) -> Context:
    """The client context :meth:`~fedplug.algorithms.feddisk.SampleWeightedLoss.per_sample_loss`
    reads: the client's weights, one per training sample, in sample order."""
    return {SAMPLE_WEIGHT_KEY: weights}


@dataclass(frozen=True)
class FedDiskWeights:
    """Phase 1's result: one weight per local training sample of each client."""

    weights: list[np.ndarray]
    """``weights[k]`` is a float32 array of length n_k, in the order of client k's
    ``train_x``."""
    cost: PhaseCost


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


def client_sample_weights(
    local_models: Sequence[MADE],
    global_models: Sequence[MADE],
    clients: Sequence[ClientDensityData],
    config: FedDiskConfig,
) -> list[np.ndarray]:
    """Steps 3-4 for each client of ``clients``: its classifier D on the features of its
    inputs under its local MADE and its copy of the global one, and the normalised
    weights of its samples."""
    local_features = [
        made_features(model, client.inputs, config.made_features)
        for model, client in zip(local_models, clients)
    ]
    global_features = [
        made_features(model, client.inputs, config.made_features)
        for model, client in zip(global_models, clients)
    ]
    classifiers = train_classifiers(
        global_features,
        local_features,
        config,
        [client.classifier_generator for client in clients],
    )
    return client_weights(classifiers, local_features, config)


# ------------------------------------------------------------------- FedDiskAb


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
        pooled_sets, inputs, config, [torch_generator(rng) for _ in inputs]
    )
    weights = client_weights(classifiers, inputs, config)
    raw_bytes = total * input_dim * BYTES_PER_PARAMETER
    return FedDiskWeights(weights=weights, cost=PhaseCost(0, raw_bytes, raw_bytes))
