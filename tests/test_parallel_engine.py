"""The parallel engine against the sequential one: the same run, bit for bit.

Both engines run inside a real :class:`Simulator` on the same federation of clients of
unequal sizes; a recording wrapper keeps every outcome each engine yields, in order, so
the tests compare each chain's update (plan order included), the final global model,
the round records and the client states. The round's workers then compute the
evaluation's batches (with one torch thread, as here), which must give the numbers the
main process would. Then failures: a client that raises, a worker process that dies,
every worker dying, a worker dying while it evaluates; the config checks; and resuming
from a checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from test_engines import DATA, TRAIN  # 6 clients of unequal sizes, 2 rounds, SGD with momentum
from test_simulator import Faulty, FaultyConfig  # raises or returns NaN for chosen clients
from torch import Tensor

from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig
from fedplug.components import ClientUpdate, RoundPlan
from fedplug.config import validate_section
from fedplug.data.build import build_federation
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.evaluation import Evaluator
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure
from fedplug.run.vectors import model_to_vector, vector_to_model
from fedplug.simulation import parallel_worker
from fedplug.simulation.parallel import ParallelEngine, default_workers
from fedplug.simulation.simulator import Simulator

pytestmark = pytest.mark.timeout(120)

ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "scaffold": {"aggregator": "scaffold", "optimizer": {"name": "sgd", "lr": 0.05}},
    "fedgsp": {
        "grouper": {"name": "fedgsp", "mode": "naive", "fixed_groups": 4, "group_fraction": 1.0},
        "loss_transform": {"name": "fedprox", "mu": 0.5},
    },
    "iwds+fedshift": {"sampler": "iwds", "loss_transform": "fedshift"},
    "adam": {"optimizer": {"name": "adam", "lr": 0.01}},
    "server state read by clients": {"aggregator": "counting"},  # Counting, below
}


class CountingConfig(FedAvgConfig):
    name: Literal["counting"] = "counting"  # type: ignore[assignment]


class Counting(FedAvg):
    """FedAvg whose client side reads server state directly, not through the payload: a
    proximal term scaled by the rounds aggregated so far (0 in round 1)."""

    def __init__(self, config: CountingConfig, num_clients: int) -> None:
        super().__init__(config, num_clients)
        self.aggregations = 0

    def client_penalty(self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Any) -> Tensor | None:
        return 0.5 * self.aggregations * sum(((params[name] - anchor[name]) ** 2).sum() for name in params)

    def aggregate(self, global_vector: Tensor, updates: Any) -> Tensor:
        self.aggregations += 1
        return super().aggregate(global_vector, updates)


class Recorder:
    """Wraps an engine and keeps what it yields, round by round (attempts included)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.rounds: list[list[ClientUpdate | ClientFailure]] = []
        self.start_vectors: list[Tensor] = []

    def run_round(self, *args: Any) -> Iterator[ClientUpdate | ClientFailure]:
        outcomes: list[ClientUpdate | ClientFailure] = []
        self.start_vectors.append(args[0])
        self.rounds.append(outcomes)
        for outcome in self.engine.run_round(*args):
            outcomes.append(outcome)
            yield outcome

    def __getattr__(self, name: str) -> Any:  # workers, fork_seconds, ...
        return getattr(self.engine, name)


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The workers train with one torch thread; with one here too, they also evaluate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("loss_transforms", "test", "faulty", FaultyConfig, Faulty)
    registry.register("aggregators", "test", "counting", CountingConfig, Counting)
    return registry


@pytest.fixture(scope="module")
def federation(registry: Registry) -> Federation:
    federation = build_federation(validate_section("data", DATA, registry), registry)
    sizes = [client.num_samples for client in federation.clients]
    assert len(set(sizes)) == len(sizes)  # every client a different size
    return federation


def simulate(
    registry: Registry, federation: Federation, engine: str, workers: int | None = None, **train: Any
) -> tuple[Simulator, Recorder]:
    config = validate_section("train", {**TRAIN, **train, "engine": engine, "workers": workers}, registry)
    simulator = Simulator(config, federation, registry)
    recorder = Recorder(simulator.engine)
    simulator.engine = recorder
    simulator.result = simulator.run(resume=False)
    return simulator, recorder


def history(simulator: Simulator) -> list[dict[str, Any]]:
    return [{k: v for k, v in record.as_dict().items() if k != "seconds"} for record in simulator.result.history]


def assert_identical(actual: Tensor, expected: Tensor) -> None:
    """Equal element for element (NaN where the other has NaN: a poisoned client's model)."""
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0, equal_nan=True)


def assert_same_outcomes(expected: Recorder, actual: Recorder) -> None:
    """The same outcomes in the same (plan) order, every tensor equal bit for bit."""
    assert len(actual.rounds) == len(expected.rounds)
    for wanted_round, got_round in zip(expected.rounds, actual.rounds):
        assert [outcome.chain for outcome in got_round] == [outcome.chain for outcome in wanted_round]
        for wanted, got in zip(wanted_round, got_round):
            assert type(got) is type(wanted)
            if isinstance(wanted, ClientFailure):
                assert got == wanted
                continue
            assert (got.client_id, got.weight, got.num_steps) == (wanted.client_id, wanted.weight, wanted.num_steps)
            assert_identical(got.vector, wanted.vector)
            assert sorted(got.extras) == sorted(wanted.extras)
            for key, value in wanted.extras.items():
                assert_identical(got.extras[key], value)


def assert_same_client_states(expected: dict[int, dict[str, Tensor]], actual: dict[int, dict[str, Tensor]]) -> None:
    assert list(actual) == list(expected)
    for client, state in expected.items():
        assert sorted(actual[client]) == sorted(state)
        assert all(torch.equal(actual[client][key], value) for key, value in state.items()), client


def assert_same_run(expected: tuple[Simulator, Recorder], actual: tuple[Simulator, Recorder]) -> None:
    (sequential, sequential_log), (other, other_log) = expected, actual
    assert_same_outcomes(sequential_log, other_log)
    assert torch.equal(other.final_vector, sequential.final_vector)
    assert history(other) == history(sequential)


@pytest.fixture(scope="module")
def sequential_run(registry: Registry, federation: Federation):
    """The sequential engine's run of an entry of ALGORITHMS (each run once per module)."""
    runs: dict[str, tuple[Simulator, Recorder]] = {}

    def run(algorithm: str) -> tuple[Simulator, Recorder]:
        if algorithm not in runs:
            runs[algorithm] = simulate(registry, federation, "sequential", **ALGORITHMS[algorithm])
        return runs[algorithm]

    return run


def live_workers() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children() if child.name.startswith("fedplug-parallel")]


def settle() -> None:
    """Let workers of earlier tests' last rounds finish exiting."""
    for worker in live_workers():
        worker.join(30)


def no_workers_left(engine: Any) -> bool:
    """After :meth:`ParallelEngine.close`, which joins the last round's workers."""
    engine.close()
    return not live_workers()


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_parallel_equals_sequential_bit_for_bit(registry, federation, sequential_run, algorithm, workers):
    sequential = sequential_run(algorithm)
    actual = simulate(registry, federation, "parallel", workers, **ALGORITHMS[algorithm])
    assert_same_run(sequential, actual)
    simulator = actual[0]
    assert simulator.engine.name == "parallel" and simulator.result.derived_params["engine_workers"] == workers
    assert len(simulator.engine.fork_seconds) == TRAIN["rounds"]
    # The model moved: the comparison is not between two untouched start vectors.
    assert not torch.equal(sequential[0].final_vector, sequential[1].start_vectors[0])
    assert no_workers_left(simulator.engine)


def test_scaffold_client_states_come_back_from_the_workers(registry, federation, tmp_path):
    checkpoints = []
    for engine, workers in (("sequential", None), ("parallel", 2)):
        train = {**TRAIN, **ALGORITHMS["scaffold"], "engine": engine, "workers": workers}
        path = tmp_path / f"{engine}.pt"
        simulator = Simulator(validate_section("train", train, registry), federation, registry, checkpoint_path=path)
        simulator.run(resume=False)
        checkpoints.append(torch.load(path, weights_only=False))
    expected, actual = (checkpoint["client_states"] for checkpoint in checkpoints)
    assert len(expected) == federation.num_clients
    assert all(torch.count_nonzero(state["c_k"]) > 0 for state in expected.values())  # c_k moved
    assert_same_client_states(expected, actual)
    assert torch.equal(checkpoints[1]["aggregator"]["control"], checkpoints[0]["aggregator"]["control"])
    assert torch.equal(checkpoints[1]["global_vector"], checkpoints[0]["global_vector"])


def test_fedgsp_chains_are_trained_whole_in_plan_order(registry, federation):
    _, log = simulate(registry, federation, "parallel", 3, **ALGORITHMS["fedgsp"])
    chains = [outcome.chain for outcome in log.rounds[0]]
    assert sorted(len(chain) for chain in chains) == [1, 1, 2, 2]
    assert all(isinstance(outcome, ClientUpdate) and outcome.weight == 1.0 for outcome in log.rounds[0])


def test_one_worker_and_more_workers_than_chains(registry, federation, monkeypatch):
    forks: list[int] = []
    original = ParallelEngine._fork

    def counting(self, earlier, *args):
        forks.append(len(earlier))
        return original(self, earlier, *args)

    monkeypatch.setattr(ParallelEngine, "_fork", counting)
    sequential = simulate(registry, federation, "sequential", client_fraction=0.5)
    one = simulate(registry, federation, "parallel", 1, client_fraction=0.5)
    assert forks == [0]  # one worker, forked for round 1 and reused in round 2
    forks.clear()
    many = simulate(registry, federation, "parallel", 8, client_fraction=0.5)
    assert forks == [0, 1, 2]  # 3 chains per round: 3 workers, not 8
    assert_same_run(sequential, one)
    assert_same_run(sequential, many)


class Unpicklable:
    """A component attribute that cannot be sent to a worker (as a lock or a lambda)."""

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle this")


@pytest.mark.parametrize("algorithm", ["scaffold", "fedgsp"])
def test_workers_are_reused_and_forked_again_when_the_state_cannot_be_sent(
    registry, federation, sequential_run, monkeypatch, algorithm
):
    pids: list[list[int]] = []
    original = ParallelEngine._collect

    def recording(self, workers, *args):
        pids.append([worker.process.pid for worker in workers])
        return original(self, workers, *args)

    monkeypatch.setattr(ParallelEngine, "_collect", recording)
    reused = simulate(registry, federation, "parallel", 2, **ALGORITHMS[algorithm], rounds=3)
    assert pids[0] == pids[1] == pids[2]  # the same two processes trained every round
    assert_same_run(simulate(registry, federation, "sequential", **ALGORITHMS[algorithm], rounds=3), reused)
    pids.clear()
    sequential = sequential_run(algorithm)
    config = validate_section("train", {**TRAIN, **ALGORITHMS[algorithm], "engine": "parallel", "workers": 2}, registry)
    simulator = Simulator(config, federation, registry)
    simulator.algorithm.aggregator.unsendable = Unpicklable()
    recorder = Recorder(simulator.engine)
    simulator.engine = recorder
    simulator.result = simulator.run(resume=False)
    assert not set(pids[0]) & set(pids[1])  # round 2 forked new workers
    assert_same_run(sequential, (simulator, recorder))


def test_a_worker_killed_while_it_stands_by_is_replaced(registry, federation, sequential_run):
    sequential = sequential_run("fedavg")
    config = validate_section("train", {**TRAIN, "engine": "parallel", "workers": 2}, registry)

    def kill_one_worker(record: Any) -> None:
        if record.round == 1:
            victim = live_workers()[0]
            victim.kill()
            victim.join()

    simulator = Simulator(config, federation, registry, observers=[kill_one_worker])
    recorder = Recorder(simulator.engine)
    simulator.engine = recorder
    simulator.result = simulator.run(resume=False)
    assert_same_run(sequential, (simulator, recorder))  # no chain failed
    assert no_workers_left(simulator.engine)


def _round_of_every_client(
    registry: Registry, federation: Federation, **train: Any
) -> tuple[ParallelEngine, Tensor, RoundPlan, RoundContext]:
    """A parallel engine (2 workers), its start vector, a plan of every client alone and a
    round context, to drive ``run_round`` directly."""
    config = validate_section("train", {**TRAIN, "engine": "parallel", "workers": 2, **train}, registry)
    simulator = Simulator(config, federation, registry)
    simulator.algorithm.loss_transform.prepare(federation)
    context = RoundContext(federation, simulator.algorithm, simulator.schedule, 0, {})
    plan = RoundPlan([[k] for k in range(federation.num_clients)])
    return simulator.engine, model_to_vector(simulator.model), plan, context


def test_loss_contexts_computed_in_the_workers_are_cached(registry, federation, monkeypatch):
    engine, start, plan, context = _round_of_every_client(registry, federation, loss_transform="fedshift")
    loss_transform = context.algorithm.loss_transform
    first = list(engine.run_round(start, plan, 0, context))
    assert sorted(context.loss_contexts) == list(range(federation.num_clients))
    for client in federation.clients:
        expected = loss_transform.client_context(client.client_id, client.class_counts)
        assert sorted(context.loss_contexts[client.client_id]) == sorted(expected)
        for key, value in expected.items():
            assert_identical(context.loss_contexts[client.client_id][key], value)

    def unavailable(client_id: int, class_counts: np.ndarray) -> dict[str, Tensor]:
        raise RuntimeError("computed again")

    monkeypatch.setattr(loss_transform, "client_context", unavailable)
    second = list(engine.run_round(start, plan, 0, context))
    assert all(isinstance(outcome, ClientUpdate) for outcome in first + second)
    assert all(torch.equal(a.vector, b.vector) for a, b in zip(first, second))


def test_results_travel_back_exactly():
    values = {
        "vector": torch.randn(1000),
        "scalar": torch.tensor(2.5),
        "counts": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(3).half(),
        "brain": torch.randn(3).bfloat16(),  # no numpy dtype: torch's own pickling
        "view": torch.randn(100_000)[10:20],
        "nested": {"c_k": torch.randn(2, 3).t()},
    }
    message = parallel_worker.dumps(values)
    back = pickle.loads(message)
    assert len(message) < 100_000  # the view sent its 10 elements, not its 100,000
    for key in ("vector", "scalar", "counts", "mask", "half", "brain", "view"):
        assert back[key].dtype == values[key].dtype and torch.equal(back[key], values[key]), key
    assert torch.equal(back["nested"]["c_k"], values["nested"]["c_k"])


# ------------------------------------------------------------------ failures


def test_a_raising_client_fails_as_in_the_sequential_engine(registry, federation):
    faulty = {"loss_transform": {"name": "faulty", "raise_on": [1], "nan_on": [4]}}
    sequential = simulate(registry, federation, "sequential", **faulty)
    actual = simulate(registry, federation, "parallel", 2, **faulty)
    assert_same_run(sequential, actual)
    failures = [outcome for outcome in actual[1].rounds[0] if isinstance(outcome, ClientFailure)]
    assert failures == [ClientFailure([1], "RuntimeError: client 1 lost its disk")]
    assert [record.failures for record in actual[0].result.history] == [2, 2]  # + client 4's NaN


def _dying_on(client: int, how: str):
    original = parallel_worker.train_chain

    def train_chain(model, start_vector, chain, plan, round_index, context):
        if client in chain or client < 0:
            if how == "exit":
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(model, start_vector, chain, plan, round_index, context)

    return train_chain


@pytest.mark.parametrize(
    "how, reason",
    [
        ("exit", "the worker process training it died with exit code 7"),
        ("sigkill", "the worker process training it died with exit code -9 (signal SIGKILL)"),
    ],
)
def test_a_dying_worker_fails_only_its_chain(registry, federation, sequential_run, monkeypatch, how, reason):
    _, sequential_log = sequential_run("fedavg")
    monkeypatch.setattr(parallel_worker, "train_chain", _dying_on(2, how))
    simulator, log = simulate(registry, federation, "parallel", 2)
    for round_outcomes, expected in zip(log.rounds, sequential_log.rounds):
        assert [outcome.chain for outcome in round_outcomes] == [outcome.chain for outcome in expected]
        failures = [outcome for outcome in round_outcomes if isinstance(outcome, ClientFailure)]
        assert failures == [ClientFailure([2], reason)]
    # In round 1 the chains queued behind the dead one went to the other worker and
    # trained exactly as in the sequential engine.
    for outcome, wanted in zip(log.rounds[0], sequential_log.rounds[0]):
        if wanted.chain != [2]:
            assert torch.equal(outcome.vector, wanted.vector)
    assert [record.failures for record in simulator.result.history] == [1, 1]
    assert no_workers_left(simulator.engine)


def _parallel_simulator(registry: Registry, federation: Federation, **train: Any) -> tuple[Simulator, Recorder]:
    config = validate_section("train", {**TRAIN, "engine": "parallel", "workers": 2, **train}, registry)
    simulator = Simulator(config, federation, registry)
    recorder = Recorder(simulator.engine)
    simulator.engine = recorder
    return simulator, recorder


def test_a_dead_worker_counts_against_the_failure_policy(registry, federation, monkeypatch):
    monkeypatch.setattr(parallel_worker, "train_chain", _dying_on(0, "exit"))
    simulator, recorder = _parallel_simulator(
        registry, federation, failures={"max_failed_fraction": 0.1, "max_round_retries": 1}
    )
    with pytest.raises(TrainingError, match=r"round 1: 1 of 6 client updates failed in each of 2 attempts"):
        simulator.run(resume=False)
    assert len(recorder.rounds) == 2  # the round was retried once
    for outcomes in recorder.rounds:
        assert [outcome.chain for outcome in outcomes if isinstance(outcome, ClientFailure)] == [[0]]
    assert no_workers_left(simulator.engine)


def test_every_worker_dying_fails_every_chain_without_hanging(registry, federation, monkeypatch):
    monkeypatch.setattr(parallel_worker, "train_chain", _dying_on(-1, "exit"))
    simulator, recorder = _parallel_simulator(registry, federation)
    # As with the sequential engine when every client fails: the round is retried, then the run stops.
    with pytest.raises(TrainingError, match=r"round 1: 6 of 6 client updates failed in each of 2 attempts"):
        simulator.run(resume=False)
    reasons = [outcome.reason for outcome in recorder.rounds[0]]
    assert reasons[:2] == ["the worker process training it died with exit code 7"] * 2
    assert reasons[2:] == ["not trained: every worker process died (exit code 7, exit code 7)"] * 4
    assert no_workers_left(simulator.engine)


def test_workers_stand_by_for_the_evaluation_and_exit_when_dismissed(registry, federation):
    engine, start, plan, context = _round_of_every_client(registry, federation)
    settle()
    outcomes = list(engine.run_round(start, plan, 0, context))
    assert len(outcomes) == federation.num_clients
    workers = live_workers()
    assert len(workers) == 2 and all(worker.exitcode is None for worker in workers)  # waiting
    assert engine.evaluator is not None
    engine.evaluator.evaluate(engine.model, spread=engine.spread_evaluation)
    assert all(worker.exitcode is None for worker in workers)  # waiting for the next round
    engine._dismiss()  # what close() does before it joins them
    for worker in workers:
        worker.join(30)
    assert [worker.exitcode for worker in workers] == [0] * len(workers)
    engine.close()


# ------------------------------------------------------------------ evaluation in the workers


def _after_a_round(registry: Registry, federation: Federation, **train: Any) -> tuple[ParallelEngine, Evaluator]:
    """A parallel engine whose 2 workers stand by after a round of every client alone,
    small evaluation batches (the test set and the local splits take several each), and
    the round's first update loaded into the model, as the simulator loads the aggregate."""
    engine, start, plan, context = _round_of_every_client(registry, federation, eval_batch_size=16, **train)
    settle()
    outcomes = list(engine.run_round(start, plan, 0, context))
    assert isinstance(outcomes[0], ClientUpdate)
    vector_to_model(outcomes[0].vector, engine.model)
    assert engine.evaluator is not None and len(engine.evaluator.batches()) >= 10
    return engine, engine.evaluator


def test_the_workers_evaluation_equals_the_main_process_bit_for_bit(registry, federation, monkeypatch):
    engine, evaluator = _after_a_round(registry, federation)
    expected = evaluator.evaluate(engine.model)
    assert 0.0 < expected.accuracy < 1.0 and not np.isnan(expected.client_accuracy_mean)

    def here(*args: Any) -> None:  # after the fork: only this process sees it
        raise AssertionError("a batch was computed in the main process")

    monkeypatch.setattr(Evaluator, "predict", here)
    batches = evaluator.batches()
    results = engine.spread_evaluation(evaluator, engine.model, batches)
    assert results is not None and len(results) == len(batches)
    monkeypatch.undo()
    actual = evaluator.evaluate(engine.model, spread=lambda evaluator, model, batches: results)
    assert actual == expected  # accuracy, loss (summed in batch order), local mean and spread
    assert engine.model.training  # the main process's model is left in training mode
    assert no_workers_left(engine)


def test_a_worker_dying_while_it_evaluates_leaves_its_batches_to_the_others(registry, federation):
    engine, evaluator = _after_a_round(registry, federation)
    expected = evaluator.evaluate(engine.model)  # here: the workers go on standing by
    victim = engine._standby[0].process
    victim.kill()
    victim.join()
    assert evaluator.evaluate(engine.model, spread=engine.spread_evaluation) == expected
    assert no_workers_left(engine)


def test_every_worker_dying_while_they_evaluate_leaves_the_batches_to_the_main_process(registry, federation):
    engine, evaluator = _after_a_round(registry, federation)
    expected = evaluator.evaluate(engine.model)
    for worker in engine._standby:
        worker.process.kill()
        worker.process.join()
    assert evaluator.evaluate(engine.model, spread=engine.spread_evaluation) == expected
    assert no_workers_left(engine)


def test_an_error_in_a_workers_evaluation_is_raised_by_the_main_process(registry, federation, monkeypatch):
    def broken(self, model, batch):  # in the workers (forked after this) and here
        raise RuntimeError(f"cannot evaluate batch at {batch.start}")

    monkeypatch.setattr(Evaluator, "predict", broken)
    engine, evaluator = _after_a_round(registry, federation)
    workers = live_workers()
    with pytest.raises(RuntimeError, match="cannot evaluate batch at 0"):
        evaluator.evaluate(engine.model, spread=engine.spread_evaluation)
    engine._dismiss()
    for worker in workers:
        worker.join(30)
    assert [worker.exitcode for worker in workers] == [0, 0]  # they reported the error, not died of it
    engine.close()


def test_with_more_torch_threads_or_another_evaluator_the_main_process_evaluates(registry, federation):
    engine, evaluator = _after_a_round(registry, federation)
    torch.set_num_threads(2)
    try:
        assert engine.spread_evaluation(evaluator, engine.model, evaluator.batches()) is None
    finally:
        torch.set_num_threads(1)
    # nor when asked for another evaluator's batches (the workers hold the one they were forked with)
    other = Evaluator(federation, 16)
    assert engine.spread_evaluation(other, engine.model, other.batches()) is None
    assert engine.spread_evaluation(evaluator, engine.model, evaluator.batches()) is not None
    assert no_workers_left(engine)


def _child_processes() -> set[int]:
    """Every child of this process, running or exited but not yet joined (zombie)."""
    children: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as listing:
            children.update(int(pid) for pid in listing.read().split())
    return children


def test_a_finished_run_leaves_no_worker_process_behind(registry, federation):
    settle()
    before = _child_processes()
    config = validate_section("train", {**TRAIN, "engine": "parallel", "workers": 2}, registry)
    Simulator(config, federation, registry).run(resume=False)
    assert _child_processes() <= before


@pytest.mark.parametrize("complete_rounds_before", [0, 1])
def test_workers_are_terminated_when_the_consumer_stops_early(registry, federation, complete_rounds_before):
    engine, start, plan, context = _round_of_every_client(registry, federation)
    settle()
    for round_index in range(complete_rounds_before):  # then the stopped round reuses the workers
        list(engine.run_round(start, plan, round_index, context))
    standing_by = live_workers()
    outcomes = engine.run_round(start, plan, complete_rounds_before, context)
    first = next(outcomes)
    assert isinstance(first, ClientUpdate) and first.chain == [0]
    assert len(live_workers()) == 2
    assert set(live_workers()) >= set(standing_by)
    outcomes.close()
    assert not live_workers()  # terminated and joined by close(), not left to exit


# ------------------------------------------------------------------ config


def _config_error(registry: Registry, **train: Any) -> str:
    with pytest.raises(ConfigError) as error:
        validate_section("train", {**TRAIN, **train}, registry)
    return str(error.value)


def test_config_refuses_parallel_on_cuda_and_bad_workers(registry):
    assert "use engine 'vectorized' or 'sequential'" in _config_error(registry, engine="parallel", device="cuda")
    assert "train.workers: Input should be greater than or equal to 1" in _config_error(
        registry, engine="parallel", workers=0
    )
    assert "train.worker: unknown key" in _config_error(registry, engine="parallel", worker=2)
    assert "workers is set but engine is 'sequential'" in _config_error(registry, engine="sequential", workers=2)


def test_default_workers_is_one_per_usable_cpu(registry, federation):
    config = validate_section("train", {**TRAIN, "engine": "parallel"}, registry)
    assert config.workers is None
    assert Simulator(config, federation, registry).engine.workers == default_workers() == len(os.sched_getaffinity(0))


def test_a_platform_without_fork_is_refused(registry, federation, monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    config = validate_section("train", {**TRAIN, "engine": "parallel"}, registry)
    with pytest.raises(ConfigError, match="cannot do; use engine 'sequential'"):
        Simulator(config, federation, registry)


def test_auto_stays_sequential_on_cpu(registry, federation):
    config = validate_section("train", TRAIN, registry)
    assert Simulator(config, federation, registry).engine.name == "sequential"


# ------------------------------------------------------------------ checkpoint and resume


class Crash(Exception):
    pass


def test_resume_after_a_crash_gives_the_uninterrupted_model(registry, federation, tmp_path):
    train = {**TRAIN, **ALGORITHMS["scaffold"], "rounds": 3, "engine": "parallel", "workers": 2}
    config = validate_section("train", train, registry)
    uninterrupted = Simulator(config, federation, registry)
    uninterrupted.run(resume=False)

    def crash_after_round_2(record: Any) -> None:
        if record.round == 2:
            raise Crash

    checkpoint = tmp_path / "checkpoint.pt"
    with pytest.raises(Crash):
        Simulator(config, federation, registry, checkpoint_path=checkpoint, observers=[crash_after_round_2]).run()
    resumed = Simulator(config, federation, registry, checkpoint_path=checkpoint)
    result = resumed.run()
    assert len(result.history) == 3
    assert torch.equal(resumed.final_vector, uninterrupted.final_vector)
    assert torch.equal(resumed.algorithm.aggregator.control, uninterrupted.algorithm.aggregator.control)
