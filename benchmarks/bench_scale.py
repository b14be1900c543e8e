"""Scale: from 1,000 to 1,000,000 clients, peak RSS and the time to the first round.

For each K (default 1,000 / 10,000 / 100,000 / 1,000,000) a fresh subprocess (so nothing
else shares its heap) imports fedplug, generates the ``synthetic`` dataset through its
registered loader (``--samples`` training samples, default 10,000,000, 20 features, 10
classes, 100,000 test samples), partitions it ``dirichlet_client`` (alpha 1) over K
clients, builds the federation and a simulator (``logreg``, FedAvg, uniform sampling,
SGD lr 0.05, batch 10, one local epoch, the sequential engine, ``--local-test-fraction``
default 0) and runs ``--rounds`` rounds (default 3) of ``--per-round`` clients (default
100, ``client_fraction`` = 100 / K), evaluating the global model on the test set after
every round.

Reported per K: the peak RSS (the child's VmHWM; ``getrusage`` beside it), the
time from starting the process to the first finished round, split into import, data,
partition, federation (``build_federation``), simulator (constructing the simulator:
class counts, evaluator, round core) and the first round, and every round's time with
the samples it trained; and the worker's CPU time up to the first finished round (less
sensitive than wall time to other processes on a shared machine). At a fixed number of
samples, a round of 100 clients trains 100 x N / K samples, so its time falls with K;
``--samples-per-client n`` instead gives every K the same n_k (N = n x K), where a
round's time should not depend on K.

The data are, by default, the library's own ``synthetic`` generator (the values every
run gets), so the data phase counts its two passes over the noise (it keeps one float32
copy and draws the noise twice to stay bit-identical to one large float64 draw).
``--data float32`` instead draws the benchmark's own float32 data in one pass (other
values, same shapes and classes), to time what comes after the data.

The targets (issue #27) apply to K = 1,000,000: peak RSS below 2 GB (2 x 10^9 bytes)
and the first round finished within 10 s; the exit status is 1 when either is missed
(or a worker fails).

Run: ``.venv/bin/python benchmarks/bench_scale.py [--clients 1000 1000000] [--json out.json]``
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

TARGET_CLIENTS = 1_000_000
RSS_BUDGET_MIB = round(2e9 / 2**20, 1)
SECONDS_BUDGET = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000], help="the K to run"
    )
    parser.add_argument("--samples", type=int, default=10_000_000, help="training samples N (default 10,000,000)")
    parser.add_argument(
        "--samples-per-client", type=int, default=None, help="n_k instead of a fixed N (N = n_k x K)"
    )
    parser.add_argument("--features", type=int, default=20, help="features (default 20)")
    parser.add_argument("--per-round", type=int, default=100, help="clients per round (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--local-test-fraction", type=float, default=0.0, help="data.local_test_fraction (default 0)"
    )
    parser.add_argument(
        "--data",
        choices=["library", "float32"],
        default="library",
        help="library: the synthetic dataset plugin (default); float32: the benchmark's own one-pass float32 data",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    """One K, in this fresh process; phase ends are wall-clock times (``time.time()``)."""
    marks: dict[str, float] = {}
    peaks: dict[str, float] = {}

    cpu: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.time()
        cpu[name] = time.process_time()
        peaks[name] = benchlib.peak_rss_mib()
        benchlib.reset_peak_rss()

    threads = benchlib.set_threads(args.threads)
    import numpy as np

    from fedplug.config import validate_section
    from fedplug.data.build import build_federation, load_dataset, make_partition
    from fedplug.plugins import default_registry
    from fedplug.simulation.simulator import Simulator

    registry = default_registry()
    mark("import")
    num_clients = args.clients[0]
    samples = args.samples_per_client * num_clients if args.samples_per_client else args.samples
    data_config = validate_section(
        "data",
        {
            "dataset": {
                "name": "synthetic",
                "num_train": samples,
                "num_test": 100_000,
                "num_features": args.features,
                "num_classes": 10,
                "class_separation": 1.0,
            },
            "partition": {"name": "dirichlet_client", "alpha": 1.0},
            "num_clients": num_clients,
            "local_test_fraction": args.local_test_fraction,
            "seed": 0,
        },
        registry,
    )
    if args.data == "float32":
        dataset = float32_dataset(samples, 100_000, args.features, 10, seed=0)
    else:
        dataset = load_dataset(data_config, registry)
    mark("data")
    partition = make_partition(dataset, data_config, registry)
    mark("partition")
    federation = build_federation(data_config, registry, "cpu", dataset=dataset, partition=partition)
    del dataset, partition  # the federation keeps the arrays it needs
    mark("federation")
    train_config = benchlib.train_config(
        model={"name": "logreg"},
        client_fraction=min(1.0, args.per_round / num_clients),
        rounds=args.rounds,
        batch_size=10,
        optimizer={"name": "sgd", "lr": 0.05},
        engine="sequential",
        seed=0,
    )
    round_ends: list[float] = []
    rounds: list[dict[str, Any]] = []

    def observe(record: Any) -> None:
        round_ends.append(time.time())
        cpu.setdefault("first_round", time.process_time())
        rounds.append({"seconds": round(record.seconds, 3), "participants": record.participants,
                       "accuracy": round(record.accuracy, 4)})

    simulator = Simulator(train_config, federation, registry, observers=[observe])
    mark("simulator")
    simulator.run(resume=False)
    mark("rounds")
    if hasattr(federation, "client_sizes"):
        sizes = federation.client_sizes
    else:  # a checkout from before the federation held arrays (for before/after runs)
        sizes = np.array([client.num_samples for client in federation.clients])
    for record, members in zip(rounds, _round_members(simulator, len(rounds))):
        record["samples"] = int(sizes[members].sum())
    result = {
        "num_clients": num_clients,
        "samples": samples,
        "marks": marks,
        "first_round_end": round_ends[0],
        "rounds": rounds,
        "peak_rss_mib": benchlib.process_peak_rss_mib(),
        "phase_peak_rss_mib": peaks,
        "cpu_to_first_round_seconds": round(cpu["first_round"], 2),
        "phase_cpu_seconds": _differences(cpu, ("import", "data", "partition", "federation", "simulator", "first_round")),
        "rss_end_mib": benchlib.current_rss_mib(),
        "threads": threads,
    }
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


def float32_dataset(num_train: int, num_test: int, num_features: int, num_classes: int, seed: int) -> Any:
    """Gaussian classes like the ``synthetic`` plugin's, drawn in one pass in float32 and
    mapped by a fixed affine map (``x / 12 + 0.5``, clipped) onto [0, 1]: not the
    plugin's values, a cheaper stand-in for timing what comes after the data."""
    import numpy as np

    from fedplug.data.datasets import Dataset

    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 1.0, size=(num_classes, num_features)).astype(np.float32)

    def split(count: int) -> tuple[Any, Any]:
        # Classes of equal size (up to one), as the plugin's.
        labels = rng.permutation(np.arange(count, dtype=np.int64) % num_classes)
        inputs = np.empty((count, num_features), dtype=np.float32)
        rows = max(1, (1 << 22) // num_features)
        for start in range(0, count, rows):
            block = rng.standard_normal((min(rows, count - start), num_features), dtype=np.float32)
            block += means[labels[start : start + rows]]
            block *= np.float32(1 / 12)
            block += np.float32(0.5)
            inputs[start : start + len(block)] = np.clip(block, 0.0, 1.0)
        return inputs, labels

    train_x, train_y = split(num_train)
    test_x, test_y = split(num_test)
    return Dataset(
        name="synthetic",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
        input_shape=(num_features,),
    ).validate("bench_scale's float32 data")


def _differences(marks: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """Each named phase's share of ``marks`` (cumulative readings, the first from 0)."""
    shares, previous = {}, 0.0
    for name in names:
        shares[name] = round(marks[name] - previous, 2)
        previous = marks[name]
    return shares


def _round_members(simulator: Any, rounds: int) -> list[list[int]]:
    """The clients each round trained (planned again: sampling depends only on the seed and round)."""
    from fedplug.run.round_plan import participants

    return [participants(simulator.core.plan(index)) for index in range(rounds)]


def run_one(args: argparse.Namespace, num_clients: int) -> dict[str, Any] | None:
    out = Path(f"/tmp/fedplug-bench-scale-{num_clients}-{int(time.time())}.json")
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker-out", str(out),
        "--clients", str(num_clients), "--samples", str(args.samples), "--features", str(args.features),
        "--per-round", str(args.per_round), "--rounds", str(args.rounds),
        "--local-test-fraction", str(args.local_test_fraction), "--threads", str(args.threads),
        "--data", args.data,
    ]  # fmt: skip
    if args.samples_per_client:
        command += ["--samples-per-client", str(args.samples_per_client)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.time()
    completed = subprocess.run(command, check=False)
    if completed.returncode != 0:
        print(f"error: the worker for K={num_clients:,} failed with status {completed.returncode}", file=sys.stderr)
        return None
    result = json.loads(out.read_text())
    out.unlink()
    children_maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # RUSAGE_CHILDREN holds the largest child so far: it names this child only when it grew.
    # A cross-check only: it also counts the forked copy of this (driver) process before
    # the exec, so for a small K it shows the driver's size, not the worker's.
    result["children_maxrss_mib"] = round(children_maxrss / 1024, 1) if children_maxrss > before else None
    marks = {**result["marks"], "first_round": result["first_round_end"], "start": started}
    names = ("start", "import", "data", "partition", "federation", "simulator", "first_round")
    result["phases_seconds"] = {
        name: seconds for name, seconds in _differences(marks, names).items() if name != "start"
    }
    result["to_first_round_seconds"] = round(result["first_round_end"] - started, 2)
    del result["marks"], result["first_round_end"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        return worker(args)
    threads = benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    size = f"n_k = {args.samples_per_client}" if args.samples_per_client else f"N = {args.samples:,}"
    benchlib.print_machine(
        f"scale: K clients over {size} synthetic samples ({args.data} data), {args.per_round} a round", machine
    )
    print(
        f"torch threads: {threads}; targets at K = {TARGET_CLIENTS:,}: peak RSS < {RSS_BUDGET_MIB} MiB (2 GB), "
        f"first round within {SECONDS_BUDGET} s of the start"
    )
    results, failed = [], False
    for num_clients in args.clients:
        result = run_one(args, num_clients)
        if result is None:
            failed = True
            continue
        results.append(result)
        phases = result["phases_seconds"]
        print(
            f"K={num_clients:>9,}: peak RSS {result['peak_rss_mib']:7.1f} MiB "
            f"(getrusage {result['children_maxrss_mib']}); first round after "
            f"{result['to_first_round_seconds']:6.2f} s ("
            + ", ".join(f"{name} {seconds}" for name, seconds in phases.items())
            + f"; CPU time {result['cpu_to_first_round_seconds']} s: "
            + ", ".join(f"{name} {seconds}" for name, seconds in result["phase_cpu_seconds"].items())
            + "); rounds "
            + ", ".join(f"{r['seconds']} s ({r['samples']:,} samples)" for r in result["rounds"])
            + "; peak RSS by phase (MiB): "
            + ", ".join(f"{name} {mib}" for name, mib in result["phase_peak_rss_mib"].items())
        )
        sys.stdout.flush()
    target = next((r for r in results if r["num_clients"] == TARGET_CLIENTS), None)
    verdict: dict[str, Any] = {}
    if target is not None:
        verdict = {
            "rss_within": target["peak_rss_mib"] < RSS_BUDGET_MIB,
            "time_within": target["to_first_round_seconds"] < SECONDS_BUDGET,
        }
        print(
            f"K={TARGET_CLIENTS:,}: peak RSS {target['peak_rss_mib']} MiB "
            f"({'within' if verdict['rss_within'] else 'OVER'} {RSS_BUDGET_MIB}); first round after "
            f"{target['to_first_round_seconds']} s ({'within' if verdict['time_within'] else 'OVER'} {SECONDS_BUDGET} s)"
        )
    load = benchlib.load_average()
    print(f"load average at the end: {' '.join(str(v) for v in load)}")
    benchlib.write_result(
        args.json,
        {
            "benchmark": "scale",
            "machine": machine,
            "threads": threads,
            "samples": args.samples,
            "samples_per_client": args.samples_per_client,
            "features": args.features,
            "per_round": args.per_round,
            "rounds": args.rounds,
            "local_test_fraction": args.local_test_fraction,
            "data": args.data,
            "rss_budget_mib": RSS_BUDGET_MIB,
            "seconds_budget": SECONDS_BUDGET,
            "results": results,
            "verdict": verdict,
            "load_average_end": load,
        },
    )
    return 1 if failed or (verdict and not all(verdict.values())) else 0


if __name__ == "__main__":
    sys.exit(main())
