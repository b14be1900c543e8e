"""A federation: a dataset split into clients, each with a local train and test split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class ClientData:
    """One client's data, already on the training device."""

    client_id: int
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    class_counts: np.ndarray
    """Counts of each class in the client's local *training* split (length C)."""

    @property
    def num_samples(self) -> int:
        return int(self.train_y.shape[0])


@dataclass
class Federation:
    """All clients plus the held-out global test set."""

    clients: list[ClientData]
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    dataset_name: str

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def class_counts(self) -> np.ndarray:
        """The K x C matrix of local training class counts."""
        return np.stack([client.class_counts for client in self.clients])

    @property
    def device(self) -> torch.device:
        return self.test_x.device
