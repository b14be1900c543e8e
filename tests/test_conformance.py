"""Conformance: the simulator and Flower's in-process grid give the same round records.

For every combination of the built-in aggregators x loss transforms x samplers x groupers
that Flower runs (the config accepts it and no component needs pooled raw data), for the
loss transforms composed in one slot (:data:`COMPOSED_LOSSES`: FedShift + FedProx,
FedDisk + FedProx), and for
the test-only plugins of :mod:`conformance_plugins` (a stateful aggregator with a payload
and a reply extra, a loss transform with a two-step setup phase, a grouper with its own
metrics), a two-round run on both runtimes must agree: accuracy and loss within 1e-5;
the same participants, failures, bytes and component metrics every round; the same
setup traffic and derived params (except ``engine``), a measured setup time on both, and
the same checkpoint (``fedplug.run.state.RunState``) after the last round
(:func:`assert_same_checkpoint` says what stays on Flower's nodes instead). So must a
round where every client fails, a NaN update and a misshapen update.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conformance_checks import assert_same_state, assert_same_summary
from conformance_plugins import (
    AGGREGATOR,
    FAULTY_LOSS_TRANSFORM,
    GROUPER,
    LOSS_TRANSFORM,
    conformance_registry,
    reset_faults,
)
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
from fedplug.adapters.flower.records import MODEL_KEY
from flwr.app import Array, Message
from flwr.clientapp import ClientApp

import fedplug.plugins
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.federated_round import client_needs
from fedplug.run.results import RoundRecord, RunResult

NUM_CLIENTS = 4
ROUNDS = 2

# Small settings for the components that have expensive or interesting parameters; any
# other registered component runs with its defaults.
SETTINGS: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.1},
    "fedavgm": {"momentum": 0.9},
    "feddisk": {
        "made_hidden": 8,
        "made_max_epochs": 1,
        "global_rounds": 1,
        "classifier_hidden": 8,
        "classifier_epochs": 1,
    },
    # ICG groups from the gathered class counts; K = 4, beta = 1: chains of several clients.
    "fedgsp": {
        "mode": "fedgsp",
        "growth": "log",
        "alpha": 2.0,
        "beta": 1.0,
        "group_fraction": 0.5,
    },
}
# FedGSP samples groups itself, so it sees every client.
CLIENT_FRACTION = {"fedgsp": 1.0}
SLOTS = {
    "sampler": "samplers",
    "loss_transform": "loss_transforms",
    "aggregator": "aggregators",
    "grouper": "groupers",
}
DEFAULTS = {
    "sampler": "uniform",
    "loss_transform": "cross_entropy",
    "aggregator": "fedavg",
    "grouper": "none",
}
TEST_ONLY = {"loss_transform": LOSS_TRANSFORM, "aggregator": AGGREGATOR, "grouper": GROUPER}
COMPOSED_LOSSES: dict[str, list[Any]] = {
    "fedshift+fedprox": ["fedshift", {"name": "fedprox", **SETTINGS["fedprox"]}],
    "feddisk+fedprox": [{"name": "feddisk", **SETTINGS["feddisk"]}, {"name": "fedprox", **SETTINGS["fedprox"]}],
}
"""Loss transforms composed in the one slot (``loss_transform: [a, b]``, the ``composite``
loss transform), by row label; the bare name ``composite`` has no parts and no row."""
COMPOSED_ROWS: list[dict[str, str]] = [
    {**DEFAULTS, "loss_transform": "fedshift+fedprox"},
    {**DEFAULTS, "loss_transform": "fedshift+fedprox", "aggregator": "scaffold"},
    {**DEFAULTS, "loss_transform": "fedshift+fedprox", "sampler": "iwds"},
    {**DEFAULTS, "loss_transform": "fedshift+fedprox", "grouper": "fedgsp"},
    {**DEFAULTS, "loss_transform": "feddisk+fedprox"},
]
"""The compositions' rows: FedShift + FedProx with each slot's other interesting choice
(SCAFFOLD's client penalty adds to FedProx's), FedDisk + FedProx (a part with a setup phase)."""


def base_experiment() -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update(rounds=ROUNDS, client_fraction=0.75)
    return data


def experiment_dict(names: dict[str, str], **train: Any) -> dict[str, Any]:
    data = base_experiment()
    for slot, name in names.items():
        data["train"][slot] = COMPOSED_LOSSES.get(name) or {"name": name, **SETTINGS.get(name, {})}
        if name in CLIENT_FRACTION:
            data["train"]["client_fraction"] = CLIENT_FRACTION[name]
    data["train"].update(train)
    return data


def runs_on_flower(names: dict[str, str]) -> bool:
    """Whether the config accepts the combination and no component needs pooled data."""
    registry = conformance_registry()
    try:
        config = validate_experiment(experiment_dict(names), registry)
    except ConfigError:
        return False
    train = config.train
    components = [
        registry.build("samplers", train.sampler),
        registry.build("loss_transforms", train.loss_transform),
        registry.build("aggregators", train.aggregator, NUM_CLIENTS),
        registry.build("groupers", train.grouper),
    ]
    return client_needs(*components).pooled_data is None


def combinations() -> list[Any]:
    """Every built-in combination Flower runs; then the test-only plugins, each with every
    built-in of the other slots held at the default but one, and all three together."""
    builtin = {slot: default_registry().names(kind) for slot, kind in SLOTS.items()}
    product = itertools.product(*(builtin[slot] for slot in SLOTS))
    chosen: list[dict[str, str]] = [dict(zip(SLOTS, names)) for names in product]
    for slot, plugin in TEST_ONLY.items():
        for other in SLOTS:
            if other == slot:
                continue
            for name in builtin[other]:
                chosen.append({**DEFAULTS, slot: plugin, other: name})
    for sampler in builtin["sampler"]:
        chosen.append({"sampler": sampler, **TEST_ONLY})
    chosen += COMPOSED_ROWS
    unique = {tuple(names[slot] for slot in SLOTS): names for names in chosen}
    return [
        pytest.param(names, id="-".join(key))
        for key, names in unique.items()
        if runs_on_flower(names)
    ]


@pytest.fixture
def plugins_everywhere(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The conformance registry wherever a runtime asks for the installed plugins (the
    Flower nodes build their components from ``default_registry()``)."""
    registry = conformance_registry()
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    return registry


# ------------------------------------------------------------------------ comparison


def assert_same_records(flower: RunResult, simulated: RunResult) -> None:
    """The same result summary but the wall times (:func:`conformance_checks.assert_same_summary`),
    the setup report included (a setup phase's report is built from its clients' reports,
    which reach Flower's server in the phase's last replies), and a measured setup time on
    both (the components' preparation and phases), however short."""
    assert_same_summary(flower.summary(), simulated.summary(), frozenset())
    assert flower.setup_seconds > 0 and simulated.setup_seconds > 0


def without_engine(derived: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in derived.items() if key != "engine"}


def assert_same_record(ours: RoundRecord, theirs: RoundRecord) -> None:
    where = f"round {theirs.round}"
    assert ours.round == theirs.round
    assert ours.accuracy == pytest.approx(theirs.accuracy, abs=1e-5), where
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-5), where
    exact = ("participants", "failures", "bytes_up", "bytes_down", "cumulative_bytes")
    assert [getattr(ours, key) for key in exact] == [getattr(theirs, key) for key in exact], where
    assert ours.metrics == pytest.approx(theirs.metrics, rel=1e-12), where
    modelled = ("compute_seconds_model", "communication_seconds_model")
    assert [getattr(ours, key) for key in modelled] == pytest.approx(
        [getattr(theirs, key) for key in modelled], rel=1e-12
    ), where


def assert_same_checkpoint(
    flower_out: Path, simulator_out: Path, reports: tuple[dict, dict], registry: Any, config: Any
) -> None:
    """The two runs' last checkpoints hold the same run state: the same keys, global
    model, aggregator and grouper states, setup cost and round records (as
    :func:`assert_same_record`), and a setup wall time each. What Flower keeps on its
    nodes is in neither its checkpoint nor its result: the per-client states (the
    simulator holds them exactly when a component declares ``client_state``), and the
    result of the loss transform's setup phase, if it declares one (its state stays empty
    on Flower's server); both give the same setup report (``reports``, Flower's and the
    simulator's), a phase's assembled from its clients' reports."""
    flower = torch.load(flower_out / "checkpoint.pt", weights_only=True)
    simulated = torch.load(simulator_out / "checkpoint.pt", weights_only=True)
    assert flower.keys() == simulated.keys()
    for key in ("global_vector", "aggregator", "grouper", "setup_cost", "version"):
        assert_same_state(flower[key], simulated[key], key)
    for ours, theirs in zip(flower["history"], simulated["history"], strict=True):
        assert_same_record(RoundRecord.from_dict(ours), RoundRecord.from_dict(theirs))
    assert flower["setup_seconds"] > 0 and simulated["setup_seconds"] > 0
    train = config.train
    loss_transform = registry.build("loss_transforms", train.loss_transform)
    needs = client_needs(
        registry.build("samplers", train.sampler),
        loss_transform,
        registry.build("aggregators", train.aggregator, NUM_CLIENTS),
        registry.build("groupers", train.grouper),
    )
    assert flower["client_states"] == {}
    assert bool(simulated["client_states"]) == needs.client_state
    assert reports[0] == reports[1]
    if loss_transform.setup_phase() is None:
        assert_same_state(flower["loss_transform"], simulated["loss_transform"], "loss_transform")
    else:
        assert flower["loss_transform"] == {} and simulated["loss_transform"] != {}
        assert reports[0] != {}


def run_both(registry: Any, data: dict[str, Any], out: Path | None = None) -> tuple[Any, Any]:
    """Run ``data`` on the simulator and on the loopback grid (writing their folders,
    checkpoint included, to ``out / "simulator"`` and ``out / "flower"`` when ``out`` is
    given); the results and final models, Flower's first."""
    config = validate_experiment(data, registry)
    reset_faults()
    simulated, simulator = run_experiment(config, out / "simulator" if out else None, registry=registry)
    reset_faults()
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    flower, strategy = run_on_grid(
        grid,
        config,
        out_dir=out / "flower" if out else None,
        registry=registry,
        track=False,
    )
    return (flower, strategy.final_vector), (simulated, simulator.final_vector)


# ------------------------------------------------------------------------ the matrix


@pytest.mark.parametrize("names", combinations())
def test_flower_gives_the_simulators_records(
    plugins_everywhere: Any, names: dict[str, str], tmp_path: Path
) -> None:
    # Prepare
    data = experiment_dict(names)
    # Execute
    (flower, flower_vector), (simulated, simulator_vector) = run_both(plugins_everywhere, data, tmp_path)
    # Assert: the same records and checkpoints, and no combination agrees by failing alike.
    assert_same_records(flower, simulated)
    config = validate_experiment(data, plugins_everywhere)
    reports = (flower.setup_report, simulated.setup_report)
    assert_same_checkpoint(tmp_path / "flower", tmp_path / "simulator", reports, plugins_everywhere, config)
    assert [record.failures for record in simulated.history] == [0] * ROUNDS
    torch.testing.assert_close(flower_vector, simulator_vector, rtol=0, atol=1e-5)


def test_the_matrix_covers_every_registered_component() -> None:
    """A component added to the built-ins joins the matrix, unless it needs pooled data."""
    covered: dict[str, set[str]] = {slot: set() for slot in SLOTS}
    for param in combinations():
        for slot, name in param.values[0].items():
            covered[slot].add("composite" if name in COMPOSED_LOSSES else name)
    registry = conformance_registry()
    expected = {
        slot: {
            name
            for name in registry.names(kind)
            if name != FAULTY_LOSS_TRANSFORM and runs_on_flower({**DEFAULTS, slot: name})
        }
        for slot, kind in SLOTS.items()
    }
    assert "feddisk_ab" not in expected["loss_transform"]  # it pools raw data: simulator only
    expected["loss_transform"].add("composite")  # its rows: COMPOSED_ROWS
    assert covered == expected


def test_the_test_only_plugins_report_what_they_declare(plugins_everywhere: Any) -> None:
    # Prepare: all three test-only plugins together.
    data = experiment_dict({"sampler": "uniform", **TEST_ONLY})
    # Execute
    (flower, _), (simulated, _) = run_both(plugins_everywhere, data)
    # Assert: the grouper's and the aggregator's metrics, the config's derived value and the
    # phase's traffic (4 clients x 12 float32 sums up, the 12-float mean down to each)
    # reach both records; the
    # aggregator's damping (1 + a mean update norm) agrees between them.
    dampings = []
    for result in (flower, simulated):
        metrics = [dict(record.metrics) for record in result.history]
        dampings.append([round_metrics.pop("conformance_damping") for round_metrics in metrics])
        assert metrics == [{"chain_count": 2.0, "largest_chain": 2.0}] * ROUNDS
        assert all(damping > 1.0 for damping in dampings[-1])
        assert result.derived_params["conformance_effective_lr"] == pytest.approx(0.5 / (1 - 0.5))
        assert (result.setup_rounds, result.setup_bytes) == (2, 2 * NUM_CLIENTS * 12 * 4)
    # The phase's weights stay on Flower's nodes; its report, built from the clients'
    # reports, is the simulator's.
    assert simulated.setup_report["weighted_clients"] == NUM_CLIENTS
    assert flower.setup_report == simulated.setup_report
    assert dampings[0] == pytest.approx(dampings[1], rel=1e-5)


# ----------------------------------------------------------------------- failures


class MisshapenGrid(LoopbackGrid):
    """The loopback grid, except that the train replies of ``partitions`` carry a model
    whose first array has the wrong shape (as a buggy node would send)."""

    def __init__(self, client_app: ClientApp, num_nodes: int, partitions: set[int]) -> None:
        super().__init__(client_app, num_nodes)
        self.partitions = partitions

    def _deliver(self, message: Message) -> Message | None:
        reply = super()._deliver(message)
        partition = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        if message.metadata.message_type != "train" or partition not in self.partitions:
            return reply
        if reply is not None and reply.has_content() and MODEL_KEY in reply.content.array_records:
            arrays = reply.content.array_records[MODEL_KEY]
            arrays[next(iter(arrays))] = Array(np.zeros(3, dtype=np.float32))
        return reply


def faulty_experiment(loss: dict[str, Any], **train: Any) -> dict[str, Any]:
    data = experiment_dict({}, client_fraction=1.0, **train)
    data["train"]["loss_transform"] = {"name": FAULTY_LOSS_TRANSFORM, **loss}
    return data


@pytest.mark.parametrize("aggregator", ["fedavg", "scaffold", AGGREGATOR])
def test_a_round_where_every_client_fails_is_retried_the_same_way(
    plugins_everywhere: Any, aggregator: str
) -> None:
    # Prepare: every client raises the first time it trains; the retry succeeds.
    data = faulty_experiment(
        {"raise_on": list(range(NUM_CLIENTS)), "raise_once": True},
        aggregator={"name": aggregator},
        failures={"max_failed_fraction": 0.5, "max_round_retries": 1},
    )
    # Execute
    (flower, flower_vector), (simulated, simulator_vector) = run_both(plugins_everywhere, data)
    # Assert: both replayed round 1 and recorded the accepted attempt.
    assert_same_records(flower, simulated)
    assert [record.failures for record in simulated.history] == [0, 0]
    torch.testing.assert_close(flower_vector, simulator_vector, rtol=0, atol=1e-5)


@pytest.mark.parametrize("aggregator", ["fedavg", AGGREGATOR])
def test_a_round_where_every_client_always_fails_stops_both_runtimes_alike(
    plugins_everywhere: Any, aggregator: str
) -> None:
    # Prepare
    data = faulty_experiment(
        {"raise_on": list(range(NUM_CLIENTS))},
        aggregator={"name": aggregator},
        failures={"max_failed_fraction": 0.9, "max_round_retries": 2},
    )
    config = validate_experiment(data, plugins_everywhere)
    expected = rf"round 1: {NUM_CLIENTS} of {NUM_CLIENTS} client updates failed in each of 3 "
    # Execute / Assert
    with pytest.raises(TrainingError, match=expected):
        run_experiment(config, None, registry=plugins_everywhere)
    grid = LoopbackGrid(make_client_app(), NUM_CLIENTS)
    with pytest.raises(TrainingError, match=expected):
        run_on_grid(grid, config, registry=plugins_everywhere, federated_evaluation=False)
    trains = [message for message in grid.delivered if message.metadata.message_type == "train"]
    assert len(trains) == 3 * NUM_CLIENTS


@pytest.mark.parametrize("grouper", ["none", GROUPER])
def test_a_nan_update_is_dropped_by_both_runtimes(plugins_everywhere: Any, grouper: str) -> None:
    # Prepare: client 2 trains to NaN every round.
    data = faulty_experiment({"nan_on": [2]}, grouper={"name": grouper})
    # Execute
    (flower, flower_vector), (simulated, simulator_vector) = run_both(plugins_everywhere, data)
    # Assert
    assert_same_records(flower, simulated)
    assert [record.failures for record in simulated.history] == [1, 1]
    torch.testing.assert_close(flower_vector, simulator_vector, rtol=0, atol=1e-5)


def test_a_misshapen_update_is_dropped_by_both_runtimes(
    plugins_everywhere: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: client 3 replies with 3 parameters, on the simulator (its engine's update)
    # and on Flower (its node's reply).
    data = experiment_dict({}, client_fraction=1.0)
    config = validate_experiment(data, plugins_everywhere)
    from fedplug.run.round_context import RoundContext

    make_update = RoundContext.make_update

    def misshapen(self: RoundContext, chain: list[int], vector: torch.Tensor, *rest: Any) -> Any:
        return make_update(self, chain, vector[:3] if chain == [3] else vector, *rest)

    monkeypatch.setattr(RoundContext, "make_update", misshapen)
    # Execute
    simulated, simulator = run_experiment(config, None, registry=plugins_everywhere)
    grid = MisshapenGrid(make_client_app(), NUM_CLIENTS, partitions={3})
    flower, strategy = run_on_grid(grid, config, registry=plugins_everywhere)
    # Assert: the same runs but the drop's wording, which names what each runtime saw (a
    # Flower node's misshapen array, the simulator's misshapen flat vector).
    for result in (flower, simulated):
        for record in result.history:
            assert [drop["clients"] for drop in record.dropped] == [[3]], record.dropped
            record.dropped = [{**drop, "reason": "misshapen"} for drop in record.dropped]
    assert_same_records(flower, simulated)
    assert [record.failures for record in simulated.history] == [1, 1]
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)


DROPOUT = {"faults": {"dropout": {"probability": 0.7}}, "rounds": 4}
"""A dropout that empties some of the 4 rounds and not others."""


@pytest.mark.parametrize("grouper", ["none", GROUPER])
def test_flower_conforms_under_dropout(plugins_everywhere: Any, grouper: str, tmp_path: Path) -> None:
    # Prepare: dropout that empties some rounds, with plain clients and with chains.
    data = experiment_dict({**DEFAULTS, "grouper": grouper}, **DROPOUT)
    # Execute
    (flower, flower_vector), (simulated, simulator_vector) = run_both(plugins_everywhere, data, tmp_path)
    # Assert: the same summaries and checkpoints; the row has rounds nobody trained and
    # rounds somebody did.
    assert_same_records(flower, simulated)
    config = validate_experiment(data, plugins_everywhere)
    reports = (flower.setup_report, simulated.setup_report)
    assert_same_checkpoint(tmp_path / "flower", tmp_path / "simulator", reports, plugins_everywhere, config)
    participants = [record.participants for record in simulated.history]
    assert 0 in participants and max(participants) > 0, participants
    torch.testing.assert_close(flower_vector, simulator_vector, rtol=0, atol=1e-5)
