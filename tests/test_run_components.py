"""A run's components, built in one place and asked together (fedplug.run.components):
every slot may prepare, declare a setup phase and report round metrics and a setup
report, and each reaches the run the same way."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Literal

import numpy as np
import pytest

from fedplug.algorithms.uniform import UniformSampler
from fedplug.components import (
    SLOTS,
    ClientNeeds,
    ComponentConfig,
    FederationSummary,
    FederationView,
    Grouper,
    PhaseCost,
    RoundPlan,
)
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.run.components import Components
from fedplug.setup_phase import ClientInputs, SetupPhase, SetupReply, SetupStep, prepare_in_process

# ----------------------------------------------------------- components of every slot


class CountPhase(SetupPhase):
    """One step: every client reports its number of training samples; the server adds
    them up (the phase costs one round, 8 bytes up per client, nothing down)."""

    def __init__(self, name: str, keep: Any) -> None:
        self.name = name
        self.keep = keep

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        replies = yield SetupStep("count")
        self.keep(sum(int(reply.values["samples"]) for reply in replies.values()))
        return PhaseCost(1, 8 * num_clients, 0)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        state["samples"] = int(data.train_y.numel())
        return SetupReply(values={"samples": state["samples"]})

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        pass

    def client_context(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


class CensusSamplerConfig(ComponentConfig):
    """The uniform sampler, with a setup phase that counts the samples of all clients."""

    name: Literal["census"] = "census"


class CensusSampler(UniformSampler):
    """A sampler that learns the federation's size in its setup phase and reports it,
    with the clients each round trains, as round metrics."""

    def __init__(self, config: CensusSamplerConfig) -> None:
        self.config = config
        self.total: int | None = None

    def setup_phase(self) -> SetupPhase | None:
        return None if self.total is not None else CountPhase("census", self._keep)

    def _keep(self, total: int) -> None:
        self.total = total

    def setup_report(self) -> dict[str, Any]:
        return {"census_total": self.total}

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        return {"census_total": float(self.total or 0), "trained": float(sum(map(len, plan.chains)))}


class LoneGrouperConfig(ComponentConfig):
    """Every client alone, with a prepare step and a setup phase of its own."""

    name: Literal["lone"] = "lone"


class LoneGrouper(Grouper):
    """Chains of one; ``prepare`` keeps K and the largest class count, its setup phase
    the number of samples; both go into its round metrics."""

    def __init__(self, config: LoneGrouperConfig) -> None:
        self.config = config
        self.prepared: tuple[int, int] | None = None
        self.samples: int | None = None

    def client_needs(self) -> ClientNeeds:
        return ClientNeeds(class_counts=True)

    def prepare(self, federation: FederationView) -> PhaseCost | None:
        self.prepared = (federation.num_clients, int(np.asarray(federation.class_counts).max()))
        return PhaseCost(0, 0, 5)

    def setup_phase(self) -> SetupPhase | None:
        return CountPhase("lone", self._keep)

    def _keep(self, total: int) -> None:
        self.samples = total

    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        return RoundPlan(chains=[[int(client)] for client in clients])

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        assert self.prepared is not None
        return {"grouper_clients": float(self.prepared[0]), "grouper_samples": float(self.samples or 0)}


@pytest.fixture
def registry():
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("samplers", "test", "census", CensusSamplerConfig, CensusSampler)
    registry.register("groupers", "test", "lone", LoneGrouperConfig, LoneGrouper)
    return registry


def test_a_sampler_and_a_grouper_setup_phase_and_metrics_reach_the_round_record(small_experiment, registry):
    small_experiment["train"].update(rounds=2, client_fraction=1.0)
    small_experiment["train"]["sampler"] = {"name": "census"}
    small_experiment["train"]["grouper"] = {"name": "lone"}
    config = validate_experiment(small_experiment, registry)

    result, simulator = run_experiment(config, None, registry=registry)

    federation = simulator.federation
    total = int(federation.client_sizes.sum())
    num_clients = federation.num_clients
    for record in result.history:
        assert record.metrics == {
            "census_total": total,
            "trained": num_clients,
            "grouper_clients": num_clients,
            "grouper_samples": total,
        }
    # the grouper's prepare (5 bytes down) and the two one-round phases (8 bytes up per client each)
    assert result.setup_rounds == 2
    assert result.setup_bytes == 5 + 2 * 8 * num_clients
    assert result.setup_report == {"census_total": total}


def test_the_in_process_runner_runs_a_setup_phase_of_any_slot(small_experiment, registry):
    small_experiment["train"]["sampler"] = {"name": "census"}
    small_experiment["train"]["grouper"] = {"name": "lone"}
    config = validate_experiment(small_experiment, registry)
    _, simulator = run_experiment(config, None, registry=registry)
    federation = simulator.federation
    components = Components.build(config.train, registry, federation.num_clients)

    cost = prepare_in_process(components, federation)

    assert components.sampler.total == int(federation.client_sizes.sum())
    assert components.grouper.samples == int(federation.client_sizes.sum())
    assert components.grouper.prepared == (federation.num_clients, int(federation.class_counts.max()))
    assert cost == PhaseCost(2, 2 * 8 * federation.num_clients, 5)
    # the sampler has its result now, so it declares no phase any more; the grouper still does
    assert [slot for slot, _ in components.setup_phases()] == ["grouper"]


# ----------------------------------------------------------------------- the build


def test_build_builds_each_slot_once_in_slot_order(small_experiment):
    registry = collect_registry(new_plugin_manager(autoload=False))
    config = validate_experiment(small_experiment, registry)
    calls: list[tuple[str, tuple[Any, ...]]] = []
    build = registry.build

    def counting(kind: str, component_config: Any, *arguments: Any) -> Any:
        calls.append((kind, arguments))
        return build(kind, component_config, *arguments)

    registry.build = counting  # type: ignore[method-assign]

    components = Components.build(config.train, registry, num_clients=7)

    assert calls == [("samplers", ()), ("loss_transforms", ()), ("aggregators", (7,)), ("groupers", ())]
    assert list(components.by_slot()) == list(SLOTS)
    assert components.aggregator.num_clients == 7


# ------------------------------------------------------------ asking all four at once


class Declares:
    """A stand-in component that declares given needs, metrics and a setup report."""

    def __init__(self, needs: ClientNeeds | None = None, metrics: dict[str, float] | None = None,
                 report: dict[str, Any] | None = None, cost: PhaseCost | None = None) -> None:
        self.needs, self.metrics, self.report, self.cost = needs or ClientNeeds(), metrics or {}, report or {}, cost
        self.prepared_with: Any = None

    def client_needs(self) -> ClientNeeds:
        return self.needs

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        return self.metrics

    def setup_report(self) -> dict[str, Any]:
        return self.report

    def prepare(self, federation: FederationView) -> PhaseCost | None:
        self.prepared_with = federation
        return self.cost

    def setup_phase(self) -> None:
        return None


def test_needs_is_the_union_of_the_four():
    components = Components(
        Declares(ClientNeeds(client_side=True, reply_metrics=("train_loss",))),  # type: ignore[arg-type]
        Declares(ClientNeeds(class_counts=True)),  # type: ignore[arg-type]
        Declares(ClientNeeds(server_payload=("c",), reply_extras=("delta_c",), client_state=True)),  # type: ignore[arg-type]
        Declares(ClientNeeds(pooled_data="an oracle")),  # type: ignore[arg-type]
    )

    assert components.needs() == ClientNeeds(
        class_counts=True,
        client_side=True,
        client_state=True,
        server_payload=("c",),
        reply_extras=("delta_c",),
        pooled_data="an oracle",
        reply_metrics=("train_loss",),
    )


def test_prepare_hands_every_slot_the_same_view_and_adds_up_the_costs():
    slots = [Declares(cost=PhaseCost(1, 2, 3)), Declares(), Declares(cost=PhaseCost(0, 10, 0)), Declares()]
    components = Components(*slots)  # type: ignore[arg-type]
    summary = FederationSummary(np.array([[1, 2], [3, 0], [0, 4]]))

    assert components.prepare(summary) == PhaseCost(1, 12, 3)
    assert all(slot.prepared_with is summary for slot in slots)
    assert summary.num_clients == 3


def test_round_metrics_and_setup_reports_merge_and_a_clash_names_both_slots():
    plan = RoundPlan(chains=[[0]])
    components = Components(
        Declares(metrics={"a": 1}, report={"x": [1]}),  # type: ignore[arg-type]
        Declares(),  # type: ignore[arg-type]
        Declares(metrics={"b": 2.5}),  # type: ignore[arg-type]
        Declares(metrics={"c": 3}, report={"y": "z"}),  # type: ignore[arg-type]
    )
    assert components.round_metrics(plan, None) == {"a": 1.0, "b": 2.5, "c": 3.0}
    assert components.setup_report() == {"x": [1], "y": "z"}

    clashing = Components(
        Declares(metrics={"cpd": 1}),  # type: ignore[arg-type]
        Declares(),  # type: ignore[arg-type]
        Declares(),  # type: ignore[arg-type]
        Declares(metrics={"cpd": 2}),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match="the sampler and the grouper both report the round metric 'cpd'"):
        clashing.round_metrics(plan, None)


def test_a_federation_summary_refuses_counts_that_are_not_a_matrix():
    with pytest.raises(ValueError, match="K x C"):
        FederationSummary(np.array([1, 2, 3]))
