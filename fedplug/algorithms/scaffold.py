"""SCAFFOLD: control variates that correct each client's drift.

    SCAFFOLD: Stochastic Controlled Averaging for Federated Learning.
    Sai Praneeth Karimireddy, Satyen Kale, Mehryar Mohri, Sashank J. Reddi,
    Sebastian U. Stich, Ananda Theertha Suresh. ICML 2020, arXiv:1910.06378.

The server's and the clients' control variates (option II of Algorithm 1), and the loss
penalty whose gradient applies the correction during plain SGD. The maths and how the
correction enters local training: docs/algorithms.md, "SCAFFOLD".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedplug.algorithms.attribute_state import AttributeState
from fedplug.components import (
    MODEL_SHAPE,
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    ComponentConfig,
    Context,
    LocalTraining,
    ReplyExtra,
    WeightedMean,
    no_updates_error,
)
from fedplug.hookspecs import RegisterAggregator, hookimpl
from fedplug.run.vectors import split_like

SERVER_VARIATE_KEY = "c"
CLIENT_VARIATE_KEY = "c_k"
CORRECTION_KEY = "correction"
VARIATE_CHANGE_KEY = "delta_c"


class ScaffoldConfig(ComponentConfig):
    """SCAFFOLD (Karimireddy et al. 2020): drift correction with control variates."""

    name: Literal["scaffold"] = "scaffold"
    server_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    """Global step size eta_g (default 1.0: the new model is the clients' mean)."""

    def incompatibilities(self, train: Any) -> list[str]:
        optimizer = train.optimizer
        reasons = []
        if str(optimizer.name).lower() != "sgd":
            reasons.append(
                f"scaffold's control-variate step assumes plain SGD, but "
                f"train.optimizer.name is {optimizer.name!r}; set it to 'sgd'"
            )
        if optimizer.momentum != 0:
            reasons.append(
                f"scaffold's control-variate step assumes SGD without momentum, but "
                f"train.optimizer.momentum is {optimizer.momentum}; set it to 0"
            )
        return reasons


class Scaffold(AttributeState, Aggregator):
    """Both sides of SCAFFOLD, option II.

    Args:
        config: the validated :class:`ScaffoldConfig`.
        num_clients: K, the number of clients in the federation (the server's c moves by
            sum(delta_c) / K).
    """

    state_attributes = ("control",)

    def __init__(self, config: ScaffoldConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config
        self.control: Tensor | None = None

    def client_needs(self) -> ClientNeeds:
        """c down with every model, c_k kept on each client, delta_c (shaped like the
        model) up in every reply."""
        return ClientNeeds(
            client_side=True,
            client_state=True,
            server_payload=(SERVER_VARIATE_KEY,),
            reply_extras=(VARIATE_CHANGE_KEY,),
            reply_extra_shapes={VARIATE_CHANGE_KEY: ReplyExtra(MODEL_SHAPE)},
        )

    def initialize(self, global_vector: Tensor) -> None:
        """The server's c starts at 0."""
        self.control = torch.zeros_like(global_vector, dtype=torch.float32)

    def _control(self) -> Tensor:
        if self.control is None:
            raise RuntimeError("Scaffold.initialize(global_vector) must run before round 0")
        return self.control

    def server_payload(self) -> dict[str, Tensor]:
        """``{"c": c}``, sent with the model."""
        return {SERVER_VARIATE_KEY: self._control()}

    @staticmethod
    def _client_variate(payload: dict[str, Tensor], client_state: dict[str, Tensor]) -> Tensor:
        """c_k, or zeros shaped like c for a client that has not trained yet."""
        server_variate = payload[SERVER_VARIATE_KEY]
        if CLIENT_VARIATE_KEY in client_state:
            return client_state[CLIENT_VARIATE_KEY]
        return torch.zeros_like(server_variate)

    def client_context(
        self, payload: dict[str, Tensor], client_state: dict[str, Tensor]
    ) -> Context:
        """``{"correction": c - c_k}`` as a flat vector."""
        server_variate = payload[SERVER_VARIATE_KEY]
        return {CORRECTION_KEY: server_variate - self._client_variate(payload, client_state)}

    def client_penalty(
        self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Context
    ) -> Tensor | None:
        """``<c - c_k, w - x>``: its gradient in ``w`` is the correction ``c - c_k``."""
        correction = split_like(context[CORRECTION_KEY].detach(), params)
        terms = [(correction[key] * (params[key] - anchor[key].detach())).sum() for key in params]
        if not terms:
            raise ValueError("SCAFFOLD's penalty needs at least one parameter")
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    def client_finish(
        self, start_vector: Tensor, end_vector: Tensor, training: LocalTraining,
        payload: dict[str, Tensor], client_state: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """Option II: ``c_k+ = c_k - c + (x - y) / (tau eta)``; returns ``{"delta_c": c_k+ - c_k}``.

        A client that took no step keeps its c_k and sends a zero change.
        """
        client_variate = self._client_variate(payload, client_state)
        if training.num_steps <= 0:
            return {VARIATE_CHANGE_KEY: torch.zeros_like(client_variate)}
        if training.learning_rate <= 0:
            raise ValueError(
                f"SCAFFOLD needs a positive learning rate, got {training.learning_rate}"
            )
        scale = 1.0 / (training.num_steps * training.learning_rate)
        drift = (start_vector.detach() - end_vector.detach()) * scale
        change = drift - payload[SERVER_VARIATE_KEY]
        client_state[CLIENT_VARIATE_KEY] = client_variate + change
        return {VARIATE_CHANGE_KEY: change}

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """``x + eta_g mean(y_k - x)`` and ``c + sum(delta_c_k) / K``, both unweighted."""
        models = WeightedMean()
        variate_change: Tensor | None = None
        for update in updates:
            if VARIATE_CHANGE_KEY not in update.extras:
                raise ValueError(
                    f"client {update.client_id}'s update has no extras[{VARIATE_CHANGE_KEY!r}]; "
                    "SCAFFOLD's client_finish must run on every client"
                )
            models.add(update.vector, 1.0)
            change = update.extras[VARIATE_CHANGE_KEY].detach().double()
            variate_change = change if variate_change is None else variate_change + change
        if models.empty or variate_change is None:
            raise no_updates_error(self.config.name)
        rate = self.config.server_lr
        mean = models.mean(torch.float64)
        current = global_vector.detach().double()
        # x + rate (mean - x), written so that rate = 1 returns the mean exactly.
        next_vector = (1.0 - rate) * current + rate * mean
        control = self.control if self.control is not None else torch.zeros_like(global_vector)
        self.control = (control.double() + variate_change / self.num_clients).float()
        return next_vector.float()


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    register(ScaffoldConfig, Scaffold)
