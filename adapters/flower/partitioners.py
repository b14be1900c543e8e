"""fedplug's partitioners as Flower Datasets partitioners (``flwr_datasets.partitioner``).

:class:`FedplugPartitioner` is a ``flwr_datasets.partitioner.Partitioner``: its
``load_partition(k)`` returns client k's rows of any registered fedplug partitioner, the
split ``fedplug run`` makes for the same ``num_clients``, ``seed`` and ``partition``
(with ``noise_column`` for partitioners that change inputs, such as ``feature_noise``).
Guide: docs/flower.md, 'fedplug's partitioners in your Flower app'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import datasets
import numpy as np
from flwr_datasets.partitioner import Partitioner
from pydantic import ValidationError

from fedplug.components import ComponentConfig
from fedplug.config import format_validation_error
from fedplug.data.build import make_partition
from fedplug.data.partitions import Partition, add_feature_noise
from fedplug.errors import ConfigError, DataError
from fedplug.registry import Registry

NOISE_SEED_TAG = 0x7E57
"""Same tag as the per-client generator of :func:`fedplug.data.build.build_federation`."""


def partition_config(
    partition: Mapping[str, Any] | ComponentConfig | str, registry: Registry
) -> ComponentConfig:
    """Validate ``partition`` (``"iid"``, ``{"name": "llt", "alpha_l": 0.9}``, or a config
    object) against the registered partitioners; :class:`ConfigError` in one line per
    problem otherwise."""
    if isinstance(partition, ComponentConfig):
        return partition
    data = {"name": partition} if isinstance(partition, str) else dict(partition)
    name = data.get("name")
    if not isinstance(name, str):
        raise ConfigError(
            f"partition needs a 'name'; registered partitioners: {', '.join(registry.names('partitioners'))}"
        )
    config_class = registry.get("partitioners", name).config_class
    try:
        return config_class.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            "invalid partition: " + format_validation_error(error, data).replace("\n", "; ")
        ) from None


@dataclass(frozen=True)
class _Columns:
    """The dataset columns a partitioner reads: the labels, the writers (``natural``) and
    the input that receives a noisy partition's noise."""

    partition_by: str
    users: str | None
    noise: str | None


class FedplugPartitioner(Partitioner):
    """A fedplug partitioner as a Flower Datasets ``Partitioner``.

    Parameters
    ----------
    num_partitions : int
        K, the number of clients (fedplug's ``data.num_clients``).
    partition : mapping, str or ComponentConfig
        fedplug's ``data.partition``: a registered partitioner's name and parameters,
        e.g. ``{"name": "dirichlet_class", "alpha": 0.5, "min_size": 10}``. Validated
        strictly when the partitioner is made (a typo is a ``ConfigError``).
    partition_by : str (default ``"label"``)
        The column of integer class ids 0..C-1 (a ``ClassLabel`` column works as is).
    seed : int (default 0)
        fedplug's ``data.seed``: the same seed gives the same split as ``fedplug run``.
    num_classes : int, optional (default: the ``ClassLabel``'s count, else max label + 1)
        C; it matters to ``llt`` (K must be a multiple of C) and to the class counts.
    users_column : str, optional (default none)
        The column naming each sample's writer, for the ``natural`` partitioner.
    noise_column : str, optional (default none)
        The input column that receives a noisy partitioner's Gaussian noise (see the
        module docstring); required when the partition has noise.
    registry : Registry, optional (default: the installed plugins')
        Where partitioner names are looked up.
    """

    def __init__(
        self,
        num_partitions: int,
        partition: Mapping[str, Any] | ComponentConfig | str,
        *,
        partition_by: str = "label",
        seed: int = 0,
        num_classes: int | None = None,
        users_column: str | None = None,
        noise_column: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
            raise ValueError(f"num_partitions must be a positive int, got {num_partitions!r}")
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        # What make_partition reads of a data config: K, the seed and the partition.
        self._data_config = SimpleNamespace(
            num_clients=num_partitions, seed=seed, partition=partition_config(partition, registry)
        )
        self._registry = registry
        self._columns = _Columns(partition_by, users_column, noise_column)
        self._num_classes = num_classes
        self._partition: Partition | None = None

    @property
    def num_partitions(self) -> int:
        """K, the number of partitions."""
        return self._data_config.num_clients

    @property
    def partition_config(self) -> ComponentConfig:
        """The validated fedplug partition config."""
        return self._data_config.partition

    @property
    def partition(self) -> Partition:
        """fedplug's :class:`Partition` of the assigned dataset (computed once):
        ``client_indices[k]`` are the dataset rows of partition k, ``class_counts`` the
        K x C class counts, ``noise_std`` the per-client input noise or ``None``."""
        if self._partition is None:
            self._partition = self._make_partition()
        return self._partition

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """Client ``partition_id``'s rows, in fedplug's order, with its input noise
        applied to ``noise_column`` when the partition has noise."""
        if not isinstance(partition_id, (int, np.integer)) or not 0 <= partition_id < self.num_partitions:
            raise ValueError(
                f"partition_id must be an int in 0..{self.num_partitions - 1}, got {partition_id!r}"
            )
        partition = self.partition
        rows = self.dataset.select(partition.client_indices[partition_id])
        if partition.noise_std is None:
            return rows
        noise_std = float(partition.noise_std[partition_id])
        rng = np.random.default_rng([self._data_config.seed, int(partition_id), NOISE_SEED_TAG])
        return _with_noise(rows, self._columns.noise or "", noise_std, rng)

    # ---------------------------------------------------------------------- internals

    def _make_partition(self) -> Partition:
        dataset, columns, config = self.dataset, self._columns, self._data_config.partition
        _require_column(dataset, "partition_by", columns.partition_by)
        labels = _column(dataset, columns.partition_by)
        if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
            raise ValueError(
                f"column {columns.partition_by!r} must hold integer class ids; convert it with "
                f"dataset.class_encode_column({columns.partition_by!r})"
            )
        users = None
        if columns.users is not None:
            _require_column(dataset, "users_column", columns.users)
            # fedplug's writers are indices into the sorted writer ids.
            _, users = np.unique(_column(dataset, columns.users), return_inverse=True)
            users = users.reshape(-1).astype(np.int64)
        fedplug_dataset = SimpleNamespace(
            name="flwr-datasets dataset",
            train_y=labels.astype(np.int64, copy=False),
            num_classes=self._class_count(labels),
            train_users=users,
        )
        partition: Partition = make_partition(fedplug_dataset, self._data_config, self._registry)
        if partition.num_clients != self.num_partitions:
            raise DataError(
                f"partitioner {config.name!r} made {partition.num_clients} partitions, "
                f"not num_partitions={self.num_partitions}"
            )
        if partition.noise_std is not None and np.any(partition.noise_std > 0):
            if columns.noise is None:
                raise DataError(
                    f"partition {config.name!r} adds Gaussian noise to each client's inputs; "
                    "pass noise_column='<input column>' so load_partition applies it"
                )
            _require_column(dataset, "noise_column", columns.noise)
        return partition

    def _class_count(self, labels: np.ndarray) -> int:
        if self._num_classes is not None:
            return int(self._num_classes)
        feature = self.dataset.features.get(self._columns.partition_by)
        if isinstance(feature, datasets.ClassLabel):
            return int(feature.num_classes)
        return int(labels.max()) + 1 if labels.size else 1


def _require_column(dataset: datasets.Dataset, option: str, column: str) -> None:
    """Refuse ``option=column`` when the dataset has no such column, listing its columns."""
    if column not in dataset.column_names:
        raise ValueError(
            f"{option}={column!r} is not a column of the dataset; its columns: "
            f"{', '.join(dataset.column_names)}"
        )


def _column(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """One column as a numpy array, without decoding the other columns (images)."""
    return np.asarray(dataset.select_columns([column]).with_format("numpy")[:][column])


def _with_noise(
    rows: datasets.Dataset, column: str, noise_std: float, rng: np.random.Generator
) -> datasets.Dataset:
    """``rows`` with ``clip(x + N(0, noise_std^2), 0, 1)`` in ``column`` (uint8 and
    images through a 1/255 scale and back); the column keeps its feature type."""
    values = _column(rows, column)
    if values.dtype == object:
        raise ValueError(
            f"noise_column {column!r} holds values of different shapes; feature_noise needs "
            "inputs of one shape (resize the images first)"
        )
    if np.issubdtype(values.dtype, np.integer):
        noisy = add_feature_noise(values.astype(np.float32) / 255.0, noise_std, rng)
        values = np.rint(noisy * 255.0).astype(np.uint8)
    else:
        values = add_feature_noise(values, noise_std, rng)
    feature = rows.features[column]
    encoded = rows.features.encode_column(list(values), column)
    return (
        rows.remove_columns(column)
        .add_column(column, encoded, feature=feature)
        .select_columns(list(rows.column_names))
    )
