"""The CLI's threads under load, and what `fedplug --help` imports.

**Threads.** ``fedplug run`` chooses torch's threads itself (``--threads``,
``train.threads``, ``$FEDPLUG_TORCH_THREADS``, else 1: :mod:`fedplug.threads`); before,
it left torch at its default of one thread per core, which on a shared 2-core machine
was 30-40x slower (issue 41). This script loads the machine with ``--spinners`` busy
loops of its own (default 4 Python processes spinning) and runs the same command three
ways, ``--repeats`` times each, alternating:

- ``fedplug default``: ``fedplug run`` as a user types it (no thread variable set);
- ``pinned by hand``: ``OMP_NUM_THREADS=1 fedplug run ... --threads 0`` (fedplug leaves
  torch's threads to the environment, which pins one: what the benchmarks used to do);
- ``torch default``: ``fedplug run ... --threads 0`` without the variable: torch's own
  default, the behaviour before (one thread per usable core).

The command is the issue's: ``fedplug run params.yaml --set data.dataset=synthetic``
with ``--samples`` training samples (default 1,000,000) and 10,000 test samples over
``--clients`` clients (default 100,000, ``dirichlet_client`` alpha 1), ``logreg``, 100
clients a round (``client_fraction`` = 100 / K), ``--rounds`` rounds (default 5),
``data.local_test_fraction=0`` (the clients' local splits are another row), ``--no-track``.
Reported: every round's seconds (``metrics.json``'s ``history[].seconds``), their median
over rounds 2.. (round 1 warms up), the thread line the run printed and the run's wall
time; the ratios torch default / fedplug default and fedplug default / pinned by hand.

**`--help`.** Wall and CPU seconds (``getrusage`` of the child) of
``python -m fedplug.cli --help`` in a fresh interpreter, the median of ``--help-repeats``
(default 5), measured before the busy loops start, for this checkout and, with
``--before-root``, for an older checkout (``PYTHONPATH`` pointing at it), and the
heavy libraries (torch, Ray, Flower, MLflow) it imported.

Run: ``.venv/bin/python benchmarks/bench_cli_threads.py [--before-root /path/to/old/checkout] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

DEFAULT_JSON = benchlib.REPO_ROOT / "benchmarks" / "results" / "cli_threads.json"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FEDPLUG_TORCH_THREADS")
HEAVY = ("torch", "ray", "flwr", "mlflow")
HELP_PROBE = (
    "import sys, runpy\n"
    "sys.argv = ['fedplug', '--help']\n"
    "try:\n"
    "    runpy.run_module('fedplug.cli', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    f"print('heavy:', sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}), file=sys.stderr)\n"
)
VARIANTS = {
    "fedplug default": ({}, []),
    "pinned by hand": ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, ["--threads", "0"]),
    "torch default": ({}, ["--threads", "0"]),
}
"""Name -> (environment added, arguments added) of each way the command runs."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100_000, help="K (default 100,000)")
    parser.add_argument("--samples", type=int, default=1_000_000, help="training samples (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (default 5)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating (default 2)")
    parser.add_argument("--spinners", type=int, default=4, help="busy-loop processes loading the machine (default 4)")
    parser.add_argument("--help-repeats", type=int, default=5, help="`--help` measurements per checkout (default 5)")
    parser.add_argument("--before-root", default=None, help="an older checkout whose `--help` is measured too")
    parser.add_argument("--quick", action="store_true", help="1,000 clients, 2 rounds, one repeat: checks the script")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help=f"write the result here (default {DEFAULT_JSON})")
    return parser.parse_args(argv)


def clean_environment(**added: str) -> dict[str, str]:
    """This process's environment without any thread variable, plus ``added``."""
    environment = {key: value for key, value in os.environ.items() if key not in THREAD_VARIABLES}
    return {**environment, **added}


def help_cost(root: Path | None) -> dict[str, Any]:
    """Wall and CPU seconds of one ``fedplug --help`` in a fresh interpreter (``root``: an
    older checkout put first on ``PYTHONPATH``), and the heavy libraries it imported."""
    environment = clean_environment(**({"PYTHONPATH": str(root)} if root else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, check=True, env=environment,
        cwd=root or benchlib.REPO_ROOT, timeout=300,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    heavy = next(line for line in completed.stderr.splitlines() if line.startswith("heavy:"))
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "heavy": heavy.removeprefix("heavy:").strip()}


def measure_help(root: Path | None, repeats: int) -> dict[str, Any]:
    samples = [help_cost(root) for _ in range(repeats)]
    return {
        "root": str(root or benchlib.REPO_ROOT),
        "wall_s": statistics.median(sample["wall_s"] for sample in samples),
        "cpu_s": statistics.median(sample["cpu_s"] for sample in samples),
        "heavy": samples[0]["heavy"],
        "samples": samples,
    }


def run_arguments(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of the issue's synthetic run (see the module docstring)."""
    settings = {
        "data.dataset": "synthetic",
        "data.dataset.num_train": args.samples,
        "data.dataset.num_test": 10_000,
        "data.num_clients": args.clients,
        "data.partition": "dirichlet_client",
        "data.partition.alpha": 1.0,
        "data.local_test_fraction": 0,
        "train.model": "logreg",
        "train.client_fraction": 100 / args.clients,
        "train.rounds": args.rounds,
    }
    return [part for key, value in settings.items() for part in ("--set", f"{key}={value}")]


def run_once(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One ``fedplug run`` of variant ``name`` into a fresh folder under ``folder``."""
    added_environment, added_arguments = VARIANTS[name]
    out = Path(tempfile.mkdtemp(dir=folder))
    command = [sys.executable, "-m", "fedplug.cli", "run", str(benchlib.REPO_ROOT / "params.yaml"),
               *run_arguments(args), "--no-track", "--quiet", "--out", str(out / "run"), *added_arguments]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=clean_environment(**added_environment),
                               cwd=benchlib.REPO_ROOT, timeout=1800)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"{name}: exit status {completed.returncode}: {completed.stderr[-2000:]}")
    metrics = json.loads((out / "run" / "metrics.json").read_text())
    run_info = json.loads((out / "run" / "run_info.json").read_text())
    seconds = [round(record["seconds"], 4) for record in metrics["history"]]
    said = [line for line in completed.stderr.splitlines() if line.startswith("fedplug: torch uses")]
    return {
        "variant": name,
        "round_seconds": seconds,
        "median_round_s": round(statistics.median(seconds[1:] or seconds), 4),
        "torch_threads": run_info["torch_threads"],
        "said": said[0] if said else "",
        "wall_s": round(wall, 2),
        "load_average": benchlib.load_average(),
    }


def start_spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` Python processes spinning on a core each (the load)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the median of its runs' median round seconds and its threads; the ratios."""
    variants: dict[str, Any] = {}
    for name in VARIANTS:
        mine = [run for run in runs if run["variant"] == name]
        variants[name] = {
            "median_round_s": statistics.median(run["median_round_s"] for run in mine),
            "torch_threads": sorted({run["torch_threads"] for run in mine}),
            "wall_s": statistics.median(run["wall_s"] for run in mine),
        }
    fedplug, pinned, torch_default = (variants[name]["median_round_s"] for name in VARIANTS)
    return {
        "variants": variants,
        "torch_default_over_fedplug": round(torch_default / fedplug, 2),
        "fedplug_over_pinned": round(fedplug / pinned, 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.repeats, args.help_repeats = 1_000, 2, 1, 1
    machine = benchlib.machine_description()
    benchlib.print_machine(
        f"cli_threads: `fedplug run` ({args.clients:,} clients, 100 a round, logreg) under {args.spinners} busy "
        "loops; `fedplug --help`", machine,
    )
    help_after = measure_help(None, args.help_repeats)
    help_before = measure_help(Path(args.before_root), args.help_repeats) if args.before_root else None
    for label, result in (("after", help_after), ("before", help_before)):
        if result is not None:
            print(f"--help {label} ({result['root']}): wall {result['wall_s']:.2f} s, CPU {result['cpu_s']:.2f} s "
                  f"(median of {args.help_repeats}); heavy libraries imported: {result['heavy']}", flush=True)
    runs: list[dict[str, Any]] = []
    spinners = start_spinners(args.spinners)
    try:
        with tempfile.TemporaryDirectory(prefix="fedplug-bench-cli-threads-") as folder:
            for repeat in range(args.repeats):
                for name in VARIANTS:
                    run = run_once(name, args, Path(folder))
                    runs.append(run)
                    print(f"[{repeat + 1}/{args.repeats}] {name:<16} torch threads {run['torch_threads']}: rounds "
                          f"{', '.join(f'{s:.3f}' for s in run['round_seconds'])} s (median after round 1 "
                          f"{run['median_round_s']:.3f} s); wall {run['wall_s']:.1f} s; load "
                          f"{' '.join(str(v) for v in run['load_average'])}; said: {run['said'] or '-'}", flush=True)
    finally:
        stop(spinners)
    result = summary(runs)
    for name, variant in result["variants"].items():
        print(f"{name:<16} median round {variant['median_round_s']:.3f} s, torch threads {variant['torch_threads']}")
    print(f"torch default / fedplug default: {result['torch_default_over_fedplug']}x; "
          f"fedplug default / pinned by hand: {result['fedplug_over_pinned']}x")
    document = {
        "machine": machine,
        "settings": {key: value for key, value in vars(args).items() if key != "json"},
        "help": {"after": help_after, "before": help_before},
        "runs": runs,
        **result,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
