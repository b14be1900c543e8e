"""What travels between the FedML server rank and the worker ranks, and the round
schedule both sides derive from the experiment config.

A fedplug round whose chains have length L takes L FedML rounds ("steps"); client ``k``
always trains on worker ``k mod W`` (:func:`owner_of`). No FedML import here: the same
structures are used in-process by the tests.
Design: docs/fedml.md, 'FedGSP's chains: one FedML round per chain member'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from fedplug.components import FederationSummary, Grouper, RoundPlan
from fedplug.errors import ConfigError
from fedplug.registry import Registry
from fedplug.run.components import build_component
from fedplug.run.round_plan import participants, plan_round, round_steps


def owner_of(client_id: int, workers: int) -> int:
    """The worker slot (0-based; MPI rank - 1) that simulates ``client_id``."""
    return client_id % workers


@dataclass(frozen=True)
class Task:
    """One client's local training in one step."""

    client_id: int
    chain_index: int
    """Position of the client's chain in the round's plan."""
    start_vector: Tensor | None
    """The model to start from; ``None`` means the round's global model (first member)."""


@dataclass
class WorkerInstructions:
    """The server's message to one worker for one step.

    Deliberately not a ``dict``: FedML's cross-silo server treats a returned ``dict`` as
    per-client models keyed by silo index, which is exactly how the server sends each
    worker its own :class:`WorkerInstructions` (see :mod:`.fedml_components`).
    """

    step: int
    """The FedML round this step is (0-based, counted over the whole run)."""
    round_index: int
    """The fedplug round (0-based); equal to ``rounds`` once training is over."""
    position: int
    """Which member of each chain trains in this step (0-based)."""
    global_vector: Tensor | None
    """The round's global model, sent when a task starts from it."""
    payload: dict[str, Tensor]
    """The aggregator's :meth:`~fedplug.components.Aggregator.server_payload` for the round."""
    tasks: list[Task]
    loss_transform_state: dict[str, Any] | None = None
    """The loss transform's state after ``prepare`` (FedShift's prior, FedDisk's weights);
    sent with the first step only."""


@dataclass
class TaskResult:
    """A worker's outcome for one :class:`Task`: a model, or the reason it failed."""

    client_id: int
    chain_index: int
    vector: Tensor | None = None
    num_samples: int = 0
    num_steps: int = 0
    extras: dict[str, Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """The reply metrics the run's components ask for (``ClientNeeds.reply_metrics``,
    e.g. ``train_loss``); empty when none is asked for."""


def reply(step: int, results: list[TaskResult]) -> dict[str, Any]:
    """A worker's message to the server. A plain ``dict`` on purpose: FedML's server moves
    non-dict client replies to its device as if they were state dicts
    (``cross_silo/server/fedml_aggregator.py``, ``add_local_trained_result``)."""
    return {"fedplug_step": step, "results": results}


@dataclass(frozen=True)
class Schedule:
    """Every round's plan, fixed before FedML starts (FedML needs the number of its rounds
    up front: ``comm_round``)."""

    plans: list[RoundPlan]
    grouper: Grouper | None = None
    """The prepared grouper that formed the plans; the coordinator reports its round
    metrics (:meth:`fedplug.components.Grouper.round_metrics`)."""

    @property
    def steps_per_round(self) -> list[int]:
        """FedML rounds each fedplug round takes
        (:func:`fedplug.run.round_plan.round_steps`)."""
        return [round_steps(plan) for plan in self.plans]

    @property
    def fedml_rounds(self) -> int:
        return sum(self.steps_per_round)

    def locate(self, step: int) -> tuple[int, int]:
        """``(round_index, position)`` of a FedML round; ``(rounds, 0)`` after the last."""
        for round_index, steps in enumerate(self.steps_per_round):
            if step < steps:
                return round_index, step
            step -= steps
        return len(self.plans), 0


def plan_rounds(train_config: Any, registry: Registry, class_counts: np.ndarray) -> Schedule:
    """Every round's plan, in round order, from the round core
    (:func:`fedplug.run.round_plan.plan_round`): the clients and groups the simulator
    draws for the same config."""
    grouper = build_component("grouper", train_config, registry)
    grouper.prepare(FederationSummary(class_counts))
    plans = []
    for round_index in range(train_config.rounds):
        plan, _ = plan_round(train_config, grouper, class_counts.shape[0], round_index)
        members = participants(plan)
        if len(members) != len(set(members)):
            raise ConfigError(
                f"grouper {train_config.grouper.name!r} put a client into two chains of round "
                f"{round_index + 1}; the FedML adapter trains each client once per round"
            )
        plans.append(plan)
    return Schedule(plans, grouper)
