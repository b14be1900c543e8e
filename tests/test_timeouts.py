"""Timeouts that interrupt (issue #15, item 1), on the simulator's three engines.

First :mod:`fedplug.deadline` on its own: the ``SIGALRM`` path interrupts a
``time.sleep`` in the main thread, the watchdog path a Python loop in another thread,
deadlines nest without extending each other, an outer timer (pytest-timeout's, say) is
put back, and nothing fires after the body ended.

Then whole runs: a loss transform whose client side hangs for chosen clients (it sleeps,
spins or swallows the interruption), with ``client_timeout_seconds`` about a second, on
the sequential, vectorised and parallel engines. The run finishes within one timeout
per round plus a margin, the hanging client is dropped every round with a reason naming
the limit, and the other clients' updates are aggregated: the final model is the one of
a run where that client fails at once (raises), bit for bit on the sequential and
parallel engines and up to rounding on the vectorised one. The failure policy still
decides: too many hanging clients stop the run with one line.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from torch import Tensor

from fedplug.components import ClientUpdate, ComponentConfig, LossTransform
from fedplug.config import validate_section
from fedplug.data.build import build_federation
from fedplug.data.federation import Federation
from fedplug.deadline import ClientTimeout, deadline
from fedplug.errors import TrainingError
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.round_screen import ClientFailure
from fedplug.simulation import parallel, vectorized_blocks
from fedplug.simulation.simulator import Simulator
from fedplug.simulation.vectorized import VectorizedEngine

pytestmark = pytest.mark.timeout(120)  # a deadline that does not interrupt must fail, not hang

ENGINES = ["sequential", "vectorized", "parallel"]
HANGING = 2
"""The client that hangs in the runs below."""

# ------------------------------------------------------------------ fedplug.deadline


def test_the_main_thread_deadline_interrupts_a_sleep():
    started = time.monotonic()
    with pytest.raises(ClientTimeout, match=r"^client 7 ran past train.failures.client_timeout_seconds=0.2 and was"):
        with deadline(0.2, "client 7"):
            time.sleep(30)
    assert 0.2 <= time.monotonic() - started < 1.5


def test_a_worker_thread_deadline_interrupts_a_python_loop():
    caught: list[BaseException] = []
    times: list[float] = []

    def client() -> None:
        started = time.monotonic()
        try:
            with deadline(0.2, "client 3"):
                while True:
                    pass
        except ClientTimeout as error:
            caught.append(error)
        times.append(time.monotonic() - started)

    thread = threading.Thread(target=client)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the watchdog did not interrupt the loop"
    assert len(caught) == 1 and isinstance(caught[0], ClientTimeout)
    assert str(caught[0]).startswith("client 3 ran past train.failures.client_timeout_seconds=0.2")
    assert (caught[0].what, caught[0].seconds) == ("client 3", 0.2)
    assert 0.2 <= times[0] < 1.5


def test_an_inner_deadline_fires_first_and_the_outer_one_still_holds():
    started = time.monotonic()
    with pytest.raises(ClientTimeout) as outer:
        with deadline(0.6, "outer"):
            with pytest.raises(ClientTimeout) as inner:
                with deadline(0.2, "inner"):
                    time.sleep(30)
            assert inner.value.what == "inner"
            assert time.monotonic() - started < 0.5
            time.sleep(30)  # the outer deadline was re-armed with what it had left
    assert outer.value.what == "outer"
    assert 0.6 <= time.monotonic() - started < 1.5


@pytest.mark.parametrize("in_thread", [False, True], ids=["main thread", "other thread"])
def test_an_inner_deadline_never_extends_an_outer_one(in_thread):
    caught: list[ClientTimeout] = []

    def body() -> None:
        try:
            with deadline(0.2, "outer"):
                with deadline(30, "inner"):
                    end = time.monotonic() + 30
                    while time.monotonic() < end:  # a loop, so the watchdog can interrupt it
                        time.sleep(0.01)
        except ClientTimeout as error:
            caught.append(error)

    started = time.monotonic()
    if in_thread:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join(10)
    else:
        body()
    assert [error.what for error in caught] == ["outer"]
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("in_thread", [False, True], ids=["main thread", "other thread"])
def test_nothing_fires_after_the_body_ended(in_thread):
    errors: list[BaseException] = []

    def body() -> None:
        try:
            for _ in range(20):  # many quick bodies, then well past their deadline
                with deadline(0.05, "client"):
                    sum(range(1000))
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                time.sleep(0.01)
        except BaseException as error:  # noqa: BLE001 - anything at all is the failure
            errors.append(error)

    handler = signal.getsignal(signal.SIGALRM)
    if in_thread:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join(10)
    else:
        body()
    assert errors == []
    assert signal.getsignal(signal.SIGALRM) is handler


def test_an_outer_alarm_is_put_back_with_its_remaining_time():
    """What pytest-timeout (or a runtime) armed before the deadline stays armed after it."""
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    previous_timer = signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        own = signal.getsignal(signal.SIGALRM)
        with pytest.raises(ClientTimeout):
            with deadline(0.1):
                time.sleep(30)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert signal.getsignal(signal.SIGALRM) is own
        assert 4.0 < remaining <= 5.0
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if previous_timer[0]:
            signal.setitimer(signal.ITIMER_REAL, *previous_timer)


def test_no_limit_and_bad_limits():
    with deadline(None):
        time.sleep(0.01)
    with pytest.raises(ValueError, match="positive"):
        with deadline(0):
            pass


# ------------------------------------------------------------------ whole runs


class HangingConfig(ComponentConfig):
    """Cross-entropy, except that chosen clients hang (or raise) in their client code."""

    name: Literal["hanging"] = "hanging"
    on: tuple[int, ...] = ()
    how: Literal["sleep", "spin", "swallow", "raise"] = "sleep"


class Hanging(LossTransform):
    """Hangs in ``client_context``, the loss transform's per-client code that every
    engine calls for each client and each round until it returns."""

    def __init__(self, config: HangingConfig) -> None:
        self.config = config

    def client_context(self, client_id: int, class_counts: np.ndarray) -> dict[str, Tensor]:
        if client_id in self.config.on:
            how = self.config.how
            if how == "raise":
                raise RuntimeError(f"client {client_id} is unreachable")
            if how == "sleep":
                time.sleep(10**6)
            if how == "spin":
                while True:
                    pass
            while True:  # "swallow": code that catches every exception and goes on
                try:
                    time.sleep(10**6)
                except Exception:  # noqa: BLE001, S110
                    pass
        return {}


DATA: dict[str, Any] = {
    "dataset": {"name": "synthetic", "num_train": 360, "num_test": 100, "num_features": 12, "num_classes": 4},
    "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
    "num_clients": 6,
    "local_test_fraction": 0.2,
    "seed": 0,
}

TRAIN: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [16]},
    "client_fraction": 1.0,
    "rounds": 2,
    "local_epochs": 1,
    "batch_size": 16,
    "optimizer": {"name": "sgd", "lr": 0.1},
    "seed": 0,
}


class Recorder:
    """Wraps an engine and keeps every outcome it yields, round by round."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.rounds: list[list[ClientUpdate | ClientFailure]] = []

    def run_round(self, *args: Any) -> Iterator[ClientUpdate | ClientFailure]:
        outcomes: list[ClientUpdate | ClientFailure] = []
        self.rounds.append(outcomes)
        self.context = args[3]  # the round context: the client states
        for outcome in self.engine.run_round(*args):
            outcomes.append(outcome)
            yield outcome

    def derived_params(self) -> dict[str, Any]:
        return self.engine.derived_params()

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("loss_transforms", "test", "hanging", HangingConfig, Hanging)
    return registry


@pytest.fixture(scope="module")
def federation(registry: Registry) -> Federation:
    return build_federation(validate_section("data", DATA, registry), registry)


def simulate(
    registry: Registry, federation: Federation, engine: str, **train: Any
) -> tuple[Simulator, Recorder, float]:
    """Run ``TRAIN`` updated with ``train`` on ``engine``; the simulator, the engine's
    outcomes and the run's wall time."""
    options = {"workers": train.pop("workers", 2)} if engine == "parallel" else {}
    config = validate_section("train", {**TRAIN, **train, "engine": engine, **options}, registry)
    simulator = Simulator(config, federation, registry)
    recorder = Recorder(simulator.engine)
    simulator.engine = recorder
    started = time.monotonic()
    simulator.result = simulator.run(resume=False)
    return simulator, recorder, time.monotonic() - started


@pytest.fixture(scope="module")
def reference(registry: Registry, federation: Federation) -> tuple[Simulator, Recorder, float]:
    """The sequential run where the hanging client fails at once instead (it raises)."""
    return simulate(
        registry, federation, "sequential", loss_transform={"name": "hanging", "on": [HANGING], "how": "raise"}
    )


def failures_by_round(recorder: Recorder) -> list[list[ClientFailure]]:
    return [[outcome for outcome in outcomes if isinstance(outcome, ClientFailure)] for outcomes in recorder.rounds]


def updates_by_chain(outcomes: list[ClientUpdate | ClientFailure]) -> dict[tuple[int, ...], ClientUpdate]:
    return {tuple(outcome.chain): outcome for outcome in outcomes if isinstance(outcome, ClientUpdate)}


def assert_same_updates(expected: list[Any], actual: list[Any], atol: float) -> None:
    wanted, got = updates_by_chain(expected), updates_by_chain(actual)
    assert sorted(got) == sorted(wanted)
    for chain, update in wanted.items():
        assert (got[chain].weight, got[chain].num_steps) == (update.weight, update.num_steps)
        torch.testing.assert_close(got[chain].vector, update.vector, rtol=0.0, atol=atol)


@pytest.fixture(scope="module")
def warm(registry: Registry, federation: Federation) -> None:
    """A first vectorised run in the process spends about 2 s setting ``torch.func`` up:
    outside the timed runs."""
    simulate(registry, federation, "vectorized", rounds=1)


TIMEOUT = 1.0
MARGIN = 2.5
"""Seconds a whole run may take beyond one timeout per round (training, forking). A
second timeout per round (a vectorised block halved instead of the client found) would
take at least 5 s more."""


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hanging_client_is_interrupted_and_dropped_every_round(registry, federation, reference, warm, engine):
    simulator, recorder, seconds = simulate(
        registry,
        federation,
        engine,
        loss_transform={"name": "hanging", "on": [HANGING], "how": "sleep"},
        failures={"client_timeout_seconds": TIMEOUT},
    )
    rounds = TRAIN["rounds"]
    assert seconds < TIMEOUT * rounds + MARGIN, f"{seconds:.1f}s: a hanging client held the run up"
    expected_reason = (
        f"ClientTimeout: client {HANGING} ran past train.failures.client_timeout_seconds=1 and was interrupted"
    )
    assert failures_by_round(recorder) == [[ClientFailure([HANGING], expected_reason)]] * rounds
    assert [record.failures for record in simulator.result.history] == [1] * rounds
    assert [record.participants for record in simulator.result.history] == [6] * rounds
    assert all(np.isfinite(record.accuracy) for record in simulator.result.history)
    # the round kept the other clients' updates: those of the run where the client raised
    reference_simulator, reference_recorder, _ = reference
    atol = 1e-5 if engine == "vectorized" else 0.0
    for expected, actual in zip(reference_recorder.rounds, recorder.rounds):
        assert_same_updates(expected, actual, atol)
    torch.testing.assert_close(simulator.final_vector, reference_simulator.final_vector, rtol=0.0, atol=atol)
    assert not torch.equal(simulator.final_vector, reference_recorder.rounds[0][0].vector)  # it trained


def test_a_spinning_client_is_interrupted_too(registry, federation, reference):
    """A Python loop, not a blocking call: the alarm interrupts it at its next bytecode."""
    simulator, recorder, seconds = simulate(
        registry,
        federation,
        "sequential",
        rounds=1,
        loss_transform={"name": "hanging", "on": [HANGING], "how": "spin"},
        failures={"client_timeout_seconds": 0.5},
    )
    assert seconds < 0.5 + MARGIN
    assert [[failure.chain for failure in failures] for failures in failures_by_round(recorder)] == [[[HANGING]]]
    assert_same_updates(reference[1].rounds[0], recorder.rounds[0], 0.0)


def test_the_parallel_engine_kills_a_worker_its_deadline_cannot_stop(registry, federation, reference):
    """The client swallows the interruption: the main process kills its only worker past
    the deadline plus a margin, forks a replacement, and the round goes on."""
    timeout = 0.5
    simulator, recorder, seconds = simulate(
        registry,
        federation,
        "parallel",
        workers=1,
        loss_transform={"name": "hanging", "on": [HANGING], "how": "swallow"},
        failures={"client_timeout_seconds": timeout},
    )
    rounds = TRAIN["rounds"]
    assert seconds < parallel.kill_after(timeout) * rounds + MARGIN
    for failures in failures_by_round(recorder):
        assert [failure.chain for failure in failures] == [[HANGING]]
        assert failures[0].reason.startswith(
            f"ClientTimeout: client {HANGING} ran past train.failures.client_timeout_seconds=0.5; "
        )
        assert "its worker process was killed" in failures[0].reason
    for expected, actual in zip(reference[1].rounds, recorder.rounds):
        assert [outcome.chain for outcome in actual] == [outcome.chain for outcome in expected]  # plan order
        assert_same_updates(expected, actual, 0.0)
    assert torch.equal(simulator.final_vector, reference[0].final_vector)


def test_a_vectorised_block_that_runs_past_its_deadline_is_retried_in_halves(
    registry, federation, reference, warm, monkeypatch
):
    """A hang in the block's batched steps names no client: the block (n chains, n x T)
    is interrupted and retried in halves until the chain that hangs alone is dropped;
    the others keep their updates and the block size stays as it was."""
    original = VectorizedEngine._train_block
    blocks: list[list[list[int]]] = []

    def train_block(self, start_vector, chains, plan, round_index, context):
        blocks.append([list(chain) for chain in chains])
        if [HANGING] in chains:
            time.sleep(10**6)
        return original(self, start_vector, chains, plan, round_index, context)

    monkeypatch.setattr(VectorizedEngine, "_train_block", train_block)
    timeout = 0.25
    simulator, recorder, seconds = simulate(
        registry, federation, "vectorized", rounds=1, failures={"client_timeout_seconds": timeout}
    )
    hung = [block for block in blocks if [HANGING] in block]
    assert [len(block) for block in hung][0] == 6 and len(hung[-1]) == 1
    assert [len(block) for block in hung] == sorted((len(block) for block in hung), reverse=True)
    assert seconds < timeout * sum(len(block) for block in hung) + MARGIN
    reason = f"ClientTimeout: client {HANGING} ran past train.failures.client_timeout_seconds=0.25 and was interrupted"
    assert failures_by_round(recorder) == [[ClientFailure([HANGING], reason)]]
    assert_same_updates(reference[1].rounds[0], recorder.rounds[0], 1e-5)
    assert simulator.engine.engine.block_size >= 6


def test_a_vectorised_retry_restores_the_client_states_first(registry, federation, warm, monkeypatch):
    """SCAFFOLD's c_k changes in ``client_finish``. Here the hanging client's own code
    hangs only after the whole block trained (every member's c_k has moved): its chain
    is dropped and the block's other chains are trained again from their saved states,
    so their updates, extras and c_k are those of the sequential run where the client
    raises instead (not moved twice)."""
    original = VectorizedEngine._train_block

    def train_block(self, start_vector, chains, plan, round_index, context):
        progress = original(self, start_vector, chains, plan, round_index, context)
        if [HANGING] in chains:  # e.g. its client_finish, after the others' ran
            with vectorized_blocks.client_code(HANGING, context.client_timeout):
                time.sleep(10**6)
        return progress

    monkeypatch.setattr(VectorizedEngine, "_train_block", train_block)
    train = {"rounds": 1, "aggregator": {"name": "scaffold"}, "optimizer": {"name": "sgd", "lr": 0.05}}
    expected, expected_log, _ = simulate(
        registry, federation, "sequential", **train, loss_transform={"name": "hanging", "on": [HANGING], "how": "raise"}
    )
    actual, actual_log, _ = simulate(registry, federation, "vectorized", **train, failures={"client_timeout_seconds": 0.5})
    [failure] = failures_by_round(actual_log)[0]
    assert failure.chain == [HANGING] and f"client {HANGING} ran past" in failure.reason
    wanted, got = updates_by_chain(expected_log.rounds[0]), updates_by_chain(actual_log.rounds[0])
    assert sorted(got) == sorted(wanted) and len(got) == 5
    for key, update in wanted.items():
        torch.testing.assert_close(got[key].vector, update.vector, rtol=0.0, atol=1e-5)
        assert sorted(got[key].extras) == sorted(update.extras) and update.extras
        for name, value in update.extras.items():
            torch.testing.assert_close(got[key].extras[name], value, rtol=0.0, atol=1e-5)
    expected_states, actual_states = expected_log.context.client_states, actual_log.context.client_states
    kept = [client for key in wanted for client in key]
    assert all(expected_states[client] for client in kept)
    for client in kept:
        assert sorted(actual_states[client]) == sorted(expected_states[client])
        for name, value in expected_states[client].items():
            torch.testing.assert_close(actual_states[client][name], value, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(actual.final_vector, expected.final_vector, rtol=0.0, atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_too_many_hanging_clients_stop_the_run_with_one_line(registry, federation, engine):
    with pytest.raises(TrainingError) as error:
        simulate(
            registry,
            federation,
            engine,
            loss_transform={"name": "hanging", "on": [0, 1, 2], "how": "sleep"},
            failures={"client_timeout_seconds": 0.5, "max_failed_fraction": 0.4, "max_round_retries": 0},
        )
    message = str(error.value)
    assert message.startswith("round 1: 3 of 6 client updates failed in each of 1 attempts")
    assert "\n" not in message
