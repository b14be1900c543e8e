"""A setup phase of any slot on every runtime: the clients' reports that build the setup
report, a grouper's phase on Flower as on the simulator, and the refusal of a sampler's
or aggregator's phase where its client side trains in another process."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import pytest
import torch
from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
from fedplug.adapters.flower.setup_phase import REPORT_KEY, VALUES_KEY, decode_setup_reply
from flwr.app import ConfigRecord, RecordDict
from test_run_components import CensusSampler, CensusSamplerConfig, LoneGrouper, LoneGrouperConfig

import fedplug.plugins
from fedplug.components import PhaseCost
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.components import Components
from fedplug.setup_phase import (
    ClientInputs,
    PhaseInputs,
    SetupPhase,
    SetupReply,
    SetupStep,
    checked_report,
    run_in_process,
)

# ------------------------------------------------------------------ client reports


class TwoStepPhase(SetupPhase):
    """``first``: every client keeps its sample count. ``last`` (final): every client
    keeps twice it; the server keeps the reports it received at each step."""

    name = "two_step"

    def __init__(self) -> None:
        self.received: list[dict[int, dict[str, Any]]] = []

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        for step in (SetupStep("first"), SetupStep("last", final=True)):
            replies = yield step
            self.received.append({client: reply.report for client, reply in replies.items()})
        return PhaseCost(2, 0, 0)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        state["samples"] = int(data.train_y.numel()) * (2 if step.name == "last" else 1)
        return SetupReply()

    def client_report(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"samples": state["samples"], "flags": [1, 0], "label": "ab"}

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        pass

    def client_context(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


def test_only_the_final_steps_replies_carry_the_clients_reports() -> None:
    # Prepare: two clients of 3 and 5 samples.
    phase = TwoStepPhase()
    clients = [PhaseInputs(client, torch.zeros(size, 2), torch.zeros(size)) for client, size in ((0, 3), (1, 5))]
    # Execute
    cost = run_in_process(phase, clients)  # type: ignore[arg-type]
    # Assert: no report after the first step; after the final one each client's, of the
    # state that step left; reports are not traffic.
    assert phase.received[0] == {0: {}, 1: {}}
    assert phase.received[1] == {
        0: {"samples": 6, "flags": [1, 0], "label": "ab"},
        1: {"samples": 10, "flags": [1, 0], "label": "ab"},
    }
    assert cost == PhaseCost(2, 0, 0)


@pytest.mark.parametrize(
    "report", [{"x": float("nan")}, {"x": [1, 2.5]}, {"x": [float("inf")]}, {"x": None}, {"x": [True]}]
)
def test_a_report_a_runtime_cannot_carry_is_refused_and_named(report: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="'x'"):
        checked_report(report)


def test_a_nodes_report_is_decoded_and_a_malformed_one_refused() -> None:
    content = RecordDict({VALUES_KEY: ConfigRecord({}), REPORT_KEY: ConfigRecord({"counts": [1, 2], "mean": 0.5})})
    assert decode_setup_reply(content).report == {"counts": [1, 2], "mean": 0.5}
    content[REPORT_KEY] = ConfigRecord({"mean": float("nan")})
    with pytest.raises(ValueError, match="client report"):
        decode_setup_reply(content)


# ---------------------------------------------------------------- slots and runtimes


@pytest.fixture
def registry() -> Registry:
    """The built-ins, and test_run_components' sampler and grouper with a setup phase each."""
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("samplers", "test", "census", CensusSamplerConfig, CensusSampler)
    registry.register("groupers", "test", "lone", LoneGrouperConfig, LoneGrouper)
    return registry


def phase_experiment(small_experiment: dict[str, Any], registry: Registry, **slots: str) -> Any:
    """``small_experiment`` for 2 rounds of every client, with the components ``slots``
    names (slot -> name)."""
    data = copy.deepcopy(small_experiment)
    data["train"].update(rounds=2, client_fraction=1.0)
    for slot, name in slots.items():
        data["train"][slot] = {"name": name}
    return validate_experiment(data, registry)


def test_a_groupers_setup_phase_gives_flower_the_simulators_run(
    small_experiment: dict[str, Any], registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the nodes build their components from the same registry.
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    config = phase_experiment(small_experiment, registry, grouper="lone")
    num_clients = config.data.num_clients
    # Execute
    simulated, simulator = run_experiment(config, None, registry=registry)
    flower, strategy = run_on_grid(LoopbackGrid(make_client_app(), num_clients), config, registry=registry)
    # Assert: the grouper's phase ran on the nodes (one round, 8 bytes up per client),
    # and its result reached the server's grouper as the simulator's.
    total = int(simulator.federation.client_sizes.sum())
    for result in (flower, simulated):
        assert [record.metrics["grouper_samples"] for record in result.history] == [total, total]
        assert (result.setup_rounds, result.setup_bytes) == (1, 5 + 8 * num_clients)
    assert flower.setup_report == simulated.setup_report
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)


def test_a_samplers_setup_phase_is_refused_on_flower_naming_slot_and_runtime(
    small_experiment: dict[str, Any], registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    config = phase_experiment(small_experiment, registry, sampler="census")
    grid = LoopbackGrid(make_client_app(), config.data.num_clients)
    with pytest.raises(ConfigError, match=r"the sampler 'census' declares the setup phase 'census', but on Flower"):
        run_on_grid(grid, config, registry=registry)
    # The simulator, where one sampler object serves both sides, runs it.
    result, _ = run_experiment(config, None, registry=registry)
    assert result.setup_rounds == 1


def test_a_samplers_setup_phase_is_refused_for_fedmls_workers(
    small_experiment: dict[str, Any], registry: Registry
) -> None:
    config = phase_experiment(small_experiment, registry, sampler="census")
    components = Components.build(config.train, registry, config.data.num_clients)
    assert isinstance(config.train.sampler, CensusSamplerConfig)
    with pytest.raises(ConfigError, match=r"sampler 'census'.* on FedML .*fedplug run"):
        components.distributed_setup_phases("FedML")
    # Without the census sampler, the lone grouper's phase passes.
    components = Components.build(phase_experiment(small_experiment, registry, grouper="lone").train, registry, 6)
    assert [slot for slot, _ in components.distributed_setup_phases("FedML")] == ["grouper"]
