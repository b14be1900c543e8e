"""The built-in simulator: rounds of sampling, grouping, local training, aggregation and
evaluation, with a checkpoint after every round.

A round:

1. sample ``client_fraction`` of the K clients;
2. let the grouper decide who trains with whom (default: everyone alone);
3. the engine runs local training with the client's sampler and loss transform, chain
   by chain, and streams the results into the aggregator (a running aggregate: never K
   models in memory);
4. updates that raised, timed out, or came back non-finite or misshapen are dropped with
   a logged reason; too many failures retry the round, then stop the run;
5. evaluate, record, checkpoint.

All randomness derives from ``(seed, round, client)``, so a resumed run is identical
to an uninterrupted one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from fedplug.algorithms.cost_model import LinkAndDevice, round_cost
from fedplug.algorithms.fedgsp import cpd_summary
from fedplug.components import ClientUpdate, PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.models.zoo import has_batch_norm
from fedplug.registry import Registry
from fedplug.simulation.checkpoint import load_checkpoint, save_checkpoint
from fedplug.simulation.evaluation import Evaluator
from fedplug.simulation.local_training import ClientAlgorithm, LocalSchedule
from fedplug.simulation.results import RoundRecord, RunResult
from fedplug.simulation.round_context import ClientFailure, RoundContext
from fedplug.simulation.sequential import SequentialEngine
from fedplug.simulation.vectors import all_finite, model_to_vector, move_tensors, tensors_num_bytes, vector_to_model

logger = logging.getLogger("fedplug.simulation")

RoundObserver = Callable[[RoundRecord], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device is {name!r} but this machine has no CUDA device; use 'cpu' or 'auto'")
    return torch.device(name)


def sample_clients(num_clients: int, fraction: float, seed: int, round_index: int) -> np.ndarray:
    """The sorted ids of this round's clients (at least one)."""
    count = max(1, int(round(fraction * num_clients)))
    rng = np.random.default_rng([seed, round_index, 0xC11E])
    return np.sort(rng.choice(num_clients, size=count, replace=False))


def build_model(train_config: Any, registry: Registry, federation: Federation, device: torch.device) -> torch.nn.Module:
    """The model, initialised from ``train_config.seed`` without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(train_config.seed)
        model = registry.build("models", train_config.model, federation.input_shape, federation.num_classes)
    return model.to(device)


def config_fingerprint(train_config: Any, federation: Federation) -> str:
    """Identifies a run: the training config and the exact federation it trains on."""
    digest = hashlib.sha256(json.dumps(train_config.model_dump(mode="json"), sort_keys=True).encode())
    digest.update(federation.class_counts.tobytes())
    digest.update(federation.dataset_name.encode())
    return digest.hexdigest()[:16]


@dataclass
class _Tally:
    accepted: int = 0
    failures: int = 0
    bytes_up: int = 0


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
        self.algorithm = ClientAlgorithm(
            sampler=registry.build("samplers", train_config.sampler),
            loss_transform=registry.build("loss_transforms", train_config.loss_transform),
            aggregator=registry.build("aggregators", train_config.aggregator, num_clients),
        )
        self.grouper = registry.build("groupers", train_config.grouper)
        self.grouper.prepare(federation.class_counts)
        self.schedule = LocalSchedule(train_config.local_epochs, train_config.batch_size, train_config.optimizer)
        self.engine = self._choose_engine()
        self.evaluator = Evaluator(federation, train_config.eval_batch_size)
        self.fingerprint = config_fingerprint(train_config, federation)
        self.train_flops = training_flops_per_sample(self.model, federation.input_shape)
        self.client_sizes = np.array([client.num_samples for client in federation.clients])

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

            return ParallelEngine(self.model, self.config.workers)
        return SequentialEngine(self.model)

    # ------------------------------------------------------------------------- run

    def run(self, *, resume: bool = True) -> RunResult:
        """Train for ``rounds`` rounds (continuing from a checkpoint when there is one)."""
        config = self.config
        global_vector = model_to_vector(self.model)
        client_states: dict[int, dict[str, Tensor]] = {}
        history: list[RoundRecord] = []
        setup_cost = PhaseCost(0, 0, 0)
        state = load_checkpoint(self.checkpoint_path, self.fingerprint) if (self.checkpoint_path and resume) else None
        if state is not None:
            global_vector = state["global_vector"].to(self.device)
            self.algorithm.aggregator.load_state_dict(move_tensors(state["aggregator"], self.device))
            self.grouper.load_state_dict(state["grouper"])
            self.algorithm.loss_transform.load_state_dict(state["loss_transform"])
            client_states = move_tensors(state["client_states"], self.device)
            history = [RoundRecord(**record) for record in state["history"]]
            setup_cost = PhaseCost(**state["setup_cost"])
            logger.info("resuming from %s after round %d", self.checkpoint_path, len(history))
        else:
            setup_cost = self.algorithm.loss_transform.prepare(self.federation) or setup_cost
            self.algorithm.aggregator.initialize(global_vector)
        context = RoundContext(self.federation, self.algorithm, self.schedule, config.seed, client_states)
        result = RunResult(
            history,
            self.target_accuracy,
            setup_rounds=setup_cost.rounds,
            setup_bytes=setup_cost.bytes_up + setup_cost.bytes_down,
            derived_params=self.derived_params(),
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
            getattr(self.engine, "close", lambda: None)()
        vector_to_model(global_vector, self.model)
        self.final_vector = global_vector
        return result

    def derived_params(self) -> dict[str, Any]:
        """Values computed from the config, logged with the run's params."""
        derived: dict[str, Any] = {
            "train_flops_per_sample": int(self.train_flops),
            "model_bytes": int(model_to_vector(self.model).numel() * 4),
            "engine": self.engine.name,
        }
        if hasattr(self.engine, "workers"):
            derived["engine_workers"] = self.engine.workers
        aggregator_config = self.config.aggregator
        if hasattr(aggregator_config, "effective_learning_rate"):
            # Hsu et al. report eta / (1 - beta), eta being the clients' learning rate.
            derived["effective_learning_rate"] = aggregator_config.effective_learning_rate(self.config.optimizer.lr)
        return derived

    def _run_round(
        self, round_index: int, global_vector: Tensor, context: RoundContext, bytes_so_far: int
    ) -> tuple[Tensor, RoundRecord]:
        config = self.config
        started = time.perf_counter()
        clients = sample_clients(self.federation.num_clients, config.client_fraction, config.seed, round_index)
        plan = self.grouper.plan(round_index + 1, clients, np.random.default_rng([config.seed, round_index, 0x6E0]))
        participants = [client for chain in plan.chains for client in chain]
        aggregator = self.algorithm.aggregator
        context.payload = aggregator.server_payload()
        model_bytes = global_vector.numel() * global_vector.element_size()
        bytes_down_each = model_bytes + tensors_num_bytes(context.payload)
        for attempt in range(config.failures.max_round_retries + 1):
            saved_server = copy.deepcopy(aggregator.state_dict())
            saved_clients = {k: copy.deepcopy(context.client_states[k]) for k in participants if k in context.client_states}
            tally = _Tally()
            outcomes = self.engine.run_round(global_vector, plan, round_index, context)
            updates = self._screen(outcomes, global_vector, tally, model_bytes, round_index)
            try:
                new_vector: Tensor | None = aggregator.aggregate(global_vector, updates)
            except (ValueError, TrainingError):
                if tally.accepted:
                    raise
                new_vector = None  # every update failed: nothing to aggregate; retry the round
            finally:  # an engine's workers stop now, even if the aggregator stopped early
                getattr(outcomes, "close", lambda: None)()
            failed_fraction = tally.failures / max(len(plan.chains), 1)
            if new_vector is not None and failed_fraction <= config.failures.max_failed_fraction:
                break
            aggregator.load_state_dict(saved_server)
            for client in participants:
                context.client_states.pop(client, None)
            context.client_states.update(saved_clients)
            logger.warning(
                "round %d: %d of %d updates failed (limit %.0f%%); attempt %d of %d",
                round_index + 1, tally.failures, len(plan.chains), 100 * config.failures.max_failed_fraction,
                attempt + 1, config.failures.max_round_retries + 1,
            )
        else:
            raise TrainingError(
                f"round {round_index + 1}: {tally.failures} of {len(plan.chains)} client updates failed in each of "
                f"{config.failures.max_round_retries + 1} attempts (train.failures.max_failed_fraction = "
                f"{config.failures.max_failed_fraction}); see the log for each client's reason"
            )
        assert new_vector is not None
        if not all_finite(new_vector):
            raise TrainingError(
                f"the global model became non-finite at round {round_index + 1}; the last good state is "
                f"{'the checkpoint at ' + str(self.checkpoint_path) if self.checkpoint_path else 'round ' + str(round_index)}"
                "; lower train.optimizer.lr or the server learning rate"
            )
        vector_to_model(new_vector, self.model)
        evaluation = self.evaluator.evaluate(self.model)
        groups = plan.groups if plan.groups is not None else plan.chains
        sigma = getattr(config.grouper, "cpd_sigma", 1.0)
        cpd_median, cpd_mean = cpd_summary(groups, self.federation.class_counts, sigma)
        cost = round_cost(
            plan.chains, self.client_sizes, config.local_epochs, self.train_flops, model_bytes, self.link
        )
        bytes_down = bytes_down_each * len(participants)
        record = RoundRecord(
            round=round_index + 1,
            accuracy=evaluation.accuracy,
            loss=evaluation.loss,
            client_accuracy_mean=evaluation.client_accuracy_mean,
            client_accuracy_std=evaluation.client_accuracy_std,
            bytes_up=tally.bytes_up,
            bytes_down=bytes_down,
            cumulative_bytes=bytes_so_far + tally.bytes_up + bytes_down,
            seconds=time.perf_counter() - started,
            participants=len(participants),
            failures=tally.failures,
            cpd_median=float(cpd_median),
            cpd_mean=float(cpd_mean),
            compute_seconds_model=float(cost.compute_seconds),
            communication_seconds_model=float(cost.communication_seconds),
        )
        return new_vector, record

    def _screen(
        self,
        outcomes: Iterator[ClientUpdate | ClientFailure],
        global_vector: Tensor,
        tally: _Tally,
        model_bytes: int,
        round_index: int,
    ) -> Iterator[ClientUpdate]:
        """Pass on usable updates; count and log the rest."""
        timeout = self.config.failures.client_timeout_seconds
        for outcome in outcomes:
            reason = None
            if isinstance(outcome, ClientFailure):
                reason, chain = outcome.reason, outcome.chain
            else:
                chain = outcome.chain
                if outcome.vector.shape != global_vector.shape:
                    reason = f"returned {tuple(outcome.vector.shape)} parameters, expected {tuple(global_vector.shape)}"
                elif not all_finite(outcome.vector):
                    reason = "returned non-finite (NaN/Inf) parameters"
                elif any(extra.numel() and not all_finite(extra.reshape(-1)) for extra in outcome.extras.values()):
                    reason = "returned non-finite extras"
                elif timeout is not None and outcome.seconds > timeout:
                    reason = f"took {outcome.seconds:.1f}s, over train.failures.client_timeout_seconds={timeout}"
            if reason is not None:
                tally.failures += 1
                logger.warning("round %d: dropped client(s) %s: %s", round_index + 1, chain, reason)
                continue
            tally.accepted += 1
            tally.bytes_up += len(chain) * model_bytes + tensors_num_bytes(outcome.extras)
            yield outcome

    def _checkpoint_state(
        self, global_vector: Tensor, client_states: dict, history: list[RoundRecord], setup_cost: PhaseCost
    ) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "global_vector": global_vector.cpu(),
            "aggregator": move_tensors(self.algorithm.aggregator.state_dict(), "cpu"),
            "grouper": self.grouper.state_dict(),
            "loss_transform": self.algorithm.loss_transform.state_dict(),
            "client_states": move_tensors(client_states, "cpu"),
            "history": [vars(record) for record in history],
            "setup_cost": asdict(setup_cost),
        }
