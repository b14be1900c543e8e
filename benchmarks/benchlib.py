"""Helpers shared by fedplug's benchmark scripts: environment, machine description,
memory probes, the MNIST federation and the centralised training floor.

The scripts that use this module (``bench_cpu_floor.py``, ``bench_vs_flower.py``,
``bench_memory.py``) each run as one command, print the machine and thread count, and
write a JSON result that ``run_all.py`` turns into ``docs/performance.md``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO_ROOT / "data" / "raw"
"""Where the ``mnist`` dataset plugin caches its arrays (``data/raw/mnist/mnist.npz``)."""

QUIET_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}
"""Telemetry off for the benchmark and every process it starts."""

for _name, _value in QUIET_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def set_threads(threads: int) -> int:
    """Pin torch's intra-op threads (and OpenMP/MKL for child processes); return the count."""
    import torch

    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(threads)
    torch.set_num_threads(threads)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other engineers share the machine)."""
    return [round(value, 2) for value in os.getloadavg()]


def machine_description() -> dict[str, Any]:
    """CPU model, cores, RAM, library versions, torch threads and the current load."""
    import torch

    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "ram_gib": _ram_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "flwr": _version("flwr"),
        "ray": _version("ray"),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
    }


def print_machine(title: str, machine: dict[str, Any]) -> None:
    print(f"== {title}")
    print(
        f"machine: {machine['cpu_model']}, {machine['cpus_available']} of {machine['logical_cpus']} CPUs, "
        f"{machine['ram_gib']} GiB RAM, GPU {machine['gpu'] or 'none'}"
    )
    print(
        f"python {machine['python']}, torch {machine['torch']}, numpy {machine['numpy']}, flwr {machine['flwr']}, "
        f"ray {machine['ray']}; torch threads {machine['torch_threads']}; "
        f"load average {' '.join(str(v) for v in machine['load_average'])}"
    )
    sys.stdout.flush()


# ----------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_mib() -> float:
    """Resident set size now (VmRSS), in MiB."""
    kib = _status_kib("VmRSS")
    return round(kib / 1024, 1) if kib is not None else float("nan")


def peak_rss_mib() -> float:
    """Peak resident set size (VmHWM; ``getrusage`` maxrss where /proc is missing), in MiB."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / 1024, 1)


_PEAK_BEFORE_RESETS_MIB = 0.0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``), keeping
    the peak so far for :func:`process_peak_rss_mib`.

    Returns False where the kernel does not allow it; the peak then covers the whole process.
    """
    global _PEAK_BEFORE_RESETS_MIB
    _PEAK_BEFORE_RESETS_MIB = max(_PEAK_BEFORE_RESETS_MIB, peak_rss_mib())
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def process_peak_rss_mib() -> float:
    """Peak RSS of the whole process, across every :func:`reset_peak_rss`, in MiB."""
    return max(_PEAK_BEFORE_RESETS_MIB, peak_rss_mib())


# ------------------------------------------------------------------------------ data


def mnist_federation(
    num_clients: int, *, partition: str = "iid", local_test_fraction: float = 0.0, seed: int = 0
) -> Any:
    """Real MNIST through the ``mnist`` dataset plugin, split over ``num_clients`` clients."""
    from fedplug.config import validate_section
    from fedplug.data.build import build_federation
    from fedplug.plugins import default_registry

    registry = default_registry()
    data_config = validate_section(
        "data",
        {
            "dataset": {"name": "mnist", "download": False},
            "partition": {"name": partition},
            "num_clients": num_clients,
            "local_test_fraction": local_test_fraction,
            "seed": seed,
            "root": str(DATA_ROOT),
        },
        registry,
    )
    return build_federation(data_config, registry, "cpu")


def train_config(**fields: Any) -> Any:
    """A validated ``train`` section (FedAvg, uniform sampling, no grouping by default)."""
    from fedplug.config import validate_section
    from fedplug.plugins import default_registry

    return validate_section("train", fields, default_registry())


def centralised_epoch(
    model: Any,
    inputs: Any,
    labels: Any,
    batch_size: int,
    lr: float,
    generator: Any,
    optimizer: str = "torch",
) -> int:
    """One epoch of plain mini-batch SGD over ``inputs`` in a fresh random order: the floor
    every federated engine is compared with. Returns the number of optimiser steps.

    ``optimizer="torch"`` (default) steps with ``torch.optim.SGD``, as a user's loop does;
    ``"fused"`` with fedplug's :class:`~fedplug.run.local_training.FusedSGD` (the same
    numbers, less Python per step), the floor that isolates the engine's own overhead."""
    import torch
    from torch.nn import functional as F

    from fedplug.run.local_training import FusedSGD

    model.train()
    if optimizer == "torch":
        sgd: Any = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "fused":
        sgd = FusedSGD(model.parameters(), lr=lr)
    else:
        raise ValueError(f"optimizer must be 'torch' or 'fused', not {optimizer!r}")
    order = torch.randperm(len(labels), generator=generator)
    steps = 0
    for batch_ids in torch.split(order, batch_size):
        loss = F.cross_entropy(model(inputs[batch_ids]), labels[batch_ids])
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        sgd.step()
        steps += 1
    return steps


def evaluate_accuracy(model: Any, inputs: Any, labels: Any, batch_size: int = 1000) -> float:
    """Top-1 accuracy of ``model`` on ``inputs`` (no gradient, eval mode)."""
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(inputs[start : start + batch_size])
            correct += int((logits.argmax(dim=1) == labels[start : start + batch_size]).sum())
    model.train()
    return correct / max(len(labels), 1)


# ---------------------------------------------------------------------------- results


def median(values: list[float]) -> float:
    return float(statistics.median(values))


class Stopwatch:
    """``with Stopwatch() as watch: ...`` then ``watch.seconds`` (wall clock) and
    ``watch.cpu_seconds`` (CPU time of this process, all its threads)."""

    def __enter__(self) -> Self:
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = time.process_time() - self.cpu_started


def cpu_milliseconds(function: Any, repeats: int = 200) -> float:
    """Median CPU milliseconds of ``function()`` over ``repeats`` calls in 5 blocks (after one warm-up)."""
    function()
    blocks = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(max(1, repeats // 5)):
            function()
        blocks.append((time.process_time() - started) / max(1, repeats // 5) * 1e3)
    return median(blocks)


def write_result(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {target}")
