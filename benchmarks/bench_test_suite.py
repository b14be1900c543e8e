"""How long the test suite takes: ``make test`` and ``make test-fedml`` (what ``.ci/run`` runs).

Runs each target once in this checkout (installs already done: run ``make install`` and
``make fedml-venv`` first, or the install time is counted too), one after the other, and
records its wall time, exit status, pytest's summary line (and the failed tests), the number of usable CPUs and
the 1-minute load average before and after (a busy machine makes the suite slower; the
targets on the performance page are for a quiet one).

Run: ``.venv/bin/python benchmarks/bench_test_suite.py [--targets test test-fedml] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed).*) in [\d.]+s", re.MULTILINE)
PROBLEM = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
"""pytest's short summary lines of a failed or erroring test (``-rfE``, its default)."""


def run_target(target: str) -> dict[str, Any]:
    """Time ``make TARGET`` in the repository root; its pytest summary and exit status."""
    environment = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    load_before = benchlib.load_average()
    started = time.perf_counter()
    completed = subprocess.run(
        ["make", "--no-print-directory", target],
        cwd=benchlib.REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    output = completed.stdout + completed.stderr
    summaries = SUMMARY.findall(output)
    return {
        "target": target,
        "seconds": round(seconds, 1),
        "exit_status": completed.returncode,
        "summary": summaries[-1] if summaries else None,
        "problems": PROBLEM.findall(output),
        "load_average_before": load_before,
        "load_average_after": benchlib.load_average(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["test", "test-fedml"], help="make targets, in order")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cpus} usable CPUs; load average (1 min) {benchlib.load_average()[0]}", flush=True)
    runs = []
    for target in args.targets:
        run = run_target(target)
        runs.append(run)
        print(
            f"make {target}: {run['seconds'] / 60:.1f} min, exit status {run['exit_status']}, "
            f"{run['summary']}; load average {run['load_average_before'][0]} -> {run['load_average_after'][0]}",
            flush=True,
        )
        for problem in run["problems"]:
            print(f"  {problem}", flush=True)
    total = sum(run["seconds"] for run in runs)
    print(f"all targets: {total / 60:.1f} min")
    if args.json:
        result = {"cpus": cpus, "machine": benchlib.machine_description(), "runs": runs, "seconds": round(total, 1)}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(run["exit_status"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
