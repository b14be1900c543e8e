"""What the fedplug Flower adapter costs per round over plain Flower FedAvg.

On the same nodes, shards and model, with one local epoch per round:

- ``plain``: Flower's own ``FedAvg`` strategy and a ClientApp with the usual PyTorch
  loop (shuffle, mini-batch SGD on cross-entropy), the Flower quickstart way;
- ``fedplug-fedavg``: :class:`FedplugStrategy` + the ready ClientApp, config ``fedavg``;
- ``fedplug-iwds`` and ``fedplug-fedshift``: the same with IWDS sampling / FedShift's loss.

Both evaluate centrally on the test set after every round (the same function) and skip
federated evaluation. A round's cost is measured from the end of one central evaluation
to the end of the next, as wall time and as CPU time of the measuring process; the first
round of each run (worker warm-up) is not timed, and the variants take turns
(``--passes``) so that a change in the machine's load hits all of them alike. The nodes
take their shard from the same module cache either way.

Runtimes: ``ray`` is ``flwr.simulation.run_simulation`` (its message queue is polled every
0.1 s, so a round costs at least about 0.2 s; CPU is the ServerApp's process only);
``loopback`` runs the same ServerApp code on an in-process
:class:`~fedplug.adapters.flower.LoopbackGrid`, no transport, so its CPU time covers the
server and every client: the adapter's own cost, little disturbed by other processes.

Run: ``.venv/bin/python benchmarks/bench_flower_overhead.py [--rounds 6] [--passes 2]
[--workloads tiny mnist] [--runtimes loopback ray]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

try:
    import fedplug  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from fedplug.adapters.flower import central_evaluation, run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.nodes import (
    experiment_message_config,
    handle_evaluate,
    handle_query,
    handle_train,
    node_experiment,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch.nn import functional as F

from fedplug.config import validate_experiment
from fedplug.data.build import load_dataset
from fedplug.plugins import default_registry

NUM_NODES = 10
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {
        "data": {
            "dataset": {
                "name": "synthetic",
                "num_train": 2000,
                "num_test": 500,
                "num_features": 20,
                "num_classes": 10,
            },
            "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
            "num_clients": NUM_NODES,
        },
        "train": {
            "model": {"name": "mlp", "hidden": [32]},
            "batch_size": 20,
            "optimizer": {"lr": 0.1},
        },
    },
    "mnist": {
        "data": {
            "dataset": {"name": "mnist"},
            "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
            "num_clients": NUM_NODES,
        },
        "train": {"model": {"name": "mlp"}, "batch_size": 50, "optimizer": {"lr": 0.1}},
    },
}
VARIANTS: dict[str, dict[str, Any]] = {
    "fedplug-fedavg": {},
    "fedplug-iwds": {"sampler": {"name": "iwds"}},
    "fedplug-fedshift": {"loss_transform": {"name": "fedshift"}},
}


def experiment(workload: str, rounds: int, train: dict[str, Any]) -> Any:
    spec = WORKLOADS[workload]
    return validate_experiment(
        {
            "data": dict(spec["data"]),
            "train": {
                **spec["train"],
                "rounds": rounds,
                "client_fraction": 1.0,
                "local_epochs": 1,
                **train,
            },
        }
    )


# ----------------------------------------------------------------- the ClientApp
# Module-level functions: Ray workers import this module, so the node caches of
# fedplug.adapters.flower.nodes survive between messages in both variants.


def plain_train(message: Message, context: Context) -> Message:
    """A plain Flower PyTorch client: load the arrays, one epoch of shuffled SGD."""
    node = node_experiment(message, context)  # only for the shard and the model object
    model, client = node.model, node.client
    model.load_state_dict(message.content["arrays"].to_torch_state_dict())
    model.train()
    train = node.config.train
    optimizer = torch.optim.SGD(model.parameters(), lr=train.optimizer.lr)
    generator = torch.Generator().manual_seed(int(message.content["config"]["server-round"]))
    order = torch.randperm(client.num_samples, generator=generator)
    for batch in torch.split(order, train.batch_size):
        loss = F.cross_entropy(model(client.train_x[batch]), client.train_y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    metrics = MetricRecord({"num-examples": client.num_samples})
    return Message(
        RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}),
        reply_to=message,
    )


def train(message: Message, context: Context) -> Message:
    if "bench.plain" in message.content["config"]:
        return plain_train(message, context)
    return handle_train(message, context)


client_app = ClientApp()
# the ready ClientApp's declaration (make_client_app's): it runs whatever the server names
declare(client_app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
client_app.query()(handle_query)
client_app.train()(train)
client_app.evaluate()(handle_evaluate)


# ------------------------------------------------------------------ the ServerApp


Stamp = tuple[float, float]
"""(wall seconds, CPU seconds of this process)."""


def stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


def round_costs(stamps: list[Stamp]) -> list[Stamp]:
    """Per-round (wall, CPU) seconds, the first round (warm-up) left out."""
    costs = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(stamps)]
    return costs[1:]


def run_plain(grid: Grid, config: Any) -> list[Stamp]:
    registry = default_registry()
    dataset = load_dataset(config.data, registry)
    from fedplug.adapters.flower import FedplugStrategy

    # Only to build the same initial model; FedplugStrategy sends nothing here.
    model = FedplugStrategy(
        config.train,
        num_clients=NUM_NODES,
        num_classes=dataset.num_classes,
        input_shape=dataset.input_shape,
    ).model
    evaluate = central_evaluation(
        model,
        torch.as_tensor(dataset.test_x, dtype=torch.float32),
        torch.as_tensor(dataset.test_y),
        config.train.eval_batch_size,
    )
    stamps: list[Stamp] = []

    def timed_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        result = evaluate(server_round, arrays)
        stamps.append(stamp())
        return result

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=NUM_NODES,
        min_available_nodes=NUM_NODES,
    )
    messages = experiment_message_config(config)
    strategy.start(
        grid,
        ArrayRecord(model.state_dict()),
        num_rounds=config.train.rounds,
        train_config=ConfigRecord({"bench.plain": 1, **messages}),
        evaluate_fn=timed_evaluate,
    )
    return round_costs(stamps)


def run_fedplug(grid: Grid, config: Any) -> list[Stamp]:
    stamps = [stamp()]
    run_on_grid(
        grid,
        config,
        federated_evaluation=False,
        observers=[lambda record: stamps.append(stamp())],
    )
    return round_costs(stamps)


def measure(grid: Grid, workload: str, rounds: int, passes: int) -> dict[str, list[Stamp]]:
    """(wall, CPU) seconds of every timed round of every variant, on ``grid``'s nodes.

    The variants take turns, ``passes`` times, so a change in the machine's load
    during the run hits all of them alike."""
    run_fedplug(grid, experiment(workload, 1, {}))  # warm every node: shards built, caches filled
    timings: dict[str, list[Stamp]] = {"plain": [], **{name: [] for name in VARIANTS}}
    for _ in range(passes):
        timings["plain"] += run_plain(grid, experiment(workload, rounds, {}))
        for name, train in VARIANTS.items():
            timings[name] += run_fedplug(grid, experiment(workload, rounds, train))
    return timings


def report(
    workload: str, runtime: str, rounds: int, seconds: float, timings: dict[str, list[Stamp]]
) -> None:
    cpu_scope = "all nodes (one process)" if runtime == "loopback" else "the ServerApp's process"
    print(
        f"\n{workload} on {runtime}: {NUM_NODES} nodes, {len(timings['plain'])} timed rounds per "
        f"variant, {seconds:.0f}s in all (load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores); CPU = {cpu_scope}"
    )
    print(
        f"{'variant':<18} {'wall s/round':>13} {'over plain':>11} {'CPU s/round':>12} {'over plain':>11}"
    )
    base_wall = statistics.median(wall for wall, _ in timings["plain"])
    base_cpu = statistics.median(cpu for _, cpu in timings["plain"])
    for name, values in timings.items():
        wall = statistics.median(value[0] for value in values)
        cpu = statistics.median(value[1] for value in values)
        print(
            f"{name:<18} {wall:>13.3f} {wall - base_wall:>+10.3f}s {cpu:>12.3f} {cpu - base_cpu:>+10.3f}s"
        )


def measuring_server_app(
    module: Any, workload: str, rounds: int, passes: int, timings: dict[str, list[Stamp]]
) -> ServerApp:
    """A ServerApp that fills ``timings`` with :func:`measure` of ``workload``."""
    server = ServerApp()

    @server.main()
    def server_main(grid: Grid, context: Context) -> None:
        timings.update(module.measure(grid, workload, rounds, passes))

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds per run (the first is not timed)"
    )
    parser.add_argument("--passes", type=int, default=2, help="runs of every variant, taking turns")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=["ray", "loopback"],
        choices=["ray", "loopback"],
        help="ray: flwr.simulation.run_simulation; loopback: in-process LoopbackGrid "
        "(no transport: the adapter's own CPU cost)",
    )
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    import bench_flower_overhead as module  # the importable copy, which Ray workers load
    from fedplug.adapters.flower import LoopbackGrid
    from flwr.simulation import run_simulation

    for workload in arguments.workloads:
        for runtime in arguments.runtimes:
            timings: dict[str, list[Stamp]] = {}
            started = time.perf_counter()
            if runtime == "loopback":
                timings = module.measure(
                    LoopbackGrid(module.client_app, NUM_NODES),
                    workload,
                    arguments.rounds,
                    arguments.passes,
                )
            else:
                run_simulation(
                    measuring_server_app(
                        module, workload, arguments.rounds, arguments.passes, timings
                    ),
                    module.client_app,
                    num_supernodes=NUM_NODES,
                    backend_config={
                        "client_resources": {"num_cpus": 1},
                        "init_args": {"num_cpus": os.cpu_count() or 1},
                    },
                )
            report(workload, runtime, arguments.rounds, time.perf_counter() - started, timings)


if __name__ == "__main__":
    main()
