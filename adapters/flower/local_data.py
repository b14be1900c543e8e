"""A client's own data, in whatever form a Flower app holds it, as
:func:`fedplug.simulation.local_training.train_locally` reads it.

``train_locally`` needs the labels as a tensor (the sampler reads them, the loss indexes
them) and inputs it can index with a tensor of sample ids. In-memory tensors are used as
they are; a map-style dataset (or the dataset behind a DataLoader) is wrapped in
:class:`IndexedInputs`, which loads and collates exactly the samples of each batch, so
the user's transforms still run per sample and nothing is copied up front.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from fedplug.errors import DataError


class IndexedInputs:
    """Inputs of a map-style dataset, indexed by a tensor of sample ids.

    Args:
        dataset: any object with ``__len__`` and ``__getitem__(i) -> (input, label, ...)``.
        device: where the collated batch goes (the model's device).
        collate: how a list of samples becomes a batch (default
            ``torch.utils.data.default_collate``); only the first element of its result
            (the inputs) is used.
    """

    def __init__(
        self, dataset: Any, device: torch.device, collate: Callable[[list[Any]], Any] | None = None
    ) -> None:
        self.dataset = dataset
        self.device = device
        self.collate = collate or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, sample_ids: Tensor) -> Tensor:
        batch = self.collate([self.dataset[int(i)] for i in sample_ids.tolist()])
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return torch.as_tensor(inputs).to(self.device)


@dataclass
class LocalData:
    """One client's samples: ``inputs[ids]`` gives a batch, ``labels`` all labels."""

    inputs: Tensor | IndexedInputs
    labels: Tensor
    batch_size: int | None = None
    """The DataLoader's batch size when the data came as one (it then overrides
    ``train.batch_size``)."""

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    def class_counts(self, num_classes: int) -> np.ndarray:
        labels = self.labels.cpu().numpy()
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(
                f"labels must lie in [0, {num_classes - 1}], found {int(labels.min())}..{int(labels.max())}; "
                "check the number of classes"
            )
        return np.bincount(labels, minlength=num_classes).astype(np.int64)


def _labels_of(dataset: Any) -> Tensor:
    """All labels of a map-style dataset: its ``targets`` attribute (torchvision) when it
    has one of the right length, else the second element of every sample."""
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) == len(dataset):
        return torch.as_tensor(np.asarray(targets), dtype=torch.long)
    labels = []
    for index in range(len(dataset)):
        sample = dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) < 2:
            raise DataError(
                "each sample of the dataset must be an (input, label) pair; got "
                f"{type(sample).__name__} at index {index}"
            )
        labels.append(int(sample[1]))
    return torch.as_tensor(labels, dtype=torch.long)


def as_local_data(data: Any, device: torch.device | str = "cpu") -> LocalData:
    """Accept ``(inputs, labels)`` tensors, a ``TensorDataset``, any map-style
    ``Dataset``, a ``DataLoader`` over one, or a fedplug ``ClientData`` (its training
    split).

    Raises:
        DataError: the data has another form, or the inputs and labels differ in length.
    """
    device = torch.device(device)
    if isinstance(data, LocalData):
        return data
    if hasattr(data, "train_x") and hasattr(data, "train_y"):  # fedplug.data.federation.ClientData
        return _from_tensors(data.train_x, data.train_y, device)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(part, Tensor) for part in data)
    ):
        return _from_tensors(data[0], data[1], device)
    if isinstance(data, DataLoader):
        inner = (
            as_local_data(data.dataset, device) if isinstance(data.dataset, TensorDataset) else None
        )
        if inner is None:
            inner = LocalData(
                IndexedInputs(data.dataset, device, data.collate_fn),
                _labels_of(data.dataset).to(device),
            )
        inner.batch_size = data.batch_size
        return inner
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return _from_tensors(data.tensors[0], data.tensors[1], device)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return LocalData(IndexedInputs(data, device), _labels_of(data).to(device))
    raise DataError(
        f"cannot train on a {type(data).__name__}; pass (inputs, labels) tensors, a "
        "map-style torch Dataset of (input, label) pairs, or a DataLoader over one"
    )


def _from_tensors(inputs: Tensor, labels: Tensor, device: torch.device) -> LocalData:
    if inputs.shape[0] != labels.shape[0]:
        raise DataError(f"{inputs.shape[0]} inputs but {labels.shape[0]} labels")
    return LocalData(inputs.to(device), labels.to(device=device, dtype=torch.long))


def batches(data: LocalData, batch_size: int) -> Sequence[Tensor]:
    """Sample ids of consecutive evaluation batches."""
    ids = torch.arange(data.num_samples, device=data.labels.device)
    return torch.split(ids, batch_size)
