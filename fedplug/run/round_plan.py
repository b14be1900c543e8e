"""A round's plan: which clients train, in which chains, and how their updates weigh.

Every runtime plans a round with :func:`plan_round` (through
:meth:`fedplug.run.federated_round.RoundCore.plan`), so the same seed gives the same
clients and chains everywhere; a chain's update is built by :func:`chain_update`, the
plan's weight rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from torch import Tensor

from fedplug.components import ClientUpdate, Grouper, RoundPlan
from fedplug.faults import Faults, RoundDropout

SAMPLING_STREAM = 0xC11E
"""Tag of the generator that samples a round's clients: ``[seed, round_index, tag]``."""
GROUPER_STREAM = 0x6E0
"""Tag of the generator handed to :meth:`fedplug.components.Grouper.plan`."""


# ----------------------------------------------------------------------- sampling


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many of ``num_clients`` a round samples at ``client_fraction`` = ``fraction``
    (at least one)."""
    return max(1, int(round(fraction * num_clients)))


def sample_clients(candidates: np.ndarray | int, count: int, seed: int, round_index: int) -> np.ndarray:
    """``count`` of the sorted ``candidates`` (client ids; an int K stands for all of
    0 .. K-1, without building that array), drawn with the round's sampling stream, in
    ascending order. numpy draws a few from many without replacement in O(count)."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, round_index, SAMPLING_STREAM])
    every = isinstance(candidates, (int, np.integer))
    picked = np.sort(rng.choice(int(candidates) if every else len(candidates), size=count, replace=False))
    return picked.astype(np.int64, copy=False) if every else np.asarray(candidates, dtype=np.int64)[picked]


def sample_round(
    train_config: Any,
    faults: Faults,
    num_clients: int,
    round_index: int,
    candidates: np.ndarray | None = None,
    count: int | None = None,
) -> tuple[np.ndarray, RoundDropout]:
    """The sorted clients that take part in round ``round_index`` (before grouping), and
    who dropped out.

    :func:`sample_clients` draws ``count`` clients (default :func:`clients_per_round` of
    ``client_fraction``) from ``candidates`` (default all K; Flower: the connected nodes'
    clients) less those the dropout trace lists as unavailable (all of them when fewer are
    left); then the sampled clients that ``train.faults.dropout`` drops are removed.
    """
    if count is None:
        count = clients_per_round(num_clients, train_config.client_fraction)
    if candidates is None and faults.available is None:  # all K clients, without an array of K ids
        sampled = sample_clients(num_clients, min(count, num_clients), train_config.seed, round_index)
        return faults.drop_out(sampled, (), round_index)
    pool = np.arange(num_clients, dtype=np.int64) if candidates is None else np.asarray(candidates, dtype=np.int64)
    available = faults.candidates(pool, round_index)
    sampled = sample_clients(available, min(count, len(available)), train_config.seed, round_index)
    unavailable = np.setdiff1d(pool, available) if len(available) < len(pool) else ()
    return faults.drop_out(sampled, unavailable, round_index)


# ----------------------------------------------------------------------- planning


def group(train_config: Any, grouper: Grouper, clients: np.ndarray, round_index: int) -> RoundPlan:
    """The grouper's chains of this round's sampled ``clients``, with the grouper stream."""
    rng = np.random.default_rng([train_config.seed, round_index, GROUPER_STREAM])
    return grouper.plan(round_index + 1, clients, rng)


def plan_round(
    train_config: Any,
    grouper: Grouper,
    num_clients: int,
    round_index: int,
    faults: Faults | None = None,
    *,
    candidates: np.ndarray | None = None,
    count: int | None = None,
) -> tuple[RoundPlan, RoundDropout]:
    """Round ``round_index``'s (0-based) plan, and who dropped out of it and why:
    :func:`sample_round`'s clients (``candidates``, ``count``: see there) in the grouper's
    chains. ``faults``: the run's ``train.faults`` (default built from ``train_config``).
    A round that nobody is left to train has no chains.
    """
    if faults is None:
        faults = Faults.for_run(train_config, num_clients)
    taking_part, dropout = sample_round(train_config, faults, num_clients, round_index, candidates, count)
    if len(taking_part) == 0:
        return RoundPlan(chains=[]), dropout
    return group(train_config, grouper, taking_part, round_index), dropout


def participants(plan: RoundPlan) -> list[int]:
    """Every client that trains in ``plan``, chain by chain."""
    return [client for chain in plan.chains for client in chain]


def chain_members(plan: RoundPlan) -> list[list[int]] | None:
    """Each chain's members of ``plan`` as ints, for the round's record; None when every
    chain is one client (:func:`participants` then names them all)."""
    if all(len(chain) <= 1 for chain in plan.chains):
        return None
    return [[int(client) for client in chain] for chain in plan.chains]


def round_steps(plan: RoundPlan) -> int:
    """The steps a round of ``plan`` takes on a runtime that trains one member of every
    chain per step (FedML: one FedML round per step): its longest chain, and one for a
    round that nobody is left to train (every sampled client dropped out,
    ``train.faults.dropout``), which still happens and keeps the global model."""
    return max((len(chain) for chain in plan.chains), default=1)


# ----------------------------------------------------------------------- weight rule


def chain_update(
    chain: Iterable[int],
    vector: Tensor,
    samples: int,
    steps: int,
    extras: dict[str, Tensor],
    plan: RoundPlan,
    seconds: float,
    metrics: dict[str, float] | None = None,
) -> ClientUpdate:
    """The update a chain sends the aggregator: its last member's model, weighted by the
    samples the chain trained on (or 1 when ``plan.weighting`` is ``"uniform"``), with its
    last member's reply ``metrics`` (those the components ask for; default none)."""
    members = list(chain)
    return ClientUpdate(
        client_id=members[-1],
        vector=vector,
        weight=float(samples) if plan.weighting == "samples" else 1.0,
        num_steps=steps,
        extras=extras,
        chain=members,
        seconds=seconds,
        metrics=dict(metrics) if metrics else {},
        num_examples=samples,
    )
