"""A client's own data, in whatever form a Flower app holds it, as
:func:`fedplug.run.local_training.train_locally` reads it.

``train_locally`` needs the labels as a tensor (the sampler reads them, the loss indexes
them) and inputs it can index with a tensor of sample ids. In-memory tensors are used as
they are; a map-style dataset (or the dataset behind a DataLoader) is wrapped in
:class:`IndexedInputs`, which loads and collates exactly the samples of each batch, so
the user's transforms still run per sample and nothing is copied up front.

A sample is an ``(input, label, ...)`` tuple or, as flwr-datasets and Hugging Face
``datasets`` give them, a dict such as ``{"img": ..., "label": ...}``: the label is under
``label_key`` (default ``"label"``) and the input under ``input_key`` (default: the one
key besides the label and :data:`SAMPLE_ID_KEY`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    Dataset,
    Subset,
    TensorDataset,
    default_collate,
)

from fedplug.errors import DataError

DEFAULT_LABEL_KEY = "label"
"""The label's key in a dict sample (flwr-datasets' CIFAR-10 and MNIST use it)."""
SAMPLE_ID_KEY = "sample_id"
"""The key :func:`with_sample_ids` adds to a dict sample."""


def input_of(batch: Any, label_key: str = DEFAULT_LABEL_KEY, input_key: str | None = None) -> Any:
    """The inputs of a sample or a collated batch: ``batch[input_key]`` of a dict (by
    default its one key besides ``label_key`` and :data:`SAMPLE_ID_KEY`), else the first
    element of a tuple, else ``batch`` itself.

    Raises:
        DataError: a dict batch whose input key is ambiguous or absent.
    """
    if isinstance(batch, Mapping):
        if input_key is not None:
            if input_key not in batch:
                raise DataError(
                    f"the samples have no key {input_key!r} (they have {sorted(batch)}); "
                    "pass input_key= naming the inputs"
                )
            return batch[input_key]
        candidates = [key for key in batch if key not in (label_key, SAMPLE_ID_KEY)]
        if len(candidates) != 1:
            raise DataError(
                f"cannot tell the inputs among the keys {sorted(batch)} of the samples; pass "
                "input_key= naming them (and label_key= when the label is not 'label')"
            )
        return batch[candidates[0]]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


class IndexedInputs:
    """Inputs of a map-style dataset, indexed by a tensor of sample ids.

    Args:
        dataset: any object with ``__len__`` and ``__getitem__(i)`` giving an
            ``(input, label, ...)`` tuple or a dict sample.
        device: where the collated batch goes (the model's device).
        collate: how a list of samples becomes a batch (default
            ``torch.utils.data.default_collate``); only the inputs of its result are used
            (:func:`input_of`).
        label_key: the label's key in a dict sample (default ``"label"``).
        input_key: the inputs' key in a dict sample (default: the one other key).
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device,
        collate: Callable[[list[Any]], Any] | None = None,
        *,
        label_key: str = DEFAULT_LABEL_KEY,
        input_key: str | None = None,
    ) -> None:
        self.dataset = dataset
        self.device = device
        self.collate = collate or default_collate
        self.label_key = label_key
        self.input_key = input_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, sample_ids: Tensor) -> Tensor:
        batch = self.collate([self.dataset[int(i)] for i in sample_ids.tolist()])
        inputs = input_of(batch, self.label_key, self.input_key)
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


def labels_of(data: Any, label_key: str = DEFAULT_LABEL_KEY) -> np.ndarray:
    """All labels of a client's training data, as int64, read without loading its inputs
    where the data keep their labels apart (:func:`stored_labels`), else by reading every
    sample (:func:`labels_by_iteration`).

    What is counted: ``data`` is labels themselves (a tensor, an array, a list of ints), a
    dataset, or a DataLoader, of which its whole ``dataset`` is read: its sampler is not
    applied (:class:`~fedplug.adapters.flower.FedplugTrainer` trains on that whole dataset
    in its own order; pass a ``Subset`` to train and count a part of it).

    Raises:
        DataError: a sample is neither an ``(input, label, ...)`` tuple nor a dict with
            ``label_key``.
    """
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, (Tensor, np.ndarray)):
        return np.asarray(torch.as_tensor(data).cpu(), dtype=np.int64).reshape(-1)
    if isinstance(data, (list, tuple)) and all(
        isinstance(value, (int, np.integer)) for value in data
    ):
        return np.asarray(data, dtype=np.int64)
    stored = stored_labels(data, label_key)
    return stored if stored is not None else labels_by_iteration(data, label_key)


def stored_labels(dataset: Any, label_key: str = DEFAULT_LABEL_KEY) -> np.ndarray | None:
    """The labels of ``dataset`` read from where it keeps them, as int64, without loading
    a sample or running a transform on an input; ``None`` when it keeps them nowhere known.

    Known places, each giving the labels that reading every sample would give:

    - a Hugging Face ``datasets.Dataset`` (flwr-datasets' partitions, ``train_test_split``
      results, under any ``with_format`` or ``with_transform``): its ``label_key`` column,
      read as Arrow with the format reset, so its transform never runs. The column as
      stored is counted: a transform that rewrites labels is not seen.
    - a ``torch.utils.data.Subset``: its parent's stored labels at its indices;
      a ``ConcatDataset``: its parts' stored labels, one after the other;
      :class:`SampleIds`: the wrapped dataset's.
    - a ``TensorDataset`` of two or more tensors: the second (a sample is
      ``(input, label, ...)``), when it holds one label per sample.
    - a dataset with ``targets`` of its length (torchvision's MNIST, CIFAR, ImageFolder),
      each passed through its ``target_transform`` when it has one; not when it has a
      joint ``transforms`` that could change the target.
    """
    for reader in STORED_LABEL_READERS:
        labels = reader(dataset, label_key)
        if labels is not None:
            return labels
    return None


def _hugging_face_column(dataset: Any, label_key: str) -> np.ndarray | None:
    columns = getattr(dataset, "column_names", None)
    if not (isinstance(columns, list) and label_key in columns and hasattr(dataset, "with_format")):
        return None
    # The Arrow format replaces the user's format and transform: only the column is read.
    table = dataset.with_format("arrow", columns=[label_key])[:]
    return np.array(table[label_key].to_numpy(), dtype=np.int64)  # a writable copy of Arrow's


def _wrapped_dataset_labels(dataset: Any, label_key: str) -> np.ndarray | None:
    if isinstance(dataset, SampleIds):
        return stored_labels(dataset.dataset, label_key)
    if isinstance(dataset, Subset):
        parent = stored_labels(dataset.dataset, label_key)
        return None if parent is None else parent[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, ConcatDataset):
        parts = [stored_labels(part, label_key) for part in dataset.datasets]
        if any(part is None for part in parts):
            return None
        return np.concatenate([np.empty(0, dtype=np.int64), *parts])  # type: ignore[list-item]
    return None


def _tensor_dataset_labels(dataset: Any, label_key: str) -> np.ndarray | None:
    if not (isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2):
        return None
    labels = dataset.tensors[1]
    if labels.dim() != 1:
        return None  # not one label per sample: reading the samples says what is wrong
    return np.asarray(labels.cpu(), dtype=np.int64)


def _targets(dataset: Any, label_key: str) -> np.ndarray | None:
    targets = getattr(dataset, "targets", None)
    if targets is None or len(targets) != len(dataset):
        return None
    joint = getattr(dataset, "transforms", None)
    if joint is not None and not hasattr(joint, "target_transform"):
        return None  # a joint transform of (input, target) could change the target
    stored = np.asarray(targets)
    if stored.ndim != 1:
        return None  # not one label per sample
    target_transform = getattr(dataset, "target_transform", None)
    if target_transform is None:
        return stored.astype(np.int64)
    return np.asarray([int(target_transform(int(target))) for target in stored], dtype=np.int64)


STORED_LABEL_READERS: tuple[Callable[[Any, str], np.ndarray | None], ...] = (
    _wrapped_dataset_labels,
    _hugging_face_column,
    _tensor_dataset_labels,
    _targets,
)
"""The places :func:`stored_labels` looks, in order; the first that knows the dataset
answers."""


def labels_by_iteration(dataset: Any, label_key: str = DEFAULT_LABEL_KEY) -> np.ndarray:
    """All labels of a map-style dataset, read sample by sample (each sample is loaded and
    transformed): the way that works for any dataset of ``(input, label, ...)`` tuples or
    dict samples, and what :func:`stored_labels` must agree with.

    Raises:
        DataError: a sample is neither such a tuple nor a dict with ``label_key``.
    """
    labels = []
    for index in range(len(dataset)):
        sample = dataset[index]
        if isinstance(sample, Mapping) and label_key in sample:
            labels.append(int(sample[label_key]))
        elif isinstance(sample, (tuple, list)) and len(sample) >= 2:
            labels.append(int(sample[1]))
        else:
            found = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise DataError(
                f"sample {index} of the dataset has no label: expected an (input, label) pair or "
                f"a dict with key {label_key!r} (pass label_key= for another key), got {found}"
            )
    return np.asarray(labels, dtype=np.int64)


def _labels_of(dataset: Any, label_key: str = DEFAULT_LABEL_KEY) -> Tensor:
    return torch.as_tensor(labels_of(dataset, label_key), dtype=torch.long)


def as_local_data(
    data: Any,
    device: torch.device | str = "cpu",
    *,
    label_key: str = DEFAULT_LABEL_KEY,
    input_key: str | None = None,
) -> LocalData:
    """Accept ``(inputs, labels)`` tensors, a ``TensorDataset``, any map-style
    ``Dataset`` (tuple or dict samples, a Hugging Face ``Dataset`` too), a ``DataLoader``
    over one, or a fedplug ``ClientData`` (its training split). ``label_key`` and
    ``input_key`` name the parts of a dict sample (see :func:`input_of`).

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
                IndexedInputs(
                    data.dataset,
                    device,
                    data.collate_fn,
                    label_key=label_key,
                    input_key=input_key,
                ),
                _labels_of(data.dataset, label_key).to(device),
            )
        inner.batch_size = data.batch_size
        return inner
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return _from_tensors(data.tensors[0], data.tensors[1], device)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return LocalData(
            IndexedInputs(data, device, label_key=label_key, input_key=input_key),
            _labels_of(data, label_key).to(device),
        )
    raise DataError(
        f"cannot train on a {type(data).__name__}; pass (inputs, labels) tensors, a "
        "map-style dataset of (input, label) pairs or dict samples, or a DataLoader over one"
    )


def _from_tensors(inputs: Tensor, labels: Tensor, device: torch.device) -> LocalData:
    if inputs.shape[0] != labels.shape[0]:
        raise DataError(f"{inputs.shape[0]} inputs but {labels.shape[0]} labels")
    return LocalData(inputs.to(device), labels.to(device=device, dtype=torch.long))


def batches(data: LocalData, batch_size: int) -> Sequence[Tensor]:
    """Sample ids of consecutive evaluation batches."""
    ids = torch.arange(data.num_samples, device=data.labels.device)
    return torch.split(ids, batch_size)


class SampleIds(Dataset):
    """A map-style dataset whose samples also carry their index (see
    :func:`with_sample_ids`)."""

    def __init__(self, dataset: Any, key: str = SAMPLE_ID_KEY) -> None:
        self.dataset = dataset
        self.key = key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        if isinstance(sample, Mapping):
            return {**sample, self.key: index}
        if isinstance(sample, (tuple, list)):
            return (*sample, index)
        return (sample, index)

    def __getattr__(self, name: str) -> Any:
        # targets, column_names, ...: what labels_of reads, from the wrapped dataset.
        # Not dunders: a Hugging Face Dataset's __getitems__ would make a DataLoader
        # fetch its rows directly, without the sample ids.
        if name in ("dataset", "key") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_sample_ids(dataset: Any, key: str = SAMPLE_ID_KEY) -> SampleIds:
    """``dataset`` with each sample's index in the client's training set added: under
    ``key`` (default ``"sample_id"``) in a dict sample, as the last element of a tuple
    sample. A loss that weighs each sample (FedDisk's weights) reads the batch's ids:
    ``criterion(model(batch["img"]), batch["label"], batch["sample_id"])``. Wrap the
    dataset in its own order (the order the client's setup phase saw), before any
    shuffling DataLoader."""
    return SampleIds(dataset, key)
