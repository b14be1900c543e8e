"""FedDisk and FedDiskAb: density-ratio weights, their cost, caching and the loss."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pluggy
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from pydantic import ValidationError
from torch import Tensor
from torch.nn import functional as F

from fedplug import hookspecs
from fedplug.algorithms import feddisk
from fedplug.algorithms.feddisk import (
    FedDisk,
    FedDiskAb,
    FedDiskAbConfig,
    FedDiskConfig,
    FedDiskWeights,
    cache_key,
    compute_feddisk_ab_weights,
    compute_feddisk_weights,
    density_ratios,
    load_weights,
    made_phase_cost,
    normalise_weights,
    parameter_bytes,
    partition_fingerprint,
    save_weights,
    train_classifiers,
    train_global_made,
    unit_interval_inputs,
    weight_summary,
)
from fedplug.algorithms.feddisk.made import MADE
from fedplug.algorithms.feddisk.made_training import PaddedSets
from fedplug.algorithms.feddisk.weights import (
    ClassifierHistory,
    classifier_split,
    client_weight_summary,
    histogram_top,
    merge_weight_summaries,
)
from fedplug.components import PhaseCost
from fedplug.config import validate_experiment
from fedplug.data.federation import ClientData, Federation
from fedplug.errors import DataError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import collect_registry
from fedplug.setup_phase import prepare_loss_transform

DIM = 16

# A classifier trained long enough to separate what can be separated on these small
# synthetic clients (the defaults are tuned for MNIST-sized clients).
STRONG = {
    "made_hidden": 20,
    "made_batch_size": 50,
    "classifier_lr": 0.1,
    "classifier_epochs": 30,
}


def two_mode_samples(
    num_samples: int, share_of_a: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Binary rows from two modes: A lights the first half of the pixels (p = 0.85, else
    0.15), B the second half. Returns the rows and whether each row is from mode A."""
    is_a = rng.random(num_samples) < share_of_a
    high_first = np.r_[np.full(DIM // 2, 0.85), np.full(DIM - DIM // 2, 0.15)]
    probabilities = np.where(is_a[:, None], high_first, high_first[::-1])
    return (rng.random((num_samples, DIM)) < probabilities).astype(np.float32), is_a


def make_federation(inputs: list[np.ndarray], name: str = "synthetic") -> Federation:
    clients = []
    for client_id, x in enumerate(inputs):
        labels = torch.as_tensor((x[:, 0] > 0.5).astype(np.int64))
        clients.append(
            ClientData(
                client_id=client_id,
                train_x=torch.as_tensor(x),
                train_y=labels,
                test_x=torch.as_tensor(x[:2]),
                test_y=labels[:2],
                class_counts=np.bincount(labels.numpy(), minlength=2),
            )
        )
    return Federation(
        clients=clients,
        test_x=torch.as_tensor(inputs[0][:4]),
        test_y=torch.zeros(4, dtype=torch.long),
        num_classes=2,
        input_shape=(DIM,),
        dataset_name=name,
    )


@pytest.fixture(scope="module")
def two_mode_clients() -> tuple[Federation, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    (x0, a0), (x1, a1) = two_mode_samples(400, 0.9, rng), two_mode_samples(400, 0.1, rng)
    return make_federation([x0, x1]), [a0, a1]


# ------------------------------------------------------------------ the weights


def test_weights_stay_near_one_on_iid_clients_and_spread_on_skewed_ones() -> None:
    rng = np.random.default_rng(1)
    iid = make_federation([two_mode_samples(400, 0.5, rng)[0] for _ in range(4)])
    skewed = make_federation([two_mode_samples(400, s, rng)[0] for s in (0.05, 0.35, 0.65, 0.95)])
    config = FedDiskConfig(**STRONG)

    iid_weights = compute_feddisk_weights(iid, config, np.random.default_rng(1)).weights
    skewed_weights = compute_feddisk_weights(skewed, config, np.random.default_rng(1)).weights

    for weights in iid_weights:
        assert weights.shape == (400,) and weights.dtype == np.float32
        assert weights.mean() == pytest.approx(1.0, abs=0.01)
        assert weights.std() < 0.1
    iid_spread = np.mean([w.std() for w in iid_weights])
    skewed_spread = np.mean([w.std() for w in skewed_weights])
    assert skewed_spread > 3 * iid_spread


@pytest.mark.parametrize("method", ["feddisk", "feddisk_ab"])
def test_locally_rare_mode_is_up_weighted(
    two_mode_clients: tuple[Federation, list[np.ndarray]], method: str
) -> None:
    federation, is_a = two_mode_clients
    if method == "feddisk":
        result = compute_feddisk_weights(
            federation, FedDiskConfig(**STRONG), np.random.default_rng(2)
        )
    else:
        config = FedDiskAbConfig(classifier_lr=0.1, classifier_epochs=30)
        result = compute_feddisk_ab_weights(federation, config, np.random.default_rng(2))
    w0, w1 = result.weights

    # Client 0 holds 90% mode A and client 1 90% mode B, the pool 50/50: the true ratios
    # p / p_k are 0.5 / 0.9 = 0.56 for the common mode and 0.5 / 0.1 = 5 for the rare one.
    assert w0[~is_a[0]].mean() > w0[is_a[0]].mean() + 1.0
    assert w1[is_a[1]].mean() > w1[~is_a[1]].mean() + 1.0
    assert w0[is_a[0]].mean() < 1.0 and w1[~is_a[1]].mean() < 1.0


def test_classifier_probability_is_that_of_the_global_class() -> None:
    generator = torch.Generator().manual_seed(0)
    global_like = torch.randn(300, 4, generator=generator) + 2.0
    local_like = torch.randn(300, 4, generator=generator) - 2.0
    config = FedDiskConfig(classifier_lr=0.1, classifier_epochs=20)

    [classifier] = train_classifiers([global_like], [local_like], config, [generator])

    ratios = density_ratios(
        classifier, torch.stack([torch.full((4,), 2.0), torch.full((4,), -2.0)])
    )
    assert ratios[0] > 10.0  # looks like a global-model output: D > 1/2, weight > 1
    assert ratios[1] < 0.1


def test_identical_global_and_local_outputs_give_unit_weights() -> None:
    features = torch.rand(400, 8, generator=torch.Generator().manual_seed(1))
    config = FedDiskConfig(classifier_lr=0.1, classifier_epochs=30)

    [classifier] = train_classifiers(
        [features], [features], config, [torch.Generator().manual_seed(2)]
    )

    # Each row appears once with each label, so the best D is 1/2 everywhere; what is
    # left is the noise of mini-batch SGD.
    ratios = density_ratios(classifier, features)
    assert np.all(np.abs(ratios - 1.0) < 0.2)
    assert ratios.mean() == pytest.approx(1.0, abs=0.05)
    assert np.all(np.abs(normalise_weights(ratios, "mean") - 1.0) < 0.2)


# ------------------------------------------------------------------ training D


def gaussian_pair(num_samples: int, shift: float, seed: int) -> tuple[Tensor, Tensor, np.ndarray]:
    """Global-like rows ~ N(shift e_1, I), local-like rows ~ N(0, I) in 8 dimensions, and
    the true log density ratio log p_g(x) / p_l(x) = shift x_1 - shift^2 / 2 at every
    local-like row x."""
    generator = torch.Generator().manual_seed(seed)
    local_like = torch.randn(num_samples, 8, generator=generator)
    global_like = torch.randn(num_samples, 8, generator=generator)
    global_like[:, 0] += shift
    truth = (shift * local_like[:, 0] - shift**2 / 2).double().numpy()
    return global_like, local_like, truth


KNOWN_RATIO_ERROR = 0.3
"""Bound on the mean |log w - log(p_g / p_l)| over the local-like rows of
:func:`gaussian_pair` (800 rows, shift 1): measured 0.16 at the defaults (D stopped at
epoch 66, kept 61), 0.81 after 2 epochs; a D that says 1/2 everywhere scores
E|x_1 - 1/2| = 0.90."""


def spearman(first: np.ndarray, second: np.ndarray) -> float:
    """Rank correlation (no ties in continuous data)."""
    ranks = [np.argsort(np.argsort(values)).astype(np.float64) for values in (first, second)]
    return float(np.corrcoef(*ranks)[0, 1])


def test_d_recovers_a_known_density_ratio_at_the_defaults() -> None:
    # Where p_g / p_l is known in closed form, D's weights exp(z_1 - z_0) must track it.
    global_like, local_like, truth = gaussian_pair(800, 1.0, 0)
    histories: list[ClassifierHistory] = []

    [classifier] = train_classifiers(
        [global_like], [local_like], FedDiskConfig(), [torch.Generator().manual_seed(1)], histories
    )

    estimate = np.log(density_ratios(classifier, local_like))
    error = float(np.mean(np.abs(estimate - truth)))
    assert spearman(estimate, truth) > 0.95
    assert error < KNOWN_RATIO_ERROR
    # The weights move away from 1: the true log-ratios have std 1.
    assert estimate.std() > 0.6
    [history] = histories
    assert history.best_epoch > 0
    assert history.validation_loss[history.best_epoch] == min(history.validation_loss)


def test_a_d_stopped_after_its_first_epochs_does_not_recover_the_ratio() -> None:
    # What fedplug's old rule (stop once an epoch lowers the training loss by < 1%) gave:
    # one or two epochs from D = 1/2, weights near 1 whatever the data.
    global_like, local_like, truth = gaussian_pair(800, 1.0, 0)

    [classifier] = train_classifiers(
        [global_like],
        [local_like],
        FedDiskConfig(classifier_epochs=2),
        [torch.Generator().manual_seed(1)],
    )

    estimate = np.log(density_ratios(classifier, local_like))
    assert float(np.mean(np.abs(estimate - truth))) > KNOWN_RATIO_ERROR
    assert estimate.std() < 0.3


def test_d_keeps_its_untrained_state_when_nothing_can_be_learned() -> None:
    # Identical global-like and local-like rows: every held-out pair has both labels, so
    # any D != 1/2 has a held-out loss above ln 2, the untrained D's. D stops after
    # `patience` epochs and keeps the untrained state: every weight is exactly 1.
    features = torch.rand(300, 8, generator=torch.Generator().manual_seed(1))
    histories: list[ClassifierHistory] = []
    config = FedDiskConfig(classifier_lr=0.5, classifier_patience=3)

    [classifier] = train_classifiers(
        [features], [features], config, [torch.Generator().manual_seed(2)], histories
    )

    [history] = histories
    assert history.best_epoch == 0 and history.epochs == 3
    assert history.validation_loss[0] == pytest.approx(np.log(2.0), abs=1e-6)
    assert min(history.validation_loss[1:]) > history.validation_loss[0]
    assert np.array_equal(density_ratios(classifier, features), np.ones(300))


def test_d_stops_patience_epochs_after_its_best_and_keeps_the_best() -> None:
    global_like, local_like, _ = gaussian_pair(200, 0.5, 3)
    histories: list[ClassifierHistory] = []
    # A large learning rate on a small set: the held-out loss turns up early (measured:
    # 0.693, 0.658, 0.662, 0.639, 0.714, 0.645: best at epoch 3, stop after epoch 5; the
    # worse epoch 2 did not stop it, since patience counts from the best epoch).
    config = FedDiskConfig(classifier_lr=0.3, classifier_patience=2, classifier_epochs=200)

    [classifier] = train_classifiers(
        [global_like], [local_like], config, [torch.Generator().manual_seed(4)], histories
    )

    [history] = histories
    losses = history.validation_loss
    assert 0 < history.best_epoch < history.epochs < 200
    assert history.epochs == history.best_epoch + 2
    assert losses[history.best_epoch] == min(losses)
    assert all(loss >= losses[history.best_epoch] for loss in losses[history.best_epoch + 1 :])
    # The kept state is the best one: its held-out loss, recomputed, is the minimum.
    train_ids, held_out = classifier_split(200, 0.2, _split_generator(config, 4))
    assert len(train_ids) == 160 and len(held_out) == 40
    rows = torch.cat([global_like[held_out], local_like[held_out]])
    labels = torch.cat([torch.ones(40, dtype=torch.long), torch.zeros(40, dtype=torch.long)])
    with torch.no_grad():
        kept = F.cross_entropy(classifier(rows), labels).item()
    assert kept == pytest.approx(min(losses), rel=1e-5)


def _split_generator(config: FedDiskConfig, seed: int) -> torch.Generator:
    """The generator state train_classifiers splits with: after D's initialisation."""
    generator = torch.Generator().manual_seed(seed)
    feddisk.make_classifier(8, config.classifier_hidden, generator)
    return generator


def test_classifier_split_by_hand() -> None:
    train_ids, held_out = classifier_split(10, 0.2, torch.Generator().manual_seed(0))
    assert len(held_out) == 2 and len(train_ids) == 8
    assert sorted(torch.cat([train_ids, held_out]).tolist()) == list(range(10))
    # At least one held out and one kept.
    assert [len(part) for part in classifier_split(2, 0.01, torch.Generator())] == [1, 1]
    assert [len(part) for part in classifier_split(2, 0.99, torch.Generator())] == [1, 1]


def test_the_removed_tolerance_key_says_what_replaced_it() -> None:
    with pytest.raises(ValidationError) as caught:
        FedDiskConfig(classifier_tolerance=0.01)
    [error] = caught.value.errors()
    assert error["loc"] == ("classifier_tolerance",)
    assert "classifier_patience" in error["msg"] and "\n" not in error["msg"]
    with pytest.raises(ValidationError, match="classifier_patience"):
        FedDiskAbConfig(classifier_tolerance=0.0)
    with pytest.raises(ValidationError):
        FedDiskConfig(classifier_patience=0)
    with pytest.raises(ValidationError):
        FedDiskConfig(classifier_validation_fraction=1.0)


# ------------------------------------------------------------------ weight report


def test_weight_summary_by_hand() -> None:
    summary = weight_summary([np.array([0.5, 1.0, 1.5], np.float32), np.array([2.0], np.float32)], 2.0)

    assert summary["sample_weight.min"] == [0.5, 2.0]
    assert summary["sample_weight.median"] == [1.0, 2.0]
    # numpy's linear quantiles: q05 of (0.5, 1, 1.5) = 0.5 + 0.1 * 0.5 = 0.55.
    assert summary["sample_weight.q05"] == [0.55, 2.0]
    assert summary["sample_weight.q25"] == [0.75, 2.0]
    assert summary["sample_weight.q75"] == [1.25, 2.0]
    assert summary["sample_weight.q95"] == [1.45, 2.0]
    assert summary["sample_weight.max"] == [1.5, 2.0]
    assert summary["sample_weight.mean"] == [1.0, 2.0]
    # Population std of (0.5, 1, 1.5): sqrt(1/6) = 0.408248.
    assert summary["sample_weight.std"] == [0.408248, 0.0]
    histogram = summary["sample_weight.histogram"]
    assert isinstance(histogram, dict)
    # 40 bins of width 0.05 over [0, 2]: 0.5 -> bin 10, 1.0 -> 20, 1.5 -> 30, 2.0 -> 39.
    assert len(histogram["edges"]) == 41 and histogram["edges"][-1] == 2.0
    assert sum(histogram["counts"]) == 4
    assert [i for i, count in enumerate(histogram["counts"]) if count] == [10, 20, 30, 39]


def test_the_clients_reports_merge_into_the_pooled_report() -> None:
    # Prepare: three clients' weights under the "mean" normalisation's bound clip_max = 5,
    # one client without samples.
    weights = [np.array([0.0, 0.125, 4.9], np.float32), np.zeros(0, np.float32), np.array([5.0, 2.5], np.float32)]
    top = histogram_top(FedDiskConfig())
    # Execute: each client summarises its own weights; the server adds them up.
    reports = [client_weight_summary(w, top) for w in weights]
    merged = merge_weight_summaries(reports, top)
    # Assert: the bins are fixed by the config (40 of width 5/40 = 0.125), so the pooled
    # counts are the clients' counts added up: 0 -> bin 0, 0.125 -> 1, 2.5 -> 20, 4.9 and
    # 5.0 -> 39; the client without samples has null statistics and no counts.
    assert top == 5.0 and histogram_top(FedDiskConfig(normalisation="minmax")) == 2.0
    histogram = merged["sample_weight.histogram"]
    assert histogram["edges"][:3] == [0.0, 0.125, 0.25] and histogram["edges"][-1] == 5.0
    assert {i: c for i, c in enumerate(histogram["counts"]) if c} == {0: 1, 1: 1, 20: 1, 39: 2}
    assert reports[1]["histogram_counts"] == [0] * 40
    assert merged["sample_weight.max"] == [4.9, None, 5.0]
    assert merged["sample_weight.median"] == [0.125, None, 3.75]
    assert merged == weight_summary(weights, top)


def test_the_run_reports_each_clients_weight_spread(tmp_path: Path) -> None:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"].update(
        {"rounds": 1, "loss_transform": {"name": "feddisk_ab", "classifier_lr": 0.1}}
    )
    config = validate_experiment(data)

    result, simulator = run_experiment(config, tmp_path)

    report = json.loads((tmp_path / "metrics.json").read_text())["setup_report"]
    weights = [w.numpy() for w in simulator.algorithm.loss_transform.weights]
    assert len(weights) == 6
    assert report["sample_weight.std"] == pytest.approx([float(w.std()) for w in weights], rel=1e-5)
    assert report["sample_weight.max"] == pytest.approx([float(w.max()) for w in weights], rel=1e-5)
    assert sum(report["sample_weight.histogram"]["counts"]) == sum(len(w) for w in weights)
    assert result.setup_report == report
    # The weights moved: D learned something about these clients (6 clients of a
    # Dirichlet label split, so their inputs differ).
    assert max(report["sample_weight.std"]) > 0.01
    # The setup phase's wall time is measured apart from the rounds', and a run resumed
    # from its checkpoint keeps it (no phase runs again).
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["setup_seconds"] == result.setup_seconds > 0
    assert summary["total_seconds"] == sum(record.seconds for record in result.history)
    resumed, _ = run_experiment(config, tmp_path)
    assert resumed.setup_seconds == result.setup_seconds


def test_phase_one_is_a_function_of_its_rng_and_leaves_the_global_generator_alone() -> None:
    rng = np.random.default_rng(5)
    federation = make_federation([two_mode_samples(60, share, rng)[0] for share in (0.3, 0.7)])
    config = FedDiskConfig(made_max_epochs=2, global_rounds=2, classifier_epochs=2)
    global_state = torch.random.get_rng_state()

    first = compute_feddisk_weights(federation, config, np.random.default_rng(7))
    second = compute_feddisk_weights(federation, config, np.random.default_rng(7))
    compute_feddisk_ab_weights(federation, FedDiskAbConfig(), np.random.default_rng(7))

    assert torch.equal(torch.random.get_rng_state(), global_state)
    assert first.cost == second.cost
    for ours, theirs in zip(first.weights, second.weights):
        assert np.array_equal(ours, theirs)


# ------------------------------------------------------------------ normalisation


def test_normalisation_by_hand() -> None:
    ratios = np.array([1.0, 2.0, 3.0])
    assert normalise_weights(ratios, "minmax").tolist() == [0.0, 1.0, 2.0]
    assert normalise_weights(ratios, "mean").tolist() == [0.5, 1.0, 1.5]
    # Clipped to [0.6, 1.2] with mean 1: c = 0.6 gives 0.6 + 1.2 + 1.2 = 3 (mean 1); dividing
    # by the mean first (keep_mean=False) gives 0.6, 1.0, 1.2 (mean 0.933).
    clipped = normalise_weights(ratios, "mean", clip_min=0.6, clip_max=1.2)
    assert clipped == pytest.approx([0.6, 1.2, 1.2], abs=1e-6)
    old = normalise_weights(ratios, "mean", clip_min=0.6, clip_max=1.2, keep_mean=False)
    assert old == pytest.approx([0.6, 1.0, 1.2])
    assert normalise_weights(np.full(5, 0.3), "minmax").tolist() == [1.0] * 5
    assert normalise_weights(np.full(5, 0.3), "mean").tolist() == [1.0] * 5


def test_mean_weights_keep_mean_one_when_the_clip_bites() -> None:
    # Issue #23: nine ratios of 1 and one of 91. Divided by the mean (10): 0.1 x 9 and 9.1,
    # clipped to 5: mean 0.59, a 41% shorter step. Mean one after the clip: 9c + 5 = 10,
    # c = 5/9 (and 91c >= 5, so the last one is clipped): 5/9 x 9 and 5.
    skewed = np.array([1.0] * 9 + [91.0])

    weights = normalise_weights(skewed, "mean")
    divided_first = normalise_weights(skewed, "mean", keep_mean=False)

    assert weights == pytest.approx([5 / 9] * 9 + [5.0], rel=1e-6)
    assert divided_first == pytest.approx([0.1] * 9 + [5.0], rel=1e-6)
    assert float(divided_first.mean()) == pytest.approx(0.59, rel=1e-6)


def test_mean_weights_of_a_heavy_tail_are_mean_one_bounded_and_proportional() -> None:
    # A log-normal tail like the MADE ratios' (sigma 2: the upper clip catches several %).
    ratios = np.random.default_rng(0).lognormal(0.0, 2.0, size=2000)

    weights = normalise_weights(ratios, "mean", clip_min=0.0, clip_max=5.0).astype(np.float64)

    assert weights.mean() == pytest.approx(1.0, abs=1e-6)
    assert weights.max() <= 5.0 and (weights == np.float32(5.0)).mean() > 0.01
    inside = weights < 5.0 - 1e-6
    scale = weights[inside] / ratios[inside]
    assert scale == pytest.approx(np.full(inside.sum(), scale[0]), rel=1e-5)  # one c for all
    assert np.all(np.diff(weights[np.argsort(ratios)]) >= 0)  # the order of the ratios


def test_mean_one_weights_need_enough_positive_ratios() -> None:
    # 1 of 10 ratios positive and clip_max 5: the best possible mean is 0.5.
    with pytest.raises(TrainingError, match="only 10.0% of its density ratios are positive and clip_max is 5; raise clip_max"):
        normalise_weights(np.array([0.0] * 9 + [1.0]), "mean")


def test_diverged_ratios_are_a_training_error() -> None:
    with pytest.raises(TrainingError, match="lower classifier_lr"):
        normalise_weights(np.array([1.0, np.nan]), "mean")


def test_minmax_weights_land_in_zero_two(
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    federation, _ = two_mode_clients
    config = FedDiskConfig(**STRONG, normalisation="minmax", global_rounds=2)

    result = compute_feddisk_weights(federation, config, np.random.default_rng(3))

    for weights in result.weights:
        assert weights.min() == pytest.approx(0.0) and weights.max() == pytest.approx(2.0)


def test_clip_bounds_are_validated() -> None:
    with pytest.raises(ValidationError, match="clip_min"):
        FedDiskConfig(clip_min=1.0, clip_max=1.0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        FedDiskConfig(made_hiden=30)
    with pytest.raises(ValidationError):
        FedDiskConfig(validation_fraction=1.0)


# ------------------------------------------------------------------ the loss


def test_per_sample_loss_is_weight_times_cross_entropy() -> None:
    transform = FedDisk(FedDiskConfig())
    transform.load_state_dict(
        {
            "sample_weights": [torch.tensor([0.5, 2.0, 1.5]), torch.tensor([3.0, 0.0])],
            "cost": [1, 2, 3],
        }
    )
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    targets = torch.tensor([0, 0])
    sample_ids = torch.tensor([2, 1])
    context = transform.client_context(0, np.array([1, 2]))

    loss = transform.per_sample_loss(logits, targets, sample_ids, context)

    # CE of [2, 0] with target 0 is ln(1 + e^-2); of [0, 1] with target 0 is ln(1 + e).
    expected = torch.tensor(
        [1.5 * np.log1p(np.exp(-2.0)), 2.0 * np.log1p(np.e)], dtype=torch.float32
    )
    assert torch.allclose(loss, expected, atol=1e-6)


def test_per_sample_loss_runs_under_vmap_over_clients() -> None:
    transform = FedDisk(FedDiskConfig())
    weights = torch.tensor([[0.5, 2.0, 1.5], [3.0, 0.0, 1.0]])
    logits = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]])
    sample_ids = torch.tensor([[0, 1, 2, 2], [1, 0, 0, 2]])

    batched = torch.func.vmap(
        lambda z, y, ids, w: transform.per_sample_loss(z, y, ids, {"sample_weight": w})
    )(logits, targets, sample_ids, weights)

    for k in range(2):
        ce = F.cross_entropy(logits[k], targets[k], reduction="none")
        assert torch.allclose(batched[k], weights[k][sample_ids[k]] * ce)


def test_prepare_before_context_is_required() -> None:
    with pytest.raises(RuntimeError, match="prepare"):
        FedDisk(FedDiskConfig()).client_context(0, np.array([1]))


def test_state_dict_restores_the_weights(
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    federation, _ = two_mode_clients
    transform = FedDiskAb(FedDiskAbConfig(classifier_epochs=2))
    cost = transform.prepare(federation)

    restored = FedDiskAb(FedDiskAbConfig(classifier_epochs=2))
    restored.load_state_dict(transform.state_dict())

    assert restored.cost == cost
    for client in federation.clients:
        ours = restored.client_context(client.client_id, client.class_counts)["sample_weight"]
        theirs = transform.client_context(client.client_id, client.class_counts)["sample_weight"]
        assert ours.shape == (client.num_samples,) and torch.equal(ours, theirs)


# ------------------------------------------------------------------ communication


def test_made_phase_cost_by_hand() -> None:
    # 3 rounds, 4 clients, 100-byte model: 3 * 4 * 100 up; 4 downloads per client.
    assert made_phase_cost(3, 4, 100) == PhaseCost(rounds=3, bytes_up=1200, bytes_down=1600)


def test_feddisk_cost_counts_made_rounds_and_bytes(
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    federation, _ = two_mode_clients
    config = FedDiskConfig(made_hidden=5, global_rounds=1, made_max_epochs=2, classifier_epochs=1)

    cost = compute_feddisk_weights(federation, config, np.random.default_rng(0)).cost

    # MADE(16, [5]): W 5 x 16 + b 5 + V 16 x 5 + c 16 = 181 float32 parameters = 724 bytes.
    assert parameter_bytes(MADE(DIM, (5,))) == 724
    # The clients' reports of their weights ride on the last reply and are not traffic.
    assert cost == PhaseCost(rounds=1, bytes_up=2 * 724, bytes_down=2 * 2 * 724)


def test_feddisk_ab_cost_counts_the_pooled_raw_data(
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    federation, _ = two_mode_clients
    cost = compute_feddisk_ab_weights(
        federation, FedDiskAbConfig(classifier_epochs=1), np.random.default_rng(0)
    ).cost
    assert cost == PhaseCost(rounds=0, bytes_up=800 * DIM * 4, bytes_down=800 * DIM * 4)


def test_global_made_stops_at_the_first_rise_and_keeps_the_best() -> None:
    rng = np.random.default_rng(4)
    data = [torch.as_tensor(two_mode_samples(300, s, rng)[0]) for s in (0.2, 0.8)]
    train, validation = [x[:240] for x in data], [x[240:] for x in data]
    template = MADE(DIM, (10,), generator=torch.Generator().manual_seed(0))
    # A large learning rate makes the validation NLL turn up within a few rounds.
    config = FedDiskConfig(global_rounds=12, made_lr=0.3, made_batch_size=20)

    model, rounds, history = train_global_made(
        template,
        train,
        validation,
        [300, 300],
        config,
        [torch.Generator().manual_seed(k) for k in range(2)],
    )

    assert len(history) == rounds + 1
    assert all(history[t + 1] <= history[t] for t in range(rounds - 1))
    if rounds < 12:
        assert history[-1] > history[-2]
    kept = feddisk.federated_validation_nll(model, PaddedSets(validation), [300, 300])
    assert kept == pytest.approx(min(history), rel=1e-5)


# ------------------------------------------------------------------ inputs


def test_inputs_outside_the_unit_interval_are_rescaled() -> None:
    federation = make_federation(
        [
            np.array([[-1.0] * DIM, [3.0] * DIM], np.float32),
            np.array([[1.0] * DIM, [0.0] * DIM], np.float32),
        ]
    )

    scaled = unit_interval_inputs(federation)

    assert scaled[0][:, 0].tolist() == [0.0, 1.0]
    assert scaled[1][:, 0].tolist() == [0.5, 0.25]


def test_a_client_with_one_sample_is_a_data_error() -> None:
    federation = make_federation([np.zeros((1, DIM), np.float32), np.zeros((3, DIM), np.float32)])
    with pytest.raises(DataError, match="client 0 has 1"):
        unit_interval_inputs(federation)


# ------------------------------------------------------------------ caching


def test_save_and_load_round_trip_normalises_the_stored_ratios(tmp_path: Path) -> None:
    ratios = [np.array([1.0, 3.0]), np.array([2.0])]
    result = FedDiskWeights.from_ratios(ratios, PhaseCost(7, 10, 12), FedDiskConfig())
    path = tmp_path / "weights.npz"

    save_weights(path, result)
    mean = load_weights(path, FedDiskConfig())
    minmax = load_weights(path, FedDiskConfig(normalisation="minmax"))

    assert mean.cost == minmax.cost == result.cost
    # Mean: r / mean(r) = [0.5, 1.5]; min-max: 2 (r - 1) / 2 = [0, 2]; a single (all-equal)
    # ratio gives 1 under both.
    assert [w.tolist() for w in mean.weights] == [[0.5, 1.5], [1.0]]
    assert [w.tolist() for w in minmax.weights] == [[0.0, 2.0], [1.0]]
    assert [r.tolist() for r in minmax.ratios] == [[1.0, 3.0], [2.0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.npz"]  # no temporary left


def test_weights_without_their_ratios_cannot_be_cached(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="raw density ratios"):
        save_weights(tmp_path / "w.npz", FedDiskWeights([np.ones(2, np.float32)], PhaseCost(0, 0, 0)))


@pytest.mark.parametrize("content", [b"not a zip file", b""])
def test_corrupt_cache_file_is_a_data_error_naming_it(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.npz"
    path.write_bytes(content)
    with pytest.raises(DataError, match="broken.npz"):
        load_weights(path, FedDiskConfig())


def test_cache_file_with_negative_ratios_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "negative.npz"
    np.savez(
        path,
        ratios_0=np.array([-1.0]),
        num_clients=np.int64(1),
        cost=np.zeros(3, np.int64),
    )
    with pytest.raises(DataError, match="negative.npz.*client 0 ratios are not finite"):
        load_weights(path, FedDiskConfig())


def test_a_cache_file_of_an_older_fedplug_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "old.npz"  # version 2 stored normalised weights, not ratios
    np.savez(path, weights_0=np.ones(2, np.float32), num_clients=np.int64(1), cost=np.zeros(3, np.int64))
    with pytest.raises(DataError, match="old.npz.*delete the file"):
        load_weights(path, FedDiskConfig())


def test_cache_key_tracks_what_changes_the_weights() -> None:
    config = FedDiskConfig()
    key = cache_key("mnist", "abc", 0, config)

    assert key.startswith("feddisk-mnist-")
    assert cache_key("mnist", "abc", 0, FedDiskConfig(cache_dir="/elsewhere")) == key
    assert cache_key("mnist", "abc", 1, config) != key
    assert cache_key("mnist", "abd", 0, config) != key
    assert cache_key("femnist", "abc", 0, config) != key
    assert cache_key("mnist", "abc", 0, FedDiskConfig(made_hidden=31)) != key
    assert cache_key("mnist", "abc", 0, FedDiskConfig(classifier_patience=6)) != key
    assert cache_key("mnist", "abc", 0, FedDiskAbConfig()) != key
    # The file holds raw ratios; the normalisation is applied on loading.
    assert cache_key("mnist", "abc", 0, FedDiskConfig(normalisation="minmax", clip_max=3.0)) == key


def test_partition_fingerprint_sees_sizes_and_inputs() -> None:
    base = [np.zeros((4, DIM), np.float32), np.ones((3, DIM), np.float32)]
    noisy = [base[0].copy(), base[1].copy()]
    noisy[1][1, 5] = 0.5  # the middle sample of client 1

    fingerprint = partition_fingerprint(make_federation(base))

    assert fingerprint == partition_fingerprint(make_federation([x.copy() for x in base]))
    assert fingerprint != partition_fingerprint(make_federation(noisy))
    assert fingerprint != partition_fingerprint(make_federation([base[0], base[1][:2]]))


def test_prepare_computes_once_then_loads_from_the_cache(
    tmp_path: Path,
    two_mode_clients: tuple[Federation, list[np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    federation, _ = two_mode_clients
    config = FedDiskAbConfig(classifier_epochs=2, cache_dir=str(tmp_path))
    first = FedDiskAb(config)
    cost = first.prepare(federation)
    [cached] = list(tmp_path.iterdir())
    assert (
        cached.name == cache_key("synthetic", partition_fingerprint(federation), 0, config) + ".npz"
    )

    def must_not_run(*args: object) -> None:
        raise AssertionError("phase 1 ran although its result was cached")

    second = FedDiskAb(config)
    monkeypatch.setattr(second, "_compute", must_not_run)

    assert second.prepare(federation) == cost
    for client in federation.clients:
        assert torch.equal(
            second.client_context(client.client_id, client.class_counts)["sample_weight"],
            first.client_context(client.client_id, client.class_counts)["sample_weight"],
        )


def test_feddisks_setup_phase_fills_the_cache_and_a_cached_prepare_skips_it(
    tmp_path: Path,
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    # Prepare: FedDisk as the simulator prepares it (prepare, then its setup phase).
    federation, _ = two_mode_clients
    config = FedDiskConfig(
        made_hidden=5,
        made_max_epochs=2,
        global_rounds=2,
        classifier_epochs=2,
        cache_dir=str(tmp_path),
    )
    reference = compute_feddisk_weights(federation, config, np.random.default_rng(config.seed))
    first = FedDisk(config)
    # Execute
    cost = prepare_loss_transform(first, federation)
    second = FedDisk(config)
    cached_cost = second.prepare(federation)
    # Assert: the phase ran once, gave the weights compute_feddisk_weights gives, and
    # left them in the cache, from which the second transform needs no phase.
    [cached] = list(tmp_path.iterdir())
    key = cache_key("synthetic", partition_fingerprint(federation), 0, config)
    assert cached.name == f"{key}.npz"
    assert cost == cached_cost == reference.cost == first.cost
    assert first.setup_phase() is None and second.setup_phase() is None
    for client in federation.clients:
        ours = second.client_context(client.client_id, client.class_counts)["sample_weight"]
        theirs = first.client_context(client.client_id, client.class_counts)["sample_weight"]
        assert torch.equal(ours, theirs)
        assert np.array_equal(ours.numpy(), reference.weights[client.client_id])


def test_one_phase_serves_both_normalisations(
    tmp_path: Path,
    two_mode_clients: tuple[Federation, list[np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FedDiskAb with mean weights fills the cache; FedDiskAb with min-max weights then
    # loads it without running phase 1, and gets exactly the weights a min-max run
    # without a cache computes.
    federation, _ = two_mode_clients
    mean = FedDiskAbConfig(classifier_epochs=20, cache_dir=str(tmp_path))
    minmax = mean.model_copy(update={"normalisation": "minmax"})
    FedDiskAb(mean).prepare(federation)
    direct = FedDiskAb(minmax.model_copy(update={"cache_dir": None}))
    direct.prepare(federation)
    cached = FedDiskAb(minmax)

    def must_not_run(*args: object) -> None:
        raise AssertionError("phase 1 ran although its ratios were cached")

    monkeypatch.setattr(cached, "_compute", must_not_run)
    cached.prepare(federation)

    assert len(list(tmp_path.iterdir())) == 1
    for client in federation.clients:
        ours = cached.client_context(client.client_id, client.class_counts)["sample_weight"]
        theirs = direct.client_context(client.client_id, client.class_counts)["sample_weight"]
        assert torch.equal(ours, theirs)
        assert float(ours.min()) == 0.0 and float(ours.max()) == 2.0  # min-max, not mean


def test_feddisk_without_a_federation_leaves_the_cache_alone(tmp_path: Path) -> None:
    # Flower's prepare sees class counts only: the phase runs on the nodes, uncached.
    transform = FedDisk(FedDiskConfig(cache_dir=str(tmp_path)))
    assert transform.prepare(object()) is None
    assert transform.setup_phase() is not None and not list(tmp_path.iterdir())


def test_cache_for_other_client_sizes_is_a_data_error(
    tmp_path: Path,
    two_mode_clients: tuple[Federation, list[np.ndarray]],
) -> None:
    federation, _ = two_mode_clients
    config = FedDiskAbConfig(cache_dir=str(tmp_path))
    key = cache_key("synthetic", partition_fingerprint(federation), 0, config)
    save_weights(
        tmp_path / f"{key}.npz",
        FedDiskWeights.from_ratios([np.ones(3)], PhaseCost(0, 0, 0), config),
    )

    with pytest.raises(DataError, match="delete"):
        FedDiskAb(config).prepare(federation)


# ------------------------------------------------------------------ registration


def test_both_transforms_register_through_the_hook() -> None:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(feddisk, name="fedplug.algorithms.feddisk")

    registry = collect_registry(manager)

    assert registry.names("loss_transforms") == ["feddisk", "feddisk_ab"]
    built = registry.build("loss_transforms", FedDiskAbConfig())
    assert isinstance(built, FedDiskAb)
    assert isinstance(registry.build("loss_transforms", FedDiskConfig()), FedDisk)


def test_a_node_whose_data_changed_after_the_setup_phase_is_refused():
    from fedplug.algorithms.feddisk.phase import SAMPLE_WEIGHTS, FedDiskPhase

    phase = FedDiskPhase(FedDiskConfig())
    state = {SAMPLE_WEIGHTS: torch.ones(5)}
    phase.check_data(state, 5)  # the weights cover the data: no error
    with pytest.raises(DataError, match="cover 5 samples but its training data has 4"):
        phase.check_data(state, 4)
    assert torch.equal(phase.client_context(state)["sample_weight"], torch.ones(5))
