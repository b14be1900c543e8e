"""Property-based fuzzing of the round core's screening (hypothesis).

Whatever one client's update holds, in any field (infinities, NaN, absurd or negative
counts, complex, integer, bool or numpy values where tensors belong, wrong shapes, huge
extras, junk metrics, ids outside the federation), the round core
(:meth:`fedplug.run.federated_round.RoundCore.run`, which every runtime hands its updates to)
never raises with real aggregators (FedAvg, FedAvgM, FedAdam, SCAFFOLD, FedNova and
Flower's FedMedian through the ``flower`` aggregator), and the global model stays finite;
then a second round trains from it. The simulator, with ``train.faults.corruption`` at
extreme scales, finishes with a finite model. The FedML path's own decoding is covered by
tests/test_screening_fedml.py; Flower's message decoding by the Flower adapter's tests.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.config import validate_experiment
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.components import Components
from fedplug.run.federated_round import RoundCore

P = 6
K = 4
GLOBAL = torch.linspace(-0.5, 0.5, P)

AGGREGATORS: dict[str, Any] = {
    "fedavg": "fedavg",
    "fedavgm": {"name": "fedavgm", "momentum": 0.9},
    "fedadam": "fedadam",
    "scaffold": "scaffold",
    "fednova": "fednova",
}
try:  # Flower's strategies, where Flower is installed (the main environment)
    import flwr  # noqa: F401

    AGGREGATORS["flower-fedmedian"] = {"name": "flower", "strategy": "FedMedian"}
except ImportError:
    pass


@functools.cache
def train_config(aggregator: str, corrupting: bool = False) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["data"]["num_clients"] = K
    document["train"].update(aggregator=AGGREGATORS[aggregator], failures={"max_failed_fraction": 1.0})
    if corrupting:  # the round core's fault injection meets the hostile updates first
        document["train"]["faults"] = {"corruption": {"probability": 0.5, "kind": "scale", "factor": -1e30}}
    return validate_experiment(document).train


def core_for(aggregator: str, corrupting: bool = False) -> RoundCore:
    config = train_config(aggregator, corrupting)
    registry = default_registry()
    core = RoundCore(
        config,
        components=Components.build(config, registry, K),
        num_clients=K,
        class_counts=np.full((K, 2), 50),
        client_sizes=None,
        model_bytes=P * 4,
    )
    core.aggregator.initialize(GLOBAL)
    return core


def honest(client: int, aggregator: str, global_vector: Tensor) -> ClientUpdate:
    """A plausible reply: a small step from the global model, with the extras the
    aggregator's client side sends."""
    step = torch.sin(torch.arange(P, dtype=torch.float32) + client) * 0.1
    extras: dict[str, Tensor] = {}
    if aggregator == "scaffold":
        extras = {"delta_c": step * 2}
    elif aggregator == "fednova":
        extras = {"a": torch.tensor(5.0)}
    return ClientUpdate(
        client_id=client, vector=global_vector + step, weight=40.0 + client, num_steps=5, extras=extras,
        chain=[client], seconds=0.01, num_examples=40 + client,
    )


# -------------------------------------------------------------------- mutations

HUGE = [1e30, -1e30, 1e300, 3e38, -3e38, 10**12, 10**30, 2**63, -(2**63)]
SPECIAL = [math.inf, -math.inf, math.nan, -1, -1e-30, 0, 0.5, 1e-45]
WEIRD = ["7", b"7", None, True, 1j, [1.0], {"a": 1}, np.float64(math.nan), np.int64(-3), np.array([1.0, 2.0])]

numbers = st.sampled_from(HUGE + SPECIAL + WEIRD) | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70)


def tensors(shape_of_model: tuple[int, ...]) -> st.SearchStrategy[Any]:
    """Tensors (and things that are not tensors) a hostile client might send."""
    shapes = st.sampled_from([shape_of_model, (), (1,), (2,), (P + 1,), (P - 1,), (2, P), (0,)])
    fills = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 3e38, 0.0, 1.0, -1e4, 1e-30])
    dtypes = st.sampled_from(
        [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int8, torch.bool, torch.uint8]
    )
    filled = st.builds(lambda shape, fill, dtype: _full(shape, fill, dtype), shapes, fills, dtypes)
    odd = st.sampled_from(
        [
            np.zeros(P, dtype=np.float32),
            np.array(["a"] * P),
            "weights",
            None,
            [0.0] * P,
            torch.zeros(1).expand(50_000_000),  # 200 MB, allocated as 4 bytes
            torch.zeros(P).to_sparse(),
        ]
    )
    return filled | odd


def _full(shape: tuple[int, ...], fill: float, dtype: torch.dtype) -> Tensor:
    if dtype in (torch.int64, torch.int8, torch.uint8, torch.bool):
        fill = 0 if not math.isfinite(fill) else max(min(fill, 100), 0)
    return torch.full(shape, fill).to(dtype)


MUTATIONS = st.one_of(
    st.tuples(st.just("vector"), tensors((P,))),
    st.tuples(st.just("weight"), numbers),
    st.tuples(st.just("num_steps"), numbers),
    st.tuples(st.just("num_examples"), numbers),
    st.tuples(st.just("seconds"), numbers),
    st.tuples(st.just("client_id"), numbers),
    st.tuples(st.just("chain"), st.sampled_from([[0, 99], [-1], [K], [None], ["x"], [2**70]])),
    st.tuples(st.just("extras"), st.dictionaries(st.sampled_from(["delta_c", "a", "junk", 7]), tensors((P,)), max_size=2)),
    st.tuples(st.just("extras"), st.sampled_from([None, "x", [1, 2]])),
    st.tuples(st.just("metrics"), st.dictionaries(st.sampled_from(["train_loss", "accuracy"]), numbers, max_size=2)),
    st.tuples(st.just("scale"), st.sampled_from([1e6, -1e6, 1e30, 1e38, -1.0, 1e-30])),
)


def mutate(update: ClientUpdate, field: str, value: Any, global_vector: Tensor) -> ClientUpdate:
    mutated = copy.copy(update)
    if field == "scale":  # the update's change scaled (a boosted model), if it is still a model
        vector = update.vector
        if isinstance(vector, Tensor) and vector.layout == torch.strided and vector.shape == global_vector.shape \
                and vector.is_floating_point():
            mutated.vector = global_vector + value * (vector - global_vector)
    else:
        setattr(mutated, field, value)
    return mutated


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    aggregator=st.sampled_from(sorted(AGGREGATORS)),
    mutations=st.lists(st.tuples(st.integers(0, K - 1), MUTATIONS), min_size=1, max_size=3),
    corrupting=st.booleans(),
)
def test_no_update_makes_the_server_raise_or_the_model_non_finite(
    aggregator: str, mutations: list[Any], corrupting: bool
) -> None:
    # Prepare: K clients; the drawn mutations applied to some of them (one stays honest),
    # with or without train.faults.corruption.
    core = core_for(aggregator, corrupting)
    updates = [honest(client, aggregator, GLOBAL) for client in range(K)]
    for client, (field, value) in mutations:
        if client != 0:
            updates[client] = mutate(updates[client], field, value, GLOBAL)
    plan = RoundPlan(chains=[[client] for client in range(K)])
    # Execute: the hostile round, then an honest round from its model.
    first = core.run(0, GLOBAL, plan, lambda attempt: list(updates))
    second = core.run(1, first.vector, plan, lambda attempt: [honest(k, aggregator, first.vector) for k in range(K)])
    # Assert
    assert first.vector.shape == GLOBAL.shape and bool(first.vector.isfinite().all())
    assert second.tally.failures == second.tally.corrupted and bool(second.vector.isfinite().all())
    assert first.tally.accepted + first.tally.failures == K


@pytest.mark.parametrize("factor", [1e30, -1e30, 3e38, -3e38, 1e20, 1e10])
def test_the_simulator_keeps_a_finite_model_under_extreme_corruption(factor: float) -> None:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["train"].update(
        rounds=3,
        faults={"corruption": {"probability": 0.4, "kind": "scale", "factor": factor}},
        failures={"max_failed_fraction": 1.0},
    )
    result, _ = run_experiment(validate_experiment(document), None)
    assert len(result.history) == 3 and all(math.isfinite(record.loss) for record in result.history)
    assert sum(record.faults_corrupted for record in result.history) > 0


@pytest.mark.parametrize("aggregator", sorted(AGGREGATORS))
def test_the_honest_round_is_accepted_by_every_fuzzed_aggregator(aggregator: str) -> None:
    # The property above must not hold merely because the screen drops everyone.
    core = core_for(aggregator)
    plan = RoundPlan(chains=[[client] for client in range(K)])
    attempt = core.run(0, GLOBAL, plan, lambda attempt: [honest(k, aggregator, GLOBAL) for k in range(K)])
    assert attempt.tally.failures == 0 and attempt.tally.accepted == K
