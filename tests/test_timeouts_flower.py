"""Timeouts that interrupt, on Flower: a client that hangs cannot stall a run.

``train.failures.client_timeout_seconds`` (T) is enforced twice (``adapters/flower/
chains.py``): the node's :class:`FedplugTrainer` interrupts its own training at T (the
server sends T with every train message) and replies with the failure, and the server
gives up on replies once none has come for T plus a margin (:func:`reply_wait`).

The hanging client is the test-only loss transform ``timeout_hang``
(``tests/timeout_plugins.py``), which hangs before training for chosen clients. Each
run is compared with the same run in which those clients fail at once
(``fail_instead``): dropping a hung client must leave exactly the model of a round
without it, and the run must end within a bound.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import pytest
import torch
from conftest import SMALL_EXPERIMENT
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

import timeout_plugins
from fedplug.adapters.flower import FedplugStrategy, FedplugTrainer, LoopbackGrid, run_on_grid
from fedplug.adapters.flower.apps import make_client_app
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.chains import (
    ReplyDeadlineGrid,
    no_reply_reason,
    reply_wait,
)
from fedplug.adapters.flower.nodes import handle_evaluate, handle_query, handle_train
from fedplug.adapters.flower.records import CLIENT_TIMEOUT, CONFIG_KEY
from fedplug.config import validate_experiment, validate_section

# A timeout that does not interrupt must fail the test, not hang the suite.
pytestmark = pytest.mark.timeout(240)

NUM_CLIENTS = 4
TIMEOUT = 1.0
INTERRUPTED = f"ran past train.failures.client_timeout_seconds={TIMEOUT:g} and was interrupted"


def experiment(hang: dict[str, Any], rounds: int = 2) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update(
        {
            "rounds": rounds,
            "client_fraction": 1.0,
            "loss_transform": {"name": timeout_plugins.HANG, **hang},
            "failures": {"client_timeout_seconds": TIMEOUT, "max_failed_fraction": 0.5},
        }
    )
    return validate_experiment(data, timeout_plugins.timeout_registry())


@pytest.fixture
def hang_plugin(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``timeout_hang`` wherever a node builds its components (``default_registry()``);
    every hang released at the end."""
    import fedplug.plugins

    registry = timeout_plugins.timeout_registry()
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    timeout_plugins.reset()
    yield registry
    timeout_plugins.RELEASE.set()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def dropped() -> Any:
    """The round core's warnings (each dropped client with its reason)."""
    collector = _Collect()
    logger = logging.getLogger("fedplug.round")
    logger.addHandler(collector)
    yield collector.lines
    logger.removeHandler(collector)


def run_loopback(config: Any, registry: Any, grid: Grid | None = None) -> tuple[Any, Any, float]:
    grid = grid if grid is not None else LoopbackGrid(make_client_app(), NUM_CLIENTS)
    started = time.monotonic()
    result, strategy = run_on_grid(grid, config, registry=registry, federated_evaluation=False)
    return result, strategy, time.monotonic() - started


# ------------------------------------------------------------------ the bounds


def test_the_server_waits_t_plus_a_margin_for_a_reply() -> None:
    assert reply_wait(None) is None
    assert reply_wait(1.0) == 3.0  # the 2 s floor
    assert reply_wait(100.0) == pytest.approx(110.0)  # 10% of T
    assert no_reply_reason(1.0) == (
        "sent no reply within 3s (train.failures.client_timeout_seconds=1 plus a 2s margin)"
    )


# ------------------------------------------------- a hang the node interrupts itself


def test_a_hung_client_is_interrupted_at_t_and_dropped_each_round(hang_plugin, dropped) -> None:
    # Prepare: 4 clients, all sampled, client 2 hangs forever in every round (in one
    # blocking sleep, which the timer signal ends); T = 1 s.
    hung = experiment({"hangs": [{"clients": [2], "sleep_seconds": 3600.0}]})
    failing = experiment({"hangs": [{"clients": [2], "fail_instead": True}]})

    # Execute
    result, strategy, seconds = run_loopback(hung, hang_plugin)
    reference, reference_strategy, _ = run_loopback(failing, hang_plugin)

    # Assert: each round waited about T for client 2, dropped it naming the timeout, and
    # kept the other three updates: the model of the run where client 2 fails at once.
    assert seconds < 2 * TIMEOUT + 8.0
    assert [(record.participants, record.failures) for record in result.history] == [(4, 1), (4, 1)]
    timed_out = [line for line in dropped if "client(s) [2]" in line and INTERRUPTED in line]
    assert len(timed_out) == 2, dropped
    assert torch.equal(strategy.final_vector, reference_strategy.final_vector)
    assert [record.accuracy for record in result.history] == [
        record.accuracy for record in reference.history
    ]


def test_a_users_fedplug_trainer_obeys_the_servers_timeout(hang_plugin, dropped) -> None:
    # Prepare: the drop-in path. The user's ClientApp trains with its own FedplugTrainer,
    # whose config sets no timeout; FedplugStrategy's config sets T = 1 s, which reaches
    # the trainer in every train message. Client 1 hangs forever.
    registry = hang_plugin
    config = experiment({"hangs": [{"clients": [1]}]}, rounds=1)
    user_train = validate_section(
        "train",
        {"loss_transform": {"name": timeout_plugins.HANG, "hangs": [{"clients": [1]}]}},
        registry,
    )
    assert user_train.failures.client_timeout_seconds is None
    app = ClientApp()
    trainer = FedplugTrainer(user_train, registry=registry, num_classes=4, app=app)
    generator = torch.Generator().manual_seed(0)
    shards = [(torch.randn(20, 12, generator=generator), torch.arange(20) % 4) for _ in range(4)]
    models = [torch.nn.Sequential(torch.nn.Linear(12, 4)) for _ in range(4)]

    @app.train()
    def train(message: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        assert message.content[CONFIG_KEY][CLIENT_TIMEOUT] == TIMEOUT
        return trainer.fit(models[node], shards[node], message, context)

    strategy = FedplugStrategy(
        config.train,
        num_clients=NUM_CLIENTS,
        model=torch.nn.Sequential(torch.nn.Linear(12, 4)),
        registry=registry,
        federated_evaluation=False,
    )

    # Execute
    started = time.monotonic()
    strategy.start(LoopbackGrid(app, NUM_CLIENTS))

    # Assert: interrupted at T on the node, dropped on the server, the round went on.
    assert time.monotonic() - started < TIMEOUT + 6.0
    assert [(record.participants, record.failures) for record in strategy.history] == [(4, 1)]
    assert any("dropped client(s) [1]" in line and INTERRUPTED in line for line in dropped), dropped


# ------------------------------------------ a node that does not answer: the server's bound


class ThreadedLoopbackGrid(LoopbackGrid):
    """A LoopbackGrid whose nodes answer in their own threads, as real nodes do: a node
    that hangs keeps its thread, and the server's wait is the only bound."""

    def __init__(self, client_app: ClientApp, num_nodes: int) -> None:
        super().__init__(client_app, num_nodes)
        self._answers: dict[str, Message | None] = {}
        self._lock = threading.Lock()

    def push_messages(self, messages: Any) -> list[str]:
        ids = list(super().push_messages(messages))
        for message_id in ids:
            message = self._pending.pop(message_id)
            threading.Thread(target=self._answer, args=(message_id, message), daemon=True).start()
        return ids

    def _answer(self, message_id: str, message: Message) -> None:
        reply = self._deliver(message)
        with self._lock:
            self._answers[message_id] = reply

    def pull_messages(self, message_ids: Any) -> list[Message]:
        with self._lock:
            done = [self._answers.pop(key) for key in list(message_ids) if key in self._answers]
        return [reply for reply in done if reply is not None]

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        """Flower's own wait: every reply, or what came within ``timeout``."""
        waiting = set(self.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 3600.0)
        replies: list[Message] = []
        while waiting and time.monotonic() < end:
            arrived = self.pull_messages(list(waiting))
            replies.extend(arrived)
            waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
            time.sleep(0.01)
        return replies


@pytest.mark.slow
def test_a_silent_node_is_dropped_after_t_plus_margin_and_its_late_reply_ignored(
    hang_plugin, dropped
) -> None:
    # Prepare: nodes that answer in their own threads. In round 1, client 1 hangs 4 s
    # through the interrupt (a hang the node cannot end itself); T = 1 s, so the server
    # gives up on it 3 s after the last other reply. In round 2, client 2 takes 2 s (over
    # T: dropped when it replies), so client 1's round-1 reply comes while round 2 waits:
    # it must not be taken for client 1's round-2 reply (which comes at once).
    late = experiment(
        {
            "hangs": [
                {"clients": [1], "seconds": 4.0, "times": 1, "ignore_interrupt": True},
                {"clients": [2], "seconds": 2.0, "first": 1, "times": 1, "ignore_interrupt": True},
            ]
        }
    )
    failing = experiment(
        {
            "hangs": [
                {"clients": [1], "times": 1, "fail_instead": True},
                {"clients": [2], "first": 1, "times": 1, "fail_instead": True},
            ]
        }
    )

    # Execute
    result, strategy, seconds = run_loopback(
        late, hang_plugin, ThreadedLoopbackGrid(make_client_app(), NUM_CLIENTS)
    )
    timeout_plugins.reset()
    _, reference_strategy, _ = run_loopback(failing, hang_plugin)

    # Assert: round 1 dropped client 1 once the bound passed, round 2 dropped client 2
    # for its time and kept client 1's round-2 update: the model of a run where client 1
    # fails in round 1 and client 2 in round 2.
    wait = reply_wait(TIMEOUT)
    assert wait is not None
    assert wait + 2.0 <= seconds < wait + 10.0
    assert [(record.participants, record.failures) for record in result.history] == [(4, 1), (4, 1)]
    silent = f"dropped client(s) [1]: client 1 {no_reply_reason(TIMEOUT)}"
    assert any(silent in line for line in dropped), dropped
    over = f"s, over train.failures.client_timeout_seconds={TIMEOUT}"
    assert any("dropped client(s) [2]: took " in line and over in line for line in dropped), dropped
    assert torch.equal(strategy.final_vector, reference_strategy.final_vector)


def test_the_bounded_grid_returns_what_came_and_never_mixes_exchanges() -> None:
    # Prepare: node 0 answers at once, node 1 only after the exchange gave up.
    gate = threading.Event()
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) == 1:
            gate.wait(10)
        return Message(message.content, reply_to=message)

    inner = ThreadedLoopbackGrid(app, 2)
    grid = ReplyDeadlineGrid(inner, idle_seconds=0.3)

    def ask(node: int) -> Message:
        return Message(
            copy.deepcopy(_probe()), dst_node_id=1000 + node, message_type="query", group_id="1"
        )

    # Execute
    first = list(grid.send_and_receive([ask(0), ask(1)], timeout=60))
    gate.set()
    time.sleep(0.2)  # node 1's late reply to the first exchange is now there
    second = list(grid.send_and_receive([ask(0)], timeout=60))

    # Assert: the first exchange gave up on node 1; the second got only its own reply.
    assert [reply.metadata.src_node_id for reply in first] == [1000]
    assert [reply.metadata.src_node_id for reply in second] == [1000]
    assert second[0].metadata.reply_to_message_id != first[0].metadata.reply_to_message_id


def _probe() -> Any:
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({CONFIG_KEY: ConfigRecord({"probe": 1})})


# ------------------------------------------------------------- Flower's Ray simulation


def train_with_hang_plugin(message: Message, context: Context) -> Message:
    """The ready ClientApp's train handler, on a node whose installed plugins include
    ``timeout_hang`` (set up inside the Ray actor, where this runs)."""
    timeout_plugins.install_everywhere()
    return handle_train(message, context)


def query_with_hang_plugin(message: Message, context: Context) -> Message:
    timeout_plugins.install_everywhere()
    return handle_query(message, context)


ray_client_app = ClientApp()
# like make_client_app: it builds whatever the server's config names
declare(ray_client_app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
ray_client_app.query()(query_with_hang_plugin)
ray_client_app.train()(train_with_hang_plugin)
ray_client_app.evaluate()(handle_evaluate)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
def test_a_hung_client_in_a_ray_actor_is_interrupted_and_the_run_goes_on(
    hang_plugin, dropped
) -> None:
    # Prepare: 4 virtual nodes on 2 Ray actors; client 3 hangs forever in every round, in
    # one blocking sleep (which only the timer signal of the actor's main thread can end).
    from flwr.simulation import run_simulation

    hung = experiment({"hangs": [{"clients": [3], "sleep_seconds": 3600.0}]})
    outcome: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        started = time.monotonic()
        outcome["run"] = run_on_grid(
            grid, hung, registry=hang_plugin, federated_evaluation=False, node_wait_seconds=120
        )
        outcome["seconds"] = time.monotonic() - started

    # Execute: the simulation only returns once every actor is free again, so a hang
    # that the deadline did not end would keep it from returning.
    run_simulation(
        server,
        ray_client_app,
        num_supernodes=NUM_CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    timeout_plugins.reset()
    _, reference_strategy, _ = run_loopback(
        experiment({"hangs": [{"clients": [3], "fail_instead": True}]}), hang_plugin
    )

    # Assert: both rounds dropped client 3 for its timeout and kept the three others;
    # round 2 ran on an actor the deadline had freed.
    assert "run" in outcome, "the simulation did not finish the run"
    result, strategy = outcome["run"]
    assert [(record.participants, record.failures) for record in result.history] == [(4, 1), (4, 1)]
    timed_out = [line for line in dropped if "client(s) [3]" in line and INTERRUPTED in line]
    assert len(timed_out) == 2, dropped
    assert outcome["seconds"] < 2 * (reply_wait(TIMEOUT) or 0.0) + 30.0
    torch.testing.assert_close(
        strategy.final_vector, reference_strategy.final_vector, rtol=0, atol=1e-6
    )


class _RecordingGrid(LoopbackGrid):
    """A LoopbackGrid that records the ``timeout`` of every exchange."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeouts: list[float | None] = []

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        return super().send_and_receive(messages, timeout=timeout)


def test_without_a_client_timeout_every_exchange_waits_at_most_an_hour() -> None:
    # Prepare: no train.failures.client_timeout_seconds (the default).
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update({"rounds": 2, "client_fraction": 1.0})
    config = validate_experiment(data)
    assert config.train.failures.client_timeout_seconds is None
    grid = _RecordingGrid(make_client_app(), NUM_CLIENTS)
    # Execute
    run_on_grid(grid, config, federated_evaluation=False)
    # Assert: every exchange (class counts, rounds) is bounded by Flower's default hour.
    assert grid.timeouts and set(grid.timeouts) == {3600}
