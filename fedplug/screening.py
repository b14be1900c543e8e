"""Screening: whether one client's reply may reach the aggregator, field by field.

The round core asks :func:`update_problem` about every :class:`~fedplug.components.ClientUpdate`
before the aggregator sees it, so a reply that would crash an aggregator or poison the
model is dropped with a logged reason on every runtime alike. Every function here is
pure and never raises on what a client sent.
Design: docs/reliability.md, section 8.3 and 'Design notes: screening'.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedplug.components import ClientUpdate, ReplyExtra, StrictConfig


class ScreeningConfig(StrictConfig):
    """Bounds on what one client's reply may claim (``train.screening``).

    The defaults change nothing an honest client sends; the poisoning defences that could
    drop an honest reply (``max_update_norm``, ``max_extra_norm``, ``max_weight_fraction``)
    are off until set. A reply over a bound is dropped (not clipped) with its reason, and
    counts as a failed client (``train.failures``). These bound what one reply can do to a
    weighted mean; they are no defence against many colluding clients or a small, steady
    bias: for that, use a robust aggregator (``flower`` with Flower's Krum, FedMedian or
    FedTrimmedAvg).
    """

    max_num_examples: int = Field(default=10**9, ge=1)
    """The most training samples a chain may claim (``num-examples``; its aggregation
    weight under sample weighting)."""
    max_num_steps: int = Field(default=10**9, ge=1)
    """The most local optimiser steps a chain may report (``num-steps``)."""
    check_num_examples: bool = True
    """Drop a chain that claims more samples than its members' class counts sum to, where
    the server holds the class counts (the simulator and fedplug's FedML runtime always;
    Flower with ``query_nodes``; FedML's drop-in with ``class_counts=``). An honest client's
    count is its class counts' sum, so this fires only for a client that lies about one
    of them; turn it off for clients whose own loop counts samples differently."""
    max_update_norm: float | None = Field(default=None, gt=0)
    """Drop an update whose change to the global model, ``||w_k - w||_2``, exceeds this
    (None: no bound). A scaled or boosted model is the usual model-poisoning attack;
    set it a few times above the honest updates' norms (they shrink as training converges)."""
    max_norm_ratio: float | None = Field(default=1e4, gt=0)
    """Drop an update whose change ``||w_k - w||_2``, or any model-shaped extra's norm
    (SCAFFOLD's ``delta_c``), exceeds this many times ``max(||w||_2, 1)`` (None: no
    bound). The default, 10^4, is far beyond any update of a training run that has not
    already diverged; it stops a corrupted update of absurd scale (``train.faults.corruption``
    scale 1e30) from turning the global model into one no client can train from."""
    max_extra_norm: float | None = Field(default=None, gt=0)
    """Drop an update with any reply extra (SCAFFOLD's ``delta_c``, FedNova's ``a``) whose
    L2 norm exceeds this (None: no bound)."""
    max_weight_fraction: float | None = Field(default=None, gt=0, le=1)
    """Drop an update whose aggregation weight is more than this share of the total
    weight of the round's updates (None: no cap). A round with a single update keeps it
    (its share is 1 whatever it claims). With samples weighting an honest client's share
    is its share of the round's samples, so set it above the largest one you expect
    (at least ``1 / clients per round``). When set, the simulator holds a round's updates
    in memory until they are all in."""


@dataclass(frozen=True)
class ScreeningRules:
    """What one round core screens every update against; built once per run."""

    model_shape: tuple[int, ...]
    """The flat global model's shape, ``(P,)``."""
    timeout: float | None = None
    """``train.failures.client_timeout_seconds`` (None: no limit)."""
    required_metrics: tuple[str, ...] = ()
    """The reply metrics the components ask for (:attr:`ClientNeeds.reply_metrics`)."""
    extras: Mapping[str, ReplyExtra] = field(default_factory=dict)
    """The declared reply extras (:attr:`ClientNeeds.reply_extra_shapes`)."""
    required_extras: tuple[str, ...] = ()
    """The extras every reply must carry (:attr:`ClientNeeds.reply_extras`)."""
    num_clients: int | None = None
    """K: client ids must be in ``[0, K)`` (None: not checked)."""
    max_samples: np.ndarray | None = None
    """Each client's class counts summed, where the server holds them (None: it does not)."""
    config: ScreeningConfig = field(default_factory=lambda: ScreeningConfig())


MAX_SECONDS = 10.0**9
"""The most wall time a reply may claim (``seconds``; about 31 years): a bound before any
sum of a chain's times, on every runtime (Flower's decoding has the same)."""
MAX_METRIC_NAME_CHARS = 128
"""The longest name of a reply's metric (``num-examples``, ``train_loss``: honest names are
a few dozen characters); :mod:`fedplug.run.reply_metrics` cuts a runtime's metrics to the
same bound before they reach the round core."""
MAX_METRICS_BYTES = 16 * 1024
"""The most bytes of one reply's metrics, names (one byte per character) and values (8
bytes per number) together: two full lists, or hundreds of numbers."""
LARGEST_FLOAT = sys.float_info.max
"""A metric's magnitude bound: any finite float; a larger int is refused before it is converted."""


# ------------------------------------------------------------------- metadata checks

REAL_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def dtype_problem(what: str, dtype: Any, kind: Literal["float", "real"] = "real") -> str | None:
    """Why ``dtype`` (a torch or numpy dtype, or its name) cannot carry ``what``, or None.

    ``kind="float"``: a real floating-point dtype only (the model); ``"real"``: a real
    float or an integer (extras). Complex, bool, string, object and datetime dtypes are
    refused.
    """
    if isinstance(dtype, torch.dtype):
        ok = dtype in REAL_FLOAT_DTYPES or (kind == "real" and dtype in INTEGER_DTYPES)
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            numpy_dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            return f"sent {what} of an unknown dtype {str(dtype)[:40]!r}"
        ok = numpy_dtype.kind == "f" or (kind == "real" and numpy_dtype.kind in "iu")
        name = str(numpy_dtype)
    if ok:
        return None
    wanted = "a real floating-point dtype" if kind == "float" else "a real float or integer dtype"
    return f"sent {what} of dtype {name}, expected {wanted}"


def declared_shape(declared: ReplyExtra, model_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The exact shape ``declared`` asks for (``"model"`` is ``model_shape``)."""
    return tuple(model_shape) if isinstance(declared.shape, str) else tuple(declared.shape)


def shape_problem(
    name: str, shape: Sequence[int], declared: ReplyExtra | None, model_shape: tuple[int, ...]
) -> str | None:
    """Why an extra called ``name`` of ``shape`` is not what its component declared, or
    None. An undeclared extra may have any shape of at most the model's number of
    elements. Reads only the shape."""
    shape = tuple(shape)
    if declared is not None:
        expected = declared_shape(declared, model_shape)
        if shape != expected:
            return f"sent extras[{name!r}] of shape {_short(shape)}, expected {expected}"
        return None
    limit = math.prod(model_shape)
    if math.prod(shape) > limit:
        return f"sent extras[{name!r}] of {math.prod(shape)} elements, more than the model's {limit}"
    return None


def count_problem(what: str, value: Any, cap: int) -> str | None:
    """Why ``value`` is not a count in ``[0, cap]``, or None. An integral float (``5.0``)
    counts; a bool, a string, a fraction, NaN or infinity does not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return f"sent {what} = {_short(value)} of type {type(value).__name__}, expected a non-negative integer"
    if isinstance(value, numbers.Integral):
        count = int(value)
    else:
        number = float(value)
        if not math.isfinite(number) or number != math.floor(number):
            return f"sent {what} = {_short(value)}, expected a non-negative integer"
        count = int(number)
    if count < 0:
        return f"sent {what} = {count}, expected a non-negative integer"
    if count > cap:
        return f"sent {what} = {count}, over the cap of {cap} (train.screening)"
    return None


def number_problem(what: str, value: Any, low: float = -math.inf, high: float = math.inf) -> str | None:
    """Why ``value`` is not a real, finite number in ``[low, high]``, or None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return f"sent {what} = {_short(value)} of type {type(value).__name__}, expected a number"
    if isinstance(value, numbers.Integral) and not low <= value <= high:  # exact, before float() can overflow
        return f"sent {what} = {_short(value)}, expected a number in [{low:g}, {high:g}]"
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        return f"sent {what} = {_short(value)}, expected a finite number"
    if not math.isfinite(number):
        return f"sent {what} = {number}, expected a finite number"
    if not low <= number <= high:
        return f"sent {what} = {number:.6g}, expected a number in [{low:g}, {high:g}]"
    return None


# ---------------------------------------------------------------------- the update


def update_problem(
    update: ClientUpdate,
    rules: ScreeningRules,
    global_vector: Tensor | None = None,
    global_norm: float | None = None,
) -> str | None:
    """Why ``update`` cannot be aggregated under ``rules``, or None when it can.

    ``global_vector``: the round's global model, for the norm bounds (None: they are not
    checked); ``global_norm``: its L2 norm, when the caller computed it once per round.
    Never raises: whatever the update holds, the answer is a reason or None.
    """
    try:
        return _update_problem(update, rules, global_vector, global_norm)
    except Exception as error:  # noqa: BLE001 - what a client sent must never stop the server
        return f"sent a reply that could not be screened ({type(error).__name__}: {str(error)[:200]})"


def _update_problem(
    update: ClientUpdate, rules: ScreeningRules, global_vector: Tensor | None, global_norm: float | None
) -> str | None:
    config = rules.config
    chain = list(update.chain) if update.chain else [update.client_id]
    for client in chain:
        if reason := _client_id_problem(client, rules.num_clients):
            return reason
    if update.chain and update.client_id != chain[-1]:
        return f"answered as client {_short(update.client_id)}, not as client {chain[-1]}"
    if update.num_examples is not None:
        if reason := count_problem("num-examples", update.num_examples, config.max_num_examples):
            return reason
        if config.check_num_examples and rules.max_samples is not None:
            held = int(sum(int(rules.max_samples[int(client)]) for client in chain))
            if int(update.num_examples) > held:
                return (
                    f"claimed {int(update.num_examples)} num-examples but its class counts sum to {held} "
                    "(train.screening.check_num_examples)"
                )
    if reason := number_problem("aggregation weight", update.weight, 0.0, float(config.max_num_examples)):
        return reason
    if reason := count_problem("num-steps", update.num_steps, config.max_num_steps):
        return reason
    if reason := number_problem("seconds", update.seconds, 0.0, MAX_SECONDS):
        return reason
    if reason := _vector_problem(update.vector, rules.model_shape):
        return reason
    if reason := _extras_problem(update.extras, rules):
        return reason
    if reason := _metrics_problem(update.metrics, rules.required_metrics):
        return reason
    if rules.timeout is not None and update.seconds > rules.timeout:
        return f"took {update.seconds:.1f}s, over train.failures.client_timeout_seconds={rules.timeout}"
    if global_vector is not None:
        return norm_problem(update, config, global_vector, global_norm)
    return None


def _client_id_problem(client: Any, num_clients: int | None) -> str | None:
    if reason := count_problem("client id", client, 2**63 - 1):
        return reason
    if num_clients is not None and client >= num_clients:
        return f"sent client id {int(client)}, but the run has {num_clients} clients (ids 0-{num_clients - 1})"
    return None


def _vector_problem(vector: Any, model_shape: tuple[int, ...]) -> str | None:
    if not isinstance(vector, Tensor) or vector.layout != torch.strided:
        return f"returned parameters as {type(vector).__name__}, expected a dense tensor"
    if tuple(vector.shape) != tuple(model_shape):
        return f"returned {tuple(vector.shape)} parameters, expected {tuple(model_shape)}"
    if reason := dtype_problem("parameters", vector.dtype, "float"):
        return reason
    if not _finite(vector):
        return "returned non-finite (NaN/Inf) parameters"
    return None


def _extras_problem(extras: Any, rules: ScreeningRules) -> str | None:
    if not isinstance(extras, Mapping):
        return f"sent extras as {type(extras).__name__}, expected a mapping of names to tensors"
    missing = [name for name in rules.required_extras if name not in extras]
    if missing:
        return f"sent no extras {missing}, which the run's components need in every reply"
    for name, value in extras.items():
        if not isinstance(name, str):
            return f"sent an extra named {_short(name)}, expected a string"
        if not isinstance(value, Tensor) or value.layout != torch.strided:
            return f"sent extras[{name!r}] as {type(value).__name__}, expected a dense tensor"
        declared = rules.extras.get(name)
        if reason := shape_problem(name, value.shape, declared, rules.model_shape):
            return reason
        if reason := dtype_problem(f"extras[{name!r}]", value.dtype, "real"):
            return reason
        if value.numel() == 0:
            continue
        if value.dtype in REAL_FLOAT_DTYPES and not _finite(value):
            return "returned non-finite extras"
        if declared is not None and (reason := range_problem(value, declared.minimum, declared.maximum)):
            return f"sent extras[{name!r}] with {reason}"
    return None


def range_problem(value: Tensor, minimum: float | None, maximum: float | None) -> str | None:
    """``"an entry X, below its minimum M"`` (or above its maximum) for a non-empty real
    tensor with an entry outside ``[minimum, maximum]`` (None: no bound that side), else
    None."""
    if value.numel() == 0 or (minimum is None and maximum is None):
        return None
    low, high = (float(bound) for bound in torch.aminmax(value.reshape(-1).double()))
    if minimum is not None and low < minimum:
        return f"an entry {low:.6g}, below its minimum {minimum:g}"
    if maximum is not None and high > maximum:
        return f"an entry {high:.6g}, above its maximum {maximum:g}"
    return None


def _metrics_problem(metrics: Any, required: tuple[str, ...]) -> str | None:
    if not isinstance(metrics, Mapping):
        return f"sent metrics as {type(metrics).__name__}, expected a mapping of names to numbers"
    for name in required:
        value = metrics.get(name)
        if value is None:
            return f"reported no {name!r} in its metrics"
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value):
            return f"reported {name} = {value} (not finite; a client that trained no batch has none)"
    used = 0
    for name, value in metrics.items():
        if not isinstance(name, str) or len(name) > MAX_METRIC_NAME_CHARS:
            return (
                f"sent a metric named {_short(name)}, expected a string of at most "
                f"{MAX_METRIC_NAME_CHARS} characters"
            )
        if reason := number_problem(f"metric {name[:40]!r}", value, -LARGEST_FLOAT, LARGEST_FLOAT):
            return reason
        used += len(name) + 8
        if used > MAX_METRICS_BYTES:
            return f"sent metrics of more than {MAX_METRICS_BYTES} bytes (names and 8 bytes a number)"
    return None


def norm_problem(
    update: ClientUpdate, config: ScreeningConfig, global_vector: Tensor, global_norm: float | None = None
) -> str | None:
    """Why ``update`` is over ``config``'s norm bounds (``max_update_norm``,
    ``max_norm_ratio``, ``max_extra_norm``), or None. Assumes the update passed the
    other checks (its vector has the global model's shape)."""
    ratio = config.max_norm_ratio
    if config.max_update_norm is None and ratio is None and config.max_extra_norm is None:
        return None
    if global_norm is None:
        global_norm = l2_norm(global_vector)
    reference = max(global_norm, 1.0)
    change = l2_norm(update.vector.detach().to(global_vector.device).double() - global_vector.detach().double())
    if config.max_update_norm is not None and change > config.max_update_norm:
        return f"sent an update of norm {change:.4g}, over train.screening.max_update_norm={config.max_update_norm:g}"
    if ratio is not None and change > ratio * reference:
        return (
            f"sent an update of norm {change:.4g}, over train.screening.max_norm_ratio={ratio:g} times "
            f"the global model's norm ({reference:.4g})"
        )
    for name, value in update.extras.items():
        if value.numel() == 0:
            continue
        norm = l2_norm(value)
        if config.max_extra_norm is not None and norm > config.max_extra_norm:
            return (
                f"sent extras[{name!r}] of norm {norm:.4g}, over "
                f"train.screening.max_extra_norm={config.max_extra_norm:g}"
            )
        if ratio is not None and value.shape == global_vector.shape and norm > ratio * reference:
            return (
                f"sent extras[{name!r}] of norm {norm:.4g}, over train.screening.max_norm_ratio={ratio:g} "
                f"times the global model's norm ({reference:.4g})"
            )
    return None


# ------------------------------------------------------------- setup-phase replies


def claimed_samples_problem(what: str, claimed: Any, held: int | None, config: ScreeningConfig) -> str | None:
    """Why a setup-phase reply's claim of ``claimed`` training samples (its value
    ``what``) cannot be true, or None: over ``config.max_num_examples``, or (with
    ``check_num_examples``) over ``held``, the client's class counts summed where the
    server holds them (None: it does not). The round's rule, before round 1."""
    if reason := count_problem(what, claimed, config.max_num_examples):
        return reason
    if config.check_num_examples and held is not None and int(claimed) > held:
        return (
            f"claimed {int(claimed)} samples ({what}) but its class counts sum to {held} "
            "(train.screening.check_num_examples)"
        )
    return None


def parameters_change_problem(
    parameters: Mapping[str, Tensor], reference: Mapping[str, Tensor], config: ScreeningConfig
) -> str | None:
    """Why a setup-phase reply's ``parameters`` (a model trained from ``reference``, the
    one the server sent, name by name) moved too far, or None: the change's L2 norm over
    every tensor against ``max_update_norm`` and ``max_norm_ratio`` times
    ``max(||reference||, 1)``, as a round's update (:func:`norm_problem`). Assumes the
    names and shapes match (the phase's schema checked them)."""
    ratio, bound = config.max_norm_ratio, config.max_update_norm
    if ratio is None and bound is None:
        return None
    change_squared = reference_squared = 0.0
    for name, sent in reference.items():
        received = parameters[name].detach().double().cpu().reshape(-1)
        base = sent.detach().double().cpu().reshape(-1)
        change_squared += l2_norm(received - base) ** 2
        reference_squared += l2_norm(base) ** 2
    change, reference_norm = math.sqrt(change_squared), max(math.sqrt(reference_squared), 1.0)
    if bound is not None and change > bound:
        return f"sent parameters that moved by {change:.4g}, over train.screening.max_update_norm={bound:g}"
    if ratio is not None and change > ratio * reference_norm:
        return (
            f"sent parameters that moved by {change:.4g}, over train.screening.max_norm_ratio={ratio:g} "
            f"times the norm of those it was sent ({reference_norm:.4g})"
        )
    return None


def over_weight_share(updates: Sequence[ClientUpdate], fraction: float) -> list[str | None]:
    """For each of the round's ``updates``: why its weight is over ``fraction`` of their
    total (``train.screening.max_weight_fraction``), or None. A lone update is kept."""
    if len(updates) < 2:
        return [None] * len(updates)
    total = math.fsum(float(update.weight) for update in updates)
    reasons: list[str | None] = []
    for update in updates:
        share = float(update.weight) / total if total > 0 else 0.0
        reasons.append(
            f"claimed {share:.1%} of the round's aggregation weight ({update.weight:.6g} of {total:.6g}), "
            f"over train.screening.max_weight_fraction={fraction:g}"
            if share > fraction
            else None
        )
    return reasons


def l2_norm(tensor: Tensor) -> float:
    """``||tensor||_2`` in float64 (infinite for an overflowing one)."""
    return float(torch.linalg.vector_norm(tensor.detach().reshape(-1).double()))


def _finite(tensor: Tensor) -> bool:
    """No NaN or infinity in a floating-point tensor (one pass of ``aminmax``, without a
    tensor-sized boolean mask; half precision on a CPU goes through float32)."""
    if tensor.numel() == 0:
        return True
    flat = tensor.detach().reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
