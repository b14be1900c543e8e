"""Memory: a 1,000-client MNIST federation trained in the simulator within 4 GB RSS.

A fresh subprocess (so nothing else shares its heap) imports fedplug, builds real MNIST
(the ``mnist`` dataset plugin) split IID over 1,000 clients with the default 20% local
test split, and runs

1. ``mlp``: ``--rounds`` rounds (default 3) with ``client_fraction`` 0.1 (100 clients a
   round), evaluation on the 10,000 test images and all 1,000 local test splits included;
2. the streaming check: one round of 100 clients through the engine and the FedAvg
   aggregator (the code path of ``Simulator._run_round`` without evaluation, as in
   ``bench_cpu_floor.py``), for ``mlp`` and ``cnn_mnist``, with VmHWM reset just before
   the round. ``cnn_mnist`` is 6.3 MiB, so an engine that kept one model per client
   would need about 635 MiB more; the measured increase stays near a few model sizes
   because each update is added to the aggregator's running sum and dropped.

The whole-run increase of phase 1 also contains the evaluator's buffers (all local test
splits concatenated, 12,000 images = 36 MiB) and evaluation activations (batch 1,000),
which is why the streaming check measures the training round alone.

It prints the RSS after each phase and the peak (VmHWM), and the driver cross-checks the
child's peak with ``getrusage(RUSAGE_CHILDREN).ru_maxrss``. The budget is 4 GB
(4 x 10^9 bytes = 3,815 MiB); the exit status is 1 above it.

Run: ``.venv/bin/python benchmarks/bench_memory.py [--clients 1000] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

BUDGET_MIB = round(4e9 / 2**20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000, help="K (default 1000)")
    parser.add_argument("--fraction", type=float, default=0.1, help="client_fraction (default 0.1)")
    parser.add_argument("--rounds", type=int, default=3, help="mlp rounds (default 3)")
    parser.add_argument(
        "--skip-cnn", action="store_true", help="leave out cnn_mnist in the streaming check"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_simulation(federation: Any, model: str, rounds: int, fraction: float) -> dict[str, Any]:
    from fedplug.plugins import default_registry
    from fedplug.run.vectors import num_elements
    from fedplug.simulation.simulator import Simulator

    config = benchlib.train_config(
        model={"name": model},
        client_fraction=fraction,
        rounds=rounds,
        batch_size=10,
        optimizer={"name": "sgd", "lr": 0.05},
        engine="sequential",
        seed=0,
    )
    rss_before = benchlib.current_rss_mib()
    reset = benchlib.reset_peak_rss()
    started = time.perf_counter()
    simulator = Simulator(config, federation, default_registry())
    result = simulator.run(resume=False)
    seconds = time.perf_counter() - started
    model_mib = num_elements(simulator.model) * 4 / 2**20
    participants = result.history[-1].participants
    return {
        "model": model,
        "rounds": rounds,
        "clients_per_round": participants,
        "seconds": round(seconds, 2),
        "accuracy": round(result.history[-1].accuracy, 4),
        "model_mib": round(model_mib, 2),
        "one_copy_per_client_mib": round(participants * model_mib, 1),
        "rss_before_mib": rss_before,
        "peak_increase_mib": round(benchlib.peak_rss_mib() - rss_before, 1) if reset else None,
        "rss_after_mib": benchlib.current_rss_mib(),
    }


def streaming_check(federation: Any, model: str, participants: int) -> dict[str, Any]:
    """Peak RSS increase of one engine + aggregator round over ``participants`` clients."""
    from bench_cpu_floor import FloorCase

    samples = participants * federation.clients[0].num_samples
    case = FloorCase(federation, model, batch_size=10, samples=samples, lr=0.05)
    case.centralised(0, limit=100)  # warm-up: kernels and allocator
    rss_before = benchlib.current_rss_mib()
    reset = benchlib.reset_peak_rss()
    seconds = case.federated(0).seconds
    model_mib = case.model_bytes / 2**20
    return {
        "model": model,
        "clients": len(case.participants),
        "seconds": round(seconds, 2),
        "model_mib": round(model_mib, 2),
        "one_copy_per_client_mib": round(len(case.participants) * model_mib, 1),
        "peak_increase_mib": round(benchlib.peak_rss_mib() - rss_before, 1) if reset else None,
    }


def worker(args: argparse.Namespace) -> int:
    threads = benchlib.set_threads(args.threads)
    phases: dict[str, Any] = {"after_imports_rss_mib": None}
    import fedplug.simulation.simulator  # noqa: F401  (import cost counted in the baseline)

    phases["after_imports_rss_mib"] = benchlib.current_rss_mib()
    started = time.perf_counter()
    federation = benchlib.mnist_federation(args.clients, local_test_fraction=0.2)
    phases["federation_seconds"] = round(time.perf_counter() - started, 2)
    phases["after_federation_rss_mib"] = benchlib.current_rss_mib()
    phases["federation_peak_rss_mib"] = benchlib.peak_rss_mib()
    phases["mlp"] = run_simulation(federation, "mlp", args.rounds, args.fraction)
    participants = max(1, round(args.fraction * args.clients))
    phases["streaming"] = [streaming_check(federation, "mlp", participants)]
    if not args.skip_cnn:
        phases["streaming"].append(streaming_check(federation, "cnn_mnist", participants))
    phases["peak_rss_mib"] = benchlib.process_peak_rss_mib()
    phases["threads"] = threads
    Path(args.worker_out).write_text(json.dumps(phases))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        return worker(args)
    threads = benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    benchlib.print_machine(
        f"memory: {args.clients:,}-client MNIST federation in the simulator", machine
    )
    print(f"torch threads: {threads}; budget {BUDGET_MIB} MiB (4 GB)")
    out = Path(f"/tmp/fedplug-bench-memory-{int(time.time())}.json")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker-out",
        str(out),
        "--clients",
        str(args.clients),
        "--fraction",
        str(args.fraction),
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads),
    ] + (["--skip-cnn"] if args.skip_cnn else [])
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        print(f"error: the worker failed with status {completed.returncode}", file=sys.stderr)
        return 1
    phases = json.loads(out.read_text())
    out.unlink()
    children_maxrss_mib = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    peak = max(phases["peak_rss_mib"], children_maxrss_mib)
    print(f"after imports: {phases['after_imports_rss_mib']} MiB RSS")
    print(
        f"federation of {args.clients:,} clients built in {phases['federation_seconds']} s: "
        f"{phases['after_federation_rss_mib']} MiB RSS (peak so far {phases['federation_peak_rss_mib']} MiB)"
    )
    run = phases["mlp"]
    print(
        f"simulator, mlp: {run['rounds']} round(s) x {run['clients_per_round']} clients in {run['seconds']} s "
        f"(accuracy {run['accuracy']}); peak RSS increase during the run {run['peak_increase_mib']} MiB "
        "(evaluator buffers and evaluation included)"
    )
    for check in phases["streaming"]:
        print(
            f"streaming check, {check['model']}: one round of {check['clients']} clients in {check['seconds']} s; "
            f"peak RSS increase {check['peak_increase_mib']} MiB against {check['one_copy_per_client_mib']} MiB "
            f"for one {check['model_mib']} MiB model per client"
        )
    within = peak <= BUDGET_MIB
    print(
        f"peak RSS {peak} MiB (child VmHWM {phases['peak_rss_mib']}, getrusage {children_maxrss_mib}): "
        f"{'within' if within else 'OVER'} the {BUDGET_MIB} MiB budget"
    )
    result = {
        "benchmark": "memory",
        "machine": machine,
        "threads": threads,
        "num_clients": args.clients,
        "client_fraction": args.fraction,
        "budget_mib": BUDGET_MIB,
        "phases": phases,
        "children_maxrss_mib": children_maxrss_mib,
        "peak_rss_mib": peak,
        "within_budget": within,
        "load_average_end": benchlib.load_average(),
    }
    benchlib.write_result(args.json, result)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
