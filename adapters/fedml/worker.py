"""The worker side: train the tasks of one step with fedplug's client code.

A worker rank simulates the clients it owns (:func:`.protocol.owner_of`). Each task is
one call of :func:`fedplug.run.local_training.train_locally` with the client's
sampler, loss transform and aggregator client side, the same generator
(:func:`~fedplug.run.local_training.local_rng`) and the same per-client state as
the built-in simulator's sequential engine, so a client's update is the same number in
both.

Each task runs under :func:`fedplug.deadline.deadline` with
``train.failures.client_timeout_seconds``: a client that hangs is interrupted there (a
timer signal in the rank's main thread, where FedML's message loop calls the trainer)
and its task fails with that reason, while the worker's other tasks train and the reply
goes out in time. The server bounds its own wait as well (:mod:`.deadlines`).
"""

from __future__ import annotations

import time
from typing import Any

from torch import Tensor, nn

from fedplug.data.federation import Federation
from fedplug.deadline import deadline
from fedplug.errors import TrainingError
from fedplug.registry import Registry
from fedplug.run.client_text import client_text
from fedplug.run.components import Components
from fedplug.run.local_training import (
    LocalSchedule,
    check_reply_metrics,
    local_rng,
    train_locally,
)
from fedplug.run.round_context import RoundContext

from .protocol import TaskResult, WorkerInstructions, owner_of, reply


class Worker:
    """One worker rank's clients, their state, and the training of a step's tasks.

    Args:
        train_config: the validated ``train`` section.
        federation: the whole federation (every rank builds it from the same ``data``
            config; the worker reads only its own clients).
        registry: the component registry.
        model: a model of the configured architecture (its values are overwritten).
        slot: this worker's index, MPI rank - 1.
        workers: the number of worker ranks W.
    """

    def __init__(
        self,
        train_config: Any,
        federation: Federation,
        registry: Registry,
        model: nn.Module,
        slot: int,
        workers: int,
    ) -> None:
        self.slot = slot
        self.workers = workers
        self.model = model
        components = Components.build(train_config, registry, federation.num_clients)
        algorithm = components.client_algorithm()
        schedule = LocalSchedule(
            train_config.local_epochs, train_config.batch_size, train_config.optimizer
        )
        # The metrics the server's components read (the grouper's too) travel with each model.
        reply_metrics = components.needs().reply_metrics
        check_reply_metrics(reply_metrics)
        self.context = RoundContext(
            federation,
            algorithm,
            schedule,
            train_config.seed,
            client_states={},
            reply_metrics=reply_metrics,
        )
        self.timeout: float | None = train_config.failures.client_timeout_seconds
        self.instructions: WorkerInstructions | None = None
        self.last_reply: dict[str, Any] | None = None

    @property
    def clients(self) -> list[int]:
        """The ids of the clients this worker simulates."""
        return [
            k
            for k in range(self.context.federation.num_clients)
            if owner_of(k, self.workers) == self.slot
        ]

    def receive(self, instructions: WorkerInstructions) -> None:
        """Store the server's message (and the loss transform's state, when it comes)."""
        if instructions.loss_transform_state is not None:
            self.context.algorithm.loss_transform.load_state_dict(instructions.loss_transform_state)
        self.context.payload = instructions.payload
        self.instructions = instructions

    def train(self, fedml_round: int | None = None) -> dict[str, Any]:
        """Train every task of the stored instructions and return the reply.

        ``fedml_round`` is FedML's own round counter, checked against the server's step
        so that a message arriving out of turn stops the run instead of mixing rounds.
        """
        instructions = self.instructions
        if instructions is None:
            raise TrainingError(
                f"worker {self.slot} was asked to train before the server sent a model"
            )
        if fedml_round is not None and fedml_round != instructions.step:
            raise TrainingError(
                f"worker {self.slot}: FedML is in round {fedml_round} but the server's instructions "
                f"are for step {instructions.step}; the ranks are out of step"
            )
        results = [self._run_task(task, instructions) for task in instructions.tasks]
        self.last_reply = reply(instructions.step, results)
        return self.last_reply

    def _run_task(self, task: Any, instructions: WorkerInstructions) -> TaskResult:
        if owner_of(task.client_id, self.workers) != self.slot:
            raise TrainingError(
                f"worker {self.slot} received client {task.client_id}, which worker "
                f"{owner_of(task.client_id, self.workers)} owns"
            )
        start: Tensor | None = (
            task.start_vector if task.start_vector is not None else instructions.global_vector
        )
        if start is None:
            raise TrainingError(
                f"step {instructions.step}: task for client {task.client_id} has no start model"
            )
        context = self.context
        client = context.federation.clients[task.client_id]
        started = time.perf_counter()
        try:
            with deadline(self.timeout, f"client {task.client_id}"):
                result = train_locally(
                    self.model,
                    start.to(context.federation.device),
                    client.train_x,
                    client.train_y,
                    client.class_counts,
                    algorithm=context.algorithm,
                    loss_context=context.loss_context(task.client_id),
                    payload=context.payload,
                    client_state=context.client_state(task.client_id),
                    schedule=context.schedule,
                    round_index=instructions.round_index,
                    rng=local_rng(context.seed, instructions.round_index, task.client_id),
                    reply_metrics=context.reply_metrics,
                )
        except Exception as error:  # noqa: BLE001 - a failing client must not stop the federation
            return TaskResult(
                task.client_id,
                task.chain_index,
                # Bounded before it travels: the server keeps it in the round's record.
                error=client_text(f"{type(error).__name__}: {error}"),
            )
        return TaskResult(
            client_id=task.client_id,
            chain_index=task.chain_index,
            vector=result.vector.cpu(),
            num_samples=result.num_samples,
            num_steps=result.num_steps,
            extras={key: value.cpu() for key, value in result.extras.items()},
            seconds=time.perf_counter() - started,
            metrics=result.metrics,
        )
