"""Server-side optimisers and their client sides, checked against numbers worked by hand.

Every example uses two clients and two parameters; the comment above each assertion shows
the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from fedplug.algorithms import fedavg, fedavgm, fednova, fedopt, fedprox, scaffold, uniform
from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig
from fedplug.algorithms.fedavgm import FedAvgM, FedAvgMConfig
from fedplug.algorithms.fednova import FedNova, FedNovaConfig, normalizing_factor
from fedplug.algorithms.fedopt import (
    FedAdagrad,
    FedAdagradConfig,
    FedAdam,
    FedAdamConfig,
    FedYogi,
    FedYogiConfig,
)
from fedplug.algorithms.fedprox import FedProx, FedProxConfig
from fedplug.algorithms.scaffold import Scaffold, ScaffoldConfig
from fedplug.algorithms.uniform import NoGrouping, NoGroupingConfig
from fedplug.components import Aggregator, ClientUpdate, LocalTraining, WeightedMean
from fedplug.errors import TrainingError
from fedplug.registry import Registry


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def update(
    client_id: int,
    values: tuple[float, ...],
    weight: float,
    num_steps: int = 1,
    extras: dict[str, torch.Tensor] | None = None,
) -> ClientUpdate:
    return ClientUpdate(client_id, vec(*values), weight, num_steps, extras or {})


def assert_close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, vec(*expected), rtol=0.0, atol=tol)


def registered(module: Any, kind: str) -> Registry:
    """Call one module's register hook on a fresh registry."""
    registry = Registry()
    hook = getattr(module, f"fedplug_register_{kind}")

    def register(*arguments: Any) -> None:
        registry.add(kind, module.__name__, *arguments)

    assert hook(register=register) is None
    return registry


# ------------------------------------------------------------------------------ FedAvg


def test_fedavg_is_the_sample_weighted_mean() -> None:
    aggregator = FedAvg(FedAvgConfig(), num_clients=2)
    result = aggregator.aggregate(
        vec(9.0, 9.0), iter([update(0, (1, 2), 1), update(1, (4, -1), 2)])
    )
    # ((1*1 + 4*2) / 3, (2*1 + -1*2) / 3) = (9/3, 0/3) = (3, 0); the global model is ignored.
    assert_close(result, [3.0, 0.0])
    assert result.dtype == torch.float32


def test_fedavg_reads_a_one_shot_stream() -> None:
    aggregator = FedAvg(FedAvgConfig(), num_clients=2)
    stream = (u for u in [update(0, (2, 0), 3), update(1, (0, 2), 1)])
    # (2*3 / 4, 2*1 / 4) = (1.5, 0.5)
    assert_close(aggregator.aggregate(vec(0, 0), stream), [1.5, 0.5])


@pytest.mark.parametrize(
    "build",
    [
        lambda: FedAvg(FedAvgConfig(), 2),
        lambda: FedAvgM(FedAvgMConfig(), 2),
        lambda: FedAdam(FedAdamConfig(), 2),
        lambda: FedYogi(FedYogiConfig(), 2),
        lambda: FedAdagrad(FedAdagradConfig(), 2),
        lambda: FedNova(FedNovaConfig(), 2),
        lambda: Scaffold(ScaffoldConfig(), 2),
    ],
)
def test_aggregators_reject_an_empty_round(build: Callable[[], Aggregator]) -> None:
    aggregator = build()
    aggregator.initialize(vec(0, 0))
    with pytest.raises(TrainingError, match="no client update reached"):
        aggregator.aggregate(vec(0, 0), iter([]))


def test_aggregation_rejects_a_negative_weight() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        FedAvg(FedAvgConfig(), 2).aggregate(vec(0, 0), [update(0, (1, 1), -1)])


def test_weighted_mean_sums_in_float64_and_returns_the_asked_precision() -> None:
    # Prepare: (0.1, 1) weight 1 and (0.2, 4) weight 2.
    mean = WeightedMean()
    assert mean.empty
    mean.add(vec(0.1, 1), 1.0)
    mean.add(vec(0.2, 4), 2.0)

    # Execute
    exact = mean.mean(torch.float64)

    # Assert: (w0 * 1 + w1 * 2) / 3 over the float32 inputs, in float64; the default is its float32.
    inputs = [torch.tensor(value, dtype=torch.float32).double() for value in (0.1, 0.2)]
    assert exact.dtype == torch.float64 and not mean.empty
    assert exact.tolist() == [float((inputs[0] * 1 + inputs[1] * 2) / 3), 3.0]
    assert torch.equal(mean.mean(), exact.float())


def test_all_zero_weights_are_an_empty_round() -> None:
    with pytest.raises(TrainingError):
        FedAvg(FedAvgConfig(), 2).aggregate(vec(0, 0), [update(0, (1, 1), 0)])


# ----------------------------------------------------------------------------- FedAvgM

# Round 1: x0 = (1, 1); clients (0, 2) weight 1 and (3, -1) weight 2 -> mean (2, 0),
#          dw = x0 - mean = (-1, 1).
ROUND_1 = ((1.0, 1.0), [((0.0, 2.0), 1.0), ((3.0, -1.0), 2.0)])


def run_round(
    aggregator: Aggregator, global_values: tuple[float, ...], clients: list
) -> torch.Tensor:
    updates = [update(i, values, weight) for i, (values, weight) in enumerate(clients)]
    return aggregator.aggregate(vec(*global_values), iter(updates))


def test_fedavgm_two_heavy_ball_rounds() -> None:
    aggregator = FedAvgM(FedAvgMConfig(momentum=0.9), num_clients=2)
    aggregator.initialize(vec(1, 1))
    # v1 = 0.9 * 0 + (-1, 1) = (-1, 1); x1 = x0 - v1 = (2, 0)
    x1 = run_round(aggregator, *ROUND_1)
    assert_close(x1, [2.0, 0.0])
    # Round 2: clients (2, 3) weight 1 and (2, 0) weight 2 -> mean (2, 1); dw = (0, -1)
    # v2 = 0.9 * (-1, 1) + (0, -1) = (-0.9, -0.1); x2 = (2, 0) - v2 = (2.9, 0.1)
    x2 = run_round(aggregator, (2.0, 0.0), [((2.0, 3.0), 1.0), ((2.0, 0.0), 2.0)])
    assert_close(x2, [2.9, 0.1])
    assert_close(aggregator.state_dict()["velocity"], [-0.9, -0.1])


def test_fedavgm_nesterov_two_rounds() -> None:
    aggregator = FedAvgM(FedAvgMConfig(momentum=0.9, nesterov=True), num_clients=2)
    aggregator.initialize(vec(1, 1))
    # v1 = (-1, 1); x1 = x0 - (0.9 * v1 + dw) = (1, 1) - (-1.9, 1.9) = (2.9, -0.9)
    x1 = run_round(aggregator, *ROUND_1)
    assert_close(x1, [2.9, -0.9])
    # Round 2: both clients at (3.9, -0.9) -> dw = (-1, 0); v2 = 0.9 * (-1, 1) + (-1, 0)
    # = (-1.9, 0.9); x2 = (2.9, -0.9) - (0.9 * v2 + dw) = (2.9, -0.9) - (-2.71, 0.81)
    # = (5.61, -1.71)
    x2 = run_round(aggregator, (2.9, -0.9), [((3.9, -0.9), 1.0), ((3.9, -0.9), 5.0)])
    assert_close(x2, [5.61, -1.71], tol=1e-5)


def test_fedavgm_server_learning_rate_scales_the_step() -> None:
    aggregator = FedAvgM(FedAvgMConfig(momentum=0.9, server_lr=0.5), num_clients=2)
    # v1 = (-1, 1); x1 = (1, 1) - 0.5 * (-1, 1) = (1.5, 0.5)
    assert_close(run_round(aggregator, *ROUND_1), [1.5, 0.5])


def test_fedavgm_without_momentum_is_exactly_fedavg() -> None:
    generator = torch.Generator().manual_seed(0)
    with_momentum_off = FedAvgM(FedAvgMConfig(momentum=0.0), num_clients=3)
    plain = FedAvg(FedAvgConfig(), num_clients=3)
    global_vector = torch.randn(1000, generator=generator)
    with_momentum_off.initialize(global_vector)
    weights = [17.0, 3.0, 101.0]
    for _ in range(3):
        models = [torch.randn(1000, generator=generator) for _ in range(3)]
        updates = [ClientUpdate(k, models[k], weights[k], 5) for k in range(3)]
        expected = plain.aggregate(global_vector, iter(updates))
        actual = with_momentum_off.aggregate(global_vector, iter(updates))
        assert torch.equal(actual, expected)
        global_vector = actual


def test_fedavgm_state_dict_resumes_identically() -> None:
    first = FedAvgM(FedAvgMConfig(momentum=0.9), num_clients=2)
    run_round(first, *ROUND_1)
    resumed = FedAvgM(FedAvgMConfig(momentum=0.9), num_clients=2)
    resumed.load_state_dict(first.state_dict())
    clients = [((2.0, 3.0), 1.0), ((2.0, 0.0), 2.0)]
    assert torch.equal(
        run_round(resumed, (2.0, 0.0), clients), run_round(first, (2.0, 0.0), clients)
    )


def test_fedavgm_effective_learning_rate() -> None:
    config = FedAvgMConfig(momentum=0.9)
    # eta / (1 - beta) = 0.1 / 0.1 = 1; with no client rate given, 1 / 0.1 = 10
    assert config.effective_learning_rate(0.1) == pytest.approx(1.0)
    assert config.effective_learning_rate() == pytest.approx(10.0)


def test_fedavgm_config_ranges() -> None:
    with pytest.raises(ValueError):
        FedAvgMConfig(momentum=1.0)
    with pytest.raises(ValueError):
        FedAvgMConfig(momentum=0.9, beta=0.9)  # type: ignore[call-arg]


# ------------------------------------------------------------------------------ FedOpt

# One round from x0 = (1, 1) with clients (0, 2) weight 1, (3, -1) weight 2: mean (2, 0),
# delta = (1, -1), delta^2 = (1, 1). With beta1 = 0.9: m = 0.1 * delta = (0.1, -0.1).
# tau = 0.1 so v starts at 0.01; server_lr = 0.1.
# x1 = x0 + 0.1 * m / (sqrt(v) + 0.1) = (1 + 0.01 / (sqrt(v) + 0.1), 1 - 0.01 / (sqrt(v) + 0.1))


def expected_first_step(second_moment: float) -> list[float]:
    step = 0.1 * 0.1 / (math.sqrt(second_moment) + 0.1)
    return [1.0 + step, 1.0 - step]


def test_fedadam_one_step() -> None:
    aggregator = FedAdam(FedAdamConfig(server_lr=0.1, tau=0.1), num_clients=2)
    aggregator.initialize(vec(1, 1))
    # v = 0.99 * 0.01 + 0.01 * 1 = 0.0199 -> x1 = (1.0414823, 0.9585177)
    assert_close(run_round(aggregator, *ROUND_1), expected_first_step(0.0199))
    assert_close(aggregator.state_dict()["second_moment"], [0.0199, 0.0199])


def test_fedyogi_two_steps() -> None:
    aggregator = FedYogi(FedYogiConfig(server_lr=0.1, tau=0.1), num_clients=2)
    aggregator.initialize(vec(1, 1))
    # v = 0.01 - 0.01 * 1 * sign(0.01 - 1) = 0.02 -> x1 = (1.0414214, 0.9585786)
    x1 = run_round(aggregator, *ROUND_1)
    assert_close(x1, expected_first_step(0.02))
    # Round 2: one client at x1 + (0.1, 0) -> delta = (0.1, 0), delta^2 = (0.01, 0).
    # v = 0.02 - 0.01 * 0.01 * sign(0.02 - 0.01) = 0.0199 (first); 0.02 - 0 = 0.02 (second)
    # m = 0.9 * (0.1, -0.1) + 0.1 * (0.1, 0) = (0.1, -0.09)
    x2 = aggregator.aggregate(x1, [ClientUpdate(0, x1 + vec(0.1, 0.0), 1.0, 1)])
    expected = [
        float(x1[0]) + 0.1 * 0.1 / (math.sqrt(0.0199) + 0.1),
        float(x1[1]) + 0.1 * -0.09 / (math.sqrt(0.02) + 0.1),
    ]
    assert_close(x2, expected)


def test_fedadagrad_one_step() -> None:
    aggregator = FedAdagrad(FedAdagradConfig(server_lr=0.1, tau=0.1), num_clients=2)
    aggregator.initialize(vec(1, 1))
    # v = 0.01 + 1 = 1.01 -> x1 = (1.0090499, 0.9909501)
    assert_close(run_round(aggregator, *ROUND_1), expected_first_step(1.01))


def test_fedopt_initializes_lazily_like_initialize() -> None:
    eager = FedAdam(FedAdamConfig(), num_clients=2)
    eager.initialize(vec(1, 1))
    lazy = FedAdam(FedAdamConfig(), num_clients=2)
    assert torch.equal(run_round(lazy, *ROUND_1), run_round(eager, *ROUND_1))


def test_fedadagrad_has_no_beta2() -> None:
    with pytest.raises(ValueError, match="beta2"):
        FedAdagradConfig(beta2=0.99)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------- FedNova


def test_fednova_normalizes_by_local_steps() -> None:
    aggregator = FedNova(FedNovaConfig(), num_clients=2)
    training_a = LocalTraining(num_steps=2, learning_rate=0.1, momentum=0.0)
    training_b = LocalTraining(num_steps=6, learning_rate=0.1, momentum=0.0)
    start = vec(0, 0)
    end_a, end_b = vec(-2, 4), vec(-3, 0)
    extras_a = aggregator.client_finish(start, end_a, training_a, {}, {})
    extras_b = aggregator.client_finish(start, end_b, training_b, {}, {})
    assert float(extras_a["a"]) == 2.0 and float(extras_b["a"]) == 6.0
    updates = [ClientUpdate(0, end_a, 1.0, 2, extras_a), ClientUpdate(1, end_b, 3.0, 6, extras_b)]
    # p = (1/4, 3/4); d_a = (2, -4) / 2 = (1, -2); d_b = (3, 0) / 6 = (0.5, 0)
    # sum p d = (0.25 + 0.375, -0.5) = (0.625, -0.5); tau_eff = 0.25 * 2 + 0.75 * 6 = 5
    # x1 = 0 - 5 * (0.625, -0.5) = (-3.125, 2.5)   (FedAvg would give (-2.75, 1))
    assert_close(aggregator.aggregate(start, iter(updates)), [-3.125, 2.5])


def test_fednova_with_equal_steps_is_fedavg() -> None:
    generator = torch.Generator().manual_seed(1)
    global_vector = torch.randn(50, generator=generator)
    models = [torch.randn(50, generator=generator) for _ in range(3)]
    weights = [5.0, 1.0, 2.0]
    extras = {"a": torch.tensor(7.0)}
    nova = FedNova(FedNovaConfig(), 3).aggregate(
        global_vector, [ClientUpdate(k, models[k], weights[k], 7, extras) for k in range(3)]
    )
    plain = FedAvg(FedAvgConfig(), 3).aggregate(
        global_vector, [ClientUpdate(k, models[k], weights[k], 7) for k in range(3)]
    )
    torch.testing.assert_close(nova, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("steps, rho", [(1, 0.5), (3, 0.5), (10, 0.9), (4, 0.0)])
def test_fednova_momentum_factor_is_the_sum_of_momentum_coefficients(
    steps: int, rho: float
) -> None:
    # With heavy-ball momentum, the gradient of step s (0-based) ends up multiplied by
    # 1 + rho + ... + rho^(steps - 1 - s) = (1 - rho^(steps - s)) / (1 - rho); a_k is their sum.
    # E.g. steps 3, rho 0.5: 1.75 + 1.5 + 1 = 4.25 = (3 - 0.5 * 0.875 / 0.5) / 0.5.
    coefficients = sum(sum(rho**j for j in range(steps - s)) for s in range(steps))
    assert normalizing_factor(steps, rho) == pytest.approx(coefficients)


def test_fednova_skips_a_client_without_steps_and_requires_its_extras() -> None:
    aggregator = FedNova(FedNovaConfig(), 2)
    idle = ClientUpdate(0, vec(0, 0), 1.0, 0, {"a": torch.tensor(0.0)})
    busy = ClientUpdate(1, vec(-2, 2), 1.0, 2, {"a": torch.tensor(2.0)})
    # p = (1/2, 1/2); d = (0, 0) and (1, -1); tau_eff = (0 + 2) / 2 = 1
    # x1 = 0 - 1 * (0.5, -0.5) = (-0.5, 0.5)
    assert_close(aggregator.aggregate(vec(0, 0), [idle, busy]), [-0.5, 0.5])
    with pytest.raises(ValueError, match="client_finish"):
        aggregator.aggregate(vec(0, 0), [ClientUpdate(0, vec(1, 1), 1.0, 1)])


def test_fednova_rejects_non_sgd_optimizers() -> None:
    adam = SimpleNamespace(optimizer=SimpleNamespace(name="adam", momentum=0.0))
    sgd = SimpleNamespace(optimizer=SimpleNamespace(name="sgd", momentum=0.9))
    assert FedNovaConfig().incompatibilities(sgd) == []
    assert "train.optimizer.name" in FedNovaConfig().incompatibilities(adam)[0]


# ---------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_client_control_variate_by_hand() -> None:
    aggregator = Scaffold(ScaffoldConfig(), num_clients=4)
    training = LocalTraining(num_steps=4, learning_rate=0.1, momentum=0.0)
    client_state: dict[str, torch.Tensor] = {}
    start, end = vec(1, 2), vec(0.8, 2.4)
    # (x - y) / (tau eta) = (0.2, -0.4) / 0.4 = (0.5, -1)
    # c_k+ = 0 - (0.1, 0.2) + (0.5, -1) = (0.4, -1.2) = delta_c (c_k was 0)
    extras = aggregator.client_finish(start, end, training, {"c": vec(0.1, 0.2)}, client_state)
    assert_close(extras["delta_c"], [0.4, -1.2])
    assert_close(client_state["c_k"], [0.4, -1.2])
    # Next round, c = 0: c_k+ = (0.4, -1.2) - 0 + (0.5, -1) = (0.9, -2.2); delta = (0.5, -1)
    extras = aggregator.client_finish(start, end, training, {"c": vec(0, 0)}, client_state)
    assert_close(extras["delta_c"], [0.5, -1.0])
    assert_close(client_state["c_k"], [0.9, -2.2])


def test_scaffold_context_is_c_minus_c_k() -> None:
    aggregator = Scaffold(ScaffoldConfig(), num_clients=4)
    payload = {"c": vec(0.5, -0.5)}
    assert_close(aggregator.client_context(payload, {})["correction"], [0.5, -0.5])
    context = aggregator.client_context(payload, {"c_k": vec(1.0, 1.0)})
    assert_close(context["correction"], [-0.5, -1.5])


def test_scaffold_server_update_by_hand() -> None:
    aggregator = Scaffold(ScaffoldConfig(), num_clients=4)
    aggregator.initialize(vec(1, 1))
    assert_close(aggregator.server_payload()["c"], [0.0, 0.0])
    updates = [
        ClientUpdate(0, vec(2, 0), 1.0, 3, {"delta_c": vec(0.4, -0.8)}),
        ClientUpdate(1, vec(0, 4), 3.0, 3, {"delta_c": vec(0.4, 0.4)}),
    ]
    # Unweighted: x1 = mean((2, 0), (0, 4)) = (1, 2); c = 0 + ((0.8, -0.4)) / K=4 = (0.2, -0.1)
    assert_close(aggregator.aggregate(vec(1, 1), iter(updates)), [1.0, 2.0])
    assert_close(aggregator.server_payload()["c"], [0.2, -0.1])


def test_scaffold_global_step_size() -> None:
    aggregator = Scaffold(ScaffoldConfig(server_lr=0.5), num_clients=2)
    aggregator.initialize(vec(1, 1))
    updates = [
        ClientUpdate(0, vec(2, 0), 1.0, 3, {"delta_c": vec(0, 0)}),
        ClientUpdate(1, vec(0, 4), 1.0, 3, {"delta_c": vec(0, 0)}),
    ]
    # x1 = (1, 1) + 0.5 * ((1, 2) - (1, 1)) = (1, 1.5)
    assert_close(aggregator.aggregate(vec(1, 1), updates), [1.0, 1.5])


def model_params(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "weight": torch.randn(2, 3, generator=generator),
        "bias": torch.randn(2, generator=generator),
    }


def test_scaffold_penalty_gradient_is_the_correction() -> None:
    generator = torch.Generator().manual_seed(2)
    anchor = model_params(generator)
    params = {key: (value + 0.3).requires_grad_() for key, value in anchor.items()}
    correction = torch.randn(8, generator=generator)
    penalty = Scaffold(ScaffoldConfig(), 2).client_penalty(
        params, anchor, {"correction": correction}
    )
    assert penalty is not None
    # value: <c - c_k, w - x> with w - x = 0.3 everywhere
    torch.testing.assert_close(penalty, 0.3 * correction.sum())
    penalty.backward()
    torch.testing.assert_close(params["weight"].grad, correction[:6].reshape(2, 3))
    torch.testing.assert_close(params["bias"].grad, correction[6:])


def test_scaffold_penalty_turns_sgd_into_the_corrected_step() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(3, generator=generator)
    inputs, targets = torch.randn(5, 3, generator=generator), torch.randn(5, generator=generator)
    correction = torch.randn(3, generator=generator)

    def loss_fn(w: torch.Tensor) -> torch.Tensor:
        return ((inputs @ w - targets) ** 2).mean()

    gradient = torch.func.grad(loss_fn)(weight)
    # SCAFFOLD's step: y - eta (g - c_k + c) with c - c_k = correction
    expected = weight - 0.1 * (gradient + correction)
    trained = weight.clone().requires_grad_()
    optimizer = torch.optim.SGD([trained], lr=0.1)
    penalty = Scaffold(ScaffoldConfig(), 2).client_penalty(
        {"w": trained}, {"w": weight}, {"correction": correction}
    )
    assert penalty is not None
    (loss_fn(trained) + penalty).backward()
    optimizer.step()
    torch.testing.assert_close(trained.detach(), expected)


def test_scaffold_penalty_gradient_under_vmap() -> None:
    generator = torch.Generator().manual_seed(4)
    clients = [model_params(generator) for _ in range(2)]
    stacked = {key: torch.stack([c[key] for c in clients]) for key in clients[0]}
    corrections = torch.randn(2, 8, generator=generator)
    aggregator = Scaffold(ScaffoldConfig(), 2)

    def penalty(params: dict, anchor: dict, correction: torch.Tensor) -> torch.Tensor:
        value = aggregator.client_penalty(params, anchor, {"correction": correction})
        assert value is not None
        return value

    gradients = torch.func.vmap(torch.func.grad(penalty))(stacked, stacked, corrections)
    torch.testing.assert_close(gradients["weight"], corrections[:, :6].reshape(2, 2, 3))
    torch.testing.assert_close(gradients["bias"], corrections[:, 6:])


def test_scaffold_penalty_ignores_the_buffer_tail_of_the_vector() -> None:
    # Vectors hold the parameters first and the floating-point buffers after them; only
    # the leading part of the correction pairs with the parameters.
    params = {"w": torch.zeros(2, 2, requires_grad=True)}
    correction = torch.tensor([1.0, 2.0, 3.0, 4.0, 50.0, 60.0])
    penalty = Scaffold(ScaffoldConfig(), 2).client_penalty(
        params, {"w": torch.zeros(2, 2)}, {"correction": correction}
    )
    assert penalty is not None
    penalty.backward()
    assert params["w"].grad is not None
    assert params["w"].grad.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_scaffold_config_accepts_only_plain_sgd() -> None:
    # The correction enters as a penalty whose gradient is c - c_k, which is SCAFFOLD's
    # step only under SGD without momentum: the config refuses anything else, each
    # problem with its own reason.
    config = ScaffoldConfig()
    plain = SimpleNamespace(optimizer=SimpleNamespace(name="sgd", momentum=0.0))
    heavy_ball = SimpleNamespace(optimizer=SimpleNamespace(name="sgd", momentum=0.9))
    adam = SimpleNamespace(optimizer=SimpleNamespace(name="adam", momentum=0.0))
    adam_with_momentum = SimpleNamespace(optimizer=SimpleNamespace(name="adam", momentum=0.9))
    assert config.incompatibilities(plain) == []
    assert "train.optimizer.momentum" in config.incompatibilities(heavy_ball)[0]
    assert "train.optimizer.name" in config.incompatibilities(adam)[0]
    assert len(config.incompatibilities(adam_with_momentum)) == 2


def test_scaffold_state_dict_round_trip() -> None:
    first = Scaffold(ScaffoldConfig(), 2)
    first.initialize(vec(0, 0))
    first.aggregate(vec(0, 0), [ClientUpdate(0, vec(1, 1), 1.0, 1, {"delta_c": vec(2, 4)})])
    resumed = Scaffold(ScaffoldConfig(), 2)
    resumed.load_state_dict(first.state_dict())
    # c = (2, 4) / K=2 = (1, 2)
    assert_close(resumed.server_payload()["c"], [1.0, 2.0])


# ----------------------------------------------------------------------------- FedProx


def test_fedprox_penalty_value_and_gradient() -> None:
    transform = FedProx(FedProxConfig(mu=0.1))
    params = {"w": vec(1, 2).requires_grad_(), "b": vec(3).requires_grad_()}
    anchor = {"w": vec(0, 0), "b": vec(1)}
    penalty = transform.penalty(params, anchor, {})
    assert penalty is not None
    # ||w - anchor||^2 = 1 + 4 + 4 = 9; mu / 2 * 9 = 0.45
    assert float(penalty.detach()) == pytest.approx(0.45)
    penalty.backward()
    # mu (w - anchor) = (0.1, 0.2) and (0.2)
    assert_close(params["w"].grad, [0.1, 0.2])
    assert_close(params["b"].grad, [0.2])


def test_fedprox_penalty_under_vmap_matches_a_loop() -> None:
    generator = torch.Generator().manual_seed(5)
    clients = [model_params(generator) for _ in range(3)]
    anchor = model_params(generator)
    stacked = {key: torch.stack([c[key] for c in clients]) for key in clients[0]}
    transform = FedProx(FedProxConfig(mu=0.5))
    batched = torch.func.vmap(lambda p: transform.penalty(p, anchor, {}))(stacked)
    looped = torch.stack([transform.penalty(c, anchor, {}) for c in clients])  # type: ignore[misc]
    torch.testing.assert_close(batched, looped)


def test_fedprox_config_rejects_negative_mu() -> None:
    with pytest.raises(ValueError):
        FedProxConfig(mu=-0.1)


# ----------------------------------------------------------------------------- grouper


def test_no_grouping_gives_every_client_its_own_chain() -> None:
    plan = NoGrouping(NoGroupingConfig()).plan(1, np.array([4, 0, 7]), np.random.default_rng(0))
    assert plan.chains == [[4], [0], [7]]
    assert plan.groups == [[4], [0], [7]]
    assert plan.weighting == "samples"
    assert all(type(member) is int for chain in plan.chains for member in chain)


# ------------------------------------------------------------------------ registration


@pytest.mark.parametrize(
    "module, kind, names",
    [
        (fedavg, "aggregators", ["fedavg"]),
        (fedavgm, "aggregators", ["fedavgm"]),
        (fedopt, "aggregators", ["fedadagrad", "fedadam", "fedyogi"]),
        (fednova, "aggregators", ["fednova"]),
        (scaffold, "aggregators", ["scaffold"]),
        (fedprox, "loss_transforms", ["fedprox"]),
        (uniform, "samplers", ["uniform"]),
        (uniform, "loss_transforms", ["cross_entropy"]),
        (uniform, "groupers", ["none"]),
    ],
)
def test_register_hooks(module: Any, kind: str, names: list[str]) -> None:
    registry = registered(module, kind)
    assert registry.names(kind) == names
    for name in names:
        config = registry.get(kind, name).config_class()
        assert config.name == name
        args = (4,) if kind == "aggregators" else ()
        assert registry.build(kind, config, *args) is not None
