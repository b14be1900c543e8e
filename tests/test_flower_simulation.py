"""fedplug experiments through Flower's simulation runtime (``run_simulation``, Ray backend).

Ray takes tens of seconds to start on a small machine, so one simulation runs every
experiment of this module in sequence: the ServerApp below calls ``run_on_grid`` once per
job on the same four virtual SuperNodes (the nodes take the experiment from each
message, so they need no restart). The tests then check each job's outcome.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.nodes import (
    handle_evaluate,
    handle_query,
    handle_setup_phase,
    handle_train,
)
from fedplug.adapters.flower.records import CONFIG_KEY, MODEL_KEY
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedplug.config import validate_experiment
from fedplug.experiment import run_experiment

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning"),
]

NUM_NODES = 4
RAISE_ON = "test.raise-on"
NAN_ON = "test.nan-on"
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"loss_transform": {"name": "fedprox", "mu": 0.1}},
    "iwds": {"sampler": {"name": "iwds"}},
    "fedshift": {"loss_transform": {"name": "fedshift"}},
    "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.9}},
    "scaffold": {"aggregator": {"name": "scaffold"}},
    "fedgsp": {
        "grouper": {
            "name": "fedgsp",
            "mode": "fedgsp",
            "growth": "log",
            "alpha": 2.0,
            "beta": 1.0,
            "group_fraction": 0.5,
        },
        "client_fraction": 1.0,
    },
    # Phase 1 over train.feddisk messages before round 1; the weights stay on the nodes.
    "feddisk": {
        "loss_transform": {
            "name": "feddisk",
            "made_hidden": 8,
            "made_max_epochs": 3,
            "global_rounds": 2,
            "classifier_epochs": 5,
            "classifier_lr": 0.5,
        },
        "client_fraction": 1.0,
    },
}


def experiment(train: dict[str, Any]) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_NODES
    data["train"].update({"rounds": 2, **train})
    return validate_experiment(data)


# The ClientApp of this module: the ready one, plus failures the server asks for in
# the train config. Module-level functions, so Ray workers import them by reference.


def train_or_fail(message: Message, context: Context) -> Message:
    config = message.content[CONFIG_KEY]
    partition = int(context.node_config["partition-id"])
    if int(config.get(RAISE_ON, -1)) == partition:
        raise RuntimeError(f"injected failure on client {partition}")
    reply = handle_train(message, context)
    if int(config.get(NAN_ON, -1)) == partition:
        arrays = reply.content.array_records[MODEL_KEY]
        first = next(iter(arrays))
        broken = arrays[first].numpy().copy()
        broken.flat[0] = np.nan
        arrays[first] = Array(broken)
    return reply


client_app = ClientApp()
# like make_client_app: it builds whatever the server's config names
declare(client_app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
client_app.query()(handle_query)
client_app.train()(train_or_fail)
client_app.train("feddisk")(handle_setup_phase)  # FedDisk's setup phase
client_app.evaluate()(handle_evaluate)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def flower_runs() -> dict[str, Any]:
    """Run every job in one Flower simulation; return results, configs and warnings."""
    from flwr.simulation import run_simulation

    jobs: list[tuple[str, Any, dict[str, int]]] = [
        (name, experiment(train), {}) for name, train in ALGORITHMS.items()
    ]
    jobs.append(
        ("failures", experiment({"rounds": 1, "client_fraction": 1.0}), {RAISE_ON: 1, NAN_ON: 2})
    )
    outcome: dict[str, Any] = {"configs": {name: config for name, config, _ in jobs}, "results": {}}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name, config, train_config in jobs:
            outcome["results"][name] = run_on_grid(
                grid, config, train_config=train_config, node_wait_seconds=120
            )

    collector = _Collect()
    # The adapter's own warnings, and the round core's (dropped clients, retries).
    loggers = [logging.getLogger(name) for name in ("fedplug.adapters.flower", "fedplug.round")]
    for logger in loggers:
        logger.addHandler(collector)
    try:
        run_simulation(
            server,
            client_app,
            num_supernodes=NUM_NODES,
            backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
        )
    finally:
        for logger in loggers:
            logger.removeHandler(collector)
    outcome["warnings"] = collector.lines
    return outcome


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_two_rounds_on_ray_equal_the_simulator(flower_runs: dict[str, Any], name: str) -> None:
    # Prepare / Execute: the Flower run happened in the fixture; the simulator runs here.
    assert name in flower_runs["results"], f"the simulation did not finish job {name!r}"
    result, strategy = flower_runs["results"][name]
    simulated, simulator = run_experiment(flower_runs["configs"][name], None)
    # Assert: two rounds, every chain accepted, the simulator's global model and metrics.
    assert [record.round for record in result.history] == [1, 2]
    assert all(record.failures == 0 for record in result.history)
    assert (result.setup_rounds, result.setup_bytes) == (
        simulated.setup_rounds,
        simulated.setup_bytes,
    )
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)
    for ours, theirs in zip(result.history, simulated.history):
        assert ours.accuracy == pytest.approx(theirs.accuracy, abs=1e-6)
        assert ours.client_accuracy_mean == pytest.approx(theirs.client_accuracy_mean, abs=1e-6)
        assert (ours.participants, ours.bytes_up, ours.bytes_down) == (
            theirs.participants,
            theirs.bytes_up,
            theirs.bytes_down,
        )


def test_failures_on_ray_are_counted_logged_and_left_out(flower_runs: dict[str, Any]) -> None:
    result, strategy = flower_runs["results"]["failures"]
    record = result.history[0]
    assert (record.participants, record.failures) == (NUM_NODES, 2)
    warnings = "\n".join(flower_runs["warnings"])
    assert (
        "client 1 raised during training" in warnings and "injected failure on client 1" in warnings
    )
    assert "dropped client(s) [2]: returned non-finite (NaN/Inf) parameters" in warnings
    # The same round without the two broken clients, in-process.
    from test_flower_strategy import fedavg_of

    torch.testing.assert_close(
        strategy.final_vector,
        fedavg_of(flower_runs["configs"]["failures"], [0, 3]),
        rtol=0,
        atol=1e-5,
    )
