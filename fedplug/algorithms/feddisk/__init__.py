"""FedDisk: density-ratio sample weights from local and global MADE models.

    Federated Learning for distribution skewed data using sample weights.
    Hung Nguyen, Peiyuan Wu, J. Morris Chang. IEEE Transactions on Artificial
    Intelligence (2024), arXiv:2401.02586.

Phase 1 (a setup phase) estimates each sample's weight ``w_k(x) ~ p(x) / p_k(x)``; phase 2
is FedAvg with the weighted loss. This module holds the configs, the loss transforms and
their registration; ``density`` (steps 1-2), ``weights`` (steps 3-4), ``phase`` (the
exchange), ``cache``, ``made`` and ``made_training`` the rest. Design choices (MADE output,
normalisation, caching): docs/algorithms.md, "FedDisk".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from fedplug.components import ClientNeeds, Context, LossTransform, PhaseCost
from fedplug.data.federation import Federation
from fedplug.hookspecs import RegisterLossTransform, hookimpl

from .cache import (
    WEIGHTS_VERSION,
    cache_key,
    cache_path,
    check_sizes,
    load_weights,
    partition_fingerprint,
    save_weights,
)
from .config import FedDiskAbConfig, FedDiskConfig, SampleWeightConfig
from .density import (
    federated_validation_nll,
    made_phase_cost,
    parameter_bytes,
    train_global_made,
    unit_interval_inputs,
)
from .phase import FedDiskPhase, compute_feddisk_weights
from .weights import (
    SAMPLE_WEIGHT_KEY,
    FedDiskWeights,
    client_weight_summary,
    compute_feddisk_ab_weights,
    density_ratios,
    histogram_top,
    make_classifier,
    merge_weight_summaries,
    normalise_weights,
    sample_weight_context,
    train_classifiers,
    weight_summary,
)

# The public names; the helpers of each step stay in their module (.density, .weights,
# .phase, .cache).
__all__ = [
    "SAMPLE_WEIGHT_KEY",
    "WEIGHTS_VERSION",
    "FedDisk",
    "FedDiskAb",
    "FedDiskAbConfig",
    "FedDiskConfig",
    "FedDiskPhase",
    "FedDiskWeights",
    "SampleWeightConfig",
    "SampleWeightedLoss",
    "cache_key",
    "cache_path",
    "client_weight_summary",
    "compute_feddisk_ab_weights",
    "compute_feddisk_weights",
    "density_ratios",
    "federated_validation_nll",
    "histogram_top",
    "load_weights",
    "made_phase_cost",
    "make_classifier",
    "merge_weight_summaries",
    "normalise_weights",
    "parameter_bytes",
    "partition_fingerprint",
    "save_weights",
    "train_classifiers",
    "train_global_made",
    "unit_interval_inputs",
    "weight_summary",
]

logger = logging.getLogger("fedplug.algorithms.feddisk")

ComputeWeights = Callable[[Federation, Any, np.random.Generator], FedDiskWeights]


class SampleWeightedLoss(LossTransform):
    """Cross-entropy times a per-sample weight fixed before round 1.

    Args:
        config: a :class:`FedDiskConfig` or :class:`FedDiskAbConfig`.
    """

    def __init__(self, config: SampleWeightConfig) -> None:
        self.config = config
        self.weights: list[Tensor] | None = None
        self.cost: PhaseCost | None = None
        self.client_reports: list[dict[str, Any]] | None = None
        """Every client's :func:`~.weights.client_weight_summary`, in client order, as the
        setup phase's last replies carried them (None: the phase did not run here)."""

    def _keep(self, result: FedDiskWeights, device: torch.device | str) -> PhaseCost:
        self.weights = [
            torch.as_tensor(w, dtype=torch.float32, device=device) for w in result.weights
        ]
        self.cost = result.cost
        return result.cost

    def _cached(self, federation: Federation) -> tuple[FedDiskWeights | None, Path | None]:
        """The weights cached under ``config.cache_dir`` for ``federation`` (None when
        absent), and the file they are (or belong) in (None without a ``cache_dir``).

        Raises:
            DataError: a cached file is corrupt or was computed for other client sizes.
        """
        if self.config.cache_dir is None:
            return None, None
        path = cache_path(self.config.cache_dir, federation, self.config)
        if not path.exists():
            return None, path
        result = load_weights(path, self.config)
        sizes = federation.client_sizes.tolist()
        check_sizes(result, sizes, source=f"cached FedDisk weights {str(path)!r}")
        return result, path

    def setup_report(self) -> dict[str, Any]:
        """Per-client quantiles of the sample weights and their pooled histogram: merged
        from the clients' reports when the setup phase ran (on any runtime,
        :func:`~.weights.merge_weight_summaries`), else from the weights at hand (loaded
        from the cache, or restored from a checkpoint; :func:`~.weights.weight_summary`,
        the same numbers); empty before either."""
        top = histogram_top(self.config)
        if self.client_reports is not None:
            return merge_weight_summaries(self.client_reports, top)
        if self.weights is None:
            return {}
        return weight_summary([w.detach().cpu().numpy() for w in self.weights], top)

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        """``{"sample_weight": w_k}``, a float32 tensor of shape [n_k]."""
        if self.weights is None:
            raise RuntimeError(
                f"{type(self).__name__}.prepare(federation) and its setup phase must run before "
                "round 1"
            )
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
    """FedDisk's weighted cross-entropy; phase 1 is its setup phase
    (:class:`~.phase.FedDiskPhase`).

    Args:
        config: the validated :class:`FedDiskConfig`.
    """

    def __init__(self, config: FedDiskConfig) -> None:
        super().__init__(config)
        self.config: FedDiskConfig = config
        self._save_to: Path | None = None

    def prepare(self, federation: Any) -> PhaseCost | None:
        """Load phase 1's result from ``config.cache_dir`` when it is there (then
        :meth:`setup_phase` returns None) and return its traffic; otherwise leave phase 1
        to :meth:`setup_phase`, which stores its result there.

        ``federation`` is the simulator's :class:`~fedplug.data.federation.Federation`;
        anything else (Flower's class counts) holds no data to key the cache with, and
        ``cache_dir`` is not used.

        Raises:
            DataError: a cached file is corrupt or was computed for other client sizes.
        """
        self.weights, self.cost, self._save_to = None, None, None
        self.client_reports = None
        if self.config.cache_dir is None:
            return None
        if not isinstance(federation, Federation):
            logger.warning(
                "FedDisk's cache_dir %r is not used here: the clients' data are not in this "
                "process, so phase 1 runs on the clients",
                self.config.cache_dir,
            )
            return None
        cached, self._save_to = self._cached(federation)
        if cached is None:
            return None
        self._save_to = None
        return self._keep(cached, federation.device)

    def setup_phase(self) -> FedDiskPhase | None:
        """Phase 1 (:class:`~.phase.FedDiskPhase`), or None when :meth:`prepare` loaded
        its result or the phase already ran."""
        if self.weights is not None:
            return None
        return FedDiskPhase(self.config, on_finish=self._finish_phase, on_reports=self._keep_reports)

    def _keep_reports(self, client_reports: list[dict[str, Any]]) -> None:
        self.client_reports = client_reports

    def _finish_phase(self, result: FedDiskWeights, weights: list[Tensor]) -> None:
        self.weights = [w.to(torch.float32) for w in weights]
        self.cost = result.cost
        if self._save_to is not None:
            save_weights(self._save_to, result)
            self._save_to = None


class FedDiskAb(SampleWeightedLoss):
    """FedDiskAb's weighted cross-entropy (computed centrally in :meth:`prepare` by
    :func:`~.weights.compute_feddisk_ab_weights`, which pools raw data).

    Args:
        config: the validated :class:`FedDiskAbConfig`.
    """

    def __init__(self, config: FedDiskAbConfig) -> None:
        super().__init__(config)
        self._compute: ComputeWeights = compute_feddisk_ab_weights

    def prepare(self, federation: Any) -> PhaseCost:
        """Compute the weights (or load them from ``config.cache_dir``) and return their
        traffic.

        Raises:
            DataError: a cached file is corrupt or was computed for other client sizes.
        """
        cached, path = self._cached(federation)
        if cached is None:
            cached = self._compute(federation, self.config, np.random.default_rng(self.config.seed))
            if path is not None:
                save_weights(path, cached)
        return self._keep(cached, federation.device)

    def client_needs(self) -> ClientNeeds:
        return ClientNeeds(
            client_side=True,
            pooled_data=(
                "FedDiskAb is an oracle ablation that pools raw client data, which a federated "
                "deployment must not do; run it with the built-in simulator (`fedplug run`)"
            ),
        )


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(FedDiskConfig, FedDisk)
    register(FedDiskAbConfig, FedDiskAb)
