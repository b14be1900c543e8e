"""Evaluation of the global model: on the held-out test set and on every client's own
local test split. Always with raw logits (no loss transform, no FedShift shift)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedplug.data.federation import Federation
from fedplug.federated_round import Evaluation


class Evaluator:
    """Holds the test tensors, concatenated once, so a round's evaluation is a few
    large batches whatever the number of clients."""

    def __init__(self, federation: Federation, batch_size: int) -> None:
        self.batch_size = batch_size
        self.test_x, self.test_y = federation.test_x, federation.test_y
        sizes = [client.test_y.shape[0] for client in federation.clients]
        self.clients_with_tests = torch.tensor([size > 0 for size in sizes])
        self.local_x = torch.cat([client.test_x for client in federation.clients])
        self.local_y = torch.cat([client.test_y for client in federation.clients])
        self.local_owner = torch.repeat_interleave(
            torch.arange(len(sizes), device=self.local_y.device),
            torch.tensor(sizes, device=self.local_y.device),
        )
        self.num_clients = len(sizes)

    @torch.no_grad()
    def _predict(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, float]:
        correct = torch.zeros(len(y), dtype=torch.bool, device=y.device)
        total_loss = 0.0
        for start in range(0, len(y), self.batch_size):
            logits = model(x[start : start + self.batch_size])
            target = y[start : start + self.batch_size]
            total_loss += float(F.cross_entropy(logits, target, reduction="sum"))
            correct[start : start + self.batch_size] = logits.argmax(dim=1) == target
        return correct, total_loss

    def evaluate(self, model: nn.Module) -> Evaluation:
        model.eval()
        correct, total_loss = self._predict(model, self.test_x, self.test_y)
        accuracy = float(correct.float().mean())
        loss = total_loss / max(len(self.test_y), 1)
        mean = std = float("nan")
        if len(self.local_y):
            local_correct, _ = self._predict(model, self.local_x, self.local_y)
            hits = torch.bincount(self.local_owner, weights=local_correct.double(), minlength=self.num_clients)
            counts = torch.bincount(self.local_owner, minlength=self.num_clients).double()
            per_client = (hits / counts.clamp(min=1))[self.clients_with_tests.to(hits.device)]
            mean = float(per_client.mean())
            std = float(per_client.std(unbiased=False))
        model.train()
        return Evaluation(accuracy, loss, mean, std)
