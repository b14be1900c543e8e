"""Time FedGSP's Inter-Cluster Grouping (ICG) on FEMNIST-sized federations.

The paper reports ICG "within only 0.1 seconds" for K=364 clients, M=52 groups, C=62
classes and tau=10. This script times :func:`fedplug.algorithms.fedgsp.inter_cluster_groups`
on seeded random skewed class-count matrices (Dirichlet(0.1) class mixes, log-normal
client sizes around FEMNIST's 226 samples) and prints the median of several runs.

Run: ``.venv/bin/python benchmarks/bench_icg.py``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

try:
    import fedplug  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedplug.algorithms.fedgsp import cpd_summary, inter_cluster_groups, random_groups

NUM_CLASSES = 62


def skewed_class_counts(num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """K x C counts: each client draws a Dirichlet(0.1) class mix and ~226 samples."""
    sizes = np.maximum(rng.lognormal(mean=np.log(226.0), sigma=0.5, size=num_clients), 10)
    mixes = rng.dirichlet(np.full(NUM_CLASSES, 0.1), size=num_clients)
    return np.stack([rng.multinomial(int(n), p) for n, p in zip(sizes, mixes)])


def thread_count() -> str:
    try:
        from threadpoolctl import threadpool_info

        blas = ", ".join(
            f"{pool['internal_api']}={pool['num_threads']}" for pool in threadpool_info()
        )
    except ImportError:
        blas = "threadpoolctl not installed"
    return f"cpus={os.cpu_count()}; BLAS/OpenMP threads: {blas}; OR-Tools min-cost flow: 1"


def time_case(num_clients: int, groups: int, repeats: int, seed: int) -> None:
    """Print median wall and CPU time of ICG, and ICG's median CPD relative to random."""
    walls, cpus, ratios = [], [], []
    for repeat in range(repeats):
        rng = np.random.default_rng([seed, num_clients, repeat])
        counts = skewed_class_counts(num_clients, rng)
        wall, cpu = time.perf_counter(), time.process_time()
        icg = inter_cluster_groups(counts, groups, rng)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
        random = random_groups(np.arange(num_clients), groups, rng)
        ratios.append(cpd_summary(icg, counts)[0] / cpd_summary(random, counts)[0])
    print(
        f"K={num_clients:5d} M={groups:3d} L={num_clients // groups:4d} C={NUM_CLASSES}: "
        f"median wall {statistics.median(walls) * 1e3:7.1f} ms "
        f"(min {min(walls) * 1e3:.1f}), CPU {statistics.median(cpus) * 1e3:7.1f} ms "
        f"over {repeats} runs; median CPD ICG / random {statistics.median(ratios):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per case (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the count matrices")
    args = parser.parse_args()
    print(thread_count())
    print(f"load average {os.getloadavg()[0]:.1f} (wall times inflate when the CPUs are shared)")
    for num_clients, groups, repeats in (
        (364, 52, args.repeats),
        (364, 10, args.repeats),
        (3550, 52, max(3, args.repeats // 2)),
        (3550, 10, max(3, args.repeats // 2)),
    ):
        time_case(num_clients, groups, repeats, args.seed)


if __name__ == "__main__":
    main()
