"""The built-in simulator: rounds of sampling, grouping, local training, aggregation and
evaluation, with a checkpoint after every round.

The round itself is :class:`fedplug.run.federated_round.RoundCore`'s; the simulator's
engines train a round's chains in process (a running aggregate: never K models in
memory), and a chain past ``train.failures.client_timeout_seconds`` is interrupted.
Design: docs/round.md, 'The round'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import Tensor

from fedplug.components import PhaseCost
from fedplug.cost_model import LinkAndDevice
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError
from fedplug.models.flops import training_flops_per_sample
from fedplug.models.zoo import has_batch_norm
from fedplug.registry import Registry
from fedplug.run.checkpoint import save_checkpoint
from fedplug.run.components import Components
from fedplug.run.evaluation import Evaluator
from fedplug.run.federated_round import RoundCore
from fedplug.run.local_training import ClientAlgorithm, LocalSchedule, check_reply_metrics
from fedplug.run.model import build_model, resolve_device
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run.round_context import RoundContext
from fedplug.run.state import RunState, resume_run
from fedplug.run.vectors import (
    model_to_vector,
    tensors_num_bytes,
    vector_to_model,
)
from fedplug.setup_phase import setup_in_process
from fedplug.simulation.sequential import SequentialEngine

__all__ = ["Simulator"]

logger = logging.getLogger("fedplug.simulation")

RoundObserver = Callable[[RoundRecord], None]


def config_fingerprint(train_config: Any, federation: Federation) -> str:
    """Identifies a run: the training config and the exact federation it trains on."""
    digest = hashlib.sha256(json.dumps(train_config.model_dump(mode="json"), sort_keys=True).encode())
    counts = federation.class_counts
    digest.update(counts if counts.flags.c_contiguous else counts.tobytes())  # the K x C bytes, not a copy
    digest.update(federation.dataset_name.encode())
    return digest.hexdigest()[:16]


class Simulator:
    """Runs one experiment's training on a federation."""

    def __init__(
        self,
        train_config: Any,
        federation: Federation,
        registry: Registry,
        *,
        target_accuracy: float | None = None,
        checkpoint_path: str | Path | None = None,
        observers: Iterable[RoundObserver] = (),
        link: LinkAndDevice | None = None,
    ) -> None:
        self.config = train_config
        self.federation = federation
        self.registry = registry
        self.target_accuracy = target_accuracy
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.observers = list(observers)
        self.link = link or LinkAndDevice()
        self.device = resolve_device(train_config.device)
        if federation.device != self.device:
            raise ConfigError(
                f"the federation's tensors are on {federation.device} but train.device is {self.device}; "
                "build the federation on the training device"
            )
        self.model = build_model(train_config, registry, federation, self.device)
        num_clients = federation.num_clients
        self.components = Components.build(train_config, registry, num_clients)
        self.algorithm: ClientAlgorithm = self.components.client_algorithm()
        self.grouper = self.components.grouper
        self.reply_metrics = self.components.needs().reply_metrics
        """The metrics every client reports with its model (none unless a component asks)."""
        check_reply_metrics(self.reply_metrics)
        self.schedule = LocalSchedule(train_config.local_epochs, train_config.batch_size, train_config.optimizer)
        self.evaluator = Evaluator(federation, train_config.eval_batch_size)
        self.engine = self._choose_engine()
        self._start: tuple[Tensor, dict, list[RoundRecord], PhaseCost] | None = None
        """Where :meth:`run` starts, once :meth:`prepare` has found it."""
        self._setup_seconds = 0.0
        """Wall time of the setup in :meth:`prepare` (restored from a checkpoint when resuming)."""
        self.fingerprint = config_fingerprint(train_config, federation)
        self.core = RoundCore.for_clients(
            train_config,
            federation,
            self.components,
            model_bytes=model_to_vector(self.model).numel() * 4,
            train_flops=training_flops_per_sample(self.model, federation.input_shape),
            link=link,
            checkpoint=self.checkpoint_path,
        )

    def _choose_engine(self) -> Any:
        requested = self.config.engine
        vectorizable = not has_batch_norm(self.model) and self.config.optimizer.name == "sgd"
        if requested == "vectorized" and not vectorizable:
            raise ConfigError(
                f"train.engine 'vectorized' cannot run model {self.config.model.name!r} (BatchNorm "
                "buffers are not vectorised); use engine 'sequential' or 'auto'"
            )
        if requested == "vectorized" or (requested == "auto" and self.device.type == "cuda" and vectorizable):
            from fedplug.simulation.vectorized import VectorizedEngine

            return VectorizedEngine(self.model)
        if requested == "parallel":
            from fedplug.simulation.parallel import ParallelEngine

            return ParallelEngine(self.model, self.config.workers, evaluator=self.evaluator)
        return SequentialEngine(self.model)

    # ------------------------------------------------------------------------- run

    def prepare(self, *, resume: bool = True) -> None:
        """Where the run starts: the checkpoint's state when resuming from one (a corrupt
        one, or one of another config, is refused), else the components' setup phases
        (FedDisk's density estimation, which can refuse the data) and the aggregator's
        initial state; every component is prepared first either way (its ``prepare``
        rebuilds what a checkpoint does not keep: FedGSP's clusters). Runs once: :meth:`run` calls it unless
        :func:`fedplug.experiment.prepare_experiment` did, before anything is printed or
        written."""
        if self._start is not None:
            return
        global_vector = model_to_vector(self.model)
        client_states: dict[int, dict[str, Tensor]] = {}
        history: list[RoundRecord] = []
        started = time.perf_counter()
        setup_cost = self.components.prepare(self.federation)
        restored = None
        if self.checkpoint_path and resume:
            restored = resume_run(
                self.checkpoint_path,
                self.fingerprint,
                initial_vector=global_vector,
                num_clients=self.federation.num_clients,
                rounds=self.config.rounds,
                components=self.components.checkpointed(),
                num_samples=int(self.federation.client_sizes.sum()),
                device=self.device,
            )
        if restored is not None:
            global_vector = restored.global_vector
            client_states = restored.client_states
            history = restored.history
            setup_cost = restored.setup_cost
            self._setup_seconds = restored.setup_seconds
            logger.info("resuming from %s after round %d", self.checkpoint_path, restored.rounds_done)
        else:
            setup_cost = setup_cost + setup_in_process(self.components, self.federation)
            self._setup_seconds = time.perf_counter() - started
            self.algorithm.aggregator.initialize(global_vector)
        self._start = (global_vector, client_states, history, setup_cost)

    def run(self, *, resume: bool = True) -> RunResult:
        """Train for ``rounds`` rounds (continuing from a checkpoint when there is one)."""
        config = self.config
        self.prepare(resume=resume)
        assert self._start is not None
        (global_vector, client_states, history, setup_cost), self._start = self._start, None
        context = RoundContext(
            self.federation,
            self.algorithm,
            self.schedule,
            config.seed,
            client_states,
            reply_metrics=self.reply_metrics,
            client_timeout=config.failures.client_timeout_seconds,
        )
        result = self.core.run_result(
            history,
            self.components,
            target_accuracy=self.target_accuracy,
            engine=self.engine.name,
            setup_cost=setup_cost,
            setup_seconds=self._setup_seconds,
            **self.engine.derived_params(),
        )
        try:
            for round_index in range(len(history), config.rounds):
                global_vector, record = self._run_round(round_index, global_vector, context, result.total_bytes)
                history.append(record)
                if self.checkpoint_path:
                    save_checkpoint(self.checkpoint_path, self._checkpoint_state(global_vector, client_states, history, setup_cost))
                for observer in self.observers:
                    observer(record)
        finally:  # the parallel engine joins its last round's workers
            self.engine.close()
        vector_to_model(global_vector, self.model)
        self.final_vector = global_vector
        return result

    def derived_params(self) -> dict[str, Any]:
        """Values computed from the config, logged with the run's params."""
        return self.core.derived_params(self.engine.name, **self.engine.derived_params())

    def _run_round(
        self, round_index: int, global_vector: Tensor, context: RoundContext, bytes_so_far: int
    ) -> tuple[Tensor, RoundRecord]:
        started = time.perf_counter()
        plan = self.core.plan(round_index)
        context.payload = self.algorithm.aggregator.server_payload()
        attempt = self.core.run(
            round_index,
            global_vector,
            plan,
            lambda _: self.engine.run_round(global_vector, plan, round_index, context),
            client_states=context,
        )
        vector_to_model(attempt.vector, self.model)
        # the parallel engine's workers, idle after the round, may compute the batches
        evaluation = self.evaluator.evaluate(self.model, spread=getattr(self.engine, "spread_evaluation", None))
        record = self.core.record(
            round_index,
            plan,
            attempt,
            evaluation,
            payload_bytes=tensors_num_bytes(context.payload),
            bytes_so_far=bytes_so_far,
            started=started,
        )
        return attempt.vector, record

    def _checkpoint_state(
        self, global_vector: Tensor, client_states: dict, history: list[RoundRecord], setup_cost: PhaseCost
    ) -> dict[str, Any]:
        return RunState.capture(
            self.fingerprint,
            global_vector,
            history,
            setup_cost,
            self._setup_seconds,
            self.components.checkpointed(),
            client_states,
        ).to_dict()
