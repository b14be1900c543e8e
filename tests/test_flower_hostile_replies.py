"""One hostile Flower node cannot stop the ServerApp (issue 29, finding 2).

Client 1 runs the ready ClientApp, then tampers with its reply the way an attacker (or a
broken ClientApp) could: infinite counts, arrays of another serialisation or dtype,
extras of the wrong shape, absurd evaluation metrics, malformed setup replies. Every
attack runs on the in-process loopback grid under FedAvg, SCAFFOLD, FedNova and Flower's
FedMedian (the ``flower`` aggregator); the server drops that client with a logged reason
and the round goes on with the others (or, before round 1, stops with one line naming
the node). One test repeats attacks under Flower's Ray simulation runtime.
"""

from __future__ import annotations

import copy
import io
import logging
import math
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import LoopbackGrid, run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.loopback import FIRST_NODE_ID
from fedplug.adapters.flower.messages import weighted_metrics
from fedplug.adapters.flower.nodes import (
    handle_evaluate,
    handle_query,
    handle_setup_phase,
    handle_train,
)
from fedplug.adapters.flower.records import (
    ACCURACY,
    CLASS_COUNTS,
    CLIENT_ID,
    CONFIG_KEY,
    EXTRAS_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_EXAMPLES,
    NUM_STEPS,
)
from fedplug.adapters.flower.setup_phase import TENSORS_KEY, VALUES_KEY, run_setup_phase
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from test_flower_strategy import fedavg_of

from fedplug.components import PhaseCost
from fedplug.config import validate_experiment
from fedplug.errors import TrainingError
from fedplug.setup_phase import ClientInputs, SetupPhase, SetupReply, SetupStep

NUM_CLIENTS = 4
HOSTILE = 1
"""The partition (and client) id of the hostile node."""
ROUND_LOGGERS = ("fedplug.round", "flwr.fedplug", "fedplug.adapters.flower")

AGGREGATORS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "scaffold": {"aggregator": {"name": "scaffold"}},
    "fednova": {"aggregator": {"name": "fednova"}},
    "fedmedian": {"aggregator": {"name": "flower", "strategy": "FedMedian"}},
}
EXTRA_OF: dict[str, str | None] = {
    "fedavg": None,
    "scaffold": "delta_c",
    "fednova": "a",
    "fedmedian": None,
}
"""The reply extra each aggregator reads (None: none)."""
READY_APP_COMPONENTS = dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT)
"""What a hand-built ready ClientApp declares, as ``make_client_app`` does: it builds
whatever the server's config names."""

Attack = Callable[[RecordDict], None]


def experiment(train: dict[str, Any]) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update({"rounds": 1, "client_fraction": 1.0, **train})
    return validate_experiment(data)


def force(record: Any, key: str, value: Any) -> None:
    """Store ``value`` under ``key`` even where the record's type check would refuse it (a
    peer that does not use Flower's Python API is not bound by it)."""
    record.__dict__["_data"][key] = value


def hostile_app(
    train_attack: Attack | None = None,
    evaluate_attack: Attack | None = None,
    query_attack: Attack | None = None,
) -> ClientApp:
    """The ready ClientApp on every node; node :data:`HOSTILE` tampers with its replies."""
    app = ClientApp()
    declare(app, READY_APP_COMPONENTS)

    def hostile(handler: Any, attack: Attack | None) -> Any:
        def handle(message: Message, context: Context) -> Message:
            reply = handler(message, context)
            if attack is not None and int(context.node_config["partition-id"]) == HOSTILE:
                attack(reply.content)
            return reply

        return handle

    app.train()(hostile(handle_train, train_attack))
    app.evaluate()(hostile(handle_evaluate, evaluate_attack))
    app.query()(hostile(handle_query, query_attack))
    return app


def set_metric(key: str, value: Any) -> Attack:
    def attack(content: RecordDict) -> None:
        force(content[METRICS_KEY], key, value)

    return attack


def raw_model_array(content: RecordDict) -> None:
    arrays = content[MODEL_KEY]
    name = next(iter(arrays))
    array = arrays[name]
    arrays[name] = Array(dtype=array.dtype, shape=array.shape, stype="torch.raw", data=array.data)


def extras_of(aggregator: str, value: np.ndarray) -> Attack:
    """Replace the extra ``aggregator`` reads (or add SCAFFOLD's where it reads none)."""
    key = EXTRA_OF[aggregator] or "delta_c"

    def attack(content: RecordDict) -> None:
        extras = content.array_records.get(EXTRAS_KEY, ArrayRecord())
        extras[key] = Array(value)
        content[EXTRAS_KEY] = extras

    return attack


def run_attacked(
    train: dict[str, Any], app: ClientApp, caplog: pytest.LogCaptureFixture
) -> tuple[Any, Any, Any]:
    config = experiment(train)
    with caplog.at_level(logging.WARNING):
        result, strategy = run_on_grid(LoopbackGrid(app, NUM_CLIENTS), config)
    return config, result, strategy


TRAIN_ATTACKS: dict[str, tuple[Attack, str]] = {
    "inf-num-examples": (
        set_metric(NUM_EXAMPLES, math.inf),
        "sent malformed metrics: sent 'num-examples' = inf, not an integer",
    ),
    "huge-num-examples": (
        set_metric(NUM_EXAMPLES, 10**12),
        "sent 'num-examples' = 1000000000000, outside [0, 1000000000]",
    ),
    "fractional-num-examples": (
        set_metric(NUM_EXAMPLES, 2.5),
        "sent 'num-examples' = 2.5, not an integer",
    ),
    "inf-num-steps": (
        set_metric(NUM_STEPS, math.inf),
        "sent 'fedplug.num-steps' = inf, not an integer",
    ),
    "inf-client-id": (
        set_metric(CLIENT_ID, math.inf),
        "sent 'fedplug.client-id' = inf, not an integer",
    ),
    "nan-client-id": (
        set_metric(CLIENT_ID, math.nan),
        "sent 'fedplug.client-id' = nan, not an integer",
    ),
    "str-num-examples": (
        set_metric(NUM_EXAMPLES, "12"),
        "sent 'num-examples' as str, not a number",
    ),
    "torch-raw-stype": (raw_model_array, "serialised as 'torch.raw', not 'numpy.ndarray'"),
}


@pytest.mark.parametrize("aggregator", sorted(AGGREGATORS))
@pytest.mark.parametrize("attack", sorted(TRAIN_ATTACKS))
def test_a_malformed_train_reply_drops_that_client(
    aggregator: str, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: client 1 tampers with one field of its train reply.
    tamper, reason = TRAIN_ATTACKS[attack]
    # Execute
    config, result, strategy = run_attacked(
        AGGREGATORS[aggregator], hostile_app(train_attack=tamper), caplog
    )
    # Assert: the round finished without client 1, whose reason is logged.
    record = result.history[0]
    assert (record.participants, record.failures) == (NUM_CLIENTS, 1)
    assert f"dropped client(s) [{HOSTILE}]: client {HOSTILE} " in caplog.text
    assert reason in caplog.text
    assert torch.isfinite(strategy.final_vector).all()
    if aggregator == "fedavg":
        expected = fedavg_of(config, [0, 2, 3])
        torch.testing.assert_close(strategy.final_vector, expected, rtol=0, atol=1e-6)


def test_negative_num_examples_is_named_as_such(caplog: pytest.LogCaptureFixture) -> None:
    _, result, _ = run_attacked({}, hostile_app(train_attack=set_metric(NUM_EXAMPLES, -5)), caplog)
    assert result.history[0].failures == 1
    assert "sent 'num-examples' = -5, outside [0, 1000000000]" in caplog.text
    assert "sent no 'num-examples'" not in caplog.text


EXTRA_DTYPES = {
    "str": np.array(["a", "b"]),
    "datetime": np.array(["2020-01-01", "2021-01-01"], dtype="datetime64[D]"),
    "complex": np.ones(2, dtype=np.complex64),
}


@pytest.mark.parametrize("aggregator", sorted(AGGREGATORS))
@pytest.mark.parametrize("dtype", sorted(EXTRA_DTYPES))
def test_extras_of_another_dtype_never_stop_the_server(
    aggregator: str, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: client 1's extra (the one its aggregator reads; SCAFFOLD's otherwise) is
    # of a dtype that is not a real number.
    tamper = extras_of(aggregator, EXTRA_DTYPES[dtype])
    # Execute
    config, result, strategy = run_attacked(
        AGGREGATORS[aggregator], hostile_app(train_attack=tamper), caplog
    )
    # Assert: an aggregator that reads it drops the client; one that reads no extras
    # ignores them (never decoded) and averages client 1's model as usual.
    record = result.history[0]
    assert torch.isfinite(strategy.final_vector).all()
    if EXTRA_OF[aggregator] is None:
        assert record.failures == 0
        assert "which no component reads; ignored" in caplog.text
        if aggregator == "fedavg":
            expected = fedavg_of(config, [0, 1, 2, 3])
            torch.testing.assert_close(strategy.final_vector, expected, rtol=0, atol=1e-6)
    else:
        assert record.failures == 1
        assert "not a real float or integer dtype" in caplog.text


@pytest.mark.parametrize(
    ("aggregator", "value"),
    [
        ("scaffold", np.ones(3, dtype=np.float32)),  # delta_c is model-sized
        ("scaffold", np.ones((2, 3), dtype=np.float32)),
        ("fednova", np.ones(2, dtype=np.float32)),  # a is a scalar
    ],
)
def test_an_extra_of_the_wrong_shape_drops_that_client(
    aggregator: str, value: np.ndarray, caplog: pytest.LogCaptureFixture
) -> None:
    _, result, strategy = run_attacked(
        AGGREGATORS[aggregator], hostile_app(train_attack=extras_of(aggregator, value)), caplog
    )
    assert result.history[0].failures == 1
    assert f"dropped client(s) [{HOSTILE}]" in caplog.text
    assert f"of shape {value.shape}" in caplog.text
    assert torch.isfinite(strategy.final_vector).all()


def test_an_oversized_extra_is_refused_before_it_is_converted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A header that claims 10**12 elements with 8 bytes of data: read, never allocated.
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, dtype=np.float32))
    header["shape"] = (10**12,)
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, header)
    data = stream.getvalue() + b"\0" * 8

    def attack(content: RecordDict) -> None:
        content[EXTRAS_KEY] = ArrayRecord(
            {"delta_c": Array(dtype="float32", shape=(10**12,), stype="numpy.ndarray", data=data)}
        )

    _, result, _ = run_attacked(AGGREGATORS["scaffold"], hostile_app(train_attack=attack), caplog)
    assert result.history[0].failures == 1
    assert "returned 'delta_c' of shape (1000000000000,)" in caplog.text


def test_one_client_without_the_extras_is_dropped_not_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: the other clients send SCAFFOLD's delta_c, client 1 does not.
    def drop_extras(content: RecordDict) -> None:
        del content[EXTRAS_KEY]

    # Execute
    _, result, strategy = run_attacked(
        AGGREGATORS["scaffold"], hostile_app(train_attack=drop_extras), caplog
    )
    # Assert: client 1 is dropped with the reason; the run went on (a ClientApp that
    # never sends them still stops the run: test_reply_metrics, test_flower_dropin_server).
    assert result.history[0].failures == 1
    assert f"client {HOSTILE} replied without 'fedplug.extras' ['delta_c']" in caplog.text
    assert torch.isfinite(strategy.final_vector).all()


def test_no_client_with_the_extras_still_stops_with_the_fix() -> None:
    def drop_extras(content: RecordDict) -> None:
        del content[EXTRAS_KEY]

    app = ClientApp()
    declare(app, READY_APP_COMPONENTS)
    app.query()(handle_query)
    app.evaluate()(handle_evaluate)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        reply = handle_train(message, context)
        drop_extras(reply.content)
        return reply

    with pytest.raises(TrainingError, match=r"replied without 'fedplug.extras' \['delta_c'\]; "):
        run_on_grid(LoopbackGrid(app, NUM_CLIENTS), experiment(AGGREGATORS["scaffold"]))


@pytest.mark.parametrize("loss", [-5.0, math.nan, math.inf])
def test_qfedavg_drops_a_client_reporting_an_impossible_loss(
    loss: float, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: Flower's QFedAvg (the ``flower`` aggregator) weighs each client by its
    # reported train_loss ** q; client 1 reports a loss no cross-entropy can have.
    train = {
        "aggregator": {
            "name": "flower",
            "strategy": "QFedAvg",
            "q": 0.1,
            "client_learning_rate": 0.5,
        }
    }
    # Execute
    _, result, strategy = run_attacked(
        train, hostile_app(train_attack=set_metric("train_loss", loss)), caplog
    )
    # Assert: dropped, not a NaN global model that stops the run.
    assert result.history[0].failures == 1
    assert f"dropped client(s) [{HOSTILE}]" in caplog.text
    assert torch.isfinite(strategy.final_vector).all()


# ------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize(
    ("key", "value"),
    [(ACCURACY, math.nan), (ACCURACY, 1e9), (ACCURACY, -1.0), (NUM_EXAMPLES, math.inf)],
)
def test_absurd_evaluation_metrics_are_left_out(
    key: str, value: float, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: record what every client reports, then client 1 tampers with its reply.
    reported: dict[int, tuple[int, float]] = {}
    app = ClientApp()
    declare(app, READY_APP_COMPONENTS)
    app.query()(handle_query)
    app.train()(handle_train)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        reply = handle_evaluate(message, context)
        partition = int(context.node_config["partition-id"])
        metrics = reply.content[METRICS_KEY]
        reported[partition] = (int(metrics[NUM_EXAMPLES]), float(metrics[ACCURACY]))
        if partition == HOSTILE:
            force(metrics, key, value)
        return reply

    # Execute
    _, result, strategy = run_attacked({}, app, caplog)
    # Assert: the client accuracy is the other clients' (those with a test split).
    others = [
        accuracy for client, (count, accuracy) in reported.items() if client != HOSTILE and count
    ]
    record = result.history[0]
    assert record.client_accuracy_mean == pytest.approx(float(np.mean(others)), abs=1e-9)
    assert record.client_accuracy_std == pytest.approx(float(np.std(others)), abs=1e-9)
    assert f"client {HOSTILE} sent {key!r}" in caplog.text
    assert "left out of the client accuracy" in caplog.text


def reply(metrics: dict[str, Any]) -> RecordDict:
    record = MetricRecord()
    for key, value in metrics.items():
        force(record, key, value)
    return RecordDict({METRICS_KEY: record})


def test_weighted_metrics_leave_out_absurd_weights_and_values() -> None:
    # Prepare: two sane replies and hostile ones of every kind.
    contents = [
        reply({NUM_EXAMPLES: 1, ACCURACY: 0.5, "loss": 2.0, "curve": [1.0, 2.0]}),
        reply({NUM_EXAMPLES: 3, ACCURACY: 0.9, "loss": 1.0, "curve": [3.0, 4.0]}),
        reply({NUM_EXAMPLES: math.inf, ACCURACY: 0.1, "loss": 1.0}),
        reply({NUM_EXAMPLES: 10**12, ACCURACY: 0.1}),
        reply({NUM_EXAMPLES: -4, ACCURACY: 0.1}),
        reply({NUM_EXAMPLES: math.nan, ACCURACY: 0.1}),
        reply({NUM_EXAMPLES: "2", ACCURACY: 0.1}),
        reply({NUM_EXAMPLES: 2, ACCURACY: math.nan, "loss": math.inf, "curve": [1.0, math.nan]}),
        reply({NUM_EXAMPLES: 2, ACCURACY: 1e9, "loss": "x", "curve": 5.0}),
    ]
    # Execute
    metrics = weighted_metrics(contents)
    # Assert: only the sane values count, weighted by hand.
    assert metrics[ACCURACY] == pytest.approx((0.5 * 1 + 0.9 * 3) / 4)
    assert metrics["loss"] == pytest.approx((2.0 * 1 + 1.0 * 3) / 4)
    assert metrics["curve"] == pytest.approx([(1.0 + 9.0) / 4, (2.0 + 12.0) / 4])


# ---------------------------------------------------------------- before round 1


@pytest.mark.parametrize(
    "counts",
    [
        [math.inf, 10.0, 10.0, 10.0],
        [math.nan, 10.0, 10.0, 10.0],
        [2.5, 10.0, 10.0, 10.0],
        [-3, 10, 10, 10],
        [10, 10],
        [10**12, 10, 10, 10],
        "10,10,10,10",
    ],
)
def test_malformed_class_counts_refuse_the_node_in_one_line(counts: Any) -> None:
    # Prepare: FedShift needs every client's class counts; client 1's are malformed.
    app = hostile_app(query_attack=set_metric(CLASS_COUNTS, counts))
    config = experiment({"loss_transform": {"name": "fedshift"}})
    # Execute / Assert: a TrainingError naming the node, not an OverflowError or ValueError.
    with pytest.raises(TrainingError) as raised:
        run_on_grid(LoopbackGrid(app, NUM_CLIENTS), config)
    message = str(raised.value)
    assert f"node {FIRST_NODE_ID + HOSTILE} " in message
    assert "class" in message and "\n" not in message


class _SumPhase(SetupPhase):
    """A one-step phase: every client sends a tensor ``w`` and a value ``n``; the server
    adds the tensors up."""

    name = "toy"

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        replies = yield SetupStep("sum")
        total = torch.zeros(2, dtype=torch.float64)
        for reply in replies.values():
            total = total + reply.tensors["w"]
        self.total = total
        return PhaseCost(1, 0, 0)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        raise NotImplementedError  # the nodes below answer by hand

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        pass

    def client_context(self, state: dict[str, Any]) -> Any:
        return {}


SETUP_ATTACKS: dict[str, tuple[Callable[[RecordDict], None], str]] = {
    "torch-raw": (
        lambda content: content[TENSORS_KEY].__setitem__(
            "w", Array(dtype="float32", shape=(2,), stype="torch.raw", data=b"\0" * 8)
        ),
        "serialised as 'torch.raw'",
    ),
    "complex": (
        lambda content: content[TENSORS_KEY].__setitem__("w", Array(np.ones(2, np.complex64))),
        "not a real float or integer dtype",
    ),
    "nan": (
        lambda content: content[TENSORS_KEY].__setitem__(
            "w", Array(np.array([np.nan, 1.0], np.float32))
        ),
        "non-finite",
    ),
    "garbage-bytes": (
        lambda content: content[TENSORS_KEY].__setitem__(
            "w", Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"garbage")
        ),
        "not a .npy array",
    ),
    "unknown-npy-version": (
        lambda content: content[TENSORS_KEY].__setitem__(
            "w", Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"\x93NUMPY ga")
        ),
        "not 1.0 or 2.0",
    ),
    "lying-byte-count": (
        lambda content: content[TENSORS_KEY].__setitem__(
            "w",
            Array(
                dtype="float32",
                shape=(2,),
                stype="numpy.ndarray",
                data=Array(np.ones(2, np.float32)).data + b"\0" * 4,
            ),
        ),
        "its header says 8",
    ),
    "inf-value": (lambda content: force(content[VALUES_KEY], "n", math.inf), "not finite"),
    "list-value": (lambda content: force(content[VALUES_KEY], "n", [1, 2]), "as list"),
    "wrong-shape": (
        lambda content: content[TENSORS_KEY].__setitem__("w", Array(np.ones(3, np.float32))),
        "could not use the nodes' replies",
    ),
}


@pytest.mark.parametrize("attack", sorted(SETUP_ATTACKS))
def test_a_malformed_setup_reply_stops_with_one_line(attack: str) -> None:
    # Prepare: every node answers the toy phase; node 1 tampers with its answer.
    tamper, reason = SETUP_ATTACKS[attack]
    app = ClientApp()

    @app.train("toy")
    def answer(message: Message, context: Context) -> Message:
        content = RecordDict(
            {
                VALUES_KEY: ConfigRecord({"n": 1}),
                TENSORS_KEY: ArrayRecord({"w": Array(np.ones(2, np.float32))}),
            }
        )
        if int(context.node_config["partition-id"]) == HOSTILE:
            tamper(content)
        return Message(content, reply_to=message)

    grid = LoopbackGrid(app, 3)
    node_of = {client: FIRST_NODE_ID + client for client in range(3)}
    # Execute / Assert
    with pytest.raises(TrainingError, match="setup phase 'toy'") as raised:
        run_setup_phase(grid, node_of, _SumPhase(), message_config={}, timeout=None)
    assert reason in str(raised.value)
    if attack != "wrong-shape":  # a shape only the phase can judge is not one client's
        assert f"client {HOSTILE} (node {FIRST_NODE_ID + HOSTILE})" in str(raised.value)


def test_well_formed_setup_replies_reach_the_phase() -> None:
    app = ClientApp()

    @app.train("toy")
    def answer(message: Message, context: Context) -> Message:
        values = np.array([1.0, 2.0], dtype=">f8")  # another byte order is still a real dtype
        content = RecordDict(
            {VALUES_KEY: ConfigRecord({"n": 1}), TENSORS_KEY: ArrayRecord({"w": Array(values)})}
        )
        return Message(content, reply_to=message)

    phase = _SumPhase()
    run_setup_phase(
        LoopbackGrid(app, 3),
        {client: FIRST_NODE_ID + client for client in range(3)},
        phase,
        message_config={},
        timeout=None,
    )
    assert phase.total is not None
    torch.testing.assert_close(phase.total, torch.tensor([3.0, 6.0], dtype=torch.float64))


# --------------------------------------------------------------------- under Ray

ATTACK_KEY = "test.attack"
RAY_ATTACKS: dict[str, Attack] = {
    "inf-num-examples": set_metric(NUM_EXAMPLES, math.inf),
    "torch-raw-stype": raw_model_array,
    "complex-extra": extras_of("scaffold", np.ones(2, dtype=np.complex64)),
}


def train_hostile_on_ray(message: Message, context: Context) -> Message:
    """The ready train handler; partition 1 applies the attack the train config names.
    Module level, so Ray workers import it by reference."""
    reply = handle_train(message, context)
    attack = str(message.content[CONFIG_KEY].get(ATTACK_KEY, ""))
    if attack and int(context.node_config["partition-id"]) == HOSTILE:
        RAY_ATTACKS[attack](reply.content)
    return reply


ray_client_app = ClientApp()
declare(ray_client_app, READY_APP_COMPONENTS)
ray_client_app.query()(handle_query)
ray_client_app.train()(train_hostile_on_ray)
ray_client_app.train("feddisk")(handle_setup_phase)
ray_client_app.evaluate()(handle_evaluate)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
def test_a_hostile_client_app_under_ray_simulation_is_dropped() -> None:
    from flwr.simulation import run_simulation

    # Prepare: one simulation, one job per attack, each under another aggregator.
    jobs = [
        ("inf-num-examples", AGGREGATORS["fedavg"]),
        ("torch-raw-stype", AGGREGATORS["fedmedian"]),
        ("complex-extra", AGGREGATORS["scaffold"]),
    ]
    results: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for attack, train in jobs:
            results[attack] = run_on_grid(
                grid, experiment(train), train_config={ATTACK_KEY: attack}, node_wait_seconds=120
            )

    # Execute
    run_simulation(
        server,
        ray_client_app,
        num_supernodes=NUM_CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    # Assert: every job finished its round without client 1.
    for attack, _ in jobs:
        assert attack in results, f"the simulation did not finish job {attack!r}"
        result, strategy = results[attack]
        record = result.history[0]
        assert (record.participants, record.failures) == (NUM_CLIENTS, 1), attack
        assert torch.isfinite(strategy.final_vector).all()
