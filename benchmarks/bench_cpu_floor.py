"""CPU floor: the sequential engine against centralised training of the same samples.

For real MNIST (the ``mnist`` dataset plugin, IID over K clients, no local test split) and
each model, K and batch size, a measurement trains the first ``m`` clients of the
federation for one local epoch (``m`` chosen so a measurement covers about
``--samples-mlp`` / ``--samples-cnn`` samples; the clients keep the sizes that K gives
them: 6,000 samples at K=10, 600 at K=100). Two paths train exactly those samples:

- **federated**: the code path of ``Simulator._run_round`` without evaluation and
  checkpointing: ``SequentialEngine.run_round`` -> the round core's ``screen`` -> the FedAvg
  aggregator's streaming weighted mean, on the simulator's own model;
- **centralised**: one model, a plain torch loop (``torch.randperm`` order, the same batch
  size, ``torch.optim.SGD`` with the same learning rate, ``F.cross_entropy``) over the
  concatenation of the same clients' samples;
- **centralised, fused update**: the same loop stepping with the engine's own
  :class:`~fedplug.run.local_training.FusedSGD` (the same numbers as
  ``torch.optim.SGD``, less Python per step). The engine trains with it, so against the
  first floor the engine gains what the fused update saves; against this one the ratio
  shows only what the engine adds per client (loading and reading the model, screening,
  aggregating).

All start from the same initial weights in the same process and thread count. Repeats
are interleaved (the order alternates). Each repeat records wall-clock and CPU time
(``time.process_time``); the result is the median samples/s of each path and the median
of the per-repeat ratios federated/centralised, for both clocks (the target, >= 0.95, is
judged against the ``torch.optim.SGD`` loop: centralised training as users write it).
On a machine shared with other jobs the CPU-time ratio is the reliable one: wall time
also counts the moments the scheduler gave the core to someone else.

Overhead breakdown (``--breakdown``, on by default): the CPU cost of each per-client step
of the engine (loading the global vector, reading the model back, building the
optimiser, drawing the order, screening the update, adding it to the aggregator) and of
``train_locally`` against the plain loop (fused update) on one client, so a missed target can be traced
to a function.

Memory: the peak RSS (VmHWM) of the process, and the peak RSS *increase* during one
federated round (VmHWM reset through ``/proc/self/clear_refs`` just before), next to what
one model copy per trained client would cost (``bench_memory.py`` does this with 100
clients per round, where the difference is unmistakable).

Run: ``.venv/bin/python benchmarks/bench_cpu_floor.py [--threads 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: two shared cores)"
    )
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn_mnist"], help="default: mlp cnn_mnist"
    )
    parser.add_argument(
        "--clients", nargs="+", type=int, default=[10, 100], help="K values (default 10 100)"
    )
    parser.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[10, 50], help="default: 10 50"
    )
    parser.add_argument(
        "--samples-mlp",
        type=int,
        default=12_000,
        help="samples per mlp measurement (default 12000)",
    )
    parser.add_argument(
        "--samples-cnn", type=int, default=3_000, help="samples per cnn measurement (default 3000)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats of each mlp path (default 7)"
    )
    parser.add_argument(
        "--repeats-cnn", type=int, default=3, help="timed repeats of each cnn path (default 3)"
    )
    parser.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate of both paths (default 0.05)"
    )
    parser.add_argument(
        "--target", type=float, default=0.95, help="required federated/centralised ratio"
    )
    parser.add_argument(
        "--no-breakdown", dest="breakdown", action="store_false", help="skip the overhead breakdown"
    )
    parser.add_argument("--json", default=None, help="write the result here")
    return parser.parse_args(argv)


class FloorCase:
    """One (model, K, batch size): the simulator, its participants and the centralised twin."""

    def __init__(
        self, federation: Any, model_name: str, batch_size: int, samples: int, lr: float
    ) -> None:
        import torch

        from fedplug.plugins import default_registry
        from fedplug.run.model import build_model
        from fedplug.run.vectors import model_to_vector
        from fedplug.simulation.simulator import Simulator

        config = benchlib.train_config(
            model={"name": model_name},
            batch_size=batch_size,
            local_epochs=1,
            client_fraction=1.0,
            rounds=1,
            engine="sequential",
            optimizer={"name": "sgd", "lr": lr},
            seed=0,
        )
        registry = default_registry()
        self.federation = federation
        self.simulator = Simulator(config, federation, registry)
        self.initial_vector = model_to_vector(self.simulator.model)
        self.model_bytes = self.initial_vector.numel() * 4
        size = federation.clients[0].num_samples
        self.participants = list(range(min(federation.num_clients, max(1, round(samples / size)))))
        self.num_samples = sum(federation.clients[k].num_samples for k in self.participants)
        self.central_model = build_model(config, registry, federation, torch.device("cpu"))
        self.central_x = torch.cat([federation.clients[k].train_x for k in self.participants])
        self.central_y = torch.cat([federation.clients[k].train_y for k in self.participants])
        self.batch_size, self.lr = batch_size, lr

    def federated(
        self, round_index: int, participants: list[int] | None = None
    ) -> benchlib.Stopwatch:
        """Times one round over the participants (engine + screening + FedAvg)."""
        from fedplug.components import RoundPlan
        from fedplug.run.round_context import RoundContext
        from fedplug.run.round_screen import Tally, screen

        simulator = self.simulator
        aggregator = simulator.algorithm.aggregator
        aggregator.initialize(self.initial_vector)
        plan = RoundPlan(chains=[[client] for client in (participants or self.participants)])
        with benchlib.Stopwatch() as watch:
            context = RoundContext(
                simulator.federation, simulator.algorithm, simulator.schedule, 0, {}
            )
            context.payload = aggregator.server_payload()
            updates = screen(
                simulator.engine.run_round(self.initial_vector, plan, round_index, context),
                tuple(self.initial_vector.shape),
                timeout=None,
                model_bytes=self.model_bytes,
                round_number=round_index + 1,
                tally=Tally(),
            )
            new_vector = aggregator.aggregate(self.initial_vector, updates)
        if not bool(new_vector.isfinite().all()):
            raise RuntimeError("the federated round produced a non-finite model")
        return watch

    def centralised(
        self, round_index: int, limit: int | None = None, optimizer: str = "torch"
    ) -> benchlib.Stopwatch:
        """Times one epoch of plain SGD over the same samples (the first ``limit`` of them
        when given: a warm-up), stepping with ``torch.optim.SGD`` or, with
        ``optimizer="fused"``, with the engine's own update."""
        import torch

        from fedplug.run.vectors import vector_to_model

        vector_to_model(self.initial_vector, self.central_model)
        generator = torch.Generator().manual_seed(round_index)
        with benchlib.Stopwatch() as watch:
            benchlib.centralised_epoch(
                self.central_model,
                self.central_x[:limit],
                self.central_y[:limit],
                self.batch_size,
                self.lr,
                generator,
                optimizer=optimizer,
            )
        return watch


def _paired(numerators: list[float], denominators: list[float]) -> float:
    return round(benchlib.median([n / d for n, d in zip(numerators, denominators)]), 4)


def measure(case: FloorCase, repeats: int) -> dict[str, Any]:
    case.centralised(10_000, limit=50 * case.batch_size)  # warm-up: kernels and allocator
    federated: list[benchlib.Stopwatch] = []
    centralised: list[benchlib.Stopwatch] = []
    fused_floor: list[benchlib.Stopwatch] = []
    peak_increase = None
    for repeat in range(repeats):
        if repeat % 2 == 0:
            centralised.append(case.centralised(repeat))
            fused_floor.append(case.centralised(repeat, optimizer="fused"))
        if repeat == 0:
            rss_before = benchlib.current_rss_mib()
            reset = benchlib.reset_peak_rss()
            federated.append(case.federated(repeat))
            peak_increase = round(benchlib.peak_rss_mib() - rss_before, 1) if reset else None
        else:
            federated.append(case.federated(repeat))
        if repeat % 2 == 1:
            fused_floor.append(case.centralised(repeat, optimizer="fused"))
            centralised.append(case.centralised(repeat))
    n = case.num_samples
    row: dict[str, Any] = {
        "participants": len(case.participants),
        "samples_per_client": case.num_samples // len(case.participants),
        "samples": n,
    }
    for clock, attribute in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        fed = [getattr(watch, attribute) for watch in federated]
        cen = [getattr(watch, attribute) for watch in centralised]
        same_update = [getattr(watch, attribute) for watch in fused_floor]
        row[clock] = {
            "fused_floor_samples_per_s": round(n / benchlib.median(same_update), 1),
            "ratio_to_fused_floor": _paired(same_update, fed),
            "federated_samples_per_s": round(n / benchlib.median(fed), 1),
            "centralised_samples_per_s": round(n / benchlib.median(cen), 1),
            "ratio_paired": _paired(cen, fed),
            "ratio_of_medians": round(benchlib.median(cen) / benchlib.median(fed), 4),
            "federated_seconds": [round(s, 4) for s in fed],
            "centralised_seconds": [round(s, 4) for s in cen],
        }
    row.update(
        round_peak_rss_increase_mib=peak_increase,
        model_mib=round(case.model_bytes / 2**20, 2),
        copies_per_participant_mib=round(len(case.participants) * case.model_bytes / 2**20, 1),
        load_average=benchlib.load_average(),
    )
    return row


def overhead_breakdown(case: FloorCase, repeats: int = 11) -> dict[str, Any]:
    """CPU cost of each per-client piece of the engine (median of blocks), and
    ``train_locally`` against the plain loop on one client (minimum of ``repeats``
    interleaved runs each)."""
    import torch

    from fedplug.components import WeightedMean
    from fedplug.run.local_training import local_rng, make_optimizer, train_locally
    from fedplug.run.round_context import RoundContext
    from fedplug.run.round_screen import Tally, screen
    from fedplug.run.vectors import model_to_vector, vector_to_model

    simulator, vector = case.simulator, case.initial_vector
    model, algorithm, schedule = simulator.model, simulator.algorithm, simulator.schedule
    client = case.federation.clients[case.participants[0]]
    labels = client.train_y.numpy()
    context = RoundContext(case.federation, algorithm, schedule, 0, {})
    update = context.make_update(
        [client.client_id], vector.clone(), client.num_samples, 1, {}, _plan(), 0.0
    )
    accumulator = WeightedMean()
    accumulator.add(vector, 1.0)
    per_client = {
        "vector_to_model (load the global model)": lambda: vector_to_model(vector, model),
        "model_to_vector (read the local model)": lambda: model_to_vector(model),
        "make_optimizer": lambda: make_optimizer(model.parameters(), schedule.optimizer),
        "local_rng + sampler.epoch_indices": lambda: algorithm.sampler.epoch_indices(
            labels, client.class_counts, 0, local_rng(0, 0, client.client_id)
        ),
        "screen (one update)": lambda: list(
            screen(
                iter([update]),
                tuple(vector.shape),
                timeout=None,
                model_bytes=case.model_bytes,
                round_number=1,
                tally=Tally(),
            )
        ),
        "WeightedMean.add (one update)": lambda: accumulator.add(vector, 600.0),
    }
    costs = {
        name: round(benchlib.cpu_milliseconds(function, repeats=100), 4)
        for name, function in per_client.items()
    }

    def engine_path(seed: int) -> float:
        with benchlib.Stopwatch() as watch:
            train_locally(
                model,
                vector,
                client.train_x,
                client.train_y,
                client.class_counts,
                algorithm=algorithm,
                loss_context=context.loss_context(client.client_id),
                payload={},
                client_state={},
                schedule=schedule,
                round_index=seed,
                rng=local_rng(0, seed, client.client_id),
            )
        return watch.cpu_seconds

    def plain_path(seed: int) -> float:
        vector_to_model(vector, case.central_model)
        with benchlib.Stopwatch() as watch:
            benchlib.centralised_epoch(
                case.central_model,
                client.train_x,
                client.train_y,
                case.batch_size,
                case.lr,
                torch.Generator().manual_seed(seed),
                optimizer="fused",
            )
        return watch.cpu_seconds

    engine_times, plain_times = [], []
    for seed in range(repeats):
        pair = (engine_path, plain_path) if seed % 2 == 0 else (plain_path, engine_path)
        results = [function(seed) for function in pair]
        engine_times.append(results[0] if seed % 2 == 0 else results[1])
        plain_times.append(results[1] if seed % 2 == 0 else results[0])
    steps = math.ceil(client.num_samples / case.batch_size)
    # Minimum, not median: on a shared machine noise only ever adds CPU time (cache and
    # memory-bandwidth interference), so the fastest of several runs is the intrinsic cost.
    plain_ms = min(plain_times) * 1e3
    engine_ms = min(engine_times) * 1e3
    outside = costs["screen (one update)"] + costs["WeightedMean.add (one update)"]
    return {
        "client_samples": client.num_samples,
        "steps": steps,
        "per_client_ms": costs,
        "plain_loop_ms": round(plain_ms, 3),
        "train_locally_ms": round(engine_ms, 3),
        "train_locally_minus_plain_ms": round(engine_ms - plain_ms, 3),
        "per_step_overhead_us": round(
            (engine_ms - plain_ms - sum(list(costs.values())[:4])) / steps * 1e3, 1
        ),
        "overhead_fraction": round((engine_ms - plain_ms + outside) / plain_ms, 4),
    }


def _plan() -> Any:
    from fedplug.components import RoundPlan

    return RoundPlan(chains=[[0]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    benchlib.print_machine("CPU floor: sequential engine vs centralised training (MNIST)", machine)
    print(
        f"torch threads: {threads}; repeats {args.repeats} (mlp) / {args.repeats_cnn} (cnn), interleaved; "
        f"target ratio >= {args.target}, judged on CPU time (wall time shown too)"
    )
    rows, breakdowns = [], []
    for num_clients in args.clients:
        federation = benchlib.mnist_federation(num_clients)
        for model_name in args.models:
            samples = args.samples_cnn if model_name.startswith("cnn") else args.samples_mlp
            for batch_size in args.batch_sizes:
                case = FloorCase(federation, model_name, batch_size, samples, args.lr)
                row = {"model": model_name, "num_clients": num_clients, "batch_size": batch_size}
                row.update(
                    measure(
                        case, args.repeats_cnn if model_name.startswith("cnn") else args.repeats
                    )
                )
                row["meets_target"] = row["cpu"]["ratio_paired"] >= args.target
                row["meets_target_wall"] = row["wall"]["ratio_paired"] >= args.target
                rows.append(row)
                cpu, wall = row["cpu"], row["wall"]
                print(
                    f"{model_name:9s} K={num_clients:<4d} B={batch_size:<3d} {row['participants']:3d} clients x "
                    f"{row['samples_per_client']}: CPU time federated {cpu['federated_samples_per_s']:8.0f}/s vs "
                    f"centralised {cpu['centralised_samples_per_s']:8.0f}/s, ratio {cpu['ratio_paired']:.3f} "
                    f"(vs the fused-update loop {cpu['ratio_to_fused_floor']:.3f}) "
                    f"({'OK' if row['meets_target'] else 'BELOW TARGET'}); wall ratio {wall['ratio_paired']:.3f}; "
                    f"round peak RSS +{row['round_peak_rss_increase_mib']} MiB (one model per client: "
                    f"{row['copies_per_participant_mib']} MiB); load {row['load_average'][0]}"
                )
                sys.stdout.flush()
                if args.breakdown and num_clients == max(args.clients):
                    breakdown = {
                        "model": model_name,
                        "num_clients": num_clients,
                        "batch_size": batch_size,
                    }
                    breakdown.update(overhead_breakdown(case))
                    breakdowns.append(breakdown)
                    pieces = ", ".join(
                        f"{name} {ms:.3f}" for name, ms in breakdown["per_client_ms"].items()
                    )
                    print(
                        f"    overhead per client (CPU ms): {pieces}; train_locally {breakdown['train_locally_ms']} vs "
                        f"plain loop {breakdown['plain_loop_ms']} over {breakdown['steps']} steps "
                        f"(per-step overhead {breakdown['per_step_overhead_us']} us); total overhead "
                        f"{100 * breakdown['overhead_fraction']:.1f}% of the plain loop"
                    )
                del case
        del federation
    peak = benchlib.process_peak_rss_mib()
    print(f"process peak RSS (VmHWM): {peak} MiB")
    result = {
        "benchmark": "cpu_floor",
        "machine": machine,
        "threads": threads,
        "repeats": {"mlp": args.repeats, "cnn": args.repeats_cnn},
        "lr": args.lr,
        "target": args.target,
        "rows": rows,
        "breakdown": breakdowns,
        "process_peak_rss_mib": peak,
        "load_average_end": benchlib.load_average(),
    }
    benchlib.write_result(args.json, result)
    return 0 if all(row["meets_target"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
