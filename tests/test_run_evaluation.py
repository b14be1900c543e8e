"""The one evaluation of a global model (fedplug/run/evaluation.py) over plain batches,
against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedplug.run.evaluation import evaluate_batches, evaluate_held_out, held_out_batches


def identity_model() -> nn.Module:
    """Logits = inputs: a 2-class linear layer with the identity as its weights."""
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    return model


TEST_X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
TEST_Y = torch.tensor([0, 0, 0])
# Cross-entropy of logits (a, b) with label 0 is log(1 + e^(b - a)).
EXPECTED_LOSS = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1)) + math.log(1 + math.exp(-2))) / 3
EXPECTED_ACCURACY = 2 / 3  # the second sample is classified as 1


@pytest.mark.parametrize("batch_size", [1, 2, 3, 100])
def test_held_out_accuracy_and_loss_are_the_hand_computed_ones_whatever_the_batch_size(batch_size):
    model = identity_model()
    evaluation = evaluate_held_out(model, TEST_X, TEST_Y, batch_size)
    assert evaluation.accuracy == pytest.approx(EXPECTED_ACCURACY, rel=1e-6)
    assert evaluation.loss == pytest.approx(EXPECTED_LOSS, rel=1e-6)
    assert math.isnan(evaluation.client_accuracy_mean) and math.isnan(evaluation.client_accuracy_std)
    assert model.training  # left in train mode, as the runtimes expect


def test_the_user_batches_and_the_held_out_slices_give_the_same_numbers():
    model = identity_model()
    by_slices = evaluate_held_out(model, TEST_X, TEST_Y, 2)
    user_batches = [(TEST_X[:2].clone(), TEST_Y[:2].clone()), (TEST_X[2:].clone(), TEST_Y[2:].clone())]
    by_batches = evaluate_batches(model, user_batches)
    assert (by_batches.accuracy, by_batches.loss) == (by_slices.accuracy, by_slices.loss)
    assert [len(y) for _, y in held_out_batches(TEST_X, TEST_Y, 2)] == [2, 1]


def test_no_test_batches_give_nan_accuracy():
    evaluation = evaluate_batches(identity_model(), [])
    assert math.isnan(evaluation.accuracy) and evaluation.loss == 0.0
