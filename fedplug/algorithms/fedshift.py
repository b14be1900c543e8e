"""FedShift: shift the logits by each client's label prior during local training.

    Federated Learning with Classifier Shift for Class Imbalance.
    Yunheng Shen, Haoxiang Wang, Hairong Lv. Preprint, arXiv:2304.04972 (2023).

The loss transforms ``fedshift`` (the shifted cross-entropy) and ``reweighting`` (the
paper's class-weighted baseline). The shift, the smoothing and the normalisation chosen:
docs/algorithms.md, "FedShift".
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np
from torch import Tensor
from torch.nn import functional as F

from fedplug.algorithms.attribute_state import AttributeState
from fedplug.components import ClientNeeds, ComponentConfig, Context, LossTransform, as_tensor_context
from fedplug.errors import DataError
from fedplug.hookspecs import RegisterLossTransform, hookimpl

SHIFT_KEY = "shift"
CLASS_WEIGHT_KEY = "class_weight"


class HasClassCounts(Protocol):
    """What :meth:`LossTransform.prepare` needs here: the K x C class-count matrix."""

    @property
    def class_counts(self) -> np.ndarray: ...


def smoothed_label_distribution(class_counts: np.ndarray) -> np.ndarray:
    """Laplace-smoothed ``P_k(y=c) = (N_{k,c} + 1) / (n_k + C)`` along the last axis.

    Accepts one client's C-vector or the K x C matrix; returns float64 of the same shape.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim not in (1, 2) or counts.shape[-1] == 0:
        raise DataError(f"class counts must be a C-vector or a K x C matrix, got {counts.shape}")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise DataError("class counts must be finite and non-negative")
    num_classes = counts.shape[-1]
    return (counts + 1.0) / (counts.sum(axis=-1, keepdims=True) + num_classes)


def global_prior(class_counts: np.ndarray) -> np.ndarray:
    """``P(y=c) = sum_k (n_k / n) P_k(y=c)`` from the K x C count matrix (a C-vector).

    Raises:
        DataError: the matrix is not K x C or holds no samples at all.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2:
        raise DataError(f"the global prior needs the K x C class-count matrix, got {counts.shape}")
    sizes = counts.sum(axis=1)
    total = sizes.sum()
    if total <= 0:
        raise DataError("the clients hold no training samples; cannot compute the label prior")
    return (sizes / total) @ smoothed_label_distribution(counts)


def class_shift(class_counts_k: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """FedShift's ``s_k = ln(P_k / P)`` for one client (a C-vector, float64)."""
    local = smoothed_label_distribution(class_counts_k)
    return np.log(local) - np.log(np.asarray(prior, dtype=np.float64))


def reweighting_weights(class_counts_k: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The Reweighting baseline's ``r_k(c) = P(y=c) / P_k(y=c)`` (a C-vector, float64)."""
    return np.asarray(prior, dtype=np.float64) / smoothed_label_distribution(class_counts_k)


class _GlobalPriorTransform(AttributeState, LossTransform):
    """A loss transform that needs the global label prior, computed in :meth:`prepare`;
    built from its validated config (FedShift's and Reweighting's have no parameters)."""

    state_attributes = ("prior",)

    def __init__(self, config: ComponentConfig) -> None:
        self.config = config
        self.prior: np.ndarray | None = None

    def client_needs(self) -> ClientNeeds:
        """The global prior comes from every client's class counts."""
        return ClientNeeds(class_counts=True, client_side=True)

    def prepare(self, federation: Any) -> None:
        """Compute P(y) from ``federation.class_counts``.

        ``federation`` is a :class:`fedplug.data.federation.Federation` or any object with
        a K x C ``class_counts`` attribute (:class:`HasClassCounts`), e.g. counts the
        Flower adapter gathered by message. No phase cost is reported: the counts travel
        once, before training, and are tiny next to a model."""
        self.prior = global_prior(federation.class_counts)

    def _prior(self) -> np.ndarray:
        if self.prior is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(federation) must run before round 0")
        return self.prior


class FedShiftConfig(ComponentConfig):
    """FedShift (Shen, Wang, Lv 2023): shift the logits by ln(P_k / P) in local training."""

    name: Literal["fedshift"] = "fedshift"


class FedShift(_GlobalPriorTransform):
    """Cross-entropy of the shifted logits ``f(w; x) + s_k``."""

    config: FedShiftConfig

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        """``{"shift": s_k}``, a float32 tensor of shape [C]."""
        return as_tensor_context({SHIFT_KEY: class_shift(class_counts, self._prior())})

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        return F.cross_entropy(logits + context[SHIFT_KEY], targets, reduction="none")


class ReweightingConfig(ComponentConfig):
    """Reweighting baseline of the FedShift paper: CE weighted by P(y) / P_k(y)."""

    name: Literal["reweighting"] = "reweighting"


class Reweighting(_GlobalPriorTransform):
    """Per-sample ``r_k(y) * CE(f(w; x), y)`` with ``r_k = P / P_k`` (no renormalisation)."""

    config: ReweightingConfig

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        """``{"class_weight": r_k}``, a float32 tensor of shape [C]."""
        weights = reweighting_weights(class_counts, self._prior())
        return as_tensor_context({CLASS_WEIGHT_KEY: weights})

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        sample_weights = context[CLASS_WEIGHT_KEY].gather(0, targets)
        return sample_weights * F.cross_entropy(logits, targets, reduction="none")


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(FedShiftConfig, FedShift)
    register(ReweightingConfig, Reweighting)
