"""A sign-flipping client on the simulator, for tests/test_sign_flip_attack.py and
benchmarks/bench_sign_flip.py (issue 44, finding 9's measured table).

The attacker trains like every other client, then sends ``w - boost * (w_k - w)``
instead of its trained model ``w_k`` (``w``: the round's global model): its honest step
reversed and made ``boost`` times longer, with its honest sample count. The update is
rewritten where it leaves the simulator's engine, before the round core sees it, so
``train.screening``, the round's record and the aggregator meet exactly what a hostile
client would send; nothing on the server side is changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.simulation.simulator import Simulator

ROBUST_AGGREGATORS: dict[str, dict[str, Any]] = {
    "FedMedian": {"name": "flower", "strategy": "FedMedian"},
    "Krum": {"name": "flower", "strategy": "Krum", "num_malicious_nodes": 1},
    "FedTrimmedAvg": {"name": "flower", "strategy": "FedTrimmedAvg", "beta": 0.2},
}
"""Flower's robust strategies as ``train.aggregator`` sections, by strategy name."""
FEDAVG: dict[str, Any] = {"name": "fedavg"}
"""fedplug's FedAvg (the default aggregator), for tables that name it."""


def sign_flipped(update: ClientUpdate, global_vector: Tensor, boost: float) -> ClientUpdate:
    """``update`` with its model replaced by ``w - boost * (w_k - w)`` (a new update)."""
    flipped = global_vector - boost * (update.vector - global_vector)
    return dataclasses.replace(update, vector=flipped)


@dataclasses.dataclass
class SignFlippingEngine:
    """A simulator engine whose ``attacker`` sends sign-flipped updates (every other
    outcome passes through unchanged)."""

    engine: Any
    """The simulator's own engine, which trains every client."""
    attacker: int
    """The client id that flips its update."""
    boost: float
    """How many times its honest step the reversed step is (1: a plain sign flip)."""
    flipped: int = 0
    """How many updates it has flipped so far."""

    @property
    def name(self) -> str:
        return str(self.engine.name)

    def derived_params(self) -> dict[str, Any]:
        return dict(self.engine.derived_params())

    def close(self) -> None:
        self.engine.close()

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: Any
    ) -> Iterator[Any]:
        for outcome in self.engine.run_round(start_vector, plan, round_index, context):
            if isinstance(outcome, ClientUpdate) and outcome.client_id == self.attacker:
                outcome = sign_flipped(outcome, start_vector, self.boost)
                self.flipped += 1
            yield outcome


def attack(simulator: Simulator, attacker: int, boost: float) -> SignFlippingEngine:
    """Make client ``attacker`` of a prepared ``simulator`` send sign-flipped updates;
    return the engine that does it (its ``flipped`` counts the updates it flipped)."""
    engine = SignFlippingEngine(simulator.engine, attacker, boost)
    simulator.engine = engine
    return engine
