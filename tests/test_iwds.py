"""IWDS sampling weights, its beta schedule, and the default uniform sampler."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from fedplug.algorithms import iwds
from fedplug.algorithms.iwds import IWDSConfig, IWDSSampler, beta_at, class_weights, iwds_weights
from fedplug.algorithms.uniform import UniformSampler, UniformSamplerConfig
from fedplug.registry import Registry

COUNTS = np.array([1, 2, 7])
LABELS = np.repeat(np.arange(3), COUNTS)  # [0, 1, 1, 2, 2, 2, 2, 2, 2, 2]


def test_weights_by_hand_for_a_three_class_client() -> None:
    # beta = 0.9: w_c = 0.1 / (1 - 0.9^N_c)
    #   N = 1: 0.1 / 0.1 = 1
    #   N = 2: 0.1 / 0.19 = 0.5263158
    #   N = 7: 0.1 / (1 - 0.4782969) = 0.1916799
    expected_class = np.array([1.0, 0.1 / 0.19, 0.1 / (1 - 0.9**7)])
    np.testing.assert_allclose(class_weights(COUNTS, 0.9), expected_class, rtol=1e-12)
    np.testing.assert_allclose(expected_class, [1.0, 0.5263158, 0.1916799], rtol=1e-6)
    # p(i) = w_{y_i} / (1 + 2 * 0.5263158 + 7 * 0.1916799) = w_{y_i} / 3.3943909
    probabilities = iwds_weights(LABELS, COUNTS, 0.9)
    np.testing.assert_allclose(
        probabilities[[0, 1, 3]], [0.2946037, 0.1550546, 0.0564696], rtol=1e-6
    )
    assert probabilities.sum() == pytest.approx(1.0)
    # The class shares move from (0.1, 0.2, 0.7) towards equal: (0.2946, 0.3101, 0.3953).
    shares = np.bincount(LABELS, weights=probabilities)
    np.testing.assert_allclose(shares, [0.2946037, 0.3101091, 0.3952872], rtol=1e-6)


def test_beta_zero_is_uniform() -> None:
    np.testing.assert_array_equal(iwds_weights(LABELS, COUNTS, 0.0), np.full(10, 0.1))


def test_beta_one_is_the_class_balanced_limit() -> None:
    np.testing.assert_allclose(class_weights(COUNTS, 1.0), [1.0, 1 / 2, 1 / 7])
    # (1 - b) / (1 - b^N) -> 1 / N as b -> 1
    np.testing.assert_allclose(class_weights(COUNTS, 1 - 1e-12), [1.0, 1 / 2, 1 / 7], rtol=1e-9)


@pytest.mark.parametrize("exponent", [3, 5, 7, 9, 11, 13])
def test_weights_keep_full_precision_close_to_one(exponent: int) -> None:
    # Reference: exact rational arithmetic on the same double beta. The direct formula
    # (1 - b) / (1 - b**N) is off by up to ~5e-9 relative in this range.
    beta = 1 - 0.7 * 10.0**-exponent
    counts = np.array([2, 3, 7, 1000])
    exact_beta = Fraction(beta)
    exact = [float((1 - exact_beta) / (1 - exact_beta ** int(n))) for n in counts]
    np.testing.assert_allclose(class_weights(counts, beta), exact, rtol=1e-14)


def test_a_class_without_samples_counts_as_one() -> None:
    weights = class_weights(np.array([0, 4]), 0.5)
    # N = 0 -> counted as 1 -> w = 0.5 / 0.5 = 1; N = 4 -> 0.5 / (1 - 0.0625) = 0.5333333
    np.testing.assert_allclose(weights, [1.0, 0.5 / 0.9375])
    assert np.all(np.isfinite(iwds_weights(np.array([1, 1, 1]), np.array([0, 3]), 0.5)))


def test_near_one_beta_draws_classes_equally_often() -> None:
    counts = np.array([3000, 6000, 21000])
    labels = np.repeat(np.arange(3), counts)
    sampler = IWDSSampler(IWDSConfig(beta_0=0.999999, beta_m=0.999999, rho=1.0))
    indices = sampler.epoch_indices(labels, counts, 0, np.random.default_rng(7))
    assert len(indices) == 30000
    frequencies = np.bincount(labels[indices], minlength=3) / len(indices)
    # At beta = 0.999999 every class has probability 1/3 (to 1e-5). A class share drawn
    # 30k times has standard deviation sqrt(1/3 * 2/3 / 30000) = 0.0027; 0.015 is over
    # 5 standard deviations, while uniform sampling would give (0.1, 0.2, 0.7).
    np.testing.assert_allclose(frequencies, [1 / 3] * 3, atol=0.015)


def test_uniform_beta_draws_the_local_distribution() -> None:
    counts = np.array([3000, 6000, 21000])
    labels = np.repeat(np.arange(3), counts)
    sampler = IWDSSampler(IWDSConfig(beta_0=0.0, beta_m=0.0))
    indices = sampler.epoch_indices(labels, counts, 3, np.random.default_rng(8))
    frequencies = np.bincount(labels[indices], minlength=3) / len(indices)
    # Same 5-sigma tolerance (the largest standard deviation, at p = 0.7, is 0.0026).
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.7], atol=0.015)


def test_sampler_is_reproducible_and_in_range() -> None:
    sampler = IWDSSampler(IWDSConfig())
    first = sampler.epoch_indices(LABELS, COUNTS, 5, np.random.default_rng(3))
    second = sampler.epoch_indices(LABELS, COUNTS, 5, np.random.default_rng(3))
    np.testing.assert_array_equal(first, second)
    assert len(first) == 10 and first.min() >= 0 and first.max() < 10
    assert (
        len(
            sampler.epoch_indices(np.array([], dtype=int), np.zeros(3), 0, np.random.default_rng(0))
        )
        == 0
    )


def test_beta_schedule() -> None:
    # t = 0: beta_0
    assert beta_at(0, 0.9999, 0.8, 0.992) == pytest.approx(0.9999)
    # t = 1: 0.8 + 0.1999 * 0.992 = 0.9983008
    assert beta_at(1, 0.9999, 0.8, 0.992) == pytest.approx(0.9983008)
    # t = 1000: 0.992^1000 = exp(-8.032) = 3.25e-4 -> 0.8 + 6.5e-5
    assert beta_at(1000, 0.9999, 0.8, 0.992) == pytest.approx(0.800065, abs=1e-6)
    sampler = IWDSSampler(IWDSConfig())
    assert sampler.beta(0) == pytest.approx(0.9999)
    assert sampler.beta(10_000) == pytest.approx(0.8)


def test_rho_one_is_the_fixed_beta_ablation_by_hand() -> None:
    # rho = 1 keeps beta_t = beta_0 = 0.9 in every round: rounds 0 and 1 both sample with
    # p = (0.2946037, 0.1550546, 0.0564696) for classes of 1, 2 and 7 samples (as in
    # test_weights_by_hand_for_a_three_class_client).
    fixed = IWDSSampler(IWDSConfig(beta_0=0.9, beta_m=0.5, rho=1.0))
    # The decaying schedule from the same start: beta_1 = 0.5 + 0.4 * 0.5 = 0.7, so
    #   w = (1, 0.3 / 0.51, 0.3 / (1 - 0.7^7)) = (1, 0.5882353, 0.3 / 0.9176457)
    #     = (1, 0.5882353, 0.3269236),
    #   sum_i w_i = 1 + 2 * 0.5882353 + 7 * 0.3269236 = 4.4649355,
    #   p = (0.2239674, 0.1317455, 0.0732202).
    decaying = IWDSSampler(IWDSConfig(beta_0=0.9, beta_m=0.5, rho=0.5))
    round_0 = [0.2946037, 0.1550546, 0.0564696]

    assert [fixed.beta(t) for t in (0, 1, 50)] == [fixed.beta(0)] * 3
    assert fixed.beta(0) == pytest.approx(0.9, abs=1e-15)
    for t in (0, 1):
        np.testing.assert_allclose(
            iwds_weights(LABELS, COUNTS, fixed.beta(t))[[0, 1, 3]], round_0, rtol=1e-6
        )
    np.testing.assert_allclose(
        iwds_weights(LABELS, COUNTS, decaying.beta(0))[[0, 1, 3]], round_0, rtol=1e-6
    )
    assert decaying.beta(1) == pytest.approx(0.7)
    np.testing.assert_allclose(
        iwds_weights(LABELS, COUNTS, decaying.beta(1))[[0, 1, 3]],
        [0.2239674, 0.1317455, 0.0732202],
        rtol=1e-6,
    )
    # The draws follow: with one generator seed, the fixed sampler draws the same indices
    # in rounds 0 and 1, the decaying one does not.
    draws = {
        (name, t): sampler.epoch_indices(LABELS, COUNTS, t, np.random.default_rng(11))
        for name, sampler in (("fixed", fixed), ("decaying", decaying))
        for t in (0, 1)
    }
    np.testing.assert_array_equal(draws["fixed", 0], draws["fixed", 1])
    np.testing.assert_array_equal(draws["fixed", 0], draws["decaying", 0])
    assert not np.array_equal(draws["decaying", 0], draws["decaying", 1])


@pytest.mark.parametrize(
    "params, field",
    [
        ({"beta_0": 0.5, "beta_m": 0.8}, "beta_m"),
        ({"beta_0": 1.0}, "beta_0"),
        ({"beta_m": -0.1}, "beta_m"),
        ({"rho": 0.0}, "rho"),
        ({"rho": 1.5}, "rho"),
        ({"decay": 0.9}, "decay"),
    ],
)
def test_config_validation(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        IWDSConfig(**params)


def test_defaults_are_the_authors() -> None:
    config = IWDSConfig()
    assert (config.beta_0, config.beta_m, config.rho) == (0.9999, 0.8, 0.992)


def test_register_hook() -> None:
    registry = Registry()

    def register(*arguments: Any) -> None:
        registry.add("samplers", iwds.__name__, *arguments)

    iwds.fedplug_register_samplers(register=register)
    assert registry.names("samplers") == ["iwds"]
    assert isinstance(registry.build("samplers", IWDSConfig()), IWDSSampler)


def test_uniform_sampler_is_a_fresh_permutation_each_epoch() -> None:
    sampler = UniformSampler(UniformSamplerConfig())
    rng = np.random.default_rng(0)
    first = sampler.epoch_indices(LABELS, COUNTS, 0, rng)
    second = sampler.epoch_indices(LABELS, COUNTS, 0, rng)
    np.testing.assert_array_equal(np.sort(first), np.arange(10))
    np.testing.assert_array_equal(np.sort(second), np.arange(10))
    assert not np.array_equal(first, second)
