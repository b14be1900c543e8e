"""Flower's strategies as fedplug's aggregator (``aggregator: {name: flower, ...}``):
each strategy's model against one computed independently here, strict validation, the
composition with IWDS, FedShift and FedGSP, the failure screening in front of Flower,
and a ``fedplug run`` killed after round 2 that resumes bit-identical."""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from typing import Any, Literal

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("flwr")

from flwr.serverapp import strategy as flower_strategies  # noqa: E402

from fedplug.algorithms import flower_strategies as bridge  # noqa: E402
from fedplug.algorithms.flower_strategies import (  # noqa: E402
    DP_WRAPPER,
    NOT_OFFERED,
    STRATEGIES,
    WRAPPER_PARAMETERS,
    FlowerStrategyAggregator,
    FlowerStrategyConfig,
)
from fedplug.components import ClientUpdate, ComponentConfig, LossTransform  # noqa: E402
from fedplug.config import validate_experiment  # noqa: E402
from fedplug.errors import ConfigError, TrainingError  # noqa: E402
from fedplug.experiment import run_experiment  # noqa: E402
from fedplug.plugins import collect_registry, new_plugin_manager  # noqa: E402

DP = DP_WRAPPER


def aggregator(**config: Any) -> FlowerStrategyAggregator:
    return FlowerStrategyAggregator(FlowerStrategyConfig(**config), num_clients=8)


def updates(vectors: list[list[float]], weights: list[float] | None = None) -> list[ClientUpdate]:
    weights = weights or [1.0] * len(vectors)
    return [
        ClientUpdate(client_id=k, vector=torch.tensor(v), weight=w, num_steps=1)
        for k, (v, w) in enumerate(zip(vectors, weights))
    ]


GLOBAL = torch.zeros(4)
FIVE = [
    [1.0, 10.0, -3.0, 0.5],
    [2.0, -1.0, 4.0, 0.25],
    [9.0, 2.0, 0.0, -2.0],
    [3.0, 3.0, 1.0, 8.0],
    [-4.0, 0.0, 2.0, 1.0],
]
"""Five client models of four parameters, no ties anywhere."""


# ------------------------------------------------------------------ the maths, by hand


def test_fedmedian_is_the_coordinate_wise_median():
    # Prepare: an odd count (torch.median is the middle value) and an even one (the
    # mean of the two middle values, as numpy and Flower take it).
    odd, even = torch.tensor(FIVE), torch.tensor(FIVE[:4])
    # Execute
    odd_result = aggregator(strategy="FedMedian").aggregate(GLOBAL, updates(FIVE))
    even_result = aggregator(strategy="FedMedian").aggregate(GLOBAL, updates(FIVE[:4]))
    # Assert: by hand, coordinate 0 of the five is median(1, 2, 9, 3, -4) = 2.
    assert odd_result.tolist() == [2.0, 2.0, 1.0, 0.5]
    torch.testing.assert_close(odd_result, odd.median(dim=0).values)
    torch.testing.assert_close(even_result, even.quantile(0.5, dim=0))


def test_fedtrimmedavg_drops_beta_of_each_tail_then_averages():
    # Prepare: beta 0.2 of five cuts one value at each end of every coordinate.
    middle_three = torch.tensor(FIVE).sort(dim=0).values[1:4]
    # Execute
    result = aggregator(strategy="FedTrimmedAvg", beta=0.2).aggregate(GLOBAL, updates(FIVE))
    # Assert: coordinate 0 keeps (1, 2, 3): mean 2.
    assert result[0].item() == pytest.approx(2.0)
    torch.testing.assert_close(result, middle_three.mean(dim=0))


def krum_scores(vectors: torch.Tensor, malicious: int) -> torch.Tensor:
    """Each vector's sum of squared distances to its n - f - 2 nearest others."""
    distances = torch.cdist(vectors.double(), vectors.double()).square()
    nearest = max(1, len(vectors) - malicious - 2)
    return torch.stack([row.sort().values[1 : nearest + 1].sum() for row in distances])


def test_krum_picks_the_update_closest_to_its_neighbours():
    vectors = torch.tensor(FIVE)
    chosen = krum_scores(vectors, malicious=1).argmin()
    # Execute
    result = aggregator(strategy="Krum", num_malicious_nodes=1).aggregate(GLOBAL, updates(FIVE))
    # Assert
    torch.testing.assert_close(result, vectors[chosen])


def test_multikrum_averages_the_m_best_by_weight():
    # Prepare
    vectors, weights = torch.tensor(FIVE), [10.0, 20.0, 30.0, 40.0, 50.0]
    best = krum_scores(vectors, malicious=1).argsort()[:3]
    w = torch.tensor(weights)[best]
    expected = (vectors[best] * w[:, None]).sum(0) / w.sum()
    # Execute
    result = aggregator(
        strategy="MultiKrum", num_malicious_nodes=1, num_nodes_to_select=3
    ).aggregate(GLOBAL, updates(FIVE, weights))
    # Assert
    torch.testing.assert_close(result, expected)


def test_bulyan_averages_the_beta_coordinates_closest_to_the_median_of_the_krum_set():
    # Prepare: f = 1 needs 4f + 3 = 7 updates; theta = n - 2f = 5 chosen by MultiKrum,
    # then per coordinate the beta = theta - 2f = 3 values closest to their median.
    generator = torch.Generator().manual_seed(3)
    vectors = torch.randn(7, 6, generator=generator)
    selected = vectors[krum_scores(vectors, malicious=1).argsort()[:5]]
    median = selected.median(dim=0).values
    closest = (selected - median).abs().argsort(dim=0)[:3]
    expected = selected.gather(0, closest).mean(dim=0)
    # Execute
    result = aggregator(strategy="Bulyan", num_malicious_nodes=1).aggregate(
        torch.zeros(6), updates(vectors.tolist())
    )
    # Assert
    torch.testing.assert_close(result, expected)


def test_bulyan_with_too_few_updates_says_what_it_needs():
    with pytest.raises(
        TrainingError,
        match=r"Bulyan returned no model from 5 updates.*4 \* num_malicious_nodes \+ 3",
    ):
        aggregator(strategy="Bulyan", num_malicious_nodes=1).aggregate(GLOBAL, updates(FIVE))


def test_fedavg_through_flower_is_the_weighted_mean():
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    expected = (torch.tensor(FIVE) * torch.tensor(weights)[:, None]).sum(0) / 15.0
    result = aggregator(strategy="FedAvg").aggregate(GLOBAL, updates(FIVE, weights))
    torch.testing.assert_close(result, expected)


def test_dp_without_noise_clips_each_update_around_the_global_model():
    # Prepare: around w = (1, 1, 1, 1), clip every change to norm 2, then average.
    current = torch.ones(4)
    changes = torch.tensor(FIVE) - current
    clipped = changes * torch.clamp(2.0 / changes.norm(dim=1), max=1.0)[:, None]
    expected = current + clipped.mean(dim=0)
    # Execute
    result = aggregator(strategy=DP, noise_multiplier=0.0, clipping_norm=2.0).aggregate(
        current, updates(FIVE)
    )
    # Assert
    torch.testing.assert_close(result, expected)


def test_dp_noise_has_flowers_scale_and_is_a_function_of_the_round_and_model():
    # Prepare: 20,000 parameters, so the noise's spread can be measured; the noise std is
    # noise_multiplier * clipping_norm / num_sampled_clients = 0.5 * 2 / 4 = 0.25.
    size = 20_000
    current = torch.zeros(size)
    small_changes = [
        torch.full((size,), 1e-3 * (k + 1)) for k in range(4)
    ]  # norms < 2: not clipped
    rounds = [ClientUpdate(k, v, 1.0, 1) for k, v in enumerate(small_changes)]
    config = {"strategy": DP, "noise_multiplier": 0.5, "clipping_norm": 2.0, "wrapped": "FedMedian"}
    numpy_before, python_before = np.random.get_state()[1].copy(), random.getstate()
    # Execute
    first = aggregator(**config).aggregate(current, rounds)
    again = aggregator(**config).aggregate(current, rounds)
    resumed = aggregator(**config)
    resumed.load_state_dict({"rounds_aggregated": 1})
    second_round = resumed.aggregate(current, rounds)
    other_seed = aggregator(**config, noise_seed=7).aggregate(current, rounds)
    moved = [ClientUpdate(k, v + 1.0, 1.0, 1) for k, v in enumerate(small_changes)]
    other_model = aggregator(**config).aggregate(current + 1.0, moved) - 1.0
    # Assert
    assert first.std().item() == pytest.approx(0.25, rel=0.03)
    assert torch.equal(first, again)
    assert not torch.equal(first, second_round)
    assert not torch.equal(first, other_seed)
    assert not torch.allclose(first, other_model)
    assert np.array_equal(np.random.get_state()[1], numpy_before), "numpy's global generator moved"
    assert random.getstate() == python_before, "Python's random moved"


def test_dp_with_an_unchanged_model_says_so_instead_of_dividing_by_zero():
    unchanged = updates([[0.0] * 4, [1.0] * 4])
    with pytest.raises(
        TrainingError, match=r"client 0 in round 1 sent back the global model unchanged"
    ):
        aggregator(strategy=DP, noise_multiplier=0.0, clipping_norm=1.0).aggregate(
            GLOBAL, unchanged
        )


def test_zero_weight_updates_are_left_out_and_nothing_to_aggregate_is_a_training_error():
    result = aggregator(strategy="FedMedian").aggregate(
        GLOBAL, updates(FIVE[:2] + [[99.0] * 4], [1.0, 1.0, 0.0])
    )
    torch.testing.assert_close(result, torch.tensor(FIVE[:2]).mean(0))
    with pytest.raises(TrainingError, match="no client update reached the 'flower' aggregator"):
        aggregator(strategy="FedMedian").aggregate(GLOBAL, [])


def test_state_is_the_round_count_and_nothing_is_needed_from_clients():
    robust = aggregator(strategy="Krum")
    robust.aggregate(GLOBAL, updates(FIVE))
    robust.aggregate(GLOBAL, updates(FIVE))
    assert robust.state_dict() == {"rounds_aggregated": 2}
    assert robust.client_needs().describe() == []


# -------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"strategy": "FedMedain"},
            "unknown Flower strategy 'FedMedain' in strategy; offered: Bulyan, FedAvg, FedMedian",
        ),
        ({}, "strategy is required: one of Bulyan, FedAvg"),
        (
            {"strategy": "QFedAvg", "client_learning_rate": 0.1, "beta": 0.2},
            "QFedAvg takes q, client_learning_rate, not beta",
        ),
        (
            {"strategy": "DifferentialPrivacyClientSideFixedClipping"},
            "fedplug's clients do not; use DifferentialPrivacyServerSideFixedClipping",
        ),
        ({"strategy": "FedAvgM"}, "use fedplug's aggregator 'fedavgm'"),
        ({"strategy": "FedMedian", "beta": 0.1}, "FedMedian takes no parameters, not beta"),
        (
            {"strategy": "MultiKrum", "momentum": 0.9},
            "MultiKrum takes num_malicious_nodes, num_nodes_to_select, not momentum",
        ),
        ({"strategy": "FedTrimmedAvg", "beta": 0.5}, "beta: Input should be less than 0.5"),
        ({"strategy": DP, "clipping_norm": 1.0}, f"{DP} needs noise_multiplier"),
        (
            {"strategy": DP, "noise_multiplier": 1.0, "clipping_norm": 1.0, "wrapped": DP},
            "cannot wrap itself",
        ),
        ({"strategy": "Krum", "wrapped": "FedAvg"}, f"wrapped is a parameter of {DP}, not of Krum"),
        (
            {
                "strategy": DP,
                "noise_multiplier": 1.0,
                "clipping_norm": 1.0,
                "wrapped": "Krum",
                "beta": 0.1,
            },
            f"{DP} wrapping Krum takes noise_multiplier, clipping_norm, num_sampled_clients, "
            "noise_seed, "
            "wrapped, num_malicious_nodes, not beta",
        ),
    ],
)
def test_config_errors_are_one_line_that_lists_what_exists(small_experiment, entry, message):
    small_experiment["train"]["aggregator"] = {"name": "flower", **entry}
    with pytest.raises(ConfigError) as caught:
        validate_experiment(small_experiment)
    (line,) = [
        line for line in str(caught.value).splitlines() if line.startswith("train.aggregator")
    ]
    assert message in line


def test_the_table_matches_flowers_constructors_and_every_flower_strategy_is_placed():
    """A Flower upgrade that renames a parameter or adds a strategy fails here."""
    for name, parameters in STRATEGIES.items():
        accepted = inspect.signature(getattr(flower_strategies, name).__init__).parameters
        assert set(parameters) <= set(accepted), name
    dp_accepted = inspect.signature(getattr(flower_strategies, DP).__init__).parameters
    assert {"noise_multiplier", "clipping_norm", "num_sampled_clients"} <= set(dp_accepted)
    assert set(WRAPPER_PARAMETERS) - set(dp_accepted) == {"noise_seed", "wrapped"}  # fedplug's own
    exported = {
        name
        for name in dir(flower_strategies)
        if isinstance(getattr(flower_strategies, name), type)
        and issubclass(getattr(flower_strategies, name), flower_strategies.Strategy)
        and name != "Strategy"
    }
    assert exported == set(STRATEGIES) | {DP} | set(NOT_OFFERED)


def test_registered_only_where_flower_is_installed(monkeypatch):
    assert "flower" in collect_registry(new_plugin_manager(autoload=False)).names("aggregators")
    monkeypatch.setattr(bridge, "flower_installed", lambda: False)
    assert "flower" not in collect_registry(new_plugin_manager(autoload=False)).names("aggregators")


# ------------------------------------------------------------------------ in fedplug run


def compose(
    small_experiment: dict[str, Any], strategy: dict[str, Any], **slots: Any
) -> dict[str, Any]:
    small_experiment["train"].update(client_fraction=1.0, rounds=3)
    small_experiment["train"]["aggregator"] = {"name": "flower", **strategy}
    small_experiment["train"].update(slots)
    return small_experiment


@pytest.mark.parametrize(
    "strategy, slots",
    [
        ({"strategy": "FedMedian"}, {"sampler": {"name": "iwds"}}),
        ({"strategy": "FedTrimmedAvg", "beta": 0.2}, {"loss_transform": {"name": "fedshift"}}),
        (
            {"strategy": "MultiKrum", "num_malicious_nodes": 1, "num_nodes_to_select": 2},
            {
                "grouper": {
                    "name": "fedgsp",
                    "mode": "naive",
                    "fixed_groups": 3,
                    "group_fraction": 1.0,
                }
            },
        ),
        (
            {
                "strategy": DP,
                "noise_multiplier": 0.01,
                "clipping_norm": 5.0,
                "wrapped": "Krum",
                "num_malicious_nodes": 1,
            },
            {"sampler": {"name": "iwds"}, "loss_transform": {"name": "fedshift"}},
        ),
    ],
    ids=["fedmedian-iwds", "fedtrimmedavg-fedshift", "multikrum-fedgsp", "dp_krum-iwds-fedshift"],
)
def test_composes_with_iwds_fedshift_and_fedgsp(small_experiment, strategy, slots):
    # Prepare
    config = validate_experiment(compose(small_experiment, strategy, **slots))
    # Execute
    result, simulator = run_experiment(config, None)
    # Assert: every round aggregated and learned something.
    assert [record.failures for record in result.history] == [0, 0, 0]
    assert simulator.algorithm.aggregator.state_dict() == {"rounds_aggregated": 3}
    assert torch.isfinite(simulator.final_vector).all()
    assert result.best_accuracy > 0.3  # 4 balanced classes: chance is 0.25


class FaultyConfig(ComponentConfig):
    """Cross-entropy, except that the chosen clients' training turns NaN."""

    name: Literal["nan_on"]
    clients: tuple[int, ...] = ()


class NaNOn(LossTransform):
    def __init__(self, config: FaultyConfig) -> None:
        self.config = config

    def client_context(self, client_id, class_counts):
        return {"poison": torch.tensor(float("nan") if client_id in self.config.clients else 0.0)}

    def per_sample_loss(self, logits, targets, sample_ids, context):
        return super().per_sample_loss(logits, targets, sample_ids, context) * (
            1 + context["poison"]
        )


def test_a_nan_update_is_dropped_by_screening_before_flower_sees_it(small_experiment, monkeypatch):
    # Prepare: client 4 trains to NaN; record every model Flower's strategy receives.
    registry = collect_registry(new_plugin_manager(autoload=False))
    registry.register("loss_transforms", "test", "nan_on", FaultyConfig, NaNOn)
    config = validate_experiment(
        compose(
            small_experiment,
            {"strategy": "FedMedian"},
            loss_transform={"name": "nan_on", "clients": [4]},
        ),
        registry,
    )
    seen: list[np.ndarray] = []
    build = FlowerStrategyAggregator.build_strategy

    def spying_build(self, num_replies):
        strategy = build(self, num_replies)
        aggregate_train = strategy.aggregate_train

        def spy(server_round, replies):
            replies = list(replies)
            seen.extend(reply.content["arrays"]["vector"].numpy() for reply in replies)
            return aggregate_train(server_round, replies)

        strategy.aggregate_train = spy
        return strategy

    monkeypatch.setattr(FlowerStrategyAggregator, "build_strategy", spying_build)
    # Execute
    result, simulator = run_experiment(config, None, registry=registry)
    # Assert: 6 clients, one dropped every round; Flower saw only the 5 finite models.
    assert [record.failures for record in result.history] == [1, 1, 1]
    assert len(seen) == 15
    assert all(np.isfinite(model).all() for model in seen)
    assert torch.isfinite(simulator.final_vector).all()


def test_flower_runtime_gives_the_simulators_records(small_experiment):
    """The same aggregator inside FedplugStrategy on Flower's in-process grid."""
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

    config = validate_experiment(
        compose(small_experiment, {"strategy": "FedTrimmedAvg", "beta": 0.2})
    )
    simulated, simulator = run_experiment(config, None)
    grid = LoopbackGrid(make_client_app(), config.data.num_clients)
    flower, strategy = run_on_grid(grid, config, federated_evaluation=False)
    for ours, theirs in zip(flower.history, simulated.history, strict=True):
        assert ours.accuracy == pytest.approx(theirs.accuracy, abs=1e-5)
        assert ours.loss == pytest.approx(theirs.loss, abs=1e-5)
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)


# ------------------------------------------------------- (d) killed after round 2, resumed

KILL_AFTER_ROUND_2 = textwrap.dedent("""
    import os, signal, sys
    import fedplug.simulation.simulator as simulator
    from fedplug.cli import main

    save_checkpoint = simulator.save_checkpoint

    def save_then_die(path, state):
        save_checkpoint(path, state)
        if len(state["history"]) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    simulator.save_checkpoint = save_then_die
    sys.exit(main(sys.argv[1:]))
    """)


def _fedplug(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = (
        [sys.executable, "-c", script, *args]
        if script
        else [sys.executable, "-m", "fedplug.cli", *args]
    )
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_fedplug_run_killed_after_round_2_resumes_bit_identical(small_experiment, tmp_path):
    # Prepare: a robust strategy under DP noise, so both the strategy and the noise
    # generator must come back exactly; FedShift and IWDS on the clients.
    data = compose(
        small_experiment,
        {
            "strategy": DP,
            "noise_multiplier": 0.05,
            "clipping_norm": 5.0,
            "wrapped": "MultiKrum",
            "num_malicious_nodes": 1,
            "num_nodes_to_select": 3,
        },
        sampler={"name": "iwds"},
        loss_transform={"name": "fedshift"},
    )
    data["train"]["rounds"] = 4
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    # Execute: an uninterrupted run; a run SIGKILLed right after round 2's checkpoint;
    # the same command again, which resumes it.
    reference = _fedplug("run", str(config_path), "--out", str(tmp_path / "reference"), "--quiet")
    killed = _fedplug(
        "run",
        str(config_path),
        "--out",
        str(tmp_path / "killed"),
        "--quiet",
        script=KILL_AFTER_ROUND_2,
    )
    partial = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)
    resumed = _fedplug("run", str(config_path), "--out", str(tmp_path / "killed"), "--quiet")
    # Assert
    assert reference.returncode == 0, reference.stderr
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(partial["history"]) == 2 and partial["aggregator"] == {"rounds_aggregated": 2}
    assert resumed.returncode == 0, resumed.stderr
    expected = json.loads((tmp_path / "reference" / "metrics.json").read_text())
    actual = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    strip = lambda history: [
        {k: v for k, v in r.items() if k != "seconds"} for r in history
    ]  # noqa: E731
    assert strip(actual["history"]) == strip(expected["history"])
    reference_model = torch.load(tmp_path / "reference" / "model.pt")
    resumed_model = torch.load(tmp_path / "killed" / "model.pt")
    assert reference_model.keys() == resumed_model.keys()
    for name in reference_model:
        assert torch.equal(reference_model[name], resumed_model[name]), name
