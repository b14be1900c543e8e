"""Study runner on Ray: a 24-run MLP study on MNIST, sequential (``--jobs 1``) against
parallel (``--jobs 2``) and on a two-node local Ray cluster, same results.

Writes a study spec to a temporary folder: real MNIST (the ``mnist`` dataset plugin),
100 clients from ``dirichlet_client`` at alpha 0.1 and 1, FedAvg and FedAvgM (beta 0.9),
2 partition draws x 3 seeds, a one-hidden-layer MLP (64 units), 10 clients a round,
``--rounds`` rounds (default 150, about 10-15 s a run on one core). Then runs
``pipelines/studies/run_study.py`` on it three times, each into a fresh folder with
``--no-mlflow``: ``--jobs 1`` (in process, one after another) and ``--jobs N`` (Ray tasks,
one torch thread each, a local Ray started by the runner) and ``--jobs 2 --address`` of a
two-node local cluster (``ray.cluster_utils.Cluster``, one CPU per node). It checks that the results
files are identical apart from wall times (``train_seconds``, ``setup_seconds``), and prints
both wall times, their ratio (issue #24's target: >= 1.7x with 2 jobs on 2 cores) and the
torch thread count. The exit status is 1 when the results differ, not when the target is
missed (a benchmark, not a timed test).

``--repeats R`` (default 2) measures ``--jobs 1`` and ``--jobs N`` R times, alternating (1, N,
1, N, ...), so that a slow stretch of the machine hits both; the speedup reported is the
median of the R ratios, each ratio and wall time kept in the result. The two-node cluster
runs once.

``--quick``: 4 runs (alpha 0.1, draw 0, seeds 0 and 1) of 5 rounds, to check the script.

Run: ``.venv/bin/python benchmarks/bench_study_jobs.py [--jobs 2] [--rounds 150] [--repeats 2] [--quick] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

RUNNER = benchlib.REPO_ROOT / "pipelines" / "studies" / "run_study.py"
DEFAULT_JSON = benchlib.REPO_ROOT / "benchmarks" / "results" / "bench_study_jobs.json"
TIMING_FIELDS = ("train_seconds", "setup_seconds", "commit", "dirty")
"""Record fields that are not results: the wall times, which a parallel run changes, and
the checkout's commit and dirty flag, which a commit made while the benchmark runs
changes."""
TARGET_SPEEDUP = 1.7
OBJECT_STORE_BYTES = 2 * 1024**3
"""Each node's object store in the two-node cluster (it holds the node's federations)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs at once in the parallel pass (default 2)")
    parser.add_argument("--rounds", type=int, default=150, help="rounds per run (default 150)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measure --jobs 1 and --jobs N this many times, alternating (default 2)")
    parser.add_argument("--quick", action="store_true", help="4 runs of 5 rounds, to check the script")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help=f"write the result here (default {DEFAULT_JSON})")
    return parser.parse_args(argv)


def study_spec(rounds: int, quick: bool) -> dict[str, Any]:
    """The study: 2 cells x 2 algorithms x 2 draws x 3 seeds = 24 runs (``quick``: 1 x 2 x 1 x 2)."""
    alphas = {"0.1": {"data.partition.alpha": 0.1}} if quick else {
        "0.1": {"data.partition.alpha": 0.1}, "1": {"data.partition.alpha": 1.0}}
    return {
        "name": "bench-study-jobs",
        "description": "Benchmark of run_study.py --jobs (benchmarks/bench_study_jobs.py).",
        "base": {
            "study": {"target_accuracy": 0.85},
            "data": {"dataset": {"name": "mnist"}, "partition": {"name": "dirichlet_client", "alpha": 1.0},
                     "num_clients": 100, "local_test_fraction": 0.2, "seed": 0, "root": str(benchlib.DATA_ROOT)},
            "train": {"model": {"name": "mlp", "hidden": [64]}, "client_fraction": 0.1, "rounds": rounds,
                      "local_epochs": 1, "batch_size": 50, "optimizer": {"name": "sgd", "lr": 0.05},
                      "engine": "sequential", "device": "cpu"},
        },
        "grid": {"alpha": alphas},
        "algorithms": {"fedavg": {}, "fedavgm0.9": {"aggregator": {"name": "fedavgm", "momentum": 0.9}}},
        "draws": [0] if quick else [0, 1],
        "seeds": [0, 1] if quick else [0, 1, 2],
        "plots": [],
    }


def run_study(spec: Path, out: Path, results: Path, jobs: int, address: str | None = None) -> float:
    """Wall seconds of ``run_study.py spec --jobs jobs [--address address]`` into ``out``
    (raises on failure)."""
    command = [sys.executable, str(RUNNER), str(spec), "--no-mlflow", "--jobs", str(jobs), "--out", str(out),
               "--results", str(results)] + (["--address", address] if address else [])
    print(f"$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=benchlib.REPO_ROOT, env={**os.environ, "FEDPLUG_TORCH_THREADS": "1"})
    return time.perf_counter() - started


def two_node_cluster() -> Any:
    """A local Ray cluster of two nodes with one CPU each (``ray.cluster_utils.Cluster``,
    as ``tests/test_study_parallel.py`` starts it); shut it down after use."""
    from ray._common.utils import reset_ray_address
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's own default object store is 30% of the memory; Cluster's is 150 MiB, less than
    # one MNIST federation (220 MB), which would then spill to disk on every node.
    store = {"object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **store})
    reset_ray_address()  # no bare ray.init() elsewhere joins it
    cluster.add_node(num_cpus=1, **store)
    cluster.wait_for_nodes()
    return cluster


def comparable_records(results: Path) -> list[dict[str, Any]]:
    """The results file's records without their wall times."""
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return [{key: value for key, value in record.items() if key not in TIMING_FIELDS} for record in records]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    threads = benchlib.set_threads(1)
    machine = benchlib.machine_description()
    spec_document = study_spec(rounds, args.quick)
    runs = (len(spec_document["grid"]["alpha"]) * len(spec_document["algorithms"]) * len(spec_document["draws"])
            * len(spec_document["seeds"]))
    benchlib.print_machine(f"study_jobs: a {runs}-run MLP study, --jobs 1 against --jobs {args.jobs}", machine)
    with tempfile.TemporaryDirectory(prefix="fedplug-bench-study-jobs-") as folder:
        root = Path(folder)
        spec = root / "study.yaml"
        spec.write_text(yaml.safe_dump(spec_document, sort_keys=False))
        timings: dict[int, list[float]] = {1: [], args.jobs: []}
        outputs: dict[int, list[Any]] = {1: [], args.jobs: []}
        for repeat in range(args.repeats):
            for jobs in (1, args.jobs):
                name = f"jobs{jobs}-{repeat}"
                timings[jobs].append(run_study(spec, root / name, root / f"{name}.jsonl", jobs))
                outputs[jobs].append(comparable_records(root / f"{name}.jsonl"))
        cluster = two_node_cluster()
        try:
            cluster_seconds = run_study(spec, root / "cluster", root / "cluster.jsonl", 2, cluster.address)
        finally:
            cluster.shutdown()
        on_cluster = comparable_records(root / "cluster.jsonl")
    reference = outputs[1][0]
    same = len(reference) == runs and all(output == reference for output in [*outputs[1], *outputs[args.jobs], on_cluster])
    speedups = [one / many for one, many in zip(timings[1], timings[args.jobs])]
    speedup = statistics.median(speedups)
    sequential, parallel = statistics.median(timings[1]), statistics.median(timings[args.jobs])
    print(f"--jobs 1: {', '.join(f'{value:.1f}' for value in timings[1])} s; --jobs {args.jobs}: "
          f"{', '.join(f'{value:.1f}' for value in timings[args.jobs])} s; speedups "
          f"{', '.join(f'{value:.2f}' for value in speedups)}, median {speedup:.2f}x (target >= {TARGET_SPEEDUP}x "
          f"with 2 jobs on 2 cores: {'met' if speedup >= TARGET_SPEEDUP else 'missed'}); torch threads {threads} per run")
    print(f"two-node local cluster (2 x 1 CPU, --address): {cluster_seconds:.1f} s, {sequential / cluster_seconds:.2f}x")
    print(f"results files: {'identical' if same else 'DIFFERENT'} apart from wall times ({runs} runs, {rounds} rounds;"
          f" {args.repeats} x sequential, {args.repeats} x --jobs, cluster)")
    benchlib.write_result(args.json, {
        "benchmark": "study_jobs",
        "machine": machine,
        "quick": args.quick,
        "runs": runs,
        "rounds": rounds,
        "jobs": args.jobs,
        "torch_threads": threads,
        "repeats": args.repeats,
        "seconds_jobs_1_each": [round(value, 2) for value in timings[1]],
        f"seconds_jobs_{args.jobs}_each": [round(value, 2) for value in timings[args.jobs]],
        "speedups": [round(value, 3) for value in speedups],
        "seconds_jobs_1": round(sequential, 2),
        f"seconds_jobs_{args.jobs}": round(parallel, 2),
        "speedup": round(speedup, 3),
        "seconds_two_node_cluster": round(cluster_seconds, 2),
        "speedup_two_node_cluster": round(sequential / cluster_seconds, 3),
        "target_speedup": TARGET_SPEEDUP,
        "same_results": same,
        "load_average_end": benchlib.load_average(),
    })
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
