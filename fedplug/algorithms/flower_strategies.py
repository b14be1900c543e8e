"""Flower's server strategies as a fedplug aggregator: ``aggregator: {name: flower, ...}``.

Hands each round's client updates to one of Flower's Message-API strategies (FedMedian,
FedTrimmedAvg, Krum, MultiKrum, Bulyan, QFedAvg, server-side DP clipping), so it composes
with any sampler, loss transform and grouper. Registered only when Flower is installed.
Use: docs/flower.md, "Flower's strategies inside `fedplug run`"; the strategies' papers
and how a round reaches Flower: docs/algorithms.md, "Flower's strategies".
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import math
import random
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from fedplug.components import TRAIN_LOSS, Aggregator, ClientNeeds, ClientUpdate, ComponentConfig
from fedplug.errors import ConfigError, TrainingError
from fedplug.hookspecs import RegisterAggregator, hookimpl

VECTOR_KEY = "vector"
"""The one array of every ArrayRecord handed to Flower: the flat model vector."""
WEIGHT_KEY = "num-examples"
"""Flower's weighting key (``weighted_by_key``); it carries :attr:`ClientUpdate.weight`."""
FLOWER_LOGGER = "flwr"

STRATEGIES: dict[str, tuple[str, ...]] = {
    "FedAvg": (),
    "FedMedian": (),
    "FedTrimmedAvg": ("beta",),
    "Krum": ("num_malicious_nodes",),
    "MultiKrum": ("num_malicious_nodes", "num_nodes_to_select"),
    "Bulyan": ("num_malicious_nodes",),
    "QFedAvg": ("q", "client_learning_rate"),
}
"""The Flower strategies that aggregate on their own, with the parameters each takes."""
FLOWER_DEFAULT_BETA = 0.2
"""FedTrimmedAvg's ``beta`` when the config sets none (Flower's default)."""
REPLY_METRICS: dict[str, tuple[str, ...]] = {
    "QFedAvg": (TRAIN_LOSS,),  # Flower's default train_loss_key is fedplug's TRAIN_LOSS
}
"""The client reply metrics a strategy reads (none unless listed)."""
METRIC_MINIMUM: dict[str, float] = {TRAIN_LOSS: 0.0}
"""The least value a reply metric can take by its meaning (a mean cross-entropy is not
negative); Flower's QFedAvg raises a negative loss to the power q, which is NaN."""
logger = logging.getLogger("fedplug.algorithms.flower")
DP_WRAPPER = "DifferentialPrivacyServerSideFixedClipping"
WRAPPER_PARAMETERS = (
    "noise_multiplier",
    "clipping_norm",
    "num_sampled_clients",
    "noise_seed",
    "wrapped",
)
"""The DP wrapper's parameters; the wrapped strategy's own parameters sit beside them."""
NOT_OFFERED: dict[str, str] = {
    "DifferentialPrivacyClientSideFixedClipping": (
        "it expects the clients to clip their updates (Flower's fixedclipping_mod), which "
        f"fedplug's clients do not; use {DP_WRAPPER}"
    ),
    "DifferentialPrivacyClientSideAdaptiveClipping": (
        "it expects the clients to clip their updates (Flower's adaptiveclipping_mod); "
        f"use {DP_WRAPPER}"
    ),
    "DifferentialPrivacyServerSideAdaptiveClipping": (
        "its clipping norm changes every round, state this bridge does not checkpoint; "
        f"use {DP_WRAPPER}"
    ),
    "FedAvgM": "it keeps a server momentum across rounds; use fedplug's aggregator 'fedavgm'",
    "FedAdam": "it keeps server moments across rounds; use fedplug's aggregator 'fedadam'",
    "FedAdagrad": "it keeps server moments across rounds; use fedplug's aggregator 'fedadagrad'",
    "FedYogi": "it keeps server moments across rounds; use fedplug's aggregator 'fedyogi'",
    "FedProx": "its proximal term runs on the clients; use fedplug's loss_transform 'fedprox'",
    "FedXgbBagging": "it aggregates XGBoost trees, not a model vector",
    "FedXgbCyclic": "it aggregates XGBoost trees, not a model vector",
}
"""Flower strategies this aggregator refuses, and why."""
PARAMETERS = (
    tuple(dict.fromkeys(p for params in STRATEGIES.values() for p in params)) + WRAPPER_PARAMETERS
)


def flower_installed() -> bool:
    """Whether ``flwr`` can be imported (without importing it)."""
    return importlib.util.find_spec("flwr") is not None


def accepted_parameters(strategy: str, wrapped: str | None) -> tuple[str, ...]:
    """The parameters ``strategy`` (wrapping ``wrapped``, for the DP wrapper) takes."""
    if strategy == DP_WRAPPER:
        return WRAPPER_PARAMETERS + STRATEGIES.get(wrapped or "FedAvg", ())
    return STRATEGIES[strategy]


def _strategy_problem(strategy: Any, role: str) -> str | None:
    """Why ``strategy`` cannot be used in ``role`` (``strategy`` or ``wrapped``)."""
    offered = sorted(STRATEGIES) + ([DP_WRAPPER] if role == "strategy" else [])
    if not isinstance(strategy, str):
        return f"{role} must be the name of a Flower strategy, one of: {', '.join(offered)}"
    if strategy in NOT_OFFERED:
        return f"Flower's {strategy} cannot be a fedplug aggregator: {NOT_OFFERED[strategy]}"
    if strategy == DP_WRAPPER and role == "wrapped":
        return f"wrapped: {DP_WRAPPER} cannot wrap itself; wrap one of: {', '.join(offered)}"
    if strategy not in offered:
        return f"unknown Flower strategy {strategy!r} in {role}; offered: {', '.join(offered)}"
    return None


class FlowerStrategyConfig(ComponentConfig):
    """Flower's FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan, QFedAvg, FedAvg or DP clipping.

    ``strategy`` names the Flower class; the parameters below are the Flower
    constructor's keyword arguments of the same name, and each strategy accepts only its
    own (a parameter it does not take is an error that lists those it does). Flower's
    node-sampling arguments (``fraction_train``, ``min_train_nodes``, ...) are not
    offered: fedplug's ``train.client_fraction`` and grouper pick the clients. The bounds
    are Flower 1.41's (``flwr/serverapp/strategy/``); :func:`robustness_warning` says
    which one a round misses.
    """

    name: Literal["flower"] = "flower"
    strategy: str
    """The Flower strategy: ``FedAvg``, ``FedMedian``, ``FedTrimmedAvg``, ``Krum``,
    ``MultiKrum``, ``Bulyan``, ``QFedAvg`` or ``DifferentialPrivacyServerSideFixedClipping``
    (required). The robust ones discard nothing unless a round has enough updates (n):
    FedMedian n >= 3, FedTrimmedAvg int(beta * n) >= 1, Krum and MultiKrum n >= 2f + 3,
    Bulyan n >= 4f + 3 with f >= 1; a round below its bound warns."""
    beta: float | None = Field(None, ge=0.0, lt=0.5)
    """FedTrimmedAvg: fraction cut off at each tail of every coordinate (Flower's default
    0.2). Flower cuts int(beta * n) of a round's n updates from each end, so a round
    trims nothing (the plain mean) unless n >= 1 / beta: beta 0.2 needs 5 clients a round,
    a round of 3 needs beta >= 1/3."""
    num_malicious_nodes: int | None = Field(None, ge=0)
    """Krum, MultiKrum, Bulyan: the number f of Byzantine clients tolerated (Flower's
    default 0, which tolerates none by the guarantee). Krum and MultiKrum need
    n >= 2f + 3 updates a round; Bulyan needs n >= 4f + 3 (fewer: the round fails), and
    with f = 0 averages every update (the plain mean)."""
    num_nodes_to_select: int | None = Field(None, ge=1)
    """MultiKrum: how many of the lowest-scoring updates are averaged (Flower's default 1,
    which is Krum). At n or more it keeps every update of a round of n (FedAvg): keep it
    at most n - max(f, 1)."""
    q: float | None = Field(None, ge=0.0)
    """QFedAvg: the fairness exponent (Flower's default 0.1); 0 weighs every client
    alike, larger values weigh clients with a higher training loss more."""
    client_learning_rate: float | None = Field(None, gt=0.0)
    """QFedAvg: the clients' learning rate, from which Flower estimates the Lipschitz
    constant ``L = 1 / client_learning_rate`` (required for QFedAvg: an aggregator does
    not see ``train.optimizer``; normally set it to ``train.optimizer.lr``)."""
    noise_multiplier: float | None = Field(None, ge=0.0)
    """DP: Gaussian noise standard deviation as a multiple of ``clipping_norm /
    num_sampled_clients`` (required for the DP wrapper; 0 adds no noise)."""
    clipping_norm: float | None = Field(None, gt=0.0)
    """DP: each update's L2 distance to the global model is clipped to this (required for
    the DP wrapper)."""
    num_sampled_clients: int | None = Field(None, ge=1)
    """DP: the number of updates per round the noise is scaled for (default: the number
    that reached the aggregator that round)."""
    noise_seed: int | None = Field(None, ge=0, lt=2**32)
    """DP: mixed into the seed of each round's noise (default None, which is 0); see the
    module docstring."""
    wrapped: str | None = None
    """DP: the strategy the DP wrapper aggregates with (default ``FedAvg``)."""

    @model_validator(mode="before")
    @classmethod
    def _strategy_and_its_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        strategy = data.get("strategy")
        if strategy is None:
            offered = sorted(STRATEGIES) + [DP_WRAPPER]
            raise ValueError(f"strategy is required: one of {', '.join(offered)}")
        problem = _strategy_problem(strategy, "strategy")
        wrapped = data.get("wrapped")
        if problem is None and wrapped is not None:
            if strategy != DP_WRAPPER:
                problem = f"wrapped is a parameter of {DP_WRAPPER}, not of {strategy}"
            else:
                problem = _strategy_problem(wrapped, "wrapped")
        if problem is not None:
            raise ValueError(problem)
        accepted = accepted_parameters(strategy, wrapped)
        # None is "not set": a dumped config (model_dump, as the Flower runtime sends it)
        # holds every field.
        given = [
            key
            for key, value in data.items()
            if key not in ("name", "strategy") and value is not None
        ]
        unknown = [key for key in given if key not in accepted]
        if unknown:
            takes = ", ".join(accepted) if accepted else "no parameters"
            described = strategy if wrapped is None else f"{strategy} wrapping {wrapped}"
            raise ValueError(f"{described} takes {takes}, not {', '.join(map(str, unknown))}")
        missing = [
            key
            for key in ("noise_multiplier", "clipping_norm")
            if strategy == DP_WRAPPER and data.get(key) is None
        ]
        if missing:
            raise ValueError(f"{DP_WRAPPER} needs {' and '.join(missing)}")
        return data

    def strategy_keywords(self) -> dict[str, Any]:
        """The keyword arguments of the aggregating Flower strategy (the wrapped one for
        the DP wrapper), leaving Flower's defaults where the config sets nothing."""
        values = self.model_dump()
        return {
            key: values[key]
            for key in STRATEGIES[self.aggregating_strategy]
            if values[key] is not None
        }

    def incompatibilities(self, train: Any) -> list[str]:
        """QFedAvg without ``client_learning_rate``: the reason names the run's
        ``train.optimizer.lr``, the value to set."""
        if self.aggregating_strategy == "QFedAvg" and self.client_learning_rate is None:
            return [missing_learning_rate(train.optimizer.lr)]
        return []

    @property
    def aggregating_strategy(self) -> str:
        """The strategy that combines the models: ``strategy``, or the one the DP wrapper
        wraps."""
        return (self.wrapped or "FedAvg") if self.strategy == DP_WRAPPER else self.strategy


def missing_learning_rate(learning_rate: float | None = None) -> str:
    """The error for QFedAvg without ``client_learning_rate``."""
    value = f" ({learning_rate})" if learning_rate is not None else ""
    return (
        "Flower's QFedAvg needs client_learning_rate (it estimates the Lipschitz constant as "
        f"1 / client_learning_rate): set it to the clients' train.optimizer.lr{value}"
    )


def robustness_warning(config: FlowerStrategyConfig, num_updates: int) -> str | None:
    """Why the aggregating strategy trims or discards nothing, or has lost its guarantee,
    in a round of ``num_updates`` (n) updates, in one line with the fix; ``None`` when
    its parameters hold for n (or it claims no robustness: FedAvg, QFedAvg).

    The bounds are those of Flower 1.41's code: FedTrimmedAvg's ``trim_mean`` cuts
    ``int(beta * n)`` per tail; FedMedian's ``np.median`` of 2 is their mean; Krum and
    MultiKrum score each update by its ``n - f - 2`` closest (the guarantee needs
    ``n >= 2f + 3``), and MultiKrum averages its ``num_nodes_to_select`` best; Bulyan
    needs ``n >= 4f + 3`` and, with ``f = 0``, averages all n.
    """
    strategy = config.aggregating_strategy
    check = _BOUND_CHECKS.get(strategy)
    if check is None:
        return None
    problem = check(config, num_updates)
    if problem is None:
        return None
    wrapping = f"{config.strategy} wrapping {strategy}: " if config.strategy == DP_WRAPPER else ""
    return f"train.aggregator: {wrapping}{problem}"


def _fewest_clients_trimmed(beta: float) -> int:
    """The least n with ``int(beta * n) >= 1`` (``beta > 0``), as Flower computes it."""
    clients = max(1, math.ceil(1 / beta))
    while int(beta * clients) < 1:
        clients += 1
    while clients > 1 and int(beta * (clients - 1)) >= 1:
        clients -= 1
    return clients


def _trimmed_avg_bound(config: FlowerStrategyConfig, n: int) -> str | None:
    beta = config.beta if config.beta is not None else FLOWER_DEFAULT_BETA
    cut = int(beta * n)
    if cut > 0:
        return None
    fixes = [f"beta >= 1/{n}"] if n >= 3 else []
    if beta > 0:
        fixes.append(f"at least {_fewest_clients_trimmed(beta)} clients a round")
    elif n < 3:
        fixes.append("beta >= 1/3 and at least 3 clients a round")
    return (
        f"FedTrimmedAvg with beta={beta:g} trims int({beta:g}*{n})={cut} updates from each end "
        f"of a round of {n}: it is the plain (unweighted) mean here; use {' or '.join(fixes)}"
    )


def _median_bound(config: FlowerStrategyConfig, n: int) -> str | None:
    if n >= 3:
        return None
    return (
        f"FedMedian of a round of {n} is the mean of its {n} update(s): a median discards an "
        "outlier only among at least 3 updates; sample at least 3 clients a round"
    )


def _krum_bound(config: FlowerStrategyConfig, n: int) -> str | None:
    malicious = config.num_malicious_nodes or 0
    problems = []
    name = config.aggregating_strategy
    least = 2 * malicious + 3
    if n < least:
        lower = " or lower num_malicious_nodes" if malicious > 0 else ""
        problems.append(
            f"{name} with num_malicious_nodes={malicious} needs n >= 2f+3 = {least} updates a "
            f"round (it scores each by its n-f-2 closest), and this round has {n}: it picks "
            f"without its guarantee; sample at least {least} clients a round{lower}"
        )
    selected = config.num_nodes_to_select or 1
    if name == "MultiKrum" and n > 1 and selected >= n:
        problems.append(
            f"MultiKrum with num_nodes_to_select={selected} keeps all {n} updates of a round of "
            f"{n}: it is FedAvg here; use num_nodes_to_select <= {max(1, n - max(malicious, 1))} "
            "or more clients a round"
        )
    return "; ".join(problems) or None


def _bulyan_bound(config: FlowerStrategyConfig, n: int) -> str | None:
    malicious = config.num_malicious_nodes or 0
    if malicious > 0:
        return None  # fewer than 4f + 3 updates: Flower returns no model, the round fails
    return (
        f"Bulyan with num_malicious_nodes=0 selects all {n} updates of a round of {n} and "
        "averages them all (theta = n - 2f, beta = theta - 2f): it is the plain mean here; "
        "set num_malicious_nodes >= 1 and sample at least 4f+3 = 7 clients a round"
    )


_BOUND_CHECKS = {
    "FedTrimmedAvg": _trimmed_avg_bound,
    "FedMedian": _median_bound,
    "Krum": _krum_bound,
    "MultiKrum": _krum_bound,
    "Bulyan": _bulyan_bound,
}
"""The robust strategies, each with its check of a round's number of updates."""


class _ReplyGrid:
    """The grid a strategy's ``configure_train`` samples from: one node per reply.

    Flower's strategies only ask a grid for its node ids there; the messages they
    configure are never sent, they only give each reply its ``reply_to``.
    """

    def __init__(self, num_nodes: int) -> None:
        self.node_ids = list(range(1, num_nodes + 1))

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


@contextlib.contextmanager
def seeded_global_generators(seed_words: list[int]) -> Iterator[None]:
    """Seed numpy's legacy global generator and Python's ``random`` from ``seed_words``
    (each below 2**32) for the block, then put both back as they were."""
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    np.random.seed(np.array(seed_words, dtype=np.uint32))
    random.seed(int.from_bytes(np.array(seed_words, dtype=">u4").tobytes(), "big"))
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@contextlib.contextmanager
def flower_warnings_only() -> Iterator[None]:
    """Flower's logger at WARNING for the block (its INFO lines describe the stand-in
    grid, not the run)."""
    logger = logging.getLogger(FLOWER_LOGGER)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def model_digest(vector: Tensor) -> list[int]:
    """Two 32-bit words identifying the exact bits of ``vector``."""
    data = vector.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return [int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:], "big")]


class FlowerStrategyAggregator(Aggregator):
    """Aggregates each round with the Flower strategy its :class:`FlowerStrategyConfig`
    names."""

    def __init__(self, config: FlowerStrategyConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        if config.aggregating_strategy == "QFedAvg" and config.client_learning_rate is None:
            raise ConfigError(f"train.aggregator: {missing_learning_rate()}")
        self.config = config
        self.rounds_aggregated = 0
        """Rounds aggregated so far; round t is Flower's ``server_round`` t."""
        self.warned_sizes: set[int] = set()
        """The round sizes already warned about (:func:`robustness_warning`: once each)."""

    def client_needs(self) -> ClientNeeds:
        """The reply metrics the strategy reads (QFedAvg: ``train_loss``); the others need
        nothing beyond the model and ``num-examples``."""
        return ClientNeeds(reply_metrics=REPLY_METRICS.get(self.config.aggregating_strategy, ()))

    def check_update(self, update: ClientUpdate) -> str | None:
        """A reply metric the strategy reads below its least meaningful value (a negative
        ``train_loss``, from a broken or hostile client) makes the update unusable: the
        round core drops it before Flower turns it into a NaN model. (The core has
        already checked that every metric is present and finite.)"""
        for name in self.client_needs().reply_metrics:
            value = update.metrics.get(name)
            least = METRIC_MINIMUM.get(name)
            if value is not None and least is not None and value < least:
                return (
                    f"reported {name} = {value:g}, below {least:g}, which Flower's "
                    f"{self.config.aggregating_strategy} cannot weigh"
                )
        return None

    def initialize(self, global_vector: Tensor) -> None:
        self.rounds_aggregated = 0
        self.warned_sizes = set()

    def warn_if_inert(self, num_updates: int) -> None:
        """Warn, once per run and round size, when the strategy's parameters trim or
        discard nothing for ``num_updates`` updates (:func:`robustness_warning`): a
        robust aggregator that silently averages everything is worse than none."""
        if num_updates in self.warned_sizes:
            return
        line = robustness_warning(self.config, num_updates)
        if line is not None:
            self.warned_sizes.add(num_updates)
            logger.warning("%s", line)

    def build_strategy(self, num_replies: int) -> Any:
        """The Flower strategy of one round of ``num_replies`` replies."""
        from flwr.serverapp import strategy as flower

        sampling = {"min_train_nodes": 1, "min_available_nodes": 1}
        aggregating = getattr(flower, self.config.aggregating_strategy)(
            **sampling, **self.config.strategy_keywords()
        )
        if self.config.strategy != DP_WRAPPER:
            return aggregating
        assert self.config.noise_multiplier is not None and self.config.clipping_norm is not None
        return flower.DifferentialPrivacyServerSideFixedClipping(
            aggregating,
            noise_multiplier=self.config.noise_multiplier,
            clipping_norm=self.config.clipping_norm,
            num_sampled_clients=self.config.num_sampled_clients or num_replies,
        )

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        """The Flower strategy's model from this round's updates (held all at once).

        Raises:
            ValueError: an update's weight is negative or not finite.
            TrainingError: no update with positive weight arrived, or the strategy
                returned no model (Bulyan with fewer than 4f + 3 updates).
        """
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

        from fedplug.flower_internals import ensure_task_identity

        wanted = self.client_needs().reply_metrics
        replies: list[tuple[int, Any, dict[str, float]]] = []
        for update in updates:
            if not (np.isfinite(update.weight) and update.weight >= 0):
                raise ValueError(
                    f"client {update.client_id} sent aggregation weight {update.weight!r}; "
                    "weights must be finite and non-negative"
                )
            missing = [name for name in wanted if name not in update.metrics]
            if missing:
                raise ValueError(
                    f"client {update.client_id}'s update carries no {missing} in its metrics, "
                    f"which Flower's {self.config.aggregating_strategy} reads"
                )
            if update.weight > 0:  # copied now: a streaming runtime may reuse the tensor
                vector = update.vector.detach().to("cpu", torch.float32).numpy()
                metrics = {WEIGHT_KEY: float(update.weight)}
                metrics.update({name: float(update.metrics[name]) for name in wanted})
                replies.append(
                    (update.client_id, ArrayRecord({VECTOR_KEY: Array(vector)}), metrics)
                )
        if not replies:
            raise TrainingError(
                f"no client update reached the 'flower' aggregator ({self.config.strategy}) this "
                "round (every sampled client failed or held no training samples); check the "
                "partition and the fraction of clients sampled per round"
            )
        self.warn_if_inert(len(replies))
        server_round = self.rounds_aggregated + 1
        current = global_vector.detach().to("cpu", torch.float32).numpy()
        seed_words = [self.config.noise_seed or 0, server_round, *model_digest(global_vector)]
        strategy = self.build_strategy(len(replies))
        ensure_task_identity()  # Flower >= 1.38 builds messages only in a process that has one
        with seeded_global_generators(seed_words), flower_warnings_only():
            grid = _ReplyGrid(len(replies))
            instructions = {
                message.metadata.dst_node_id: message
                for message in strategy.configure_train(
                    server_round, ArrayRecord({VECTOR_KEY: Array(current)}), ConfigRecord(), grid
                )
            }
            messages = [
                Message(
                    RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}),
                    reply_to=instructions[node_id],
                )
                for node_id, (_, arrays, metrics) in zip(grid.node_ids, replies)
            ]
            try:
                aggregated, _ = strategy.aggregate_train(server_round, messages)
            except ZeroDivisionError:  # Flower's clipping scales by clipping_norm / norm(change)
                raise TrainingError(self._unchanged_models(current, replies)) from None
        if aggregated is None:
            raise TrainingError(
                f"Flower's {self.config.strategy} returned no model from {len(replies)} updates in "
                f"round {server_round} (see Flower's warning above; Bulyan needs at least "
                "4 * num_malicious_nodes + 3 updates): sample more clients per round or lower "
                "num_malicious_nodes"
            )
        self.rounds_aggregated = server_round
        result = np.asarray(aggregated[VECTOR_KEY].numpy(), dtype=np.float32)
        return torch.from_numpy(result.copy()).to(global_vector.device)

    def _unchanged_models(
        self, current: np.ndarray, replies: list[tuple[int, Any, dict[str, float]]]
    ) -> str:
        unchanged = [
            k for k, arrays, _ in replies if np.array_equal(arrays[VECTOR_KEY].numpy(), current)
        ]
        return (
            f"client {unchanged[0] if unchanged else '?'} in round {self.rounds_aggregated + 1} "
            f"sent back the global model unchanged, and Flower's {DP_WRAPPER} divides by the "
            "norm of each change; check that every client trains (train.optimizer.lr > 0, "
            "non-empty partitions)"
        )

    def state_dict(self) -> dict[str, Any]:
        """The round count: everything else is rebuilt each round from the config, and
        the noise is seeded from the round and the global model."""
        return {"rounds_aggregated": self.rounds_aggregated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds_aggregated = int(state["rounds_aggregated"])


@hookimpl
def fedplug_register_aggregators(register: RegisterAggregator) -> None:
    if flower_installed():
        register(FlowerStrategyConfig, FlowerStrategyAggregator)
