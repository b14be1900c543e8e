"""The FedML path screens what a worker or a silo sends, as the round core screens every
runtime's updates (tests/test_screening.py): a hostile reply fails its client with the
reason, and the run goes on.

Both of FedML's server sides run in process here, without FedML: fedplug's own
coordinator (:class:`~fedplug.adapters.fedml.coordinator.Coordinator`, which imports no
FedML) with real workers, and the drop-in aggregator
(:class:`~fedplug.adapters.fedml.drop_in.FedplugAggregator`), whose only FedML import is
the ``ServerAggregator`` base class: where FedML is not installed (the main environment;
``make test-fedml`` has it), a stand-in base class that keeps ``model`` and ``args`` is
put in its place, which is all the drop-in uses of it.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import types
from collections import OrderedDict
from typing import Any

import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.fedml.coordinator import Coordinator
from fedplug.adapters.fedml.protocol import plan_rounds
from fedplug.adapters.fedml.worker import Worker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.plugins import default_registry
from fedplug.run.model import build_model


def experiment(**train: Any) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["train"].update({"client_fraction": 1.0, "failures": {"max_failed_fraction": 1.0}, **train})
    return validate_experiment(document)


def coordinator_and_workers(config: Any, workers: int = 2) -> tuple[Coordinator, list[Worker]]:
    registry = default_registry()
    federation = build_federation(config.data, registry)
    schedule = plan_rounds(config.train, registry, federation.class_counts)
    coordinator = Coordinator(config.train, federation, registry, schedule, workers)
    trainers = [
        Worker(config.train, federation, registry, build_model(config.train, registry, federation, federation.device), slot, workers)
        for slot in range(workers)
    ]
    return coordinator, trainers


def step_replies(coordinator: Coordinator, workers: list[Worker]) -> list[dict[str, Any]]:
    replies = []
    for slot, worker in enumerate(workers):
        worker.receive(coordinator.message[slot])
        replies.append(worker.train(coordinator.step))
    return replies


def tamper(replies: list[dict[str, Any]], client: int, **fields: Any) -> None:
    for message in replies:
        for index, result in enumerate(message["results"]):
            if result.client_id == client:
                for name, value in fields.items():
                    setattr(result, name, value)


HOSTILE = [
    ({"num_samples": math.inf}, "sent num_samples = inf, expected a non-negative integer"),
    ({"num_samples": 10**12}, "sent num_samples = 1000000000000, over the cap of 1000000000 (train.screening)"),
    ({"num_samples": 10**6}, "num-examples but its class counts sum to"),
    ({"num_samples": -1}, "sent num_samples = -1, expected a non-negative integer"),
    ({"num_steps": math.nan}, "sent num_steps = nan, expected a non-negative integer"),
    ({"seconds": math.inf}, "sent seconds = inf, expected a finite number"),
    ({"vector": "weights"}, "sent its model as str, expected a tensor"),
    ({"extras": {"junk": "text"}}, "sent extras that are not a mapping of names to tensors"),
    ({"extras": {"junk": torch.zeros(3, dtype=torch.complex64)}}, "of dtype complex64, expected a real float or integer dtype"),
    ({"metrics": {"train_loss": math.nan}}, "sent metric 'train_loss' = nan, expected a finite number"),
]


@pytest.mark.parametrize(("fields", "reason"), HOSTILE)
def test_a_hostile_worker_result_fails_its_client_and_the_round_goes_on(fields: dict[str, Any], reason: str) -> None:
    # Prepare: one round; client 3's result tampered with.
    config = experiment(rounds=1)
    coordinator, workers = coordinator_and_workers(config)
    replies = step_replies(coordinator, workers)
    tamper(replies, 3, **fields)
    # Execute
    coordinator.handle_replies(replies)
    # Assert: client 3 dropped with its reason; the other five averaged into a finite model.
    (record,) = coordinator.result.history
    assert [entry["clients"] for entry in record.dropped] == [[3]]
    assert reason in record.dropped[0]["reason"]
    assert record.failures == 1 and bool(coordinator.global_vector.isfinite().all())


def test_a_worker_reply_that_is_not_a_step_reply_fails_that_workers_clients() -> None:
    config = experiment(rounds=1)
    coordinator, workers = coordinator_and_workers(config)
    replies = step_replies(coordinator, workers)
    replies[1] = "garbage"  # type: ignore[call-overload]
    coordinator.handle_replies(replies)
    (record,) = coordinator.result.history
    assert sorted(client for entry in record.dropped for client in entry["clients"]) == [1, 3, 5]
    assert "worker 1 sent a malformed reply (str, not fedplug's step reply)" in record.dropped[0]["reason"]


def test_fednova_a_of_1e30_from_a_worker_is_dropped_and_round_2_trains() -> None:
    config = experiment(rounds=2, aggregator="fednova")
    coordinator, workers = coordinator_and_workers(config)
    replies = step_replies(coordinator, workers)
    tamper(replies, 0, extras={"a": torch.tensor(1e30)})
    coordinator.handle_replies(replies)
    coordinator.handle_replies(step_replies(coordinator, workers))
    first, second = coordinator.result.history
    assert "sent extras['a'] = 1e+30" in first.dropped[0]["reason"]
    assert second.failures == 0 and math.isfinite(second.accuracy)



# ------------------------------------------------------- fuzzing the worker replies

FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.floats(), max_size=3),
    st.sampled_from(
        [
            torch.zeros(3, dtype=torch.complex64),
            torch.full((2,), math.inf),
            torch.zeros(7, dtype=torch.bool),
            torch.tensor(1e30),
            {"a": "text"},
            {"delta_c": torch.zeros(5)},
        ]
    ),
)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    aggregator=st.sampled_from(["fedavg", "scaffold", "fednova"]),
    client=st.integers(min_value=0, max_value=5),
    fields=st.dictionaries(
        st.sampled_from(["num_samples", "num_steps", "seconds", "vector", "extras", "metrics"]),
        FIELD_VALUES,
        min_size=1,
        max_size=3,
    ),
)
def test_no_worker_result_crashes_the_coordinator_or_the_model(
    aggregator: str, client: int, fields: dict[str, Any]
) -> None:
    # Prepare: one round on two workers; one client's result mutated at random.
    coordinator, workers = coordinator_and_workers(experiment(rounds=1, aggregator=aggregator))
    replies = step_replies(coordinator, workers)
    tamper(replies, client, **fields)
    # Execute: the coordinator takes the replies (it must not raise).
    coordinator.handle_replies(replies)
    # Assert: the round is recorded, at most the mutated client is dropped, the model is finite.
    (record,) = coordinator.result.history
    assert {c for entry in record.dropped for c in entry["clients"]} <= {client}
    assert bool(coordinator.global_vector.isfinite().all())


# ------------------------------------------------------------------ the drop-in


@pytest.fixture
def drop_in(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """:mod:`fedplug.adapters.fedml.drop_in`, over a stand-in for FedML's
    ``ServerAggregator`` where FedML is not installed."""
    try:
        import fedml.core  # noqa: F401
    except ImportError:
        core = types.ModuleType("fedml.core")

        class ServerAggregator:  # what the drop-in uses of FedML's base class
            def __init__(self, model: nn.Module, args: Any) -> None:
                self.model, self.args, self.id = model, args, 0

        core.ServerAggregator = ServerAggregator  # type: ignore[attr-defined]
        package = types.ModuleType("fedml")
        package.core = core  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "fedml", package)
        monkeypatch.setitem(sys.modules, "fedml.core", core)
        monkeypatch.delitem(sys.modules, "fedplug.adapters.fedml.drop_in", raising=False)
    module = importlib.import_module("fedplug.adapters.fedml.drop_in")
    yield module
    sys.modules.pop("fedplug.adapters.fedml.drop_in", None)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2))


def test_the_drop_in_survives_a_round_that_everyone_dropped_out_of(drop_in: types.ModuleType) -> None:
    # Prepare: dropout 0.9 empties rounds (comm_round raised "max() arg is an empty sequence").
    train = {"rounds": 6, "client_fraction": 1.0, "faults": {"dropout": {"probability": 0.9}}}
    model = small_model()
    aggregator = drop_in.FedplugAggregator(model, None, train, num_clients=4)
    plans = aggregator.plans
    assert any(not plan.chains for plan in plans)
    # Execute: every FedML round, every silo replying its own copy of the model.
    assert aggregator.comm_round == 6
    for _ in range(aggregator.comm_round):
        aggregator.aggregate([(10, OrderedDict(model.state_dict())) for _ in range(4)])
    # Assert
    assert len(aggregator.history) == 6


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ((math.inf, None), "sent a sample count = inf, expected a non-negative integer"),
        (("ten", None), "sent a sample count = 'ten' of type str, expected a non-negative integer"),
        ((10**12, None), "sent a sample count = 1000000000000, over the cap of 1000000000"),
        ((10, "weights"), "its reply is not the model's state dict but str"),
        ((10, {"0.weight": "x"}), "its state dict holds str at '0.weight', expected tensors"),
        ((10, "complex"), "of dtype complex64, expected a real float or integer dtype"),
        ((10, "huge"), "sent an update of norm"),
        ("not a pair", "its reply is not FedML's (sample count, state dict) but str"),
    ],
)
def test_a_hostile_silo_reply_is_dropped_by_the_drop_in(drop_in: types.ModuleType, reply: Any, reason: str) -> None:
    # Prepare: silo 1's reply replaced by a hostile one.
    model = small_model()
    aggregator = drop_in.FedplugAggregator(model, None, {"rounds": 1, "client_fraction": 1.0}, num_clients=3)
    honest = OrderedDict((key, value.clone()) for key, value in model.state_dict().items())
    if isinstance(reply, tuple) and reply[1] is None:
        reply = (reply[0], honest)
    elif isinstance(reply, tuple) and reply[1] == "complex":
        reply = (10, OrderedDict((key, value.to(torch.complex64)) for key, value in honest.items()))
    elif isinstance(reply, tuple) and reply[1] == "huge":
        reply = (10, OrderedDict((key, value * 1e30) for key, value in honest.items()))
    # Execute
    aggregator.aggregate([(10, honest), reply, (10, honest)])
    # Assert: silo 1 dropped with its reason; the model is the honest one.
    (record,) = aggregator.history
    assert [entry["clients"] for entry in record.dropped] == [[1]]
    assert reason in record.dropped[0]["reason"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, honest[key])
