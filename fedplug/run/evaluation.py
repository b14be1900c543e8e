"""Evaluation of the global model: on the held-out test set, on every client's own
local test split and, when the federation has them (``data.validation_fraction``), on the
union of the clients' validation splits. Always with raw logits (no loss transform, no
FedShift shift).

This is the only place a global model is evaluated: the simulator and the FedML
coordinator use :class:`Evaluator` (a federation's test sets), a runtime that holds only
a test set or the user's own batches (Flower's central evaluation, the FedML drop-in)
uses :func:`evaluate_held_out` or :func:`evaluate_batches`; all of them compute a batch
with :func:`predict_batch` and combine batches with :func:`held_out_metrics`, so every
runtime reports the same numbers for the same model.

An evaluation is a list of fixed batches (:meth:`Evaluator.batches`); an engine with
idle worker processes may compute them there (``spread``), and the results are combined
in batch order, so the numbers do not depend on where each batch was computed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
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


@torch.no_grad()
def predict_batch(model: nn.Module, inputs: Tensor, labels: Tensor) -> BatchResult:
    """One batch's predictions with ``model`` (which the caller has put in eval mode):
    which samples it classifies right, and its summed cross-entropy."""
    logits = model(inputs)
    loss = float(F.cross_entropy(logits, labels, reduction="sum"))
    return BatchResult(logits.argmax(dim=1) == labels, loss)


def held_out_metrics(results: Sequence[BatchResult], device: torch.device) -> tuple[float, float]:
    """Accuracy and mean cross-entropy over a test set's batch results, summed in batch
    order (so the numbers do not depend on where each batch was computed); ``device``
    holds the concatenated hits. An empty test set has NaN accuracy and loss 0."""
    total_loss = 0.0
    for result in results:
        total_loss += result.loss
    correct = _concatenate(list(results), device)
    return float(correct.float().mean()), total_loss / max(len(correct), 1)


def evaluate_batches(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> Evaluation:
    """Accuracy and mean loss of ``model`` over batches of ``(inputs, labels)`` (a FedML
    user's test data); no per-client accuracies (NaN). The model is left in train mode."""
    model.eval()
    results = [predict_batch(model, inputs, labels) for inputs, labels in batches]
    model.train()
    device = results[0].correct.device if results else torch.device("cpu")
    accuracy, loss = held_out_metrics(results, device)
    return Evaluation(accuracy, loss)


def held_out_batches(x: Tensor, y: Tensor, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Consecutive batches of ``batch_size`` rows of a test set ``(x, y)``."""
    for start in range(0, len(y), batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]


def evaluate_held_out(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> Evaluation:
    """:func:`evaluate_batches` over a held-out test set ``(x, y)`` in batches of
    ``batch_size`` (Flower's central evaluation)."""
    return evaluate_batches(model, held_out_batches(x, y, batch_size))


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
        self.validation_x, self.validation_y = federation.validation_set()

    def batches(self) -> list[Batch]:
        """The evaluation's batches: the held-out test set's, then the local splits'."""
        test = [Batch(False, start) for start in range(0, len(self.test_y), self.batch_size)]
        local = [Batch(True, start) for start in range(0, len(self.local_y), self.batch_size)]
        return test + local

    def predict(self, model: nn.Module, batch: Batch) -> BatchResult:
        """One batch's predictions with ``model`` (which the caller has put in eval mode)."""
        x, y = (self.local_x, self.local_y) if batch.local else (self.test_x, self.test_y)
        rows = slice(batch.start, batch.start + self.batch_size)
        return predict_batch(model, x[rows], y[rows])

    def evaluate(self, model: nn.Module, spread: Spread | None = None) -> Evaluation:
        """Accuracy and mean loss on the held-out test set, the mean and spread of the
        clients' accuracies on their local splits (``spread`` may compute these batches),
        and accuracy and mean loss on the clients' validation splits (when there are any)."""
        batches = self.batches()
        results = spread(self, model, batches) if spread is not None else None
        if results is None:
            model.eval()
            results = [self.predict(model, batch) for batch in batches]
            model.train()
        test = [result for batch, result in zip(batches, results) if not batch.local]
        local = [result for batch, result in zip(batches, results) if batch.local]
        accuracy, loss = held_out_metrics(test, self.test_y.device)
        mean = std = float("nan")
        if len(self.local_y):
            local_correct = _concatenate(local, self.local_y.device)
            hits = torch.bincount(self.local_owner, weights=local_correct.double(), minlength=self.num_clients)
            counts = torch.bincount(self.local_owner, minlength=self.num_clients).double()
            per_client = (hits / counts.clamp(min=1))[self.clients_with_tests.to(hits.device)]
            mean = float(per_client.mean())
            std = float(per_client.std(unbiased=False))
        validation_accuracy: float | None = None
        validation_loss: float | None = None
        if len(self.validation_y):
            # Computed here, not spread: a few batches, and never part of the test numbers.
            validation = evaluate_held_out(model, self.validation_x, self.validation_y, self.batch_size)
            validation_accuracy, validation_loss = validation.accuracy, validation.loss
        return Evaluation(accuracy, loss, mean, std, validation_accuracy, validation_loss)


def _concatenate(results: list[BatchResult], device: torch.device) -> Tensor:
    """Every batch's hits in batch order, on ``device``."""
    if not results:
        return torch.zeros(0, dtype=torch.bool, device=device)
    return torch.cat([result.correct.to(device) for result in results])
