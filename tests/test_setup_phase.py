"""The setup-phase driver is generic: a loss transform defined only here, with a two-step
setup phase, runs in one process (the simulator's path) and over Flower messages
(LoopbackGrid) with the same result."""

from __future__ import annotations

import copy
import types
from collections.abc import Generator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import FedplugTrainer, LoopbackGrid, run_on_grid
from fedplug.adapters.flower.loopback import FIRST_NODE_ID
from fedplug.adapters.flower.setup_phase import load_phase_state, run_setup_phase
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import Tensor
from torch.nn import functional as F

from fedplug.components import ComponentConfig, LossTransform, PhaseCost
from fedplug.components import Context as LossContext
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.experiment import run_experiment
from fedplug.hookspecs import RegisterLossTransform, hookimpl
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.model import build_model
from fedplug.setup_phase import (
    ClientInputs,
    PhaseInputs,
    SetupPhase,
    SetupReply,
    SetupStep,
    run_in_process,
)

NUM_CLIENTS = 3
SCALE = "scale"


class SizeScaledConfig(ComponentConfig):
    """Cross-entropy scaled by each client's share of the samples (test only)."""

    name: Literal["test_size_scaled"] = "test_size_scaled"


class SizeScalePhase(SetupPhase):
    """``count``: every client reports n_k. ``scale``: the server sends n; client k keeps
    ``K n_k / n`` (a one-element tensor) and its sample count (a plain value)."""

    name = "test_size_scale"

    def __init__(self, loss: SizeScaled) -> None:
        self.loss = loss

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        counts = yield SetupStep("count")
        total = sum(int(counts[client].values["n"]) for client in sorted(counts))
        yield SetupStep("scale", values={"total": total, "clients": num_clients})
        return PhaseCost(rounds=2, bytes_up=0, bytes_down=0)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        size = int(data.train_x.shape[0])
        if step.name == "count":
            return SetupReply(values={"n": size})
        share = size * int(step.values["clients"]) / int(step.values["total"])
        state[SCALE] = torch.tensor([share], dtype=torch.float32)
        state["n"] = size
        return SetupReply(tensors={"echo": state[SCALE]})

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        self.loss.scales = {client: state[SCALE] for client, state in states.items()}

    def client_context(self, state: dict[str, Any]) -> LossContext:
        return {SCALE: state[SCALE]}


class SizeScaled(LossTransform):
    def __init__(self, config: SizeScaledConfig) -> None:
        self.config = config
        self.scales: dict[int, Tensor] | None = None

    def setup_phase(self) -> SetupPhase | None:
        return None if self.scales is not None else SizeScalePhase(self)

    def client_context(self, client_id: int, class_counts: np.ndarray) -> LossContext:
        if self.scales is None:
            raise RuntimeError("the setup phase must run before round 1")
        return {SCALE: self.scales[client_id]}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: LossContext
    ) -> Tensor:
        scale = context[SCALE].to(logits.device)
        return scale * F.cross_entropy(logits, targets, reduction="none")


def registry_with_the_test_plugin() -> Registry:
    plugin = types.ModuleType("test_setup_phase_plugin")

    @hookimpl
    def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
        register("test_size_scaled", SizeScaledConfig, SizeScaled)

    hook = fedplug_register_loss_transforms
    plugin.fedplug_register_loss_transforms = hook  # type: ignore[attr-defined]
    manager = new_plugin_manager(autoload=False)
    manager.register(plugin, name="test_setup_phase_plugin")
    return collect_registry(manager)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return registry_with_the_test_plugin()


def experiment() -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update(
        {"rounds": 2, "client_fraction": 1.0, "loss_transform": {"name": "test_size_scaled"}}
    )
    return data


def users_client_app(trainer: FedplugTrainer, federation: Any) -> ClientApp:
    """A user's ClientApp: FedplugTrainer on each node's shard, with the phase's handler."""
    app = ClientApp()
    trainer.declare_on(app)  # the server asks the app what it runs before round 1

    def shard(context: Context) -> tuple[Tensor, Tensor]:
        client = federation.clients[int(context.node_config["partition-id"])]
        return client.train_x, client.train_y

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return trainer.describe(shard(context), message, context)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return trainer.fit(model, shard(context), message, context)

    @app.train(SizeScalePhase.name)
    def setup(message: Message, context: Context) -> Message:
        return trainer.setup_phase(shard(context), message, context)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        client = federation.clients[int(context.node_config["partition-id"])]
        return trainer.evaluate(model, (client.test_x, client.test_y), message)

    model = build_model(trainer.config, trainer.registry, federation, torch.device("cpu"))
    return app


def test_the_driver_gives_the_nodes_what_run_in_process_gives_the_clients(
    registry: Registry,
) -> None:
    # Prepare: the same phase in one process and over messages to three nodes.
    config = validate_experiment(experiment(), registry)
    federation = build_federation(config.data, registry)
    in_process = SizeScaled(config.train.loss_transform)
    clients = [PhaseInputs(c.client_id, c.train_x, c.train_y) for c in federation.clients]
    trainer = FedplugTrainer(config.train, registry=registry, num_classes=federation.num_classes)
    grid = LoopbackGrid(users_client_app(trainer, federation), NUM_CLIENTS)
    phase = SizeScaled(config.train.loss_transform).setup_phase()
    assert phase is not None
    # Execute
    local_cost = run_in_process(in_process.setup_phase(), clients)  # type: ignore[arg-type]
    remote_cost = run_setup_phase(
        grid,
        {client: FIRST_NODE_ID + client for client in range(NUM_CLIENTS)},
        phase,
        message_config={},
        timeout=None,
    )
    # Assert: the same cost, and every node keeps the state the in-process client kept
    # (a tensor and a plain value), from which the phase gives the same loss context.
    assert local_cost == remote_cost == PhaseCost(2, 0, 0)
    assert in_process.scales is not None and in_process.setup_phase() is None
    sizes = [client.num_samples for client in federation.clients]
    for client in range(NUM_CLIENTS):
        state = load_phase_state(grid.contexts[FIRST_NODE_ID + client], "fedplug", phase.name)
        assert state["n"] == sizes[client] and isinstance(state["n"], int)
        assert torch.equal(phase.client_context(state)[SCALE], in_process.scales[client])
        assert float(in_process.scales[client]) == pytest.approx(
            NUM_CLIENTS * sizes[client] / sum(sizes)
        )
    messages = [m for m in grid.delivered if m.metadata.message_type == "train.test_size_scale"]
    assert len(messages) == 2 * NUM_CLIENTS


def test_a_loss_with_a_setup_phase_trains_alike_on_the_simulator_and_on_flower(
    registry: Registry,
) -> None:
    # Prepare
    config = validate_experiment(experiment(), registry)
    federation = build_federation(config.data, registry)
    trainer = FedplugTrainer(config.train, registry=registry, num_classes=federation.num_classes)
    grid = LoopbackGrid(users_client_app(trainer, federation), NUM_CLIENTS)
    # Execute
    simulated, simulator = run_experiment(config, None, registry=registry)
    result, strategy = run_on_grid(grid, config, registry=registry)
    # Assert: the same phase cost, the same rounds and the same model after them.
    assert strategy.setup_cost == PhaseCost(2, 0, 0)
    assert (result.setup_rounds, result.setup_bytes) == (simulated.setup_rounds, 0) == (2, 0)
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-6)
    for ours, theirs in zip(result.history, simulated.history, strict=True):
        assert ours.accuracy == pytest.approx(theirs.accuracy, abs=1e-5)
        assert ours.loss == pytest.approx(theirs.loss, abs=1e-5)
