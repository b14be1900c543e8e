"""Faults on demand: client dropout, stragglers and corrupted updates, injected per round.

``train.faults`` makes a run meet the faults a real federation meets, on purpose and
reproducibly. The round core injects them (:class:`Faults`), so every runtime injects
the same faults, each decision from its own random stream of the seed and round.
Design: docs/reliability.md, section 4 and 'Design notes: faults'.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field, NonNegativeInt, model_validator
from torch import Tensor

from fedplug.components import ClientUpdate, StrictConfig
from fedplug.errors import ConfigError, DataError
from fedplug.safe_files import read_regular_bytes

DROPOUT_STREAM = 0xD809
"""Tag of the generator that decides which sampled clients drop out: ``[seed, round, tag]``."""
STRAGGLER_STREAM = 0x5106
"""Tag of the generator that picks the run's stragglers: ``[seed, tag]``."""
CORRUPTION_STREAM = 0xBAD
"""Tag of the generator that decides which updates are corrupted: ``[seed, round, tag]``."""
TRACE_HEADER = ("round", "clients")


# ---------------------------------------------------------------------------- config


class DropoutConfig(StrictConfig):
    """Clients that do not take part in a round (they neither train nor reply)."""

    probability: float = Field(0.0, ge=0, lt=1)
    """Chance that a sampled client drops out of a round, each client independently
    (0 = none). Dropped clients are not failures: they do not count against
    ``train.failures.max_failed_fraction``."""
    trace: str | None = Field(None, min_length=1)
    """A CSV file of the clients available in each round (None = all of them), read
    relative to the working folder. Header ``round,clients``, then one line per round
    (1-based, as in ``metrics.json``), the available client ids separated by spaces,
    e.g. ``3,0 4 7``; ``3,`` means nobody. Every round of the run needs a line; extra
    rounds are ignored. The round samples ``client_fraction`` x K clients among the
    available ones (all of them when fewer are available). The run's checkpoint
    fingerprint covers the path, not the file's content: edit a trace only between
    runs in different ``--out`` folders."""


class StragglerConfig(StrictConfig):
    """Clients that train slower than the cost model's device (simulated, see the module)."""

    fraction: float = Field(0.0, ge=0, le=1)
    """Share of the K clients that straggle (0 = none), drawn once per run from the seed."""
    factor: float = Field(1.0, ge=1)
    """How many times slower the ``fraction``'s clients train (1 = not at all)."""
    factors: dict[NonNegativeInt, Annotated[float, Field(ge=1)]] = Field(default_factory=dict)
    """Explicit speed factors, ``{client_id: factor}`` (instead of ``fraction``/``factor``);
    every other client has factor 1."""
    deadline_seconds: float | None = Field(None, gt=0)
    """A chain with a straggler whose modelled training time exceeds this is dropped as
    a timeout. None (the default) = ``train.failures.client_timeout_seconds``; both None
    = stragglers only slow the modelled time. Give it when the cost model's time scale
    (the FedGSP paper's device, see :mod:`fedplug.cost_model`) is far from this
    machine's: ``client_timeout_seconds`` also bounds the real training time."""

    @model_validator(mode="after")
    def _one_way_of_choosing(self) -> "StragglerConfig":
        if self.factors and self.fraction > 0:
            raise ValueError("give either fraction and factor, or factors, not both")
        return self


class CorruptionConfig(StrictConfig):
    """Updates that arrive corrupted (applied before the round screens them)."""

    probability: float = Field(0.0, ge=0, le=1)
    """Chance that a chain's update is corrupted, each chain independently (0 = none)."""
    kind: Literal["nan", "shape", "scale"] = "nan"
    """``nan``: every parameter NaN; ``shape``: the last parameter missing (both are
    dropped by the screen and count as failures); ``scale``: the update's change to the
    global model multiplied by ``factor`` (it passes the screen unless it is over a bound
    of ``train.screening``)."""
    factor: float | None = None
    """The multiplier of ``kind: scale`` (required there, refused otherwise); e.g. -1
    flips the update's direction, 10 exaggerates it."""

    @model_validator(mode="after")
    def _factor_only_for_scale(self) -> "CorruptionConfig":
        if self.kind == "scale" and self.factor is None:
            raise ValueError("kind 'scale' needs factor (the update's change is multiplied by it)")
        if self.kind != "scale" and self.factor is not None:
            raise ValueError(f"factor applies to kind 'scale' only, not {self.kind!r}; remove it")
        return self


class FaultsConfig(StrictConfig):
    """Faults injected on purpose, per round (default: none). See :mod:`fedplug.faults`."""

    dropout: DropoutConfig = Field(default_factory=DropoutConfig)
    stragglers: StragglerConfig = Field(default_factory=StragglerConfig)
    corruption: CorruptionConfig = Field(default_factory=CorruptionConfig)


# --------------------------------------------------------------------------- the trace


def read_trace(path: str | Path, num_clients: int, rounds: int) -> dict[int, frozenset[int]]:
    """The available clients of each round of a trace file, by 0-based round index.

    Raises:
        ConfigError: the file does not exist, cannot be read, or is not a regular file
            (a FIFO, socket or device is refused without waiting on it).
        DataError: the file is not a trace of this run (its line says what is wrong).
    """
    path = Path(path)
    name = str(path)
    try:
        # Not read_text(): a FIFO, socket or device given as the trace is refused, not waited on.
        text = read_regular_bytes(
            path, what="train.faults.dropout.trace: file", advice="give the trace as a regular CSV file"
        ).decode()
    except FileNotFoundError:
        raise ConfigError(f"train.faults.dropout.trace: file {name!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError(f"train.faults.dropout.trace: cannot read {name!r}: {reason}") from None
    rows = list(csv.reader(text.splitlines()))
    if not rows or tuple(cell.strip() for cell in rows[0]) != TRACE_HEADER:
        raise DataError(f"{name} line 1: expected the header 'round,clients'")
    available: dict[int, frozenset[int]] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != 2:
            raise DataError(f"{name} line {line}: expected 'round,clients' (2 fields), got {len(row)}")
        try:
            round_number = int(row[0])
            clients = [int(client) for client in row[1].split()]
        except ValueError:
            raise DataError(
                f"{name} line {line}: expected a round number and space-separated client ids, got {','.join(row)!r}"
            ) from None
        if round_number < 1:
            raise DataError(f"{name} line {line}: round {round_number} is not a round (rounds start at 1)")
        if round_number - 1 in available:
            raise DataError(f"{name} line {line}: round {round_number} is listed twice")
        outside = [client for client in clients if not 0 <= client < num_clients]
        if outside:
            raise DataError(
                f"{name} line {line}: client {outside[0]} is out of range; the run has {num_clients} "
                f"clients (ids 0-{num_clients - 1})"
            )
        available[round_number - 1] = frozenset(clients)
    missing = [index + 1 for index in range(rounds) if index not in available]
    if missing:
        raise DataError(
            f"{name}: no line for round {missing[0]} (the run has {rounds} rounds); add one line per round"
        )
    return available


# ------------------------------------------------------------------------- decisions


def straggler_factors(config: StragglerConfig, seed: int, num_clients: int) -> np.ndarray:
    """The K clients' speed factors (1 = on time), fixed for the run.

    Raises:
        ConfigError: ``factors`` names a client the run does not have.
    """
    factors = np.ones(num_clients, dtype=np.float64)
    if config.factors:
        outside = [client for client in config.factors if client >= num_clients]
        if outside:
            raise ConfigError(
                f"train.faults.stragglers.factors: client {outside[0]} is out of range; the run has "
                f"{num_clients} clients (ids 0-{num_clients - 1})"
            )
        for client, factor in config.factors.items():
            factors[client] = factor
    elif config.fraction > 0 and config.factor > 1:
        count = int(round(config.fraction * num_clients))
        rng = np.random.default_rng([seed, STRAGGLER_STREAM])
        factors[rng.choice(num_clients, size=count, replace=False)] = config.factor
    return factors


def dropout_draws(probability: float, seed: int, round_index: int, num_clients: int) -> np.ndarray:
    """Which of the K clients would drop out of round ``round_index`` if sampled
    (a boolean per client id)."""
    if probability <= 0:
        return np.zeros(num_clients, dtype=bool)
    rng = np.random.default_rng([seed, round_index, DROPOUT_STREAM])
    return rng.random(num_clients) < probability


def corruption_draws(probability: float, seed: int, round_index: int, num_clients: int) -> np.ndarray:
    """Whether the update of a chain that ends at each of the K clients is corrupted in
    round ``round_index`` (a boolean per client id)."""
    if probability <= 0:
        return np.zeros(num_clients, dtype=bool)
    rng = np.random.default_rng([seed, round_index, CORRUPTION_STREAM])
    return rng.random(num_clients) < probability


def corrupt(update: ClientUpdate, global_vector: Tensor, config: CorruptionConfig) -> ClientUpdate:
    """``update`` corrupted as ``config.kind`` says (a new update; ``update`` is unchanged)."""
    vector = update.vector
    if config.kind == "nan":
        corrupted = torch.full_like(vector, float("nan"))
    elif config.kind == "shape":
        corrupted = vector[:-1].clone()
    else:
        assert config.factor is not None  # checked by CorruptionConfig
        base = global_vector.to(device=vector.device, dtype=vector.dtype)
        corrupted = base + config.factor * (vector - base)
    return dataclasses.replace(update, vector=corrupted)


# ---------------------------------------------------------------------------- per run


@dataclass(frozen=True)
class RoundDropout:
    """The clients dropped from one round's plan, and why (for the round's record)."""

    unavailable: tuple[int, ...] = ()
    """Clients the trace lists as unavailable (never candidates for sampling)."""
    dropped: tuple[int, ...] = ()
    """Sampled clients that dropped out (``probability``)."""
    trace: str | None = None
    probability: float = 0.0

    @property
    def count(self) -> int:
        return len(self.unavailable) + len(self.dropped)

    def entries(self, round_number: int) -> list[dict[str, Any]]:
        """``[{clients, reason}]`` for the record's ``dropped`` list."""
        entries = []
        if self.unavailable:
            entries.append(
                {"clients": list(self.unavailable), "reason": f"dropout: unavailable in round {round_number} of {self.trace}"}
            )
        if self.dropped:
            entries.append(
                {
                    "clients": list(self.dropped),
                    "reason": f"dropout: did not take part (train.faults.dropout.probability={self.probability})",
                }
            )
        return entries


@dataclass(frozen=True, eq=False)
class Faults:
    """A run's fault injection: its config, with the trace read and the stragglers drawn.

    Build it with :meth:`for_run`; every method is a pure function of its arguments and
    of ``(seed, round_index)``.
    """

    config: FaultsConfig
    seed: int
    num_clients: int
    speed_factors: np.ndarray
    """Each client's speed factor (1 = on time)."""
    available: Mapping[int, frozenset[int]] | None = None
    """The trace's available clients by 0-based round index (None: no trace)."""
    deadline: float | None = None
    """Modelled seconds after which a chain with a straggler times out (None: never)."""
    deadline_source: str = "train.faults.stragglers.deadline_seconds"
    """The setting ``deadline`` comes from, for messages."""

    @classmethod
    def for_run(cls, train_config: Any, num_clients: int) -> "Faults":
        """The faults of a run of ``train_config`` over ``num_clients`` clients.

        Raises:
            ConfigError: the trace file is missing, or a straggler id is out of range.
            DataError: the trace file is malformed or does not fit the run.
        """
        config: FaultsConfig = train_config.faults
        available = None
        if config.dropout.trace is not None:
            available = read_trace(config.dropout.trace, num_clients, train_config.rounds)
        factors = straggler_factors(config.stragglers, train_config.seed, num_clients)
        deadline, source = config.stragglers.deadline_seconds, "train.faults.stragglers.deadline_seconds"
        if deadline is None:
            deadline, source = train_config.failures.client_timeout_seconds, "train.failures.client_timeout_seconds"
        return cls(config, train_config.seed, num_clients, factors, available, deadline, source)

    @functools.cached_property
    def has_stragglers(self) -> bool:
        # Asked several times a round; the factors are fixed for the run (a K-long scan).
        return bool((self.speed_factors > 1).any())

    def candidates(self, clients: np.ndarray, round_index: int) -> np.ndarray:
        """The sorted ``clients`` the trace lists as available in round ``round_index``."""
        clients = np.asarray(clients, dtype=np.int64)
        if self.available is None:
            return clients
        listed = self.available[round_index]
        return np.asarray([client for client in clients if int(client) in listed], dtype=np.int64)

    def drop_out(
        self, sampled: np.ndarray, unavailable: Sequence[int], round_index: int
    ) -> tuple[np.ndarray, RoundDropout]:
        """The ``sampled`` clients that take part in round ``round_index``, and the round's
        dropout record (``unavailable``: the clients the trace left out of sampling)."""
        dropout = self.config.dropout
        draws = dropout_draws(dropout.probability, self.seed, round_index, self.num_clients)
        sampled = np.asarray(sampled, dtype=np.int64)
        keep = np.asarray([not draws[client] for client in sampled], dtype=bool)
        record = RoundDropout(
            unavailable=tuple(int(client) for client in unavailable),
            dropped=tuple(int(client) for client in sampled[~keep]),
            trace=dropout.trace,
            probability=dropout.probability,
        )
        return sampled[keep], record

    def corrupted(self, round_index: int) -> np.ndarray:
        """Per client id: whether a chain ending at that client has its update corrupted."""
        return corruption_draws(self.config.corruption.probability, self.seed, round_index, self.num_clients)

    def stragglers_in(self, chains: Sequence[Sequence[int]]) -> int:
        """How many members of ``chains`` straggle."""
        return sum(int(self.speed_factors[client] > 1) for chain in chains for client in chain)

    @property
    def straggler_deadline(self) -> float | None:
        """The modelled deadline of chains with a straggler (None: none, or no stragglers)."""
        return self.deadline if self.has_stragglers else None

    def straggler_timeout(self, chain: Sequence[int], seconds: float) -> str | None:
        """Why a chain with a straggler is dropped as a timeout (its modelled ``seconds``
        over the deadline), or None when it is not."""
        deadline = self.straggler_deadline
        if deadline is None or seconds <= deadline or not any(self.speed_factors[client] > 1 for client in chain):
            return None
        return f"straggler: modelled {_seconds(seconds)} s over {self.deadline_source}={deadline}"


def _seconds(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)
