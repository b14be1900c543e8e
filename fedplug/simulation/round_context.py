"""What an engine needs to run a round, and what it yields back."""

from __future__ import annotations

from dataclasses import dataclass, field
from torch import Tensor

from fedplug.components import ClientUpdate, Context, RoundPlan
from fedplug.data.federation import Federation
from fedplug.simulation.local_training import ClientAlgorithm, LocalSchedule
from fedplug.simulation.vectors import move_tensors


@dataclass(frozen=True)
class ClientFailure:
    """A chain whose training raised, timed out or returned an unusable model."""

    chain: list[int]
    reason: str


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

    def loss_context(self, client_id: int) -> Context:
        """The loss transform's constants for a client, computed once per run."""
        if client_id not in self.loss_contexts:
            client = self.federation.clients[client_id]
            context = self.algorithm.loss_transform.client_context(client_id, client.class_counts)
            self.loss_contexts[client_id] = move_tensors(context, self.federation.device)
        return self.loss_contexts[client_id]

    def client_state(self, client_id: int) -> dict[str, Tensor]:
        return self.client_states.setdefault(client_id, {})

    def make_update(
        self,
        chain: list[int],
        vector: Tensor,
        samples: int,
        steps: int,
        extras: dict[str, Tensor],
        plan: RoundPlan,
        seconds: float,
    ) -> ClientUpdate:
        weight = float(samples) if plan.weighting == "samples" else 1.0
        return ClientUpdate(
            client_id=chain[-1],
            vector=vector,
            weight=weight,
            num_steps=steps,
            extras=extras,
            chain=list(chain),
            seconds=seconds,
        )

