"""fedplug's simulator against Flower's simulation engine on the same FedAvg workload.

Workload (McMahan et al. 2017's MNIST setting): real MNIST, IID over K=100 clients
(600 training samples each, no local test split), 10 clients per round, one local epoch,
batch 10, SGD lr 0.05, central evaluation of the 10,000 test images after every round.
``mlp`` runs 20 rounds; ``cnn_mnist`` runs ``--rounds-cnn`` (default 3) rounds, because
20 CNN rounds take about 10 minutes per run on one core.

Three programs do that work, each in a fresh subprocess, interleaved (the order rotates
every repeat):

- **fedplug**: ``Simulator(config, federation, registry).run()`` with the sequential
  engine and ``--threads`` torch threads;
- **flower**: ``flwr.simulation.run_simulation`` (Ray backend) of the plain Flower app in
  ``benchmarks/flower_plain`` (Message API ``ServerApp`` + ``flwr.serverapp.strategy.FedAvg``
  + ``ClientApp``), with ``--threads`` Ray CPUs and one CPU and one torch thread per
  client actor, so ``--threads`` clients train in parallel; the same model code
  (``fedplug.models.zoo``), initial weights and data (written once by this script);
- **floor**: a plain torch loop (``torch.optim.SGD``) that trains the same 10 clients'
  samples per round in one model and evaluates after each round: the time of the work
  with no FL framework at all;
- **floor_fused**: the same loop stepping with fedplug's ``FusedSGD`` (the same numbers as
  ``torch.optim.SGD``, less Python per step), which fedplug's client loop uses: against
  it, fedplug/floor_fused shows the engine's own overhead, and floor/floor_fused how much
  of fedplug's lead is the fused update.

Threads: both frameworks get the same number of CPU threads for the training math
(``--threads``, default 1). One, because the two cores of the machine this was written on
are shared with other work (load average around 10): there, two intra-op torch threads
collapsed (3 mlp rounds: 8.2 s with one thread, 196 s with two), so a two-thread figure
would measure the scheduler. ``--flower-cpus 2`` gives Flower two client actors against
fedplug's one thread (Flower then has twice the CPU). Flower's extra processes (Ray's
GCS and raylet, the ServerApp thread) are framework overhead and are not pinned.

Reported per model: the median wall time of each program's run (fedplug:
``Simulator`` construction + ``run``; Flower: the ``run_simulation`` call, Ray start and
shutdown included; the federation/data file is built before the clock starts), the whole
process wall time (imports and data loading included), the final test accuracy of every
run, and the ratios flower/fedplug and fedplug/floor. Two extra one-round Flower runs per
model split Flower's time into a fixed part (Ray and actor start, shutdown) and a part
per round. Also the CPU seconds of each
program's whole process tree (``getrusage(RUSAGE_CHILDREN)`` around the subprocess:
imports, data and Ray's processes included, as far as they are reaped inside the tree),
which is less sensitive than wall time to other jobs on the machine. fedplug's and the floor's repeats use
seeds 0, 1, ...; Flower samples its nodes with an unseeded ``random.sample``.

Run: ``.venv/bin/python benchmarks/bench_vs_flower.py [--threads 2] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS_DIR))

import benchlib

NUM_CLIENTS = 100
FRACTION = 0.1
PROGRAMS = ("fedplug", "flower", "floor", "floor_fused")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for training, both frameworks (default 1)",
    )
    parser.add_argument(
        "--flower-cpus",
        type=int,
        default=None,
        help=(
            "Ray CPUs (= concurrent client actors) for Flower (default: --threads); more than "
            "--threads gives Flower more CPU than fedplug"
        ),
    )
    parser.add_argument(
        "--fedplug-engine",
        choices=["sequential", "parallel"],
        default="sequential",
        help=(
            "fedplug's engine (default sequential); 'parallel' with --fedplug-workers N against "
            "--flower-cpus N compares the two at equal cores"
        ),
    )
    parser.add_argument(
        "--fedplug-workers", type=int, default=None, help="worker processes of the parallel engine"
    )
    parser.add_argument(
        "--no-targets",
        dest="judge_targets",
        action="store_false",
        help="report only: exit 0 whatever the one-core targets say (the equal-cores comparison)",
    )
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn_mnist"], help="default: mlp cnn_mnist"
    )
    parser.add_argument("--rounds", type=int, default=20, help="rounds for mlp (default 20)")
    parser.add_argument(
        "--rounds-cnn", type=int, default=3, help="rounds for cnn_mnist (default 3)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each program for mlp (default 3)"
    )
    parser.add_argument(
        "--repeats-cnn", type=int, default=2, help="runs of each program for cnn_mnist (default 2)"
    )
    parser.add_argument(
        "--no-startup-probe",
        dest="startup_probe",
        action="store_false",
        help="skip the two one-round Flower runs that split its time into start-up and per round",
    )
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--worker", choices=PROGRAMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--data-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ workers


def flower_cpus(args: argparse.Namespace) -> int:
    return args.flower_cpus or args.threads


def run_fedplug(args: argparse.Namespace) -> dict[str, Any]:
    from fedplug.plugins import default_registry
    from fedplug.simulation.simulator import Simulator

    federation = benchlib.mnist_federation(NUM_CLIENTS)
    config = benchlib.train_config(
        model={"name": args.model},
        client_fraction=FRACTION,
        rounds=args.rounds,
        local_epochs=1,
        batch_size=args.batch_size,
        optimizer={"name": "sgd", "lr": args.lr},
        engine=args.fedplug_engine,
        workers=args.fedplug_workers,
        seed=args.seed,
    )
    with benchlib.Stopwatch() as watch:
        simulator = Simulator(config, federation, default_registry())
        result = simulator.run(resume=False)
    return {
        "seconds": watch.seconds,
        "accuracy": [record.accuracy for record in result.history],
        "samples_trained": sum(record.participants for record in result.history)
        * federation.clients[0].num_samples,
        "engine": simulator.engine.name,
    }


def run_flower(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["FLOWER_PLAIN_DATA"] = args.data_file
    os.environ["FLOWER_PLAIN_THREADS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(BENCHMARKS_DIR), os.environ.get("PYTHONPATH")])
    )
    from flower_plain import client_app, server_app
    from flwr.simulation import run_simulation

    benchlib.set_threads(args.threads)  # the ServerApp thread evaluates with all of them
    server_app.SETTINGS.update(
        model=args.model,
        rounds=args.rounds,
        fraction=FRACTION,
        num_nodes=NUM_CLIENTS,
        batch_size=args.batch_size,
        lr=args.lr,
    )
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": flower_cpus(args),
            "num_gpus": 0,
            "logging_level": "ERROR",
            "log_to_driver": False,
        },
    }
    with benchlib.Stopwatch() as watch:
        run_simulation(
            server_app=server_app.app,
            client_app=client_app.app,
            num_supernodes=NUM_CLIENTS,
            backend_config=backend_config,
        )
    accuracy = server_app.RESULTS.get("accuracy", [])
    if len(accuracy) != args.rounds:
        raise RuntimeError(
            f"the Flower run evaluated {len(accuracy)} of {args.rounds} rounds; see its log"
        )
    return {"seconds": watch.seconds, "accuracy": accuracy, "ray_actors": flower_cpus(args)}


def run_floor(args: argparse.Namespace, optimizer: str = "torch") -> dict[str, Any]:
    import torch

    from fedplug.run.round_plan import clients_per_round, sample_clients

    data = torch.load(args.data_file, mmap=True, weights_only=True)
    from flower_plain import task

    model = task.build_model(args.model, seed=0)
    accuracy = []
    generator = torch.Generator().manual_seed(args.seed)
    with benchlib.Stopwatch() as watch:
        for round_index in range(args.rounds):
            clients = sample_clients(NUM_CLIENTS, clients_per_round(NUM_CLIENTS, FRACTION), args.seed, round_index)
            x = torch.cat([data["train_x"][k] for k in clients])
            y = torch.cat([data["train_y"][k] for k in clients])
            benchlib.centralised_epoch(
                model, x, y, args.batch_size, args.lr, generator, optimizer=optimizer
            )
            accuracy.append(task.evaluate(model, data["test_x"], data["test_y"])[0])
    return {"seconds": watch.seconds, "accuracy": accuracy}


def worker_main(args: argparse.Namespace) -> int:
    threads = benchlib.set_threads(args.threads)
    runner = {
        "fedplug": run_fedplug,
        "flower": run_flower,
        "floor": run_floor,
        "floor_fused": lambda args: run_floor(args, optimizer="fused"),
    }[args.worker]
    outcome = runner(args)
    outcome.update(
        program=args.worker,
        model=args.model,
        seed=args.seed,
        threads=threads,
        peak_rss_mib=benchlib.peak_rss_mib(),
        load_average=benchlib.load_average(),
    )
    Path(args.out).write_text(json.dumps(outcome))
    return 0


# ------------------------------------------------------------------------------ driver


def write_flower_data(path: Path) -> None:
    """The federation fedplug builds (same seed, same split), as tensors for the other programs."""
    import torch

    federation = benchlib.mnist_federation(NUM_CLIENTS)
    torch.save(
        {
            "train_x": [client.train_x for client in federation.clients],
            "train_y": [client.train_y for client in federation.clients],
            "test_x": federation.test_x,
            "test_y": federation.test_y,
        },
        path,
    )


def launch(
    program: str, args: argparse.Namespace, model: str, rounds: int, seed: int, workdir: Path
) -> dict[str, Any]:
    out = workdir / f"{program}-{model}-{seed}.json"
    log = workdir / f"{program}-{model}-{seed}.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        program,
        "--model",
        model,
        "--rounds",
        str(rounds),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        "--flower-cpus",
        str(flower_cpus(args)),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--fedplug-engine",
        args.fedplug_engine,
        *(["--fedplug-workers", str(args.fedplug_workers)] if args.fedplug_workers else []),
        "--data-file",
        str(workdir / "federation.pt"),
        "--out",
        str(out),
    ]
    started = time.perf_counter()
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as handle:
        completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
    process_seconds = time.perf_counter() - started
    usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (usage_after.ru_utime + usage_after.ru_stime) - (
        usage_before.ru_utime + usage_before.ru_stime
    )
    if completed.returncode != 0 or not out.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(
            f"{program} ({model}, seed {seed}) failed with status {completed.returncode}:\n{tail}"
        )
    outcome = json.loads(out.read_text())
    outcome["process_seconds"] = process_seconds
    outcome["process_cpu_seconds"] = cpu_seconds
    return outcome


def flower_startup(
    args: argparse.Namespace, model: str, rounds: int, summary: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """Split Flower's time into a fixed part (Ray start and shutdown, actor start) and a part
    per round, from one-round runs: t(R) = fixed + R * per_round."""
    one_round = [
        launch("flower", args, model, 1, 100 + index, workdir)["seconds"] for index in range(2)
    ]
    t_one = benchlib.median(one_round)
    t_all = summary["programs"]["flower"]["median_seconds"]
    per_round = (t_all - t_one) / (rounds - 1)
    floor_per_round = summary["programs"]["floor"]["median_seconds"] / rounds
    fedplug_per_round = summary["programs"]["fedplug"]["median_seconds"] / rounds
    probe = {
        "one_round_seconds": [round(t, 2) for t in one_round],
        "fixed_seconds": round(t_one - per_round, 2),
        "per_round_seconds": round(per_round, 3),
        "floor_per_round_seconds": round(floor_per_round, 3),
        "fedplug_per_round_seconds": round(fedplug_per_round, 3),
    }
    print(
        f"{model}: Flower one-round runs {probe['one_round_seconds']} s -> fixed cost about "
        f"{probe['fixed_seconds']} s, {probe['per_round_seconds']} s per round (fedplug "
        f"{probe['fedplug_per_round_seconds']} s, floor {probe['floor_per_round_seconds']} s per round)"
    )
    return probe


def summarise(model: str, rounds: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_program: dict[str, Any] = {}
    for program in PROGRAMS:
        mine = [run for run in runs if run["program"] == program]
        by_program[program] = {
            "seconds": [round(run["seconds"], 2) for run in mine],
            "median_seconds": round(benchlib.median([run["seconds"] for run in mine]), 2),
            "process_seconds": [round(run["process_seconds"], 2) for run in mine],
            "median_process_seconds": round(
                benchlib.median([run["process_seconds"] for run in mine]), 2
            ),
            "median_process_cpu_seconds": round(
                benchlib.median([run["process_cpu_seconds"] for run in mine]), 2
            ),
            "final_accuracy": [round(run["accuracy"][-1], 4) for run in mine],
            "peak_rss_mib": max(run["peak_rss_mib"] for run in mine),
        }
    fedplug, flower, floor, floor_fused = (by_program[p]["median_seconds"] for p in PROGRAMS)
    return {
        "model": model,
        "rounds": rounds,
        "programs": by_program,
        "flower_over_fedplug": round(flower / fedplug, 2),
        "fedplug_over_floor": round(fedplug / floor, 3),
        "fedplug_over_fused_floor": round(fedplug / floor_fused, 3),
        "flower_over_floor": round(flower / floor, 2),
        "load_average": [run["load_average"] for run in runs],
    }


def driver_main(args: argparse.Namespace) -> int:
    benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    benchlib.print_machine(
        "fedplug vs Flower simulation: FedAvg, MNIST, 100 clients, 10 per round", machine
    )
    print(
        f"threads for training: {args.threads} (fedplug: torch threads; Flower: Ray CPUs = concurrent "
        f"client actors, 1 torch thread each); Flower Ray CPUs {flower_cpus(args)}; batch {args.batch_size}, "
        f"lr {args.lr}, 1 local epoch; fedplug engine {args.fedplug_engine}"
        + (f" with {args.fedplug_workers} workers" if args.fedplug_workers else "")
    )
    targets = {
        "mlp": "flower/fedplug >= 3",
        "cnn_mnist": "fedplug <= flower and fedplug/floor <= 1.1",
    }
    models = []
    with tempfile.TemporaryDirectory(prefix="fedplug-vs-flower-") as directory:
        workdir = Path(directory)
        write_flower_data(workdir / "federation.pt")
        for model in args.models:
            is_cnn = model.startswith("cnn")
            rounds = args.rounds_cnn if is_cnn else args.rounds
            repeats = args.repeats_cnn if is_cnn else args.repeats
            runs = []
            for repeat in range(repeats):
                shift = repeat % len(PROGRAMS)
                order = PROGRAMS[shift:] + PROGRAMS[:shift]
                for program in order:
                    outcome = launch(program, args, model, rounds, repeat, workdir)
                    runs.append(outcome)
                    print(
                        f"{model:9s} {program:11s} seed {repeat}: {outcome['seconds']:7.2f} s "
                        f"(process {outcome['process_seconds']:.1f} s, CPU {outcome['process_cpu_seconds']:.1f} s), final accuracy "
                        f"{outcome['accuracy'][-1]:.4f}, peak RSS {outcome['peak_rss_mib']} MiB, "
                        f"load {outcome['load_average'][0]}"
                    )
                    sys.stdout.flush()
            summary = summarise(model, rounds, runs)
            if args.startup_probe and rounds > 1:
                summary["flower_startup"] = flower_startup(args, model, rounds, summary, workdir)
            if is_cnn:
                met = (
                    summary["programs"]["fedplug"]["median_seconds"]
                    <= summary["programs"]["flower"]["median_seconds"]
                    and summary["fedplug_over_floor"] <= 1.1
                )
            else:
                met = summary["flower_over_fedplug"] >= 3
            summary["target"] = targets.get(model, "")
            summary["meets_target"] = met
            models.append(summary)
            print(
                f"{model}: median fedplug {summary['programs']['fedplug']['median_seconds']} s, Flower "
                f"{summary['programs']['flower']['median_seconds']} s, floor {summary['programs']['floor']['median_seconds']} s; "
                f"Flower/fedplug {summary['flower_over_fedplug']}x, fedplug/floor {summary['fedplug_over_floor']}x "
                f"(fused-update floor {summary['programs']['floor_fused']['median_seconds']} s: "
                f"{summary['fedplug_over_fused_floor']}x), "
                f"Flower/floor {summary['flower_over_floor']}x; target {summary['target']}: "
                f"{'met' if met else 'NOT met'}"
            )
    result = {
        "benchmark": "vs_flower",
        "machine": machine,
        "threads": args.threads,
        "flower_cpus": flower_cpus(args),
        "fedplug_engine": args.fedplug_engine,
        "fedplug_workers": args.fedplug_workers,
        "num_clients": NUM_CLIENTS,
        "clients_per_round": int(NUM_CLIENTS * FRACTION),
        "batch_size": args.batch_size,
        "lr": args.lr,
        "models": models,
        "load_average_end": benchlib.load_average(),
    }
    benchlib.write_result(args.json, result)
    return 0 if not args.judge_targets or all(model["meets_target"] for model in models) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(args) if args.worker else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
