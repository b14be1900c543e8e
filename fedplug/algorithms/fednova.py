"""FedNova: normalised averaging, so clients that take more local steps do not dominate.

    Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization.
    Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent Poor.
    NeurIPS 2020, arXiv:2007.07481.

Clients report their accumulation norm ``a_k`` in ``extras["a"]``; the server averages the
normalised updates with two running sums. The maths: docs/algorithms.md, "FedNova".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from fedplug.components import (
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    ComponentConfig,
    LocalTraining,
    ReplyExtra,
    WeightedMean,
    check_update_weight,
    no_updates_error,
)
from fedplug.hookspecs import RegisterAggregator, hookimpl

NORM_KEY = "a"
"""Key of a_k in :attr:`ClientUpdate.extras`."""
ROUNDING = 1e-5
"""Relative slack of :meth:`FedNova.check_update`'s bounds on a_k: a_k travels as float32."""


def normalizing_factor(num_steps: int, momentum: float) -> float:
    """a_k for ``num_steps`` local SGD steps with heavy-ball ``momentum`` rho in [0, 1).

    ``rho = 0`` gives ``num_steps``; otherwise
    ``(tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)`` (FedNova, section 4 / appendix).
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be non-negative, got {num_steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"FedNova needs momentum in [0, 1), got {momentum}")
    if momentum == 0.0:
        return float(num_steps)
    rho = momentum
    return (num_steps - rho * (1.0 - rho**num_steps) / (1.0 - rho)) / (1.0 - rho)


class FedNovaConfig(ComponentConfig):
    """FedNova (Wang et al. 2020): average updates normalised by each client's step count."""

    name: Literal["fednova"] = "fednova"

    def incompatibilities(self, train: Any) -> list[str]:
        optimizer_name = str(train.optimizer.name).lower()
        if optimizer_name != "sgd":
            return [
                f"fednova normalises by the number of SGD steps, but train.optimizer.name is "
                f"{train.optimizer.name!r}; set it to 'sgd'"
            ]
        return []


class FedNova(Aggregator):
    """Client side reports a_k; server side averages normalised updates (its config has no
    parameters)."""

    def __init__(self, config: FedNovaConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config

    def client_needs(self) -> ClientNeeds:
        """Each client reports its normalising factor a_k (a non-negative scalar) with
        its model."""
        return ClientNeeds(
            client_side=True,
            reply_extras=(NORM_KEY,),
            reply_extra_shapes={NORM_KEY: ReplyExtra((), minimum=0.0)},
        )

    def check_update(self, update: ClientUpdate) -> str | None:
        """``a_k`` must be one that the reported ``num_steps`` can give: 0 (no step), or
        at least 1 (one step, whatever the momentum) and at most ``tau (tau + 1) / 2``
        (the limit of :func:`normalizing_factor` as the momentum goes to 1; ``tau`` is the
        chain's ``num_steps``, an upper bound on its last member's). A client that inflates
        ``a_k`` inflates the server's step ``tau_eff``; one that sends a tiny positive
        ``a_k`` inflates its own normalised update ``d_k``: either would blow up the
        global model."""
        factor = float(update.extras[NORM_KEY])
        steps = int(update.num_steps)
        most = steps * (steps + 1) / 2 * (1 + ROUNDING)
        if factor == 0.0 or 1.0 - ROUNDING <= factor <= most:
            return None
        return (
            f"sent extras[{NORM_KEY!r}] = {factor:.6g}, which {steps} local SGD steps cannot give "
            f"(FedNova's a_k is 0 or in [1, {steps * (steps + 1) / 2:g}])"
        )

    def client_finish(
        self, start_vector: Tensor, end_vector: Tensor, training: LocalTraining,
        payload: dict[str, Tensor], client_state: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """``{"a": a_k}`` as a 0-d float32 tensor."""
        factor = normalizing_factor(training.num_steps, training.momentum)
        return {NORM_KEY: torch.tensor(factor, dtype=torch.float32, device=end_vector.device)}

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """``w - tau_eff * sum_k p_k (w - w_k) / a_k``."""
        current = global_vector.detach().double()
        normalized_updates = WeightedMean()
        total_factor = 0.0
        for update in updates:
            check_update_weight(update)
            if NORM_KEY not in update.extras:
                raise ValueError(
                    f"client {update.client_id}'s update has no extras[{NORM_KEY!r}]; FedNova's "
                    "client_finish must run on every client"
                )
            factor = float(update.extras[NORM_KEY])
            if factor > 0.0:
                normalized = (current - update.vector.detach().double()) / factor
            else:
                normalized = torch.zeros_like(current)
            normalized_updates.add(normalized, update.weight)
            total_factor += update.weight * factor
        if normalized_updates.empty:
            raise no_updates_error(self.config.name)
        mean_normalized = normalized_updates.mean(torch.float64)
        effective_steps = total_factor / normalized_updates.weight
        return (current - effective_steps * mean_normalized).float()


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(FedNovaConfig, FedNova)
