"""Timeouts that interrupt, on FedML: a hung client or a silent worker rank cannot stall
a run. Run by ``make test-fedml`` in ``.venv-fedml``; skipped in the main environment.

``train.failures.client_timeout_seconds`` (T) is enforced twice (``adapters/fedml``):
each worker trains every client under :func:`fedplug.deadline.deadline` (a client that
hangs fails at T, the worker's other clients train, its reply goes out in time), and
the server's wait for a step's replies ends ``tasks x T + margin`` after it sent the
step (:class:`~fedplug.adapters.fedml.deadlines.StepDeadlines`): a worker still silent
then fails that step's tasks, its late reply is discarded, and after the last round a
worker that never came back is given up on.

The hanging client is the test-only loss transform ``timeout_hang``
(``tests/timeout_plugins.py``); the real ``mpirun`` run loads it as an installed plugin
(an entry point on ``PYTHONPATH``). Each run is compared with the same rounds driven in
process, where the same clients fail at once or the server stands in for the silent
worker.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import SMALL_EXPERIMENT

pytest.importorskip("fedml", reason="FedML lives in .venv-fedml: run `make test-fedml`")
pytest.importorskip("mpi4py", reason="FedML's MPI backend needs mpi4py: run `make test-fedml`")

import timeout_plugins
from fedplug.adapters.fedml.coordinator import Coordinator
from fedplug.adapters.fedml.deadlines import DEFAULT_STEP_WAIT_SECONDS, StepDeadlines, reply_margin
from fedplug.adapters.fedml.fedml_components import FedplugClientTrainer
from fedplug.adapters.fedml.launcher import run_fedml
from fedplug.adapters.fedml.protocol import plan_rounds, reply
from fedplug.adapters.fedml.runtime import fedml_dataset
from fedplug.adapters.fedml.worker import Worker

from fedplug.components import WeightedMean
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.run.model import build_model

# A timeout that does not interrupt must fail the test, not hang the suite.
pytestmark = pytest.mark.timeout(300)

TIMEOUT = 1.0
MPI_TIMEOUT = 4.0
"""T for the real ``mpirun`` runs: three MPI ranks share two cores (and CI shares them
further), so a client's ordinary training must stay well inside T."""
MPI_STEP_WAIT = 2 * MPI_TIMEOUT + reply_margin(2 * MPI_TIMEOUT)
"""The server's wait for a step whose busiest worker has 2 tasks: 10 s."""
MPI_LATE_HANG = MPI_STEP_WAIT + 3.0
"""A hang that outlasts that wait by 3 s, leaving the rank 7 s of round 2's wait."""
WORKERS = 2


def interrupted(timeout: float = TIMEOUT) -> str:
    return f"ran past train.failures.client_timeout_seconds={timeout:g} and was interrupted"

PARAMETER_TOLERANCE = 1e-5
"""As in tests/test_fedml.py: the MPI ranks and this process may differ in the last bits."""


def experiment(hangs: list[dict[str, Any]], timeout: float = TIMEOUT, **train: Any) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    failures = {
        "client_timeout_seconds": timeout,
        "max_failed_fraction": train.pop("max_failed", 0.5),
    }
    data["train"].update(
        {
            "rounds": 2,
            "client_fraction": 1.0,
            "loss_transform": {"name": timeout_plugins.HANG, "hangs": hangs},
            "failures": failures,
            **train,
        }
    )
    return validate_experiment(data, timeout_plugins.timeout_registry())


def server_and_workers(config: Any) -> tuple[Coordinator, list[FedplugClientTrainer]]:
    registry = timeout_plugins.timeout_registry()
    federation = build_federation(config.data, registry)
    schedule = plan_rounds(config.train, registry, federation.class_counts)
    coordinator = Coordinator(config.train, federation, registry, schedule, WORKERS)
    trainers = []
    for slot in range(WORKERS):
        model = build_model(config.train, registry, federation, federation.device)
        worker = Worker(config.train, federation, registry, model, slot, WORKERS)
        trainers.append(FedplugClientTrainer(model, SimpleNamespace(), worker))
    return coordinator, trainers


def worker_reply(trainer: FedplugClientTrainer, coordinator: Coordinator, slot: int) -> dict:
    """Worker ``slot``'s reply to the current step, as FedML's client produces it."""
    owned = fedml_dataset(coordinator.federation, WORKERS, eval_batch_size=100)[5]
    trainer.set_model_params(coordinator.message[slot])
    trainer.train(owned[slot], "cpu", SimpleNamespace(round_idx=coordinator.step))
    return trainer.get_model_params()


def drive(config: Any, silent: dict[int, set[int]] | None = None) -> Coordinator:
    """Every step in process; the server stands in (``timeout_reply``) for the worker
    slots ``silent[step]``."""
    silent = silent or {}
    coordinator, trainers = server_and_workers(config)
    while not coordinator.finished:
        replies = [
            coordinator.timeout_reply(slot, 4.0)
            if slot in silent.get(coordinator.step, set())
            else worker_reply(trainers[slot], coordinator, slot)
            for slot in range(WORKERS)
        ]
        coordinator.handle_replies(replies)
    return coordinator


@pytest.fixture
def dropped() -> Any:
    """The round core's warnings (each dropped client with its reason)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("fedplug.round")
    logger.addHandler(handler)
    timeout_plugins.reset()
    yield lines
    logger.removeHandler(handler)
    timeout_plugins.RELEASE.set()


# ------------------------------------------------------------ the worker's deadline


def test_a_hung_client_is_interrupted_on_its_worker_and_dropped_each_round(dropped) -> None:
    # Prepare: 6 clients, all sampled, on 2 workers; client 2 (worker 0, with clients 0
    # and 4) hangs forever in every round; T = 1 s.
    hung = experiment([{"clients": [2]}])
    failing = experiment([{"clients": [2], "fail_instead": True}])

    # Execute
    started = time.monotonic()
    coordinator = drive(hung)
    seconds = time.monotonic() - started
    reference = drive(failing)

    # Assert: each round waited about T for client 2, dropped it naming the timeout, and
    # kept the five other updates: exactly the model of the run where it fails at once.
    assert 2 * TIMEOUT <= seconds < 2 * TIMEOUT + 8.0
    history = coordinator.result.history
    assert [(record.participants, record.failures) for record in history] == [(6, 1), (6, 1)]
    timed_out = [line for line in dropped if "client(s) [2]" in line and interrupted() in line]
    assert len(timed_out) == 2, dropped
    assert torch.equal(coordinator.global_vector, reference.global_vector)


# ------------------------------------------------------------ the server's deadline


def test_the_server_stands_in_for_a_silent_worker_and_discards_its_late_reply(dropped) -> None:
    # Prepare: one round of 6 clients; worker 0 trains clients 0, 2, 4 and answers;
    # worker 1 (clients 1, 3, 5) stays silent. A clock the test moves.
    config = experiment([], rounds=1)
    coordinator, trainers = server_and_workers(config)
    now = [0.0]
    deadlines = StepDeadlines(coordinator, clock=lambda: now[0])
    deadlines.start_step()
    answer = worker_reply(trainers[0], coordinator, 0)
    mean = WeightedMean()
    for result in answer["results"]:
        mean.add(result.vector, result.num_samples)

    # Execute / Assert: the step's replies are due after 3 tasks x T + the 2 s margin.
    assert coordinator.most_tasks() == 3
    assert deadlines.seconds_allowed() == 3 * TIMEOUT + reply_margin(3 * TIMEOUT) == 5.0
    assert deadlines.take(0, answer) is None
    assert "second reply of worker 0" in (deadlines.take(0, answer) or "")
    now[0] = 4.99
    assert deadlines.overdue(WORKERS) == []
    now[0] = 5.0
    assert deadlines.overdue(WORKERS) == [1]
    stand_in = deadlines.timeout_reply(1)
    assert deadlines.take(1, stand_in) is None
    coordinator.handle_replies([answer, stand_in])

    # Assert: worker 1's three clients failed with the reason; FedAvg of worker 0's three.
    record = coordinator.result.history[0]
    assert (record.participants, record.failures) == (6, 3)
    reason = (
        "worker 1 (MPI rank 2) sent no reply within 5s "
        f"(3 task(s) x train.failures.client_timeout_seconds={TIMEOUT:g} plus a margin)"
    )
    assert sum(reason in line for line in dropped) == 3, dropped
    assert torch.equal(coordinator.global_vector, mean.mean())

    # Execute / Assert: worker 1's reply to step 0 comes after the step was closed: it is
    # discarded, not taken for a later step's.
    assert coordinator.finished
    deadlines.start_step()
    late = reply(0, [])
    assert "discarded a late reply of worker 1 (MPI rank 2) for step 0" in (
        deadlines.take(1, late) or ""
    )

    # Execute / Assert: after the last step, a worker that missed a deadline and has not
    # finished within the margin is given up on; one that finished is not.
    now[0] = 5.0 + reply_margin(0.0) - 0.01
    assert deadlines.abandoned([0]) == []
    now[0] = 5.0 + reply_margin(0.0)
    assert deadlines.abandoned([0]) == [1]
    assert deadlines.abandoned([0, 1]) == []


def test_without_a_timeout_the_server_waits_an_hour_for_a_step(small_experiment) -> None:
    # Without T a hung worker would stall FedML's server forever: it waits
    # DEFAULT_STEP_WAIT_SECONDS (Flower's hour) for a step, then stands in for it.
    config = validate_experiment(small_experiment)
    coordinator, _ = server_and_workers(config)
    now = [5.0]
    deadlines = StepDeadlines(coordinator, clock=lambda: now[0])
    deadlines.start_step()
    assert deadlines.active
    assert deadlines.due_at() == 5.0 + DEFAULT_STEP_WAIT_SECONDS
    now[0] = 5.0 + DEFAULT_STEP_WAIT_SECONDS - 0.01
    assert deadlines.overdue(WORKERS) == []
    now[0] = 5.0 + DEFAULT_STEP_WAIT_SECONDS
    assert deadlines.overdue(WORKERS) == list(range(WORKERS))
    errors = [result.error for result in deadlines.timeout_reply(0)["results"]]
    assert errors and all("client_timeout_seconds is unset" in error for error in errors)


# ------------------------------------------------------------------ a real MPI run


@pytest.mark.slow
def test_over_mpi_hung_clients_and_a_silent_rank_cannot_stall_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dropped
) -> None:
    # Prepare: 6 clients, 3 sampled per round (seed 4: round 1 = clients 0, 2, 3;
    # round 2 = 1, 2, 5) on 2 worker ranks (rank 1: even clients, rank 2: odd ones);
    # T = 4 s. Client 0 hangs forever in one sleep, the deadline interrupts it (rank 1
    # then trains client 2 and replies). Client 3 hangs 13 s through the interrupt: the server
    # gives up on rank 2 at 2 tasks x T + 2 s = 10 s, and rank 2's reply to round 1 comes during
    # round 2, where it is discarded. Client 1 then hangs rank 2 for good in round 2: the
    # server gives up on it again, and once the run is over, on the rank itself.
    hangs = [
        {"clients": [0], "sleep_seconds": 3600.0},  # one blocking sleep: the timer signal ends it
        {"clients": [3], "seconds": MPI_LATE_HANG, "ignore_interrupt": True},
        {"clients": [1], "ignore_interrupt": True},
    ]
    config = experiment(hangs, MPI_TIMEOUT, client_fraction=0.5, seed=4, max_failed=0.9)
    site = timeout_plugins.write_entry_point(tmp_path / "site")
    path = [str(site), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(part for part in path if part))
    monkeypatch.delenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)

    # Execute
    run = run_fedml(config, tmp_path / "run", workers=WORKERS, timeout=180)

    # Assert: two rounds, each with two of three clients dropped (client 0 or 5 and rank
    # 2's), rank 2 given up on at the end; the model is the one of the same rounds in
    # process, with client 0 failing at once and the server standing in for rank 2.
    assert [(record.participants, record.failures) for record in run.result.history] == [
        (3, 2),
        (3, 2),
    ]
    assert run.abandoned_ranks == [2]
    log = (tmp_path / "run" / "fedml.log").read_text(errors="replace")
    assert "discarded a late reply of worker 1 (MPI rank 2) for step 0" in log
    assert interrupted(MPI_TIMEOUT) in log and "client 0" in log
    assert f"sent no reply within {MPI_STEP_WAIT:g}s" in log
    timeout_plugins.reset()
    reference = drive(
        experiment(
            [{"clients": [0], "fail_instead": True}], client_fraction=0.5, seed=4, max_failed=0.9
        ),
        silent={0: {1}, 1: {1}},
    )
    assert_same_model(tmp_path / "run" / "model.pt", config, reference)


@pytest.mark.slow
def test_over_mpi_a_rank_that_was_late_catches_up_and_the_run_ends_as_usual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dropped
) -> None:
    # Prepare: as above (seed 4, 3 of 6 clients per round, T = 4 s), with only client 3's
    # 13 s hang in round 1: the server gives up on rank 2 at 10 s; rank 2's late reply
    # comes during round 2 and is discarded, then rank 2 answers round 2 in time, and
    # the run ends the usual way (every rank finishes; nothing is given up on).
    hangs = [{"clients": [3], "seconds": MPI_LATE_HANG, "times": 1, "ignore_interrupt": True}]
    config = experiment(hangs, MPI_TIMEOUT, client_fraction=0.5, seed=4, max_failed=0.9)
    site = timeout_plugins.write_entry_point(tmp_path / "site")
    path = [str(site), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(part for part in path if part))
    monkeypatch.delenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)

    # Execute
    run = run_fedml(config, tmp_path / "run", workers=WORKERS, timeout=180)

    # Assert: round 1 lost client 3 (rank 2's one task), round 2 lost nobody; the model
    # is the one of the same rounds in process with the server standing in for rank 2
    # in round 1 only.
    assert [(record.participants, record.failures) for record in run.result.history] == [
        (3, 1),
        (3, 0),
    ]
    assert run.abandoned_ranks == []
    assert not (tmp_path / "run" / "abandoned-ranks.json").exists()
    log = (tmp_path / "run" / "fedml.log").read_text(errors="replace")
    assert "discarded a late reply of worker 1 (MPI rank 2) for step 0" in log
    reference = drive(experiment([], client_fraction=0.5, seed=4, max_failed=0.9), silent={0: {1}})
    assert_same_model(tmp_path / "run" / "model.pt", config, reference)


def assert_same_model(path: Path, config: Any, reference: Coordinator) -> None:
    from fedplug.run.vectors import vector_to_model

    final_state = torch.load(path)
    federation = reference.federation
    registry = timeout_plugins.timeout_registry()
    model = build_model(config.train, registry, federation, federation.device)
    vector_to_model(reference.global_vector, model)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(final_state[name], tensor, rtol=0.0, atol=PARAMETER_TOLERANCE), name
