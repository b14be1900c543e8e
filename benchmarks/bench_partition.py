"""Benchmark: ``dirichlet_class`` over 1,000,000 labels (10 classes) into 1,000 clients.

Run ``.venv/bin/python benchmarks/bench_partition.py``. Prints the median of 5 timed runs
(after one warm-up), the numpy version and the thread count, and exits with status 1 when
the median exceeds the budget (2 s), so it can gate CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedplug.data.partitions import DirichletClassConfig, dirichlet_class  # noqa: E402


def thread_count() -> str:
    """Threads numpy's BLAS may use (the partitioner itself is single-threaded)."""
    try:
        from threadpoolctl import threadpool_info

        counts = {info.get("num_threads") for info in threadpool_info()}
        blas = ",".join(str(count) for count in sorted(c for c in counts if c is not None))
    except ImportError:
        blas = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"BLAS threads {blas or 'n/a'}, CPUs available {len(os.sched_getaffinity(0))}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--clients", type=int, default=1_000)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds allowed (median)")
    args = parser.parse_args()

    labels = np.random.default_rng(0).integers(0, args.classes, size=args.samples)
    config = DirichletClassConfig(alpha=args.alpha)
    dirichlet_class(labels, args.classes, args.clients, config, np.random.default_rng(0))

    seconds = []
    for repeat in range(args.repeats):
        rng = np.random.default_rng(repeat + 1)
        start = time.perf_counter()
        partition = dirichlet_class(labels, args.classes, args.clients, config, rng)
        seconds.append(time.perf_counter() - start)
        if int(partition.sizes.sum()) != args.samples:
            print("error: the partition lost samples", file=sys.stderr)
            return 1
    median = statistics.median(seconds)

    print(
        f"dirichlet_class: {args.samples:,} labels, {args.classes} classes -> "
        f"{args.clients:,} clients, alpha={args.alpha}"
    )
    runs = ", ".join(f"{value:.3f}" for value in seconds)
    print(f"median of {args.repeats}: {median:.3f} s (runs: {runs})")
    print(f"numpy {np.__version__}; {thread_count()}")
    if median > args.budget:
        print(f"FAIL: median {median:.3f} s is over the {args.budget} s budget", file=sys.stderr)
        return 1
    print(f"OK: within the {args.budget} s budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
