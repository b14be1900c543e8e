"""FedShift's logit shift, the Reweighting baseline, and the default cross-entropy."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from fedplug.algorithms import fedshift
from fedplug.algorithms.fedshift import (
    FedShift,
    FedShiftConfig,
    Reweighting,
    ReweightingConfig,
    class_shift,
    global_prior,
    reweighting_weights,
)
from fedplug.algorithms.uniform import CrossEntropyConfig, build_cross_entropy
from fedplug.data.federation import ClientData, Federation
from fedplug.errors import DataError
from fedplug.registry import Registry

# Two clients, three classes. Client 0 holds no sample of class 2.
COUNTS = np.array([[3, 1, 0], [0, 2, 4]])
# Smoothed: P_0 = (4, 2, 1) / 7, P_1 = (1, 3, 5) / 9; n = (4, 6), so
# P = 0.4 P_0 + 0.6 P_1 = (1.6/7 + 0.6/9, 0.8/7 + 1.8/9, 0.4/7 + 3/9) = (18.6, 19.8, 24.6) / 63
PRIOR = np.array([18.6, 19.8, 24.6]) / 63
# s_0 = ln(P_0 / P) = (ln(36 / 18.6), ln(18 / 19.8), ln(9 / 24.6)) = (0.6604, -0.0953, -1.0055)
SHIFT_0 = np.log([36 / 18.6, 18 / 19.8, 9 / 24.6])


def prepared(transform: Any) -> Any:
    transform.prepare(SimpleNamespace(class_counts=COUNTS))
    return transform


def test_global_prior_by_hand() -> None:
    np.testing.assert_allclose(global_prior(COUNTS), PRIOR, rtol=1e-12)
    np.testing.assert_allclose(PRIOR, [0.2952381, 0.3142857, 0.3904762], rtol=1e-6)
    assert global_prior(COUNTS).sum() == pytest.approx(1.0)


def test_shift_by_hand_and_finite_for_a_missing_class() -> None:
    shift = class_shift(COUNTS[0], PRIOR)
    np.testing.assert_allclose(shift, SHIFT_0, rtol=1e-12)
    np.testing.assert_allclose(shift, [0.6603570, -0.0953102, -1.0055218], rtol=1e-6)
    assert np.all(np.isfinite(shift))


def test_client_context_is_a_float32_shift() -> None:
    context = prepared(FedShift(FedShiftConfig())).client_context(0, COUNTS[0])
    assert context["shift"].dtype == torch.float32 and context["shift"].shape == (3,)
    np.testing.assert_allclose(context["shift"].numpy(), SHIFT_0, rtol=1e-6)


def test_prepare_reads_a_real_federation() -> None:
    def client(client_id: int, counts: np.ndarray) -> ClientData:
        labels = torch.as_tensor(np.repeat(np.arange(3), counts))
        return ClientData(
            client_id,
            torch.zeros(len(labels), 1),
            labels,
            torch.zeros(0, 1),
            torch.zeros(0, dtype=torch.long),
            counts,
        )

    federation = Federation(
        clients=[client(0, COUNTS[0]), client(1, COUNTS[1])],
        test_x=torch.zeros(0, 1),
        test_y=torch.zeros(0, dtype=torch.long),
        num_classes=3,
        input_shape=(1,),
        dataset_name="toy",
    )
    transform = FedShift(FedShiftConfig())
    assert transform.prepare(federation) is None
    np.testing.assert_allclose(transform.prior, PRIOR, rtol=1e-12)


def test_fedshift_loss_by_hand() -> None:
    transform = prepared(FedShift(FedShiftConfig()))
    context = transform.client_context(0, COUNTS[0])
    loss = transform.per_sample_loss(
        torch.zeros(2, 3), torch.tensor([0, 2]), torch.arange(2), context
    )
    # CE(0 + s, y) = ln(sum_c exp(s_c)) - s_y, with exp(s) = (36/18.6, 18/19.8, 9/24.6)
    log_partition = math.log(36 / 18.6 + 18 / 19.8 + 9 / 24.6)  # ln 3.2104291 = 1.1664054
    expected = [log_partition - math.log(36 / 18.6), log_partition - math.log(9 / 24.6)]
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_fedshift_local_optimum_is_the_global_prior() -> None:
    # Paper Theorem 1 for one input: the expected shifted loss under P_k,
    # sum_c P_k(c) CE(z + s_k, c), is minimised by z = ln P (its gradient,
    # softmax(z + s_k) - P_k, vanishes there), for every client k.
    transform = prepared(FedShift(FedShiftConfig()))
    for client_id in range(2):
        local = (COUNTS[client_id] + 1) / (COUNTS[client_id].sum() + 3)
        context = transform.client_context(client_id, COUNTS[client_id])
        logits = torch.log(torch.tensor(PRIOR, dtype=torch.float32)).repeat(3, 1).requires_grad_()
        losses = transform.per_sample_loss(logits, torch.arange(3), torch.arange(3), context)
        (losses * torch.tensor(local, dtype=torch.float32)).sum().backward()
        torch.testing.assert_close(logits.grad.sum(0), torch.zeros(3), rtol=0, atol=1e-6)


def test_reweighting_weights_by_hand() -> None:
    # r_0 = P / P_0 = (18.6/63 / (4/7), 19.8/63 / (2/7), 24.6/63 / (1/7))
    #     = (18.6/36, 19.8/18, 24.6/9) = (0.5166667, 1.1, 2.7333333)
    np.testing.assert_allclose(reweighting_weights(COUNTS[0], PRIOR), [18.6 / 36, 1.1, 24.6 / 9])
    transform = prepared(Reweighting(ReweightingConfig()))
    context = transform.client_context(0, COUNTS[0])
    logits = torch.zeros(2, 3)
    loss = transform.per_sample_loss(logits, torch.tensor([1, 2]), torch.arange(2), context)
    # Zero logits: CE = ln 3 for every sample, times r_0(y)
    torch.testing.assert_close(loss, torch.tensor([1.1, 24.6 / 9]) * math.log(3))


def test_reweighting_local_optimum_is_the_global_prior() -> None:
    # sum_c P_k(c) r_k(c) CE(z, c) = sum_c P(c) CE(z, c), minimised at z = ln P.
    transform = prepared(Reweighting(ReweightingConfig()))
    local = (COUNTS[1] + 1) / (COUNTS[1].sum() + 3)
    context = transform.client_context(1, COUNTS[1])
    logits = torch.log(torch.tensor(PRIOR, dtype=torch.float32)).repeat(3, 1).requires_grad_()
    losses = transform.per_sample_loss(logits, torch.arange(3), torch.arange(3), context)
    (losses * torch.tensor(local, dtype=torch.float32)).sum().backward()
    torch.testing.assert_close(logits.grad.sum(0), torch.zeros(3), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "build", [lambda: FedShift(FedShiftConfig()), lambda: Reweighting(ReweightingConfig())]
)
def test_losses_under_vmap_match_a_loop(build: Any) -> None:
    transform = prepared(build())
    contexts = [transform.client_context(k, COUNTS[k]) for k in range(2)]
    stacked = {key: torch.stack([c[key] for c in contexts]) for key in contexts[0]}
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 3, generator=generator)
    targets = torch.randint(0, 3, (2, 5), generator=generator)
    ids = torch.arange(5).repeat(2, 1)
    batched = torch.func.vmap(transform.per_sample_loss)(logits, targets, ids, stacked)
    looped = torch.stack(
        [transform.per_sample_loss(logits[k], targets[k], ids[k], contexts[k]) for k in range(2)]
    )
    torch.testing.assert_close(batched, looped)


def test_context_before_prepare_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="prepare"):
        FedShift(FedShiftConfig()).client_context(0, COUNTS[0])


def test_prior_of_an_empty_federation_is_a_data_error() -> None:
    with pytest.raises(DataError, match="no training samples"):
        global_prior(np.zeros((2, 3)))
    with pytest.raises(DataError, match="K x C"):
        global_prior(np.zeros(3))


def test_state_dict_round_trip() -> None:
    source = prepared(FedShift(FedShiftConfig()))
    restored = FedShift(FedShiftConfig())
    restored.load_state_dict(source.state_dict())
    torch.testing.assert_close(
        restored.client_context(1, COUNTS[1])["shift"], source.client_context(1, COUNTS[1])["shift"]
    )


def test_default_cross_entropy_by_hand() -> None:
    transform = build_cross_entropy(CrossEntropyConfig())
    loss = transform.per_sample_loss(torch.zeros(1, 4), torch.tensor([2]), torch.arange(1), {})
    # Uniform logits over 4 classes: CE = ln 4
    torch.testing.assert_close(loss, torch.tensor([math.log(4)]))
    assert transform.penalty({}, {}, {}) is None


def test_register_hook() -> None:
    registry = Registry()

    def register(*arguments: Any) -> None:
        registry.add("loss_transforms", fedshift.__name__, *arguments)

    fedshift.fedplug_register_loss_transforms(register=register)
    assert registry.names("loss_transforms") == ["fedshift", "reweighting"]
    assert isinstance(registry.build("loss_transforms", FedShiftConfig()), FedShift)
    assert isinstance(registry.build("loss_transforms", ReweightingConfig()), Reweighting)
