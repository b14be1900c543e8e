"""One federated round, for every runtime: :class:`RoundCore`.

The simulator's engines, the Flower strategy and the FedML coordinator differ only in how
they move models and messages; the round around that lives here once: the plan
(:mod:`fedplug.run.round_plan`), injected faults and screening
(:mod:`fedplug.run.round_screen`), aggregate or retry, the round's record, and the run's
result. docs/round.md walks through each step. Nothing here names an algorithm:
components describe themselves through :mod:`fedplug.components`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from fedplug.components import (
    SLOTS,
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    Grouper,
    PhaseCost,
    RoundPlan,
)
from fedplug.cost_model import LinkAndDevice, chain_training_seconds, round_cost
from fedplug.errors import ConfigError, TrainingError
from fedplug.faults import Faults, RoundDropout, corrupt
from fedplug.run.client_text import client_text
from fedplug.run.components import Components
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run.round_plan import chain_members, participants, plan_round, sample_round
from fedplug.run.round_screen import (
    ClientFailure,
    HandedUpdates,
    Outcome,
    Tally,
    chain_key,
    retract,
    screen,
)
from fedplug.run.vectors import all_finite
from fedplug.screening import ScreeningConfig, ScreeningRules, over_weight_share

logger = logging.getLogger("fedplug.round")

NO_SETUP = PhaseCost(0, 0, 0)
"""The cost of a run without a setup phase."""


@dataclass(frozen=True)
class Evaluation:
    """The global model's test metrics after a round (NaN where a runtime has none)."""

    accuracy: float = float("nan")
    loss: float = float("nan")
    client_accuracy_mean: float = float("nan")
    client_accuracy_std: float = float("nan")
    validation_accuracy: float | None = None
    """On the clients' validation splits (``data.validation_fraction``); None without them."""
    validation_loss: float | None = None

    def validation_metrics(self) -> dict[str, float]:
        """``val_accuracy`` and ``val_loss`` for the round's record; none without a
        validation split (so a run without one records exactly what it did before)."""
        if self.validation_accuracy is None or self.validation_loss is None:
            return {}
        return {"val_accuracy": self.validation_accuracy, "val_loss": self.validation_loss}


# ------------------------------------------------------------------------- the round


class ClientStates(Protocol):
    """Per-client state a runtime keeps on the server side and must restore when a round
    is replayed (the simulator's SCAFFOLD c_k); runtimes whose clients keep their own
    state restore it on the clients."""

    def save(self, clients: list[int]) -> Any: ...

    def restore(self, clients: list[int], saved: Any) -> None: ...


@dataclass
class AggregatedRound:
    """What :meth:`RoundCore.run` accepted for a round: the new global model, what
    screening saw, and the attempts it took."""

    vector: Tensor
    tally: Tally
    attempts: int


class SetupReporter(Protocol):
    """What reports a run's setup (:class:`~fedplug.run.components.Components`, or one
    component)."""

    def setup_report(self) -> dict[str, Any]: ...


class KnownClients(Protocol):
    """What the round core reads of a run's clients: a
    :class:`~fedplug.data.federation.Federation`, or a runtime's directory of nodes."""

    @property
    def num_clients(self) -> int: ...

    @property
    def class_counts(self) -> np.ndarray | None: ...

    @property
    def client_sizes(self) -> np.ndarray | None: ...


TrainAttempt = Callable[[int], Iterable[Outcome]]
"""Runs one attempt (0-based) of the round's plan on the runtime; returns one outcome per
chain, in plan order (a generator may train lazily, as the aggregator consumes it)."""


class RoundCore:
    """The round logic of one run, shared by every runtime.

    Args:
        train_config: the validated ``train`` section.
        components: the run's components (built and prepared by the runtime,
            :class:`~fedplug.run.components.Components`); every slot's round metrics
            go into the record.
        num_clients: K.
        class_counts: the K x C class counts, or ``None`` when the runtime has not
            gathered them (no component asked; metrics that need them are left out).
        client_sizes: the K training-set sizes, for the cost model (``None``: unknown).
        model_bytes: the size of the model as sent (float32 parameters).
        train_flops: training FLOPs per sample, for the cost model (0 when unknown).
        link: the cost model's link and device rates (default: the FedGSP paper's).
        can_replay: whether the runtime can train a round again (FedML cannot).
        runtime: the runtime's name, for messages.
        checkpoint: where the runtime keeps the last good state, for messages (``None``:
            it keeps none).
    """

    def __init__(
        self,
        train_config: Any,
        *,
        components: Components,
        num_clients: int,
        class_counts: np.ndarray | None,
        client_sizes: np.ndarray | None,
        model_bytes: int,
        train_flops: int = 0,
        link: LinkAndDevice | None = None,
        can_replay: bool = True,
        runtime: str = "simulator",
        checkpoint: Any = None,
    ) -> None:
        self.config = train_config
        aggregator, grouper = components.aggregator, components.grouper
        self.aggregator: Aggregator = aggregator
        self.grouper: Grouper = grouper
        self.components = components
        """The components whose round metrics the record keeps, by slot."""
        self.num_clients = num_clients
        self.class_counts = class_counts
        self.client_sizes = client_sizes
        self.model_bytes = int(model_bytes)
        self.train_flops = int(train_flops)
        self.link = link or LinkAndDevice()
        self.can_replay = can_replay
        self.runtime = runtime
        self.checkpoint = checkpoint
        needs = client_needs(aggregator, grouper)
        self.required_metrics = needs.reply_metrics
        """The reply metrics the server-side components read; screening requires them."""
        self.screening_rules = ScreeningRules(
            model_shape=(),
            timeout=train_config.failures.client_timeout_seconds,
            required_metrics=needs.reply_metrics,
            extras=dict(needs.reply_extra_shapes),
            required_extras=needs.reply_extras,
            num_clients=num_clients,
            max_samples=(
                np.asarray(class_counts, dtype=np.int64).sum(axis=1)
                if class_counts is not None and np.size(class_counts)
                else None
            ),
            config=screening_config(train_config),
        )
        """What every update is screened against (:func:`fedplug.screening.update_problem`;
        the model's shape is the round's global model's)."""
        self.faults = Faults.for_run(train_config, num_clients)
        """The run's ``train.faults`` (the trace read, the stragglers drawn)."""
        self._dropouts: dict[int, RoundDropout] = {}
        if self.faults.straggler_deadline is not None and (client_sizes is None or not self.train_flops):
            raise ConfigError(
                f"train.faults.stragglers with {self.faults.deadline_source} needs the cost model's times "
                f"(the clients' training-set sizes and the model's FLOPs per sample), which {runtime} does "
                "not have here; on Flower pass query_nodes=True, num_classes= and input_shape= to "
                "FedplugStrategy"
            )

    @classmethod
    def for_clients(
        cls, train_config: Any, clients: KnownClients, components: Components, **options: Any
    ) -> RoundCore:
        """The round core of a run of ``components`` over ``clients`` (K, their class
        counts and training-set sizes); ``options``: the other keywords of
        :class:`RoundCore` (``model_bytes`` is required)."""
        return cls(
            train_config,
            components=components,
            num_clients=clients.num_clients,
            class_counts=clients.class_counts,
            client_sizes=clients.client_sizes,
            **options,
        )

    # ------------------------------------------------------------------- plan

    def plan(self, round_index: int, *, candidates: np.ndarray | None = None, count: int | None = None) -> RoundPlan:
        """The plan of round ``round_index`` (0-based); a replayed round trains the same.
        ``candidates`` and ``count``: see :func:`~fedplug.run.round_plan.sample_round`
        (default: ``count`` = ``client_fraction`` x K of all K clients)."""
        plan, dropout = plan_round(
            self.config, self.grouper, self.num_clients, round_index, self.faults, candidates=candidates, count=count
        )
        self._dropouts[round_index] = dropout
        return plan

    def dropout(self, round_index: int) -> RoundDropout:
        """Who ``train.faults.dropout`` dropped from round ``round_index`` and why: as
        :meth:`plan` found (or, for a round planned elsewhere with the default sampling,
        drawn again)."""
        if round_index not in self._dropouts:
            self._dropouts[round_index] = sample_round(self.config, self.faults, self.num_clients, round_index)[1]
        return self._dropouts[round_index]

    def chain_seconds(self, chain: Iterable[int]) -> float:
        """The cost model's training time of ``chain``, stragglers slowed by their factors."""
        sizes = self.client_sizes if self.client_sizes is not None else np.zeros(self.num_clients, dtype=np.int64)
        return chain_training_seconds(
            list(chain), sizes, self.config.local_epochs, self.train_flops, self.link, self.faults.speed_factors
        )

    # -------------------------------------------------------- aggregate or retry

    def run(
        self,
        round_index: int,
        global_vector: Tensor,
        plan: RoundPlan,
        train: TrainAttempt,
        client_states: ClientStates | None = None,
    ) -> AggregatedRound:
        """Train and aggregate round ``round_index`` under ``train.failures``.

        Raises:
            TrainingError: every attempt failed (or the one attempt, when the runtime
                cannot replay), or the new global model is not finite.
        """
        policy = self.config.failures
        if not plan.chains:
            logger.warning(
                "round %d: no client is left to train (every sampled client dropped out, "
                "train.faults.dropout); the global model stays as it was", round_index + 1,
            )
            return AggregatedRound(global_vector, Tally(), 1)
        attempts = policy.max_round_retries + 1 if self.can_replay else 1
        members = participants(plan)
        excluded: dict[tuple[int, ...], str] = {}
        """Chains the aggregator failed on, dropped from every later pass of the round."""
        for attempt in range(attempts):
            saved_server = copy.deepcopy(self.aggregator.state_dict())
            saved_clients = client_states.save(members) if client_states is not None else None
            outcomes = train(attempt)
            try:
                new_vector, tally = self._aggregate_attempt(
                    round_index, global_vector, outcomes, excluded, saved_server
                )
            finally:  # a lazy runtime stops its remaining work, even if aggregation stopped early
                if isinstance(outcomes, Generator):
                    outcomes.close()
            if new_vector is not None and tally.failures / max(len(plan.chains), 1) <= policy.max_failed_fraction:
                self._check_finite(new_vector, round_index)
                return AggregatedRound(new_vector, tally, attempt + 1)
            self.aggregator.load_state_dict(saved_server)
            if client_states is not None:
                client_states.restore(members, saved_clients)
            if self.can_replay:
                logger.warning(
                    "round %d: %d of %d updates failed (limit %.0f%%); attempt %d of %d",
                    round_index + 1, tally.failures, len(plan.chains), 100 * policy.max_failed_fraction,
                    attempt + 1, attempts,
                )
        tail = (
            f"in each of {attempts} attempts"
            if self.can_replay
            else f"and {self.runtime} cannot replay a round, so the run stops instead of retrying"
        )
        raise TrainingError(
            f"round {round_index + 1}: {tally.failures} of {len(plan.chains)} client updates failed {tail} "
            f"(train.failures.max_failed_fraction = {policy.max_failed_fraction}); see the log for each "
            "client's reason"
        )

    def _inject(
        self, outcomes: Iterable[Outcome], round_index: int, global_vector: Tensor, tally: Tally
    ) -> Iterable[Outcome]:
        """``outcomes`` with ``train.faults``' straggler timeouts and corrupted updates
        applied (``outcomes`` itself when the run injects neither)."""
        faults = self.faults
        corrupting = faults.config.corruption.probability > 0
        if not corrupting and faults.straggler_deadline is None:
            return outcomes
        corrupted = faults.corrupted(round_index)

        def injected() -> Iterator[Outcome]:
            for outcome in outcomes:
                if isinstance(outcome, ClientUpdate) and self._injectable(outcome, global_vector):
                    chain = outcome.chain or [outcome.client_id]
                    reason = faults.straggler_timeout(chain, self.chain_seconds(chain))
                    if reason is not None:
                        tally.straggler_timeouts += 1
                        outcome = ClientFailure(list(chain), reason)
                    elif corrupted[outcome.client_id]:
                        tally.corrupted += 1
                        outcome = corrupt(outcome, global_vector, faults.config.corruption)
                yield outcome

        return injected()

    def _injectable(self, update: ClientUpdate, global_vector: Tensor) -> bool:
        """Whether ``train.faults`` can act on ``update``: its client ids index the
        federation and its model is a dense float tensor of the global model's shape. Any other
        update (only a hostile runtime or client sends one) is left to the screen."""
        ids = [update.client_id, *(update.chain or [])]
        return (
            all(isinstance(client, (int, np.integer)) and not isinstance(client, bool) for client in ids)
            and all(0 <= client < self.num_clients for client in ids)
            and isinstance(update.vector, Tensor)
            and update.vector.layout == torch.strided
            and update.vector.is_floating_point()
            and update.vector.shape == global_vector.shape
        )

    def _aggregate_attempt(
        self,
        round_index: int,
        global_vector: Tensor,
        outcomes: Iterable[Outcome],
        excluded: dict[tuple[int, ...], str],
        saved_server: dict[str, Any],
    ) -> tuple[Tensor | None, Tally]:
        """Screen and aggregate one attempt's ``outcomes``: the new model (``None`` when
        the attempt failed) and what screening saw.

        An update the aggregator raises on is added to ``excluded`` with the error; when
        the outcomes are a list (Flower, FedML), the aggregator's state is restored and
        they are aggregated again without it, at once; a runtime that trains lazily (the
        simulator's engines) drops it from the next attempt instead.
        """
        reusable = isinstance(outcomes, Sequence)
        while True:
            tally = Tally()
            updates = self._screened(outcomes, round_index, global_vector, tally, excluded)
            new_vector, blamed = self._aggregate(global_vector, updates, tally, round_index)
            if blamed is None:
                return new_vector, tally
            update, reason = blamed
            key = chain_key(update)
            if not reusable or key is None:
                retract(tally, update, reason, round_index + 1, self.model_bytes)
                if key is not None:
                    excluded[key] = reason
                return None, tally
            excluded[key] = reason
            logger.warning("round %d: client(s) %s: %s; aggregating again without it", round_index + 1, list(key), reason)
            self.aggregator.load_state_dict(copy.deepcopy(saved_server))

    def _screened(
        self,
        outcomes: Iterable[Outcome],
        round_index: int,
        global_vector: Tensor,
        tally: Tally,
        excluded: dict[tuple[int, ...], str],
    ) -> Iterator[ClientUpdate]:
        """The usable updates of ``outcomes`` (faults injected, every field screened, the
        aggregator's own check, and ``train.screening.max_weight_fraction``)."""
        updates = screen(
            self._inject(outcomes, round_index, global_vector, tally),
            tuple(global_vector.shape),
            timeout=self.config.failures.client_timeout_seconds,
            model_bytes=self.model_bytes,
            round_number=round_index + 1,
            tally=tally,
            rules=self.screening_rules,
            global_vector=global_vector,
            check=self.aggregator.check_update,
            excluded=excluded,
        )
        fraction = self.screening_rules.config.max_weight_fraction
        if fraction is None:
            return updates
        gathered = list(updates)
        kept = []
        for update, reason in zip(gathered, over_weight_share(gathered, fraction)):
            if reason is None:
                kept.append(update)
                continue
            retract(tally, update, reason, round_index + 1, self.model_bytes)
        return iter(kept)

    def _aggregate(
        self, global_vector: Tensor, updates: Iterator[ClientUpdate], tally: Tally, round_index: int
    ) -> tuple[Tensor | None, tuple[ClientUpdate, str] | None]:
        """The aggregator's new model, or ``None`` when no usable update reached it (one
        rule for every runtime: an aggregator that receives no update raises
        ``ValueError`` or :class:`TrainingError`); and, when the aggregator raised while
        it held an update, that update and why it is blamed.

        Raises:
            TrainingError: the aggregator failed after it had read every update (not the
                fault of one of them).
        """
        handed = HandedUpdates(updates)
        try:
            return self.aggregator.aggregate(global_vector, handed), None
        except Exception as error:  # noqa: BLE001 - one client's update must not stop the server
            if handed.last is not None and not handed.exhausted:
                update = handed.last
                reason = client_text(  # the error may quote what the client sent
                    f"its update made the {self.config.aggregator.name!r} aggregator fail "
                    f"({type(error).__name__}: {client_text(error, 200)})"
                )
                return None, (update, reason)
            if isinstance(error, (ValueError, TrainingError)) and not tally.accepted:
                return None, None
            if isinstance(error, TrainingError):
                raise
            raise TrainingError(
                f"round {round_index + 1}: the {self.config.aggregator.name!r} aggregator failed after reading "
                f"every update ({type(error).__name__}: {error})"
            ) from error

    def _check_finite(self, vector: Tensor, round_index: int) -> None:
        if not all_finite(vector):
            last_good = f"the checkpoint at {self.checkpoint}" if self.checkpoint else f"round {round_index}"
            raise TrainingError(
                f"the global model became non-finite at round {round_index + 1}; the last good state is "
                f"{last_good}; lower train.optimizer.lr or the server learning rate"
            )

    # ----------------------------------------------------------------- record

    def round_metrics(self, plan: RoundPlan) -> dict[str, float]:
        """The components' own metrics of the round of ``plan`` (FedGSP's CPD), every
        slot's (:meth:`~fedplug.run.components.Components.round_metrics`).

        Raises:
            ConfigError: two components report a metric of the same name.
        """
        return self.components.round_metrics(plan, self.class_counts)

    def record(
        self,
        round_index: int,
        plan: RoundPlan,
        attempt: AggregatedRound,
        evaluation: Evaluation,
        *,
        payload_bytes: int,
        bytes_so_far: int,
        started: float,
    ) -> RoundRecord:
        """The round's record. ``payload_bytes``: what the aggregator sent down with each
        model; ``bytes_so_far``: traffic before this round; ``started``: the round's
        ``time.perf_counter()`` at its start."""
        members = participants(plan)
        bytes_down = (self.model_bytes + payload_bytes) * len(members)
        sizes = self.client_sizes if self.client_sizes is not None else np.zeros(self.num_clients, dtype=np.int64)
        straggling = self.faults.has_stragglers
        cost = round_cost(
            plan.chains,
            sizes,
            self.config.local_epochs,
            self.train_flops,
            self.model_bytes,
            self.link,
            speed_factors=self.faults.speed_factors if straggling else None,
            timeout_seconds=self.faults.straggler_deadline,
        )
        tally = attempt.tally
        dropout = self.dropout(round_index)
        dropped = dropout.entries(round_index + 1) + [
            {"clients": list(chain), "reason": reason} for chain, reason in tally.dropped
        ]
        return RoundRecord(
            round=round_index + 1,
            accuracy=evaluation.accuracy,
            loss=evaluation.loss,
            client_accuracy_mean=evaluation.client_accuracy_mean,
            client_accuracy_std=evaluation.client_accuracy_std,
            bytes_up=tally.bytes_up,
            bytes_down=bytes_down,
            cumulative_bytes=bytes_so_far + tally.bytes_up + bytes_down,
            seconds=time.perf_counter() - started,
            participants=len(members),
            failures=tally.failures,
            compute_seconds_model=float(cost.compute_seconds),
            communication_seconds_model=float(cost.communication_seconds),
            faults_dropout=dropout.count,
            faults_stragglers=self.faults.stragglers_in(plan.chains),
            faults_straggler_timeouts=tally.straggler_timeouts,
            faults_corrupted=tally.corrupted,
            dropped=dropped,
            clients=[int(client) for client in members],
            chains=chain_members(plan),
            metrics={**(self.round_metrics(plan) if plan.chains else {}), **evaluation.validation_metrics()},
        )

    # ---------------------------------------------------------------- derived

    def derived_params(self, engine: str, **runtime_entries: Any) -> dict[str, Any]:
        """Values computed from the config: the components' own
        (:meth:`fedplug.components.ComponentConfig.derived_values`), the model's size and
        FLOPs, the engine, and the runtime's ``runtime_entries``."""
        return derived_params(self.config, engine, self.model_bytes, self.train_flops, **runtime_entries)

    def run_result(
        self,
        history: list[RoundRecord],
        reporter: SetupReporter,
        *,
        target_accuracy: float | None,
        engine: str,
        setup_cost: PhaseCost = NO_SETUP,
        setup_seconds: float = 0.0,
        **runtime_entries: Any,
    ) -> RunResult:
        """The run's result, the same on every runtime: ``history`` (the list the runtime
        appends each round's record to), the setup's cost (default none) and wall time, the
        ``reporter``'s setup report (the run's :class:`~fedplug.run.components.Components`,
        every slot's :meth:`~fedplug.components.ComponentHooks.setup_report`), and
        :meth:`derived_params` with ``engine`` and the runtime's ``runtime_entries``."""
        return RunResult(
            history,
            target_accuracy,
            setup_rounds=setup_cost.rounds,
            setup_bytes=setup_cost.bytes_up + setup_cost.bytes_down,
            setup_seconds=setup_seconds,
            derived_params=self.derived_params(engine, **runtime_entries),
            setup_report=reporter.setup_report(),
        )


def derived_params(train_config: Any, engine: str, model_bytes: int, train_flops: int, **runtime_entries: Any) -> dict[str, Any]:
    """See :meth:`RoundCore.derived_params`."""
    derived: dict[str, Any] = {
        "train_flops_per_sample": int(train_flops),
        "model_bytes": int(model_bytes),
        "engine": engine,
        **runtime_entries,
    }
    for slot in SLOTS:
        derived.update(getattr(train_config, slot).derived_values(train_config))
    return derived


def client_needs(*components: Any) -> ClientNeeds:
    """The union of what ``components`` need from the clients, for a runtime that holds
    them one by one (:meth:`fedplug.run.components.Components.needs` is this over a
    run's four)."""
    needs = ClientNeeds()
    for component in components:
        needs = needs | component.client_needs()
    return needs


def screening_config(train_config: Any) -> ScreeningConfig:
    """``train.screening`` (its defaults for a config that has none)."""
    config = getattr(train_config, "screening", None)
    return config if isinstance(config, ScreeningConfig) else ScreeningConfig()
