"""The server side: rounds, steps, aggregation and evaluation, driven by FedML's calls.

:class:`Coordinator` is what the FedML ``ServerAggregator`` delegates to. It moves models
and messages; the round itself is :class:`fedplug.run.federated_round.RoundCore`'s, run
with ``can_replay=False`` because FedML cannot replay a round, and a worker that misses a
step's deadline is answered for by :meth:`Coordinator.timeout_reply`.
Design: docs/fedml.md, 'Who does what' and 'What differs from `fedplug run`'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch import Tensor

from fedplug.components import RoundPlan
from fedplug.cost_model import LinkAndDevice
from fedplug.data.federation import Federation
from fedplug.errors import TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.run.chains import RoundChains
from fedplug.run.client_text import client_text
from fedplug.run.components import Components
from fedplug.run.evaluation import Evaluator
from fedplug.run.federated_round import RoundCore
from fedplug.run.model import build_model
from fedplug.run.reply_metrics import bounded_metrics
from fedplug.run.results import RoundRecord
from fedplug.run.vectors import model_to_vector, tensors_num_bytes, vector_to_model
from fedplug.screening import ScreeningConfig, count_problem, number_problem
from fedplug.setup_phase import setup_in_process

from .protocol import Schedule, Task, TaskResult, WorkerInstructions, owner_of, reply

logger = logging.getLogger("fedplug.adapters.fedml")

ENGINE_NAME = "fedml-mpi"


class Coordinator:
    """Server state of a FedML run of one fedplug experiment.

    Args:
        train_config: the validated ``train`` section.
        federation: the whole federation (for evaluation and for preparing the loss
            transform, setup phase included).
        registry: the component registry.
        schedule: every round's plan and the grouper that formed them
            (:func:`.protocol.plan_rounds`).
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
        if schedule.grouper is None:
            raise ValueError(
                "the FedML coordinator needs the schedule of plan_rounds, which carries its grouper"
            )
        self.config = train_config
        self.federation = federation
        self.schedule = schedule
        self.workers = workers
        self.on_round = on_round
        self.model = build_model(train_config, registry, federation, federation.device)
        # The schedule's grouper formed the plans: the run's grouper is that one.
        self.components = replace(
            Components.build(train_config, registry, federation.num_clients), grouper=schedule.grouper
        )
        self.aggregator = self.components.aggregator
        self.loss_transform = self.components.loss_transform
        self.evaluator = Evaluator(federation, train_config.eval_batch_size)
        self.global_vector = model_to_vector(self.model)
        self.core = RoundCore.for_clients(
            train_config,
            federation,
            self.components,
            model_bytes=self.global_vector.numel() * 4,
            train_flops=training_flops_per_sample(self.model, federation.input_shape),
            link=link,
            can_replay=False,
            runtime="FedML",
        )
        started = time.perf_counter()
        setup_cost = self.components.prepare(federation)
        self.components.distributed_setup_phases("FedML")  # refuses what workers could not use
        setup_cost = setup_cost + setup_in_process(self.components, federation)
        setup_seconds = time.perf_counter() - started
        self.aggregator.initialize(self.global_vector)
        self.result = self.core.run_result(
            [],
            self.components,
            target_accuracy=target_accuracy,
            engine=ENGINE_NAME,
            setup_cost=setup_cost,
            setup_seconds=setup_seconds,
            fedml_rounds=schedule.fedml_rounds,
            fedml_workers=workers,
        )
        self.timeout: float | None = train_config.failures.client_timeout_seconds
        """``train.failures.client_timeout_seconds``: each task's deadline on the workers."""
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
            if not isinstance(message, Mapping) or not isinstance(message.get("results"), list):
                # Not a reply of fedplug's worker: its tasks fail, the round goes on.
                results.extend(self._malformed(slot, message))
                continue
            if message.get("fedplug_step") != self.step:
                raise TrainingError(
                    f"worker {slot} replied for step {message.get('fedplug_step')!r:.40} while the server "
                    f"is at step {self.step}; the ranks are out of step"
                )
            results.extend(
                result if isinstance(result, TaskResult) else self._not_a_result(slot, result)
                for result in message["results"]
            )
        received = [(result.client_id, result.chain_index) for result in results]
        if sorted(received, key=repr) != sorted(expected, key=repr):
            raise TrainingError(
                f"step {self.step}: the workers answered for tasks {sorted(received, key=repr)!s:.300} instead of "
                f"{sorted(expected)}"
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

    def most_tasks(self) -> int:
        """The most tasks any worker trains in the current step (one after another)."""
        return max((len(message.tasks) for message in self.message.values()), default=0)

    def timeout_reply(self, slot: int, waited: float) -> dict[str, Any]:
        """The reply that stands for worker ``slot``'s to the current step when none came
        within ``waited`` seconds: every one of its tasks failed, saying so."""
        tasks = self.message[slot].tasks
        bound = (
            f"{len(tasks)} task(s) x train.failures.client_timeout_seconds={self.timeout:g} plus a margin"
            if self.timeout is not None
            else "the server's wait for a step; train.failures.client_timeout_seconds is unset"
        )
        reason = f"worker {slot} (MPI rank {slot + 1}) sent no reply within {waited:g}s ({bound})"
        return reply(
            self.step,
            [TaskResult(task.client_id, task.chain_index, error=reason) for task in tasks],
        )

    # ------------------------------------------------------------------------ rounds

    def _begin_round(self, round_index: int) -> None:
        self.round_index = round_index
        self.round_started = time.perf_counter()
        if self.finished:
            self.plan, self.payload = RoundPlan(chains=[]), {}
            self.round_chains = RoundChains(self.plan, self.global_vector)
            return
        self.plan = self.schedule.plans[round_index]
        self.round_chains = RoundChains(self.plan, self.global_vector)
        self.payload = self.aggregator.server_payload()

    def _instructions(self) -> dict[int, WorkerInstructions]:
        """What each worker trains in the current step."""
        _, position = self.schedule.locate(self.step)
        tasks: dict[int, list[Task]] = {slot: [] for slot in range(self.workers)}
        for index, chain in enumerate(self.round_chains.chains):
            if not chain.done:  # every active chain is at the step's position (lockstep)
                client = chain.current
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

    def _malformed(self, slot: int, message: Any) -> list[TaskResult]:
        """Worker ``slot``'s tasks of this step, failed: its reply is not
        :func:`.protocol.reply`'s ``{"fedplug_step", "results": [...]}``."""
        reason = f"worker {slot} sent a malformed reply ({type(message).__name__}, not fedplug's step reply)"
        return [TaskResult(task.client_id, task.chain_index, error=reason) for task in self.message[slot].tasks]

    def _not_a_result(self, slot: int, result: Any) -> TaskResult:
        """A result of worker ``slot`` that is not a :class:`TaskResult`: failed, for the
        task it names (if it names one of the slot's tasks)."""
        reason = f"worker {slot} sent a {type(result).__name__} as a task result, not fedplug's TaskResult"
        client_id = getattr(result, "client_id", None)
        chain_index = getattr(result, "chain_index", None)
        return TaskResult(client_id, chain_index, error=reason)  # type: ignore[arg-type]

    def _record(self, result: TaskResult) -> None:
        """Advance the result's chain with its member's model and counts, or fail it."""
        chain = self.round_chains.chains[result.chain_index]
        if result.error is not None or result.vector is None:
            error = client_text(result.error or "sent no model", 300)  # the worker's text
            chain.fail(f"client {result.client_id}: {error}")
            return
        reason = result_problem(result, self.core.screening_rules.config)
        if reason is not None:
            chain.fail(f"client {result.client_id}: {reason}")
            return
        metrics = bounded_metrics(result.metrics)  # sizes first: the worker's, not fedplug's
        if metrics.refused:
            logger.warning(
                "round %d: client %s's metrics: left out %s",
                self.round_index + 1,
                result.client_id,
                metrics.refusals(),
            )
        chain.advance(
            result.vector.to(self.federation.device),
            int(result.num_samples),
            int(result.num_steps),
            float(result.seconds),
            {key: value.to(self.federation.device) for key, value in result.extras.items()},
            metrics.kept,  # a chain reports its last member's
        )

    def _finish_round(self) -> None:
        """Aggregate the chains' final models (FedML has already trained the round, so the
        core's one attempt is what the workers sent), evaluate, and record the round."""
        outcomes = self.round_chains.outcomes()
        attempt = self.core.run(
            self.round_index, self.global_vector, self.plan, lambda _attempt: outcomes
        )
        self.global_vector = attempt.vector
        vector_to_model(attempt.vector, self.model)
        record = self.core.record(
            self.round_index,
            self.plan,
            attempt,
            self.evaluator.evaluate(self.model),
            payload_bytes=tensors_num_bytes(self.payload),
            bytes_so_far=self.result.total_bytes,
            started=self.round_started,
        )
        self.result.history.append(record)
        if self.on_round is not None:
            self.on_round(record)


def result_problem(result: TaskResult, config: ScreeningConfig) -> str | None:
    """Why one member's :class:`TaskResult` cannot be added to its chain, or None: the
    fields that a chain sums or moves must be what they say (counts in range, a finite
    time, tensors); the chain's model, extras and metrics are then screened whole by the
    round core (:func:`fedplug.screening.update_problem`)."""
    if reason := count_problem("num_samples", result.num_samples, config.max_num_examples):
        return reason
    if reason := count_problem("num_steps", result.num_steps, config.max_num_steps):
        return reason
    if reason := number_problem("seconds", result.seconds, 0.0):
        return reason
    if not isinstance(result.vector, Tensor):
        return f"sent its model as {type(result.vector).__name__}, expected a tensor"
    if not isinstance(result.extras, Mapping) or not all(
        isinstance(value, Tensor) for value in result.extras.values()
    ):
        return "sent extras that are not a mapping of names to tensors"
    if not isinstance(result.metrics, Mapping):
        return f"sent metrics as {type(result.metrics).__name__}, expected a mapping"
    return None
