"""FedDisk's sample weights, phase 1 steps 3-4: the classifier D on the two MADEs' output
vectors, the density ratios and their normalisation, and FedDiskAb's oracle version.
Details: docs/algorithms.md, "FedDisk: sample weights".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import skip_init

from fedplug.components import Context, PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import TrainingError
from fedplug.schema import MAX_COUNT, Counts, MessageSchema, Real

from .density import (
    BYTES_PER_PARAMETER,
    ClientDensityData,
    made_features,
    torch_generator,
    unit_interval_inputs,
)
from .made import MADE
from .made_training import PaddedSets, StackedMLP, expand_slices, ragged_batches

if TYPE_CHECKING:
    from .config import FedDiskAbConfig, FedDiskConfig, SampleWeightConfig

logger = logging.getLogger("fedplug.algorithms.feddisk")

SAMPLE_WEIGHT_KEY = "sample_weight"
"""The loss context's key of a client's sample weights."""


def sample_weight_context(weights: Tensor) -> Context:
    """The client context :meth:`~fedplug.algorithms.feddisk.SampleWeightedLoss.per_sample_loss`
    reads: the client's weights, one per training sample, in sample order."""
    return {SAMPLE_WEIGHT_KEY: weights}


@dataclass(frozen=True)
class FedDiskWeights:
    """Phase 1's result: one weight per local training sample of each client, and the raw
    density ratios they were normalised from."""

    weights: list[np.ndarray]
    """``weights[k]`` is a float32 array of length n_k, in the order of client k's
    ``train_x``."""
    cost: PhaseCost
    ratios: list[np.ndarray] | None = None
    """``ratios[k]``: client k's raw density ratios (float64, same order), before
    :func:`normalise_weights`; what the cache stores, so that both normalisations share
    one phase 1 (None: not kept)."""

    @classmethod
    def from_ratios(
        cls, ratios: Sequence[np.ndarray], cost: PhaseCost, config: SampleWeightConfig
    ) -> FedDiskWeights:
        """The weights ``config`` normalises ``ratios`` to, with the ratios kept."""
        kept = [np.asarray(r, dtype=np.float64) for r in ratios]
        return cls(weights=normalised_weights(kept, config), cost=cost, ratios=kept)


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


@dataclass
class ClassifierHistory:
    """What :func:`train_classifiers` did for one client's D."""

    validation_loss: list[float] = field(default_factory=list)
    """Mean cross-entropy (nats) on the held-out vectors: of the untrained D (ln 2, since
    its output layer starts at zero), then after every epoch."""
    best_epoch: int = 0
    """Epochs trained by the kept state (0: the untrained D, i.e. every weight 1)."""

    @property
    def epochs(self) -> int:
        """Epochs trained."""
        return len(self.validation_loss) - 1


def classifier_split(
    num_samples: int, fraction: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Shuffle ``range(num_samples)`` with ``generator`` and split it into (train,
    validation) sample ids; the validation part holds ``round(fraction * num_samples)``
    ids, at least one, and at least one id stays for training (``num_samples >= 2``)."""
    order = torch.randperm(num_samples, generator=generator)
    held_out = min(max(round(fraction * num_samples), 1), num_samples - 1)
    return order[held_out:], order[:held_out]


def _pairs(global_like: Tensor, local_like: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Rows ``ids`` of both sets stacked (global-like first) and their labels (1, then 0)."""
    ids = ids.to(global_like.device)
    inputs = torch.cat([global_like[ids], local_like[ids]]).detach()
    labels = torch.cat(
        [
            torch.ones(ids.numel(), dtype=torch.long, device=global_like.device),
            torch.zeros(ids.numel(), dtype=torch.long, device=global_like.device),
        ]
    )
    return inputs, labels


@torch.no_grad()
def _stacked_mean_cross_entropy(
    stack: StackedMLP, inputs: PaddedSets, labels: PaddedSets, chunk: int = 2048
) -> list[float]:
    """Mean cross-entropy of classifier k on data set k, for every k."""
    sizes = torch.tensor(inputs.sizes)
    totals = torch.zeros(len(inputs.sizes), dtype=torch.float64)
    longest = int(sizes.max())
    for start in range(0, longest, chunk):
        rows = torch.arange(start, min(start + chunk, longest))
        present = rows[None, :] < sizes[:, None]
        indices = torch.where(present, rows[None, :], 0)
        logits = stack.logits(inputs.gather(indices))
        losses = F.cross_entropy(
            logits.reshape(-1, 2), labels.gather(indices).reshape(-1), reduction="none"
        ).reshape(logits.shape[:2])
        totals += (losses.cpu().double() * present).sum(dim=1)
    return [float(total) / size for total, size in zip(totals, inputs.sizes)]


def train_classifiers(
    global_like: Sequence[Tensor],
    local_like: Sequence[Tensor],
    config: SampleWeightConfig,
    generators: Sequence[torch.Generator],
    histories: list[ClassifierHistory] | None = None,
) -> list[nn.Sequential]:
    """Train one classifier D per client, all at once (vectorised over clients), until
    its validation loss stops improving.

    Classifier k learns to tell the rows of ``global_like[k]`` (label 1) from those of
    ``local_like[k]`` (label 0), both ``[n_k, d]`` (in FedDisk row i of both comes from
    the client's sample i), by plain SGD on the softmax cross-entropy (paper 7.2.4). Early
    stopping:

    - ``config.classifier_validation_fraction`` of the row indices are held out, in both
      sets (:func:`classifier_split`), so the two classes stay equal in both parts;
    - after every epoch the held-out mean cross-entropy is measured; D stops after
      ``config.classifier_patience`` epochs in a row without a lower one, or after
      ``config.classifier_epochs`` epochs;
    - D keeps the state with the lowest held-out loss, the untrained one included (output
      layer at zero: D = 1/2, every weight 1). So a D that learns nothing that holds on
      new samples (a client whose local and global MADEs agree) gives weights of 1, and no
      single epoch's training loss decides when to stop.

    ``generators[k]`` draws D's initial weights, then the split, then the mini-batch
    orders. When ``histories`` is given, one :class:`ClassifierHistory` per client is
    appended to it.
    """
    input_dim = global_like[0].shape[1]
    device = global_like[0].device
    classifiers = [
        make_classifier(input_dim, config.classifier_hidden, generator).to(device)
        for generator in generators
    ]
    layers = [classifier_layers(classifier) for classifier in classifiers]
    stack = StackedMLP.from_linear_layers(layers)
    train_parts, validation_parts = [], []
    for g, l, generator in zip(global_like, local_like, generators):
        train_ids, validation_ids = classifier_split(
            int(g.shape[0]), config.classifier_validation_fraction, generator
        )
        train_parts.append(_pairs(g, l, train_ids))
        validation_parts.append(_pairs(g, l, validation_ids))
    inputs = PaddedSets([x for x, _ in train_parts])
    labels = PaddedSets([y for _, y in train_parts])
    validation_inputs = PaddedSets([x for x, _ in validation_parts])
    validation_labels = PaddedSets([y for _, y in validation_parts])

    count = len(classifiers)
    records = [ClassifierHistory() for _ in range(count)]
    best = _stacked_mean_cross_entropy(stack, validation_inputs, validation_labels)
    for record, loss in zip(records, best):
        record.validation_loss.append(loss)
    best_state = stack.state()
    running = [True] * count
    for epoch in range(1, config.classifier_epochs + 1):
        if not any(running):
            break
        for batch in ragged_batches(inputs.sizes, config.classifier_batch_size, generators, running):
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
        validation = _stacked_mean_cross_entropy(stack, validation_inputs, validation_labels)
        improved = torch.zeros(count, dtype=torch.bool)
        for index, record in enumerate(records):
            if not running[index]:
                continue
            record.validation_loss.append(validation[index])
            if validation[index] < best[index]:
                best[index] = validation[index]
                record.best_epoch = epoch
                improved[index] = True
            elif epoch - record.best_epoch >= config.classifier_patience:
                running[index] = False
        if bool(improved.any()):
            best_state = [
                torch.where(expand_slices(improved, now), now, kept)
                for now, kept in zip(stack.state(), best_state)
            ]
    stack.load_slices(best_state, torch.ones(count, dtype=torch.bool))
    stack.write_back(layers)
    for classifier in classifiers:
        classifier.eval()
    if histories is not None:
        histories.extend(records)
    return classifiers


def log_classifier_training(epochs: Sequence[int], kept: Sequence[int]) -> None:
    """Log how long the clients' classifiers D trained (``epochs``) and which epoch each
    kept (``kept``; 0 is the untrained D)."""
    if not epochs:
        return
    logger.info(
        "FedDisk: the classifiers D trained %.1f epochs on average (%d-%d) and kept epoch %.1f "
        "on average (%d of %d clients kept the untrained D, all weights 1)",
        float(np.mean(epochs)),
        min(epochs),
        max(epochs),
        float(np.mean(kept)),
        sum(1 for epoch in kept if epoch == 0),
        len(kept),
    )


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
    keep_mean: bool = True,
) -> np.ndarray:
    """Turn one client's raw density ratios into sample weights (float32).

    Args:
        ratios: non-negative ratios, one per local sample.
        method: ``"mean"``: ``clip(c r, clip_min, clip_max)`` with the scale ``c`` that
            gives the clipped weights mean 1 (:func:`mean_one_scale`; ``keep_mean=False``:
            ``c = 1 / mean(r)``, whose clipped weights have a mean below 1 when the upper
            clip bites); ``"minmax"``: ``2 (r - min r) / (max r - min r)``, in [0, 2].
        clip_min (default 0.0), clip_max (default 5.0): bounds of the ``"mean"`` weights.
        keep_mean (default True): see ``method``.

    All-equal ratios give weights of 1 under both methods (min-max would divide by 0).

    Raises:
        TrainingError: a ratio is NaN, infinite or negative (training diverged), or too few
            are positive for clipped weights of mean 1 (raise ``clip_max``).
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
    scale = mean_one_scale(values, clip_min, clip_max) if keep_mean else 1.0 / values.mean()
    return np.clip(scale * values, clip_min, clip_max).astype(np.float32)


def mean_one_scale(ratios: np.ndarray, clip_min: float, clip_max: float, steps: int = 200) -> float:
    """The scale ``c`` with ``mean(clip(c r, clip_min, clip_max)) = 1``.

    Density ratios are importance weights: ``E_{p_k}[p / p_k] = 1``, so weights of mean 1
    keep the mean-reduced loss's step the step of plain cross-entropy (FedAvg's). Dividing
    by the mean and then clipping loses that: the clipped mass is gone, the mean falls
    below 1 and every local step is shorter. The clipped mean is continuous and
    non-decreasing in ``c``, from ``clip_min`` (<= 1) at ``c = 0``; bisection (``steps``
    halvings of a bracket that starts at ``1 / mean(r)``) finds ``c`` to float64 precision.

    Raises:
        TrainingError: even ``c -> inf`` leaves the mean below 1 (fewer than a
            ``1 / clip_max`` share of the ratios is positive).
    """

    def clipped_mean(scale: float) -> float:
        return float(np.clip(scale * ratios, clip_min, clip_max).mean())

    positive = float(np.mean(ratios > 0))
    if clip_max * positive + clip_min * (1.0 - positive) < 1.0:
        raise TrainingError(
            f"FedDisk cannot give this client's weights mean 1: only {positive:.1%} of its "
            f"density ratios are positive and clip_max is {clip_max:g}; raise clip_max"
        )
    low, high = 0.0, 1.0 / float(ratios.mean())
    while clipped_mean(high) < 1.0:
        low, high = high, 2.0 * high
    for _ in range(steps):
        middle = (low + high) / 2.0
        if clipped_mean(middle) < 1.0:
            low = middle
        else:
            high = middle
    return high


def normalised_weights(
    ratios: Sequence[np.ndarray], config: SampleWeightConfig
) -> list[np.ndarray]:
    """Each client's raw ratios normalised as ``config`` says (:func:`normalise_weights`)."""
    return [
        normalise_weights(r, config.normalisation, config.clip_min, config.clip_max, config.keep_mean)
        for r in ratios
    ]


def client_ratios(
    classifiers: Sequence[nn.Module], features: Sequence[Tensor]
) -> list[np.ndarray]:
    """Step 4 for each client: classifier k's raw density ratios of ``features[k]``
    (:func:`density_ratios`, float64)."""
    return [density_ratios(classifier, inputs) for classifier, inputs in zip(classifiers, features)]


def client_density_ratios(
    local_models: Sequence[MADE],
    global_models: Sequence[MADE],
    clients: Sequence[ClientDensityData],
    config: FedDiskConfig,
    histories: list[ClassifierHistory] | None = None,
) -> list[np.ndarray]:
    """Steps 3-4 for each client of ``clients``: its classifier D on the features of its
    inputs under its local MADE and its copy of the global one, and the raw density
    ratios of its samples (:func:`normalised_weights` turns them into weights).
    ``histories``, when given, receives each client's :class:`ClassifierHistory`."""
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
        histories,
    )
    return client_ratios(classifiers, local_features)


WEIGHT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
"""The quantiles of each client's weights :func:`weight_summary` reports."""

HISTOGRAM_BINS = 40
"""Bins of the pooled histogram :func:`weight_summary` reports."""

WEIGHT_STATS = ("min", "q05", "q25", "median", "q75", "q95", "max", "mean", "std")
"""The per-client statistics of the weights, in the order :func:`client_weight_summary`
computes them (the quantiles are :data:`WEIGHT_QUANTILES`)."""

HISTOGRAM_COUNTS = "histogram_counts"
"""The key of a client's histogram counts in :func:`client_weight_summary`."""

PREFIX = "sample_weight."
"""The prefix of every entry of the setup report."""


REPORT_BYTES = 4096
"""The most bytes of one client's report (its 9 statistics and 40 counts take about 600)."""


def weight_report_schema(top: float) -> MessageSchema:
    """What the server accepts as one client's :func:`client_weight_summary` for the
    histogram of ``top`` (:func:`histogram_top`): ``histogram_counts``, exactly
    :data:`HISTOGRAM_BINS` counts in ``[0, 10^9]``; each of :data:`WEIGHT_STATS` a weight
    in ``[0, top]`` (a hair above, for the 6-digit rounding), absent for a client without
    samples; nothing else, at most :data:`REPORT_BYTES`. Checked before anything adds the
    counts up, so no count can wrap an int64 sum."""
    weight = Real(0.0, top * (1 + 1e-5), optional=True)
    fields = {HISTOGRAM_COUNTS: Counts(length=HISTOGRAM_BINS, high=MAX_COUNT)}
    return MessageSchema("report", {**fields, **dict.fromkeys(WEIGHT_STATS, weight)}, max_bytes=REPORT_BYTES)


def report_counts(report: Mapping[str, object]) -> int | None:
    """How many samples a client's report counts over its histogram (None: it holds no
    histogram)."""
    counts = report.get(HISTOGRAM_COUNTS)
    return int(sum(int(count) for count in counts)) if isinstance(counts, list) else None


def histogram_top(config: SampleWeightConfig) -> float:
    """The upper edge of the weight histogram, which every weight ``config`` gives lies
    under: ``clip_max`` for the ``"mean"`` normalisation, 2 for ``"minmax"``. Fixed by the
    config, so that each client can count its own weights over the same bins and the
    pooled histogram is their sum."""
    return float(config.clip_max) if config.normalisation == "mean" else 2.0


def histogram_edges(top: float) -> np.ndarray:
    """The :data:`HISTOGRAM_BINS` + 1 edges of the weight histogram, from 0 to ``top``."""
    return np.linspace(0.0, top if top > 0 else 1.0, HISTOGRAM_BINS + 1)


def client_weight_summary(weights: np.ndarray, top: float) -> dict[str, float | list[int]]:
    """One client's share of :func:`weight_summary`, computed where its weights are (what
    a client sends in the setup phase's last reply): its :data:`WEIGHT_STATS`, each
    rounded to 6 significant digits (absent when it has no samples), and
    ``histogram_counts``, the counts of its weights over :func:`histogram_edges` of
    ``top`` (a weight above ``top`` counts in the last bin)."""
    values = np.asarray(weights, dtype=np.float64)
    edges = histogram_edges(top)
    counts, _ = np.histogram(np.minimum(values, edges[-1]), bins=edges)
    summary: dict[str, float | list[int]] = {HISTOGRAM_COUNTS: [int(count) for count in counts]}
    if values.size:
        stats = [values.min(), *np.quantile(values, WEIGHT_QUANTILES), values.max()]
        stats += [values.mean(), values.std()]
        summary.update({name: float(f"{value:.6g}") for name, value in zip(WEIGHT_STATS, stats)})
    return summary


def merge_weight_summaries(
    client_summaries: Sequence[Mapping[str, object]], top: float
) -> dict[str, object]:
    """The setup report from every client's :func:`client_weight_summary` (in client
    order), as JSON-ready values:

    - ``sample_weight.min``, ``.q05``, ``.q25``, ``.median``, ``.q75``, ``.q95``, ``.max``,
      ``.mean``, ``.std``: one list entry per client, null for a client without samples
      (or one the setup phase dropped: its summary is empty);
    - ``sample_weight.histogram``: ``{"edges": [41 floats from 0 to top], "counts": [40
      ints]}``, the clients' counts added up (the weights of all clients pooled).

    The summaries are the ones :func:`weight_report_schema` accepted (or computed here).
    """
    report: dict[str, object] = {
        PREFIX + name: [summary.get(name) for summary in client_summaries] for name in WEIGHT_STATS
    }
    counts = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
    for summary in client_summaries:
        if HISTOGRAM_COUNTS in summary:  # a dropped client's summary is empty
            counts += np.asarray(summary[HISTOGRAM_COUNTS], dtype=np.int64)
    report[PREFIX + "histogram"] = {
        "edges": [float(f"{edge:.6g}") for edge in histogram_edges(top)],
        "counts": [int(count) for count in counts],
    }
    return report


def weight_summary(weights: Sequence[np.ndarray], top: float) -> dict[str, object]:
    """What a report needs to show the spread of the sample weights
    (:meth:`~fedplug.algorithms.feddisk.SampleWeightedLoss.setup_report`; the simulator
    writes them to metrics.json under ``setup_report``): :func:`merge_weight_summaries` of
    every client's :func:`client_weight_summary`, the same whether the weights are in
    this process or each on its own client."""
    return merge_weight_summaries([client_weight_summary(w, top) for w in weights], top)


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
    histories: list[ClassifierHistory] = []
    classifiers = train_classifiers(
        pooled_sets, inputs, config, [torch_generator(rng) for _ in inputs], histories
    )
    log_classifier_training(
        [history.epochs for history in histories], [history.best_epoch for history in histories]
    )
    raw_bytes = total * input_dim * BYTES_PER_PARAMETER
    return FedDiskWeights.from_ratios(
        client_ratios(classifiers, inputs), PhaseCost(0, raw_bytes, raw_bytes), config
    )
