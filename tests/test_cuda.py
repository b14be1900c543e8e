"""CUDA smoke test: one vectorised round on the GPU against the same round on the CPU.

Skipped on a machine without CUDA (CI has none); `make bench-gpu` and the device check in
docs/performance.md run it where a GPU is lent. The CPU side is the sequential engine, an
independent path (one client after another, torch.optim.SGD arithmetic), so agreement
checks the vectorised engine's CUDA arithmetic, not two runs of the same code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fedplug.components import ClientUpdate
from fedplug.config import validate_section
from fedplug.data.build import build_federation
from fedplug.plugins import default_registry
from fedplug.run.model import resolve_device
from fedplug.run.vectors import model_to_vector
from fedplug.simulation.simulator import Simulator

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ATOL = 1e-4
"""float32 on two devices: the same sums in another order (cuBLAS vs MKL), a few rounding
steps apart after a round of SGD; a wrong sample, step or update is off by far more."""

DATA: dict[str, Any] = {
    "dataset": {"name": "synthetic", "num_train": 800, "num_test": 200, "num_features": 12, "num_classes": 4},
    "partition": {"name": "dirichlet_class", "alpha": 0.3, "min_size": 5},
    "num_clients": 8,
    "local_test_fraction": 0.2,
    "seed": 0,
}

TRAIN: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "client_fraction": 1.0,
    "rounds": 2,
    "local_epochs": 2,
    "batch_size": 7,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "seed": 0,
    "engine": "sequential",
}


def _simulator(device: str, **train: Any) -> Simulator:
    registry = default_registry()
    federation = build_federation(validate_section("data", DATA, registry), registry, device)
    config = validate_section("train", {**TRAIN, **train, "device": device}, registry)
    return Simulator(config, federation, registry)


class _Recorder:
    """Wraps the simulator's engine and keeps the first round's updates by client."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.name = engine, engine.name
        self.updates: dict[int, ClientUpdate] = {}

    def run_round(self, start: torch.Tensor, plan: Any, round_index: int, context: Any) -> Iterator[Any]:
        for outcome in self.engine.run_round(start, plan, round_index, context):
            if round_index == 0:
                assert isinstance(outcome, ClientUpdate), outcome
                self.updates[outcome.client_id] = outcome
            yield outcome

    def derived_params(self) -> dict[str, Any]:
        return self.engine.derived_params()

    def close(self) -> None:
        self.engine.close()


def _first_round(simulator: Simulator) -> tuple[torch.Tensor, dict[int, ClientUpdate]]:
    start = model_to_vector(simulator.model).cpu()
    recorder = _Recorder(simulator.engine)
    simulator.engine = recorder
    simulator.run(resume=False)
    return start, recorder.updates


@needs_cuda
@pytest.mark.parametrize(
    "algorithm",
    [{}, {"loss_transform": {"name": "fedprox", "mu": 0.5}}, {"loss_transform": "fedshift", "sampler": "iwds"}],
    ids=["fedavg", "fedprox", "fedshift+iwds"],
)
def test_a_vectorised_round_on_cuda_matches_the_sequential_round_on_the_cpu(algorithm):
    cpu = _simulator("cpu", rounds=1, **algorithm)
    cuda = _simulator("cuda", rounds=1, engine="vectorized", **algorithm)
    assert (cpu.engine.name, cuda.engine.name) == ("sequential", "vectorized")
    start, expected = _first_round(cpu)
    cuda_start, actual = _first_round(cuda)
    torch.testing.assert_close(cuda_start, start, rtol=0.0, atol=0.0)  # the same initial model
    assert sorted(actual) == sorted(expected) == list(range(DATA["num_clients"]))
    for client_id, update in expected.items():
        other = actual[client_id]
        assert other.vector.device.type == "cuda"
        assert (other.weight, other.num_steps) == (update.weight, update.num_steps)
        torch.testing.assert_close(other.vector.cpu(), update.vector, rtol=0.0, atol=ATOL)
        assert (update.vector - start).abs().max() > 100 * ATOL  # the client really trained


@needs_cuda
def test_auto_picks_the_vectorised_engine_on_cuda_and_the_run_matches_the_cpu():
    cpu = _simulator("cpu")
    cuda = _simulator("cuda", engine="auto")
    assert cuda.engine.name == "vectorized"
    expected, actual = cpu.run(resume=False).history, cuda.run(resume=False).history
    assert len(actual) == len(expected) == TRAIN["rounds"]
    for got, wanted in zip(actual, expected):
        assert got.accuracy == pytest.approx(wanted.accuracy, abs=1.0 / DATA["dataset"]["num_test"])
        assert got.loss == pytest.approx(wanted.loss, abs=1e-3)
    torch.testing.assert_close(cuda.final_vector.cpu(), cpu.final_vector, rtol=0.0, atol=ATOL)


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_cuda_resolves_to_the_indexed_device_its_tensors_live_on(name, monkeypatch):
    """`train.device: cuda` must equal the device of a tensor moved to "cuda" (cuda:0), or
    the simulator refuses a federation built on that very device. Runs without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(name) == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
