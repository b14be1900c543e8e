"""IWDS: imbalanced weight decay sampling of each client's local data.

    Imbalanced Weight Decay Sampling (IWDS) for federated learning on non-IID data
    (``shared/papers/iwds-imbalanced-weight-decay-sampling.txt``; the authors' code
    derives from FedML).

A sampler that draws each local epoch with class-rebalancing weights whose strength
decays over the rounds. The weights, the schedule, the fixed-beta ablation and the
numerics: docs/algorithms.md, "IWDS".
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from fedplug.components import ComponentConfig, Sampler
from fedplug.hookspecs import RegisterSampler, hookimpl


def beta_at(round_index: int, beta_0: float, beta_m: float, rho: float) -> float:
    """``beta_t = beta_m + (beta_0 - beta_m) * rho ** t`` for the 0-based global round t."""
    if round_index < 0:
        raise ValueError(f"round_index must be non-negative, got {round_index}")
    return beta_m + (beta_0 - beta_m) * rho**round_index


def class_weights(class_counts: np.ndarray, beta: float) -> np.ndarray:
    """Per-class weight ``(1 - beta) / (1 - beta ** N_c)`` (a C-vector, float64).

    Args:
        class_counts: N_c for each class; a class with no samples is counted as 1.
        beta: in [0, 1]; 0 gives all ones, 1 gives the limit ``1 / N_c``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"IWDS needs beta in [0, 1], got {beta}")
    counts = np.maximum(np.asarray(class_counts, dtype=np.float64), 1.0)
    if beta == 0.0:
        return np.ones_like(counts)
    if beta == 1.0:
        return 1.0 / counts
    # Computed directly, 1 - beta^N cancels when beta is close to 1: relative errors up to
    # ~5e-9 for beta in [1 - 1e-3, 1 - 1e-13], against ~3e-16 for -expm1(N log beta)
    # (1 - beta itself is exact there).
    return (1.0 - beta) / -np.expm1(counts * np.log(beta))


def iwds_weights(labels: np.ndarray, class_counts: np.ndarray, beta: float) -> np.ndarray:
    """The sampling probability p(k, i) of each local sample (sums to 1).

    Args:
        labels: the client's training labels (length n_k, ints in [0, C)).
        class_counts: the client's C-vector of label counts N_{k,c}.
        beta: beta_t in [0, 1] (see :func:`class_weights`).
    """
    labels = np.asarray(labels)
    if labels.size == 0:
        return np.zeros(0, dtype=np.float64)
    per_sample = class_weights(class_counts, beta)[labels]
    return per_sample / per_sample.sum()


class IWDSConfig(ComponentConfig):
    """IWDS: draw local samples with class-rebalancing weights that decay over rounds."""

    name: Literal["iwds"] = "iwds"
    beta_0: float = Field(default=0.9999, ge=0.0, lt=1.0)
    """beta at round 0 (default 0.9999: close to class-balanced sampling)."""
    beta_m: float = Field(default=0.8, ge=0.0, lt=1.0)
    """The value beta decays to (default 0.8: close to the client's own distribution);
    must not exceed beta_0."""
    rho: float = Field(default=0.992, gt=0.0, le=1.0)
    """Decay rate per round (default 0.992); 1.0 keeps beta at beta_0 in every round
    (the fixed-beta ablation; beta_m is then unused)."""

    @model_validator(mode="after")
    def _decays(self) -> IWDSConfig:
        if self.beta_m > self.beta_0:
            raise ValueError(
                f"beta_m ({self.beta_m}) must not exceed beta_0 ({self.beta_0}): beta decays "
                "from beta_0 towards beta_m; swap them or lower beta_m"
            )
        return self


class IWDSSampler(Sampler):
    """Draw n_k local indices with replacement from the IWDS probabilities of round t.

    Args:
        config: the validated :class:`IWDSConfig`.
    """

    def __init__(self, config: IWDSConfig) -> None:
        self.config = config

    def beta(self, round_index: int) -> float:
        """beta_t of this config for the 0-based global round ``round_index``."""
        return beta_at(round_index, self.config.beta_0, self.config.beta_m, self.config.rho)

    def epoch_indices(
        self, labels: np.ndarray, class_counts: np.ndarray, round_index: int, rng: np.random.Generator
    ) -> np.ndarray:
        """``len(labels)`` indices drawn with replacement by p(k, .)."""
        num_samples = len(labels)
        if num_samples == 0:
            return np.zeros(0, dtype=np.int64)
        probabilities = iwds_weights(labels, class_counts, self.beta(round_index))
        return rng.choice(num_samples, size=num_samples, replace=True, p=probabilities)


@hookimpl
def fedplug_register_samplers(register: RegisterSampler) -> None:
    register(IWDSConfig, IWDSSampler)
