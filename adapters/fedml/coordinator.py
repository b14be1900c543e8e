"""The server side: rounds, steps, aggregation and evaluation, driven by FedML's calls.

:class:`Coordinator` is what the FedML ``ServerAggregator`` delegates to. It follows the
built-in simulator's round (:mod:`fedplug.simulation.simulator`) step for step: the same
sampled clients and groups (:func:`.protocol.plan_rounds`), the same aggregator fed the
chains' final models in plan order, the same screening of unusable updates, the same
evaluation and the same :class:`~fedplug.simulation.results.RoundRecord`.

One difference is forced by FedML: a round cannot be replayed. FedML's server advances
its round counter after every aggregation and has no message to undo one
(``fedml/cross_silo/server/fedml_server_manager.py``,
``handle_message_receive_model_from_client``), so where the simulator retries a round with
too many failed clients (``train.failures.max_round_retries``), the coordinator stops the
run with a :class:`~fedplug.errors.TrainingError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedplug.algorithms.cost_model import LinkAndDevice, round_cost
from fedplug.algorithms.fedgsp import cpd_summary
from fedplug.components import ClientUpdate, PhaseCost, RoundPlan
from fedplug.data.federation import Federation
from fedplug.errors import TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.simulation.evaluation import Evaluator
from fedplug.simulation.results import RoundRecord, RunResult
from fedplug.simulation.simulator import build_model
from fedplug.simulation.vectors import model_to_vector, tensors_num_bytes, vector_to_model

from .protocol import Schedule, Task, TaskResult, WorkerInstructions, owner_of

logger = logging.getLogger("fedplug.adapters.fedml")

ENGINE_NAME = "fedml-mpi"


@dataclass
class _Chain:
    """A chain's progress through the steps of a round."""

    members: list[int]
    vector: Tensor | None = None
    samples: int = 0
    steps: int = 0
    seconds: float = 0.0
    extras: dict[str, Tensor] = field(default_factory=dict)
    error: str | None = None


class Coordinator:
    """Server state of a FedML run of one fedplug experiment.

    Args:
        train_config: the validated ``train`` section.
        federation: the whole federation (for evaluation and the loss transform's
            ``prepare``).
        registry: the component registry.
        schedule: every round's plan (:func:`.protocol.plan_rounds`).
        workers: the number of worker ranks W.
        target_accuracy: for :attr:`RunResult.rounds_to_target` (default None).
        on_round: called with each finished round's record (default: nothing).
        link: the cost model's device and link (default: the paper's).
    """

    def __init__(
        self,
        train_config: Any,
        federation: Federation,
        registry: Registry,
        schedule: Schedule,
        workers: int,
        *,
        target_accuracy: float | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        link: LinkAndDevice | None = None,
    ) -> None:
        self.config = train_config
        self.federation = federation
        self.schedule = schedule
        self.workers = workers
        self.on_round = on_round
        self.link = link or LinkAndDevice()
        self.model = build_model(train_config, registry, federation, federation.device)
        self.aggregator = registry.build(
            "aggregators", train_config.aggregator, federation.num_clients
        )
        self.loss_transform = registry.build("loss_transforms", train_config.loss_transform)
        self.evaluator = Evaluator(federation, train_config.eval_batch_size)
        self.client_sizes = np.array([client.num_samples for client in federation.clients])
        self.train_flops = training_flops_per_sample(self.model, federation.input_shape)
        self.global_vector = model_to_vector(self.model)
        setup_cost = self.loss_transform.prepare(federation) or PhaseCost(0, 0, 0)
        self.aggregator.initialize(self.global_vector)
        self.result = RunResult(
            [],
            target_accuracy,
            setup_rounds=setup_cost.rounds,
            setup_bytes=setup_cost.bytes_up + setup_cost.bytes_down,
            derived_params=self._derived_params(),
        )
        self.step = 0
        self._loss_transform_state: dict[str, Any] | None = self.loss_transform.state_dict()
        self._begin_round(0)
        self.message = self._instructions()

    # ----------------------------------------------------------------- FedML entry points

    def handle_replies(self, replies: list[dict[str, Any]]) -> dict[int, WorkerInstructions]:
        """Take every worker's reply to the current step (in slot order) and return the
        next step's instructions, one per worker slot."""
        if len(replies) != self.workers:
            raise TrainingError(
                f"step {self.step}: {len(replies)} replies for {self.workers} workers"
            )
        expected = {
            (task.client_id, task.chain_index)
            for message in self.message.values()
            for task in message.tasks
        }
        results: list[TaskResult] = []
        for slot, message in enumerate(replies):
            if message.get("fedplug_step") != self.step:
                raise TrainingError(
                    f"worker {slot} replied for step {message.get('fedplug_step')} while the server is at step "
                    f"{self.step}; the ranks are out of step"
                )
            results.extend(message["results"])
        received = [(result.client_id, result.chain_index) for result in results]
        if sorted(received) != sorted(expected):
            raise TrainingError(
                f"step {self.step}: the workers answered for tasks {sorted(received)} instead of {sorted(expected)}"
            )
        for result in results:
            self._record(result)
        self.step += 1
        round_index, _ = self.schedule.locate(self.step)
        if round_index != self.round_index:
            self._finish_round()
            self._begin_round(round_index)
        self.message = self._instructions()
        return self.message

    @property
    def finished(self) -> bool:
        return self.round_index >= len(self.schedule.plans)

    # ------------------------------------------------------------------------ rounds

    def _begin_round(self, round_index: int) -> None:
        self.round_index = round_index
        self.round_started = time.perf_counter()
        if self.finished:
            self.plan, self.chains, self.payload = RoundPlan(chains=[]), [], {}
            return
        self.plan = self.schedule.plans[round_index]
        self.chains = [_Chain(list(chain)) for chain in self.plan.chains]
        self.payload = self.aggregator.server_payload()

    def _instructions(self) -> dict[int, WorkerInstructions]:
        """What each worker trains in the current step."""
        _, position = self.schedule.locate(self.step)
        tasks: dict[int, list[Task]] = {slot: [] for slot in range(self.workers)}
        for index, chain in enumerate(self.chains):
            if position < len(chain.members) and chain.error is None:
                client = chain.members[position]
                start = None if position == 0 else chain.vector
                tasks[owner_of(client, self.workers)].append(Task(client, index, start))
        needs_global = position == 0 and not self.finished
        state, self._loss_transform_state = self._loss_transform_state, None
        return {
            slot: WorkerInstructions(
                step=self.step,
                round_index=self.round_index,
                position=position,
                global_vector=self.global_vector if needs_global and tasks[slot] else None,
                payload=self.payload,
                tasks=tasks[slot],
                loss_transform_state=state,
            )
            for slot in range(self.workers)
        }

    def _record(self, result: TaskResult) -> None:
        chain = self.chains[result.chain_index]
        if result.error is not None or result.vector is None:
            chain.error = f"client {result.client_id}: {result.error or 'sent no model'}"
            return
        chain.vector = result.vector.to(self.federation.device)
        chain.samples += result.num_samples
        chain.steps += result.num_steps
        chain.seconds += result.seconds
        chain.extras = {
            key: value.to(self.federation.device) for key, value in result.extras.items()
        }

    def _finish_round(self) -> None:
        """Aggregate the chains' final models, evaluate, and record the round."""
        config = self.config
        round_index = self.round_index
        model_bytes = self.global_vector.numel() * self.global_vector.element_size()
        participants = sum(len(chain.members) for chain in self.chains)
        tally = {"accepted": 0, "failures": 0, "bytes_up": 0}
        updates = self._screen(tally, model_bytes)
        try:
            new_vector: Tensor | None = self.aggregator.aggregate(self.global_vector, updates)
        except ValueError:
            if tally["accepted"]:
                raise
            new_vector = None
        failed_fraction = tally["failures"] / max(len(self.chains), 1)
        if new_vector is None or failed_fraction > config.failures.max_failed_fraction:
            raise TrainingError(
                f"round {round_index + 1}: {tally['failures']} of {len(self.chains)} client updates failed "
                f"(train.failures.max_failed_fraction = {config.failures.max_failed_fraction}); FedML cannot "
                "replay a round, so the FedML adapter stops instead of retrying; see the log for each reason"
            )
        if not torch.isfinite(new_vector).all():
            raise TrainingError(
                f"the global model became non-finite at round {round_index + 1}; "
                "lower train.optimizer.lr or the server learning rate"
            )
        self.global_vector = new_vector
        vector_to_model(new_vector, self.model)
        evaluation = self.evaluator.evaluate(self.model)
        groups = self.plan.groups if self.plan.groups is not None else self.plan.chains
        cpd_median, cpd_mean = cpd_summary(
            groups, self.federation.class_counts, getattr(config.grouper, "cpd_sigma", 1.0)
        )
        cost = round_cost(
            self.plan.chains,
            self.client_sizes,
            config.local_epochs,
            self.train_flops,
            model_bytes,
            self.link,
        )
        bytes_down = (model_bytes + tensors_num_bytes(self.payload)) * participants
        record = RoundRecord(
            round=round_index + 1,
            accuracy=evaluation.accuracy,
            loss=evaluation.loss,
            client_accuracy_mean=evaluation.client_accuracy_mean,
            client_accuracy_std=evaluation.client_accuracy_std,
            bytes_up=tally["bytes_up"],
            bytes_down=bytes_down,
            cumulative_bytes=self.result.total_bytes + tally["bytes_up"] + bytes_down,
            seconds=time.perf_counter() - self.round_started,
            participants=participants,
            failures=tally["failures"],
            cpd_median=float(cpd_median),
            cpd_mean=float(cpd_mean),
            compute_seconds_model=float(cost.compute_seconds),
            communication_seconds_model=float(cost.communication_seconds),
        )
        self.result.history.append(record)
        if self.on_round is not None:
            self.on_round(record)

    def _screen(self, tally: dict[str, int], model_bytes: int) -> Iterator[ClientUpdate]:
        """The chains' final models as updates, in plan order; unusable ones are counted
        and logged, as the simulator does."""
        timeout = self.config.failures.client_timeout_seconds
        weighting = self.plan.weighting
        for chain in self.chains:
            reason = chain.error
            vector = chain.vector
            if reason is None:
                if vector is None or vector.shape != self.global_vector.shape:
                    shape = None if vector is None else tuple(vector.shape)
                    reason = (
                        f"returned {shape} parameters, expected {tuple(self.global_vector.shape)}"
                    )
                elif not torch.isfinite(vector).all():
                    reason = "returned non-finite (NaN/Inf) parameters"
                elif any(not torch.isfinite(extra).all() for extra in chain.extras.values()):
                    reason = "returned non-finite extras"
                elif timeout is not None and chain.seconds > timeout:
                    reason = f"took {chain.seconds:.1f}s, over train.failures.client_timeout_seconds={timeout}"
            if reason is not None or vector is None:
                tally["failures"] += 1
                logger.warning(
                    "round %d: dropped client(s) %s: %s",
                    self.round_index + 1,
                    chain.members,
                    reason,
                )
                continue
            tally["accepted"] += 1
            tally["bytes_up"] += len(chain.members) * model_bytes + tensors_num_bytes(chain.extras)
            yield ClientUpdate(
                client_id=chain.members[-1],
                vector=vector,
                weight=float(chain.samples) if weighting == "samples" else 1.0,
                num_steps=chain.steps,
                extras=chain.extras,
                chain=list(chain.members),
                seconds=chain.seconds,
            )

    def _derived_params(self) -> dict[str, Any]:
        derived: dict[str, Any] = {}
        aggregator_config = self.config.aggregator
        if hasattr(aggregator_config, "effective_learning_rate"):
            derived["effective_learning_rate"] = aggregator_config.effective_learning_rate()
        derived["train_flops_per_sample"] = int(self.train_flops)
        derived["model_bytes"] = int(self.global_vector.numel() * 4)
        derived["engine"] = ENGINE_NAME
        derived["fedml_rounds"] = self.schedule.fedml_rounds
        derived["fedml_workers"] = self.workers
        return derived
