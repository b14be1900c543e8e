"""Evaluation of the global model: on the held-out test set and on every client's own
local test split. Always with raw logits (no loss transform, no FedShift shift).

An evaluation is a list of fixed batches (:meth:`Evaluator.batches`); an engine with
idle worker processes may compute them there (``spread``), and the results are combined
in batch order, so the numbers do not depend on where each batch was computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.data.federation import Federation
from fedplug.run.federated_round import Evaluation


class Batch(NamedTuple):
    """One batch of an evaluation: rows ``start:start + batch_size`` of the held-out
    test set, or of the clients' concatenated local test splits (``local``)."""

    local: bool
    start: int


class BatchResult(NamedTuple):
    correct: Tensor
    """Whether each sample's prediction is its label (bool)."""
    loss: float
    """The batch's summed cross-entropy."""


Spread = Callable[["Evaluator", nn.Module, list[Batch]], "list[BatchResult] | None"]
"""Computes an evaluator's batches elsewhere (the parallel engine's workers), in batch
order, for the model's current state; ``None`` when it cannot, and the evaluator computes
them itself."""


class Evaluator:
    """Holds the test tensors, concatenated once, so a round's evaluation is a few
    large batches whatever the number of clients."""

    def __init__(self, federation: Federation, batch_size: int) -> None:
        self.batch_size = batch_size
        self.test_x, self.test_y = federation.test_x, federation.test_y
        self.local_x, self.local_y, sizes = federation.local_test_set()
        self.clients_with_tests = torch.from_numpy(sizes > 0)
        self.local_owner = torch.repeat_interleave(
            torch.arange(len(sizes), device=self.local_y.device),
            torch.from_numpy(sizes).to(self.local_y.device),
        )
        self.num_clients = len(sizes)

    def batches(self) -> list[Batch]:
        """The evaluation's batches: the held-out test set's, then the local splits'."""
        test = [Batch(False, start) for start in range(0, len(self.test_y), self.batch_size)]
        local = [Batch(True, start) for start in range(0, len(self.local_y), self.batch_size)]
        return test + local

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> BatchResult:
        """One batch's predictions with ``model`` (which the caller has put in eval mode)."""
        x, y = (self.local_x, self.local_y) if batch.local else (self.test_x, self.test_y)
        logits = model(x[batch.start : batch.start + self.batch_size])
        target = y[batch.start : batch.start + self.batch_size]
        loss = float(F.cross_entropy(logits, target, reduction="sum"))
        return BatchResult(logits.argmax(dim=1) == target, loss)

    def evaluate(self, model: nn.Module, spread: Spread | None = None) -> Evaluation:
        """Accuracy and mean loss on the held-out test set, and the mean and spread of
        the clients' accuracies on their local splits; ``spread`` may compute the batches."""
        batches = self.batches()
        results = spread(self, model, batches) if spread is not None else None
        if results is None:
            model.eval()
            results = [self.predict(model, batch) for batch in batches]
            model.train()
        test = [result for batch, result in zip(batches, results) if not batch.local]
        local = [result for batch, result in zip(batches, results) if batch.local]
        total_loss = 0.0
        for result in test:  # summed in batch order, wherever each batch was computed
            total_loss += result.loss
        accuracy = float(_concatenate(test, self.test_y).float().mean())
        loss = total_loss / max(len(self.test_y), 1)
        mean = std = float("nan")
        if len(self.local_y):
            local_correct = _concatenate(local, self.local_y)
            hits = torch.bincount(self.local_owner, weights=local_correct.double(), minlength=self.num_clients)
            counts = torch.bincount(self.local_owner, minlength=self.num_clients).double()
            per_client = (hits / counts.clamp(min=1))[self.clients_with_tests.to(hits.device)]
            mean = float(per_client.mean())
            std = float(per_client.std(unbiased=False))
        return Evaluation(accuracy, loss, mean, std)


def _concatenate(results: list[BatchResult], labels: Tensor) -> Tensor:
    if not results:
        return torch.zeros(0, dtype=torch.bool, device=labels.device)
    return torch.cat([result.correct.to(labels.device) for result in results])
