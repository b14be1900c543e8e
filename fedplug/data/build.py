"""Turn a validated ``data`` config into a :class:`Federation` (I/O lives here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedplug.data.federation import ClientData, Federation
from fedplug.data.partitions import add_feature_noise
from fedplug.errors import DataError
from fedplug.registry import Registry


def load_dataset(data_config: Any, registry: Registry) -> Any:
    """The :class:`fedplug.data.datasets.Dataset` named by ``data_config.dataset``, read
    from ``data_config.root_path()`` (a relative ``data.root`` against the config file's
    folder, :meth:`fedplug.config.DataConfigBase.root_path`), or from ``data_config.root``
    for an object without that method."""
    root_path = getattr(data_config, "root_path", None)
    root = Path(root_path()) if callable(root_path) else Path(data_config.root)
    return registry.build("datasets", data_config.dataset, root)


def make_partition(dataset: Any, data_config: Any, registry: Registry) -> Any:
    """Split ``dataset``'s training set over ``data_config.num_clients`` clients."""
    if data_config.num_clients > len(dataset.train_y):
        raise DataError(
            f"data.num_clients is {data_config.num_clients} but dataset {dataset.name!r} has only "
            f"{len(dataset.train_y)} training samples; use fewer clients"
        )
    rng = np.random.default_rng([data_config.seed, 0xDA7A])
    partitioner = registry.get("partitioners", data_config.partition.name).factory
    return partitioner(
        dataset.train_y,
        dataset.num_classes,
        data_config.num_clients,
        data_config.partition,
        rng,
        users=dataset.train_users,
    )


def split_local_test(indices: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle a client's indices and keep ``fraction`` of them (at least one sample
    stays for training) as its local test split."""
    shuffled = rng.permutation(indices)
    num_test = min(int(np.floor(fraction * len(shuffled))), max(len(shuffled) - 1, 0))
    return shuffled[num_test:], shuffled[:num_test]


def build_federation(
    data_config: Any,
    registry: Registry,
    device: torch.device | str = "cpu",
    *,
    dataset: Any = None,
    partition: Any = None,
) -> Federation:
    """Load (or take) the dataset and partition and build every client's tensors."""
    if dataset is None:
        dataset = load_dataset(data_config, registry)
    if partition is None:
        partition = make_partition(dataset, data_config, registry)
    device = torch.device(device)
    train_y = torch.as_tensor(dataset.train_y, dtype=torch.long)
    clients = []
    for client_id, indices in enumerate(partition.client_indices):
        rng = np.random.default_rng([data_config.seed, client_id, 0x7E57])
        train_ids, test_ids = split_local_test(np.asarray(indices), data_config.local_test_fraction, rng)
        x_train, x_test = dataset.train_x[train_ids], dataset.train_x[test_ids]
        if partition.noise_std is not None:
            # Feature skew: the client's inputs, local test split included, carry its noise.
            x_train = add_feature_noise(x_train, float(partition.noise_std[client_id]), rng)
            x_test = add_feature_noise(x_test, float(partition.noise_std[client_id]), rng)
        y_train = train_y[train_ids]
        clients.append(
            ClientData(
                client_id=client_id,
                train_x=torch.as_tensor(x_train, dtype=torch.float32).to(device),
                train_y=y_train.to(device),
                test_x=torch.as_tensor(x_test, dtype=torch.float32).to(device),
                test_y=train_y[test_ids].to(device),
                class_counts=np.bincount(y_train.numpy(), minlength=dataset.num_classes).astype(np.int64),
            )
        )
    return Federation(
        clients=clients,
        test_x=torch.as_tensor(dataset.test_x, dtype=torch.float32).to(device),
        test_y=torch.as_tensor(dataset.test_y, dtype=torch.long).to(device),
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
        dataset_name=dataset.name,
    )
