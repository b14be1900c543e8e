"""What an engine needs to run a round, and what it yields back."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from fedplug.components import ClientUpdate, Context, RoundPlan
from fedplug.data.federation import Federation
from fedplug.run.local_training import ClientAlgorithm, LocalSchedule
from fedplug.run.round_plan import chain_update
from fedplug.run.round_screen import ClientFailure
from fedplug.run.vectors import move_tensors

__all__ = ["Engine", "RoundContext"]


class Engine(Protocol):
    """How the simulator trains a round's chains: the sequential, vectorised and parallel
    engines (the round around them is :class:`fedplug.run.federated_round.RoundCore`'s)."""

    name: str

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: "RoundContext"
    ) -> Iterator[ClientUpdate | ClientFailure]:
        """One outcome per chain of ``plan``, in plan order."""

    def derived_params(self) -> dict[str, Any]:
        """The engine's entries in the run's derived params."""

    def close(self) -> None:
        """Stop anything the engine left running (the parallel engine's workers)."""


@dataclass
class RoundContext:
    federation: Federation
    algorithm: ClientAlgorithm
    schedule: LocalSchedule
    seed: int
    client_states: dict[int, dict[str, Tensor]]
    """Per-client state that persists across rounds (SCAFFOLD's c_k); owned by the
    simulator so that it is checkpointed with the run."""
    payload: dict[str, Tensor] = field(default_factory=dict)
    loss_contexts: dict[int, Context] = field(default_factory=dict)
    """Each client's loss-transform constants, computed once per run by :meth:`loss_context`
    (an engine that trains in other processes brings the ones computed there back here)."""
    reply_metrics: tuple[str, ...] = ()
    """The metrics every chain reports with its model, as the run's components ask
    (:attr:`fedplug.components.ClientNeeds.reply_metrics`); empty (the default) costs the
    engines nothing."""
    client_timeout: float | None = None
    """``train.failures.client_timeout_seconds``: each chain's training is interrupted
    (:func:`fedplug.deadline.deadline`) and dropped once it runs this long (``None``: no
    limit). Every engine applies it per chain, as the post-hoc check of
    :func:`fedplug.run.round_screen.unusable` reads each chain's ``seconds``."""

    def loss_context(self, client_id: int) -> Context:
        """The loss transform's constants for a client, computed once per run."""
        if client_id not in self.loss_contexts:
            client = self.federation.clients[client_id]
            context = self.algorithm.loss_transform.client_context(client_id, client.class_counts)
            self.loss_contexts[client_id] = move_tensors(context, self.federation.device)
        return self.loss_contexts[client_id]

    def client_state(self, client_id: int) -> dict[str, Tensor]:
        return self.client_states.setdefault(client_id, {})

    def make_update(self, chain: list[int], vector: Tensor, *fields: Any) -> ClientUpdate:
        """A chain's update under the round's weight rule:
        :func:`~fedplug.run.round_plan.chain_update` of ``chain``, ``vector`` and its other
        ``fields`` (samples, steps, extras, plan, seconds, metrics). The engines build
        every update through here, so a test can alter what all of them send."""
        return chain_update(chain, vector, *fields)

    def save(self, clients: list[int]) -> dict[int, dict[str, Tensor]]:
        """Copies of ``clients``' states, for a replayed round."""
        return {k: copy.deepcopy(self.client_states[k]) for k in clients if k in self.client_states}

    def restore(self, clients: list[int], saved: dict[int, dict[str, Tensor]]) -> None:
        """Put back :meth:`save`'s copies (clients that had no state get none)."""
        for client in clients:
            self.client_states.pop(client, None)
        self.client_states.update(saved)
