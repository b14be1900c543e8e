"""Training throughput of the engines (sequential, vectorised, parallel), K = 100 clients.

One round of FedAvg local training (one local epoch, plain SGD) of every client on an
MNIST-sized federation: K clients of ``--samples-per-client`` random 1x28x28 inputs with
10 classes (MNIST's 60,000 training samples over 100 clients is 600 each), for the ``mlp``
(McMahan et al.'s 2NN) and ``cnn_mnist`` models at batch sizes 10 and 50. Random inputs
cost exactly what real ones do; only the accuracy would differ, and it is not measured.

Each case runs one untimed warm-up round of each engine of ``--engines`` on a few
clients, then times ``--repeats`` rounds of each, interleaved (the engine order rotating
every repeat), consuming the yielded updates as the simulator does; it reports each
engine's best round and, against the first engine, the ratio of the bests and the median
ratio of adjacent rounds. For the ``mlp`` on a CPU it also times the model's matrix
products alone (``matmul_seconds_per_step``): the most any engine that computes them
client by client could gain. Printed: device, torch threads, the 1-minute load average at
the start and the end, and per case the samples/s of each engine with its ratio to the
first engine's; for the vectorised engine also its block size and memory per client (on
CUDA ``torch.cuda.max_memory_allocated() / K`` during the round and the increment over the
memory held before it; on CPU the engine's own estimate,
:func:`fedplug.simulation.vectorized_blocks.estimate_bytes_per_client`, as the process-wide peak
RSS cannot be attributed to one engine); for the parallel engine (CPU only) its worker
count and the median wall time per timed round of forking its workers and of stopping
them.

Run: ``.venv/bin/python benchmarks/bench_engines.py [--device cuda] [--threads 1] [--json out.json]``
(sequential vs vectorised); the parallel engine against the sequential one on the CPU:
``.venv/bin/python benchmarks/bench_engines.py --threads 1 --engines sequential parallel --workers 2``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.config import OptimizerConfig
from fedplug.data.federation import ClientData, Federation
from fedplug.plugins import default_registry
from fedplug.run.local_training import ClientAlgorithm, LocalSchedule
from fedplug.run.model import resolve_device
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure
from fedplug.run.vectors import model_to_vector
from fedplug.simulation.parallel import ParallelEngine, default_workers
from fedplug.simulation.sequential import SequentialEngine
from fedplug.simulation.vectorized import VectorizedEngine
from fedplug.simulation.vectorized_blocks import estimate_bytes_per_client

INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
WARMUP_CLIENTS = 4
ENGINES = ("sequential", "vectorized", "parallel")


def random_federation(
    num_clients: int, samples_per_client: int, device: torch.device, seed: int
) -> Federation:
    """K clients of MNIST-shaped uniform noise with random labels, on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    clients = []
    for client_id in range(num_clients):
        x = torch.rand((samples_per_client, *INPUT_SHAPE), generator=generator)
        y = torch.randint(0, NUM_CLASSES, (samples_per_client,), generator=generator)
        clients.append(
            ClientData(
                client_id=client_id,
                train_x=x.to(device),
                train_y=y.to(device),
                test_x=x[:1].to(device),
                test_y=y[:1].to(device),
                class_counts=np.bincount(y.numpy(), minlength=NUM_CLASSES),
            )
        )
    return Federation(
        clients=clients,
        test_x=clients[0].test_x,
        test_y=clients[0].test_y,
        num_classes=NUM_CLASSES,
        input_shape=INPUT_SHAPE,
        dataset_name="random-mnist-shaped",
    )


def build_context(federation: Federation, batch_size: int, lr: float) -> RoundContext:
    registry = default_registry()
    sampler_config = registry.get("samplers", "uniform").config_class(name="uniform")
    loss_config = registry.get("loss_transforms", "cross_entropy").config_class(
        name="cross_entropy"
    )
    aggregator_config = registry.get("aggregators", "fedavg").config_class(name="fedavg")
    algorithm = ClientAlgorithm(
        sampler=registry.build("samplers", sampler_config),
        loss_transform=registry.build("loss_transforms", loss_config),
        aggregator=registry.build("aggregators", aggregator_config, federation.num_clients),
    )
    schedule = LocalSchedule(
        local_epochs=1,
        batch_size=batch_size,
        optimizer=OptimizerConfig(name="sgd", lr=lr, momentum=0.0, weight_decay=0.0),
    )
    return RoundContext(federation, algorithm, schedule, seed=0, client_states={})


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    registry = default_registry()
    config = registry.get("models", name).config_class(name=name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = registry.build("models", config, INPUT_SHAPE, NUM_CLASSES)
    return model.to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(engine: Any, start: torch.Tensor, clients: list[int], context: RoundContext) -> None:
    """One round, keeping a running sum of the updates as an aggregator would."""
    total = torch.zeros_like(start, dtype=torch.float64)
    for outcome in engine.run_round(start, RoundPlan([[k] for k in clients]), 0, context):
        failure = outcome.reason if isinstance(outcome, ClientFailure) else None
        if failure is not None:
            raise RuntimeError(f"client {outcome.chain} failed: {failure}")
        assert isinstance(outcome, ClientUpdate)
        total.add_(outcome.vector.double(), alpha=outcome.weight)


def time_round(engine: Any, start: torch.Tensor, context: RoundContext, device: torch.device) -> tuple[float, float, float]:
    """Seconds of one round of every client, peak CUDA bytes, and CUDA bytes held before it."""
    peak = baseline = 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = float(torch.cuda.memory_allocated(device))
    started = time.perf_counter()
    run_round(engine, start, list(range(context.federation.num_clients)), context)
    synchronize(device)
    seconds = time.perf_counter() - started
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
    return seconds, peak, baseline


def make_engine(name: str, model: torch.nn.Module, workers: int | None) -> Any:
    if name == "vectorized":
        return VectorizedEngine(model)
    if name == "parallel":
        return ParallelEngine(model, workers)
    return SequentialEngine(model)


def engine_notes(
    engine: Any,
    model: torch.nn.Module,
    batch_size: int,
    num_clients: int,
    peak: float,
    baseline: float,
    device: torch.device,
) -> str:
    """What an engine's entry reports besides its throughput."""
    if isinstance(engine, ParallelEngine):
        fork = statistics.median(engine.fork_seconds[1:]) * 1e3  # [0] is the warm-up round
        stop = statistics.median(engine.stop_seconds[1:]) * 1e3
        return f" ({engine.workers} workers; per round: fork {fork:.1f} ms, stop {stop:.1f} ms)"
    if not isinstance(engine, VectorizedEngine):
        return ""
    if device.type == "cuda":
        memory = (
            f"peak/K {peak / num_clients / 2**20:.1f} MiB, "
            f"increment/K {(peak - baseline) / num_clients / 2**20:.1f} MiB"
        )
    else:
        estimate = estimate_bytes_per_client(
            model, INPUT_SHAPE, batch_size, device, momentum=False, penalty=False
        )
        memory = f"estimate/K {estimate / 2**20:.1f} MiB"
    return f" ({memory}, block size {engine.block_size})"


def bench_case(
    model_name: str,
    batch_size: int,
    federation: Federation,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Time every engine of ``args.engines`` on one model and batch size, repeats
    interleaved (engine order rotating), after one warm-up round each on a few clients."""
    model = build_model(model_name, device)
    context = build_context(federation, batch_size, args.lr)
    start = model_to_vector(model)
    samples = sum(client.num_samples for client in federation.clients)
    engines = {name: make_engine(name, model, args.workers) for name in args.engines}
    for engine in engines.values():
        run_round(engine, start, list(range(WARMUP_CLIENTS)), context)
        synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in engines}
    peaks: dict[str, tuple[float, float]] = {}
    names = list(engines)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            seconds, peak, baseline = time_round(engines[name], start, context, device)
            times[name].append(seconds)
            peaks[name] = max(peaks.get(name, (0.0, 0.0)), (peak, baseline))
    first = names[0]
    entries, record = [], {"model": model_name, "batch_size": batch_size, "engines": {}}
    first_rate = samples / min(times[first])
    for name, engine in engines.items():
        rate = samples / min(times[name])
        paired = statistics.median(a / b for a, b in zip(times[first], times[name]))
        notes = engine_notes(engine, model, batch_size, federation.num_clients, *peaks[name], device)
        ratio = f", ratio {rate / first_rate:5.2f} (paired {paired:5.2f})" if name != first else ""
        entries.append(f"{name} {rate:10.0f} samples/s{ratio}{notes}")
        record["engines"][name] = {
            "samples_per_second": round(rate, 1),
            "seconds": [round(t, 4) for t in times[name]],
            "ratio_best": round(rate / first_rate, 3),
            "ratio_paired_median": round(paired, 3),
            "notes": notes.strip(" ()"),
        }
        if isinstance(engine, VectorizedEngine):
            record["engines"][name]["analytic_path"] = engine.analytic_groups > 0
        engine.close()
    print(f"{model_name:9s} B={batch_size:3d}: " + "; ".join(entries), flush=True)
    bound = matmul_seconds_per_step(model, batch_size) if device.type == "cpu" else None
    if bound is not None and first == "sequential":
        per_step = batch_size / first_rate
        record["matmul_bound"] = round(per_step / bound, 3)
        print(
            f"{'':9s}        bound: the matmuls alone {bound * 1e3:.3f} ms per client step, the sequential "
            f"engine {per_step * 1e3:.3f} ms (full batches): the same matmuls, however batched, "
            f"can be at most {per_step / bound:.2f}x faster on this CPU",
            flush=True,
        )
    return record


def matmul_seconds_per_step(model: torch.nn.Module, batch_size: int, repeats: int = 300) -> float | None:
    """Seconds of the matrix products alone in one client's SGD step of a model made of
    ``nn.Linear`` layers (forward, input gradients, weight gradients), in a bare loop;
    None for other models. Any engine computes these products per client (each client
    has its own weights), so sequential time / this time bounds what batching clients
    can gain on this CPU."""
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    counted = sum(p.numel() for layer in layers for p in layer.parameters())
    if not layers or counted != sum(p.numel() for p in model.parameters()):
        return None
    inputs = [torch.rand(batch_size, layer.in_features) for layer in layers]
    grads = [torch.rand(batch_size, layer.out_features) for layer in layers]
    weights = [layer.weight.detach().cpu() for layer in layers]

    def step() -> None:
        for n, weight in enumerate(weights):
            torch.nn.functional.linear(inputs[n], weight)
            torch.mm(grads[n].t(), inputs[n])
            if n:
                torch.mm(grads[n], weight)

    for _ in range(repeats // 10):
        step()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    parser.add_argument("--clients", type=int, default=100, help="K (default 100)")
    parser.add_argument(
        "--samples-per-client", type=int, default=600, help="n_k (default 600: MNIST / 100)"
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn_mnist"], help="models")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[10, 50], help="B values")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per engine (best)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--lr", type=float, default=0.05, help="client learning rate")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["sequential", "vectorized"],
        help="engines to time; ratios are to the first (default: sequential vectorized)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="parallel engine's workers (default: one per usable CPU)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {device} ({name}); torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"K={args.clients}, n_k={args.samples_per_client}, 1 local epoch, SGD lr {args.lr}; "
        f"{default_workers()} usable CPUs, "
        f"load average (1 min) {load_average()}",
        flush=True,
    )
    federation = random_federation(args.clients, args.samples_per_client, device, seed=0)
    cases = [
        bench_case(model_name, batch_size, federation, args, device)
        for model_name in args.models
        for batch_size in args.batch_sizes
    ]
    print(f"load average (1 min) at the end {load_average()}")
    if args.json:
        result = {
            "device": str(device),
            "device_name": name,
            "torch_threads": torch.get_num_threads(),
            "num_clients": args.clients,
            "samples_per_client": args.samples_per_client,
            "repeats": args.repeats,
            "machine": benchlib.machine_description(),
            "cases": cases,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
