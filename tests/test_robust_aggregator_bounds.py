"""Robust aggregators that say when they do nothing (issue 44, finding 9).

Flower's robust strategies discard nothing below a number of updates a round that their
parameters set (Flower 1.41's code): FedTrimmedAvg cuts ``int(beta * n)`` per tail,
FedMedian of 2 is their mean, Krum and MultiKrum need ``n >= 2f + 3``, MultiKrum with
``num_nodes_to_select >= n`` keeps everything, Bulyan with ``f = 0`` averages everything.
The ``flower`` aggregator warns once per run and round size when a round is below its
bound, and ``fedplug list`` states the bounds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from fedplug.algorithms.flower_strategies import FlowerStrategyAggregator, FlowerStrategyConfig
from fedplug.cli import main
from fedplug.components import ClientUpdate

GLOBAL = torch.zeros(2)


@pytest.fixture
def warnings_logged() -> Iterable[list[str]]:
    """Every warning fedplug logs."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("fedplug")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def aggregator(**config: Any) -> FlowerStrategyAggregator:
    built = FlowerStrategyAggregator(FlowerStrategyConfig(name="flower", **config), num_clients=10)
    built.initialize(GLOBAL)
    return built


def updates(vectors: list[list[float]]) -> list[ClientUpdate]:
    return [
        ClientUpdate(client_id=k, vector=torch.tensor(vector), weight=10.0, num_steps=1)
        for k, vector in enumerate(vectors)
    ]


HONEST_AND_BOOSTED = [[1.0, 2.0], [3.0, 4.0], [1000.0, 1000.0]]
"""Two honest updates and one x1000 update."""


def test_trimmed_avg_with_3_clients_warns_at_beta_02_and_trims_at_beta_04(
    warnings_logged: list[str],
) -> None:
    # Prepare: with 3 updates, Flower trims int(0.2 * 3) = 0 from each end at beta 0.2,
    # int(0.4 * 3) = 1 at beta 0.4.
    inert = aggregator(strategy="FedTrimmedAvg", beta=0.2)
    trimming = aggregator(strategy="FedTrimmedAvg", beta=0.4)
    # Execute
    plain = inert.aggregate(GLOBAL, updates(HONEST_AND_BOOSTED))
    warned_at_02 = list(warnings_logged)
    trimmed = trimming.aggregate(GLOBAL, updates(HONEST_AND_BOOSTED))
    # Assert: at beta 0.2 the x1000 update went through (the plain mean, by hand), with one
    # warning giving the bound and the fix; at beta 0.4 each coordinate's middle value
    # (3 and 4), without a warning.
    expected = torch.tensor([(1.0 + 3.0 + 1000.0) / 3, (2.0 + 4.0 + 1000.0) / 3])
    torch.testing.assert_close(plain, expected)
    assert warned_at_02 == [
        "train.aggregator: FedTrimmedAvg with beta=0.2 trims int(0.2*3)=0 updates from each end "
        "of a round of 3: it is the plain (unweighted) mean here; use beta >= 1/3 or at least "
        "5 clients a round"
    ]
    torch.testing.assert_close(trimmed, torch.tensor([3.0, 4.0]))
    assert warnings_logged == warned_at_02


def test_krum_warns_below_2f_plus_3_updates_once_per_round_size(warnings_logged: list[str]) -> None:
    # Prepare: Krum tolerating f = 1 needs n >= 2f + 3 = 5 updates a round.
    krum = aggregator(strategy="Krum", num_malicious_nodes=1)
    four = updates([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [9.0, 9.0]])
    five = updates([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [0.1, 0.1], [9.0, 9.0]])
    # Execute: two rounds of 4, then one of 5.
    for round_updates in (four, four, five):
        krum.aggregate(GLOBAL, round_updates)
    # Assert: one warning, for the round size 4, naming the bound.
    assert warnings_logged == [
        "train.aggregator: Krum with num_malicious_nodes=1 needs n >= 2f+3 = 5 updates a round "
        "(it scores each by its n-f-2 closest), and this round has 4: it picks without its "
        "guarantee; sample at least 5 clients a round or lower num_malicious_nodes"
    ]


@pytest.mark.parametrize(
    ("config", "vectors", "expected"),
    [
        (
            {"strategy": "FedMedian"},
            [[1.0, 2.0], [1000.0, 1000.0]],
            "FedMedian of a round of 2 is the mean of its 2 update(s)",
        ),
        (
            {"strategy": "MultiKrum", "num_malicious_nodes": 0, "num_nodes_to_select": 3},
            HONEST_AND_BOOSTED,
            "MultiKrum with num_nodes_to_select=3 keeps all 3 updates of a round of 3: it is "
            "FedAvg here; use num_nodes_to_select <= 2",
        ),
        (
            {"strategy": "Bulyan", "num_malicious_nodes": 0},
            HONEST_AND_BOOSTED,
            "Bulyan with num_malicious_nodes=0 selects all 3 updates of a round of 3 and averages "
            "them all",
        ),
    ],
    ids=["FedMedian", "MultiKrum", "Bulyan"],
)
def test_every_robust_strategy_warns_when_it_keeps_every_update(
    warnings_logged: list[str], config: dict[str, Any], vectors: list[list[float]], expected: str
) -> None:
    # Prepare / Execute
    result = aggregator(**config).aggregate(GLOBAL, updates(vectors))
    # Assert: every update entered the model (here: the plain mean), and the warning says so.
    torch.testing.assert_close(result, torch.tensor(vectors).mean(dim=0))
    assert len(warnings_logged) == 1 and expected in warnings_logged[0], warnings_logged


def test_fedplug_list_states_each_robust_strategys_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Execute
    assert main(["list", "aggregators"]) == 0
    # Assert: the flower aggregator's entry names each bound (words rewrapped to one line).
    listing = " ".join(capsys.readouterr().out.split())
    flower = listing[listing.index("flower [") :]
    for bound in (
        "FedMedian n >= 3",
        "FedTrimmedAvg int(beta * n) >= 1",
        "Krum and MultiKrum n >= 2f + 3",
        "Bulyan n >= 4f + 3 with f >= 1",
        "beta 0.2 needs 5 clients a round",
    ):
        assert bound in flower, bound
