"""Turn a validated ``data`` config into a :class:`Federation` (I/O lives here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedplug.data.federation import DEFAULT_CACHE_CLIENTS, ClientArrays, Federation
from fedplug.data.partitions import flat_indices
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


def build_federation(
    data_config: Any,
    registry: Registry,
    device: torch.device | str = "cpu",
    *,
    dataset: Any = None,
    partition: Any = None,
    cache_clients: int = DEFAULT_CACHE_CLIENTS,
) -> Federation:
    """Load (or take) the dataset and partition; the federation keeps their arrays and
    builds a client's tensors when it is first asked for (:class:`ClientArrays`: client
    k's samples are shuffled by the generator ``[data.seed, k, 0x7E57]``, its local test
    split and then its validation split (``data.validation_fraction``) cut off, its
    feature noise drawn; the last ``cache_clients`` clients built are
    kept)."""
    if dataset is None:
        dataset = load_dataset(data_config, registry)
    if partition is None:
        partition = make_partition(dataset, data_config, registry)
    device = torch.device(device)
    indices, offsets = flat_indices(partition.client_indices)
    clients = ClientArrays(
        np.asarray(dataset.train_x),
        np.asarray(dataset.train_y, dtype=np.int64),
        indices,
        offsets,
        num_classes=dataset.num_classes,
        seed=data_config.seed,
        local_test_fraction=data_config.local_test_fraction,
        validation_fraction=getattr(data_config, "validation_fraction", 0.0),
        noise_std=partition.noise_std,
        device=device,
        cache_clients=cache_clients,
    )
    return Federation(
        clients=clients,
        test_x=torch.as_tensor(dataset.test_x, dtype=torch.float32).to(device),
        test_y=torch.as_tensor(dataset.test_y, dtype=torch.long).to(device),
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.input_shape),
        dataset_name=dataset.name,
    )
