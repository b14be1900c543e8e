"""Flower Datasets' partitioners as a fedplug partitioner: ``data.partition.name: flwr``.

Any row partitioner of ``flwr_datasets.partitioner`` splits a fedplug dataset; client k
holds exactly the rows flwr-datasets' own ``load_partition(k)`` returns. Registered only
when flwr-datasets is installed. Use: docs/flower.md, "Flower Datasets' partitioners in
`fedplug run`"; how it works: docs/algorithms.md, "Flower Datasets' partitioners".
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from fedplug.components import ComponentConfig
from fedplug.data.partitions import Partition, class_counts_of
from fedplug.data.partitions.sampling import _check_request
from fedplug.errors import DataError
from fedplug.hookspecs import RegisterPartitioner, hookimpl

LABEL_COLUMN = "label"
USER_COLUMN = "user"
INDEX_COLUMN = "fedplug_index"
"""Columns of the ``datasets.Dataset`` handed to the flwr-datasets partitioner."""

FILLED_BY_FEDPLUG = ("num_partitions",)
"""Constructor arguments fedplug sets itself (from ``data.num_clients``)."""


def flwr_datasets_installed() -> bool:
    """Whether ``flwr_datasets`` can be imported (without importing it)."""
    return importlib.util.find_spec("flwr_datasets") is not None


@functools.cache
def available_partitioners() -> dict[str, type]:
    """The row partitioners of ``flwr_datasets.partitioner`` by class name.

    Read from the installed package, so partitioners added in a later flwr-datasets
    release are offered too. The vertical partitioners split columns, not samples.
    """
    from flwr_datasets import partitioner as module

    classes = {}
    for name in getattr(module, "__all__", dir(module)):
        candidate = getattr(module, name, None)
        if (
            isinstance(candidate, type)
            and issubclass(candidate, module.Partitioner)
            and not inspect.isabstract(candidate)
            and not name.startswith("Vertical")
        ):
            classes[name] = candidate
    return classes


def _constructor_parameters(partitioner_class: type) -> dict[str, inspect.Parameter]:
    signature = inspect.signature(partitioner_class.__init__)
    return {name: parameter for name, parameter in signature.parameters.items() if name != "self"}


class FlwrPartitionConfig(ComponentConfig):
    """A Flower Datasets partitioner (flwr_datasets.partitioner) by class name, with its own parameters."""

    name: Literal["flwr"] = "flwr"
    partitioner: str = "IidPartitioner"
    """Class name in ``flwr_datasets.partitioner`` (default ``IidPartitioner``), e.g.
    ``DirichletPartitioner``, ``ShardPartitioner``, ``PathologicalPartitioner``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the partitioner (default none). ``num_partitions`` comes from
    ``data.num_clients``; ``partition_by`` defaults to ``label``; ``seed``, if left out,
    is drawn from ``data.seed``."""

    @field_validator("partitioner")
    @classmethod
    def _known_partitioner(cls, value: str) -> str:
        available = available_partitioners()
        if value not in available:
            raise ValueError(
                f"unknown flwr-datasets partitioner {value!r}; available: {', '.join(sorted(available))}"
            )
        return value

    @model_validator(mode="after")
    def _params_fit_the_partitioner(self) -> "FlwrPartitionConfig":
        partitioner_class = available_partitioners()[self.partitioner]
        accepted = _constructor_parameters(partitioner_class)
        for key in self.params:
            if key in FILLED_BY_FEDPLUG:
                raise ValueError(
                    f"params.{key}: fedplug sets it from data.num_clients; remove it from params"
                )
            if key not in accepted:
                raise ValueError(
                    f"params.{key}: {self.partitioner} has no such parameter; its parameters: "
                    f"{', '.join(name for name in accepted if name not in FILLED_BY_FEDPLUG)}"
                )
        missing = [
            name
            for name, parameter in accepted.items()
            if parameter.default is inspect.Parameter.empty
            and name not in self.params
            and name not in FILLED_BY_FEDPLUG
            and name != "partition_by"
            and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if missing:
            raise ValueError(f"{self.partitioner} needs params.{', params.'.join(missing)}")
        partition_by = self.params.get("partition_by", LABEL_COLUMN)
        if "partition_by" in accepted and partition_by not in (LABEL_COLUMN, USER_COLUMN):
            raise ValueError(
                f"params.partition_by: {partition_by!r} is not a column; fedplug's columns are "
                f"{LABEL_COLUMN!r} and {USER_COLUMN!r} (the writer of each sample)"
            )
        return self


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def build_partitioner(
    config: FlwrPartitionConfig, num_clients: int, rng: np.random.Generator
) -> Any:
    """The flwr-datasets partitioner ``config`` names, with fedplug's arguments filled in."""
    partitioner_class = available_partitioners()[config.partitioner]
    accepted = _constructor_parameters(partitioner_class)
    arguments = dict(config.params)
    if "num_partitions" in accepted:
        arguments["num_partitions"] = num_clients
    if "partition_by" in accepted:
        arguments.setdefault("partition_by", LABEL_COLUMN)
    if "seed" in accepted and "seed" not in arguments:
        arguments["seed"] = int(rng.integers(2**32))
    try:
        return partitioner_class(**arguments)
    except (ValueError, TypeError) as error:
        raise DataError(f"flwr-datasets {config.partitioner}: {_one_line(error)}") from None


def flwr_partition(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    config: FlwrPartitionConfig,
    rng: np.random.Generator,
    users: np.ndarray | None = None,
) -> Partition:
    """Split the training set with the flwr-datasets partitioner ``config`` names.

    Client k holds the rows of ``load_partition(k)``, in flwr-datasets' order. Samples
    the partitioner leaves out (``ShardPartitioner`` without ``keep_incomplete_shard``)
    are on no client. Raises :class:`DataError` in one line when the partitioner refuses
    the split, makes another number of partitions than ``num_clients``, or puts a sample
    on two clients.
    """
    from datasets import Dataset

    labels = _check_request(labels, num_classes, num_clients)
    partition_by = config.params.get("partition_by", LABEL_COLUMN)
    if partition_by == USER_COLUMN and users is None:
        raise DataError(
            "flwr partition_by: user needs the writer of every sample, and this dataset has none: "
            "pick a dataset with users (e.g. femnist) or partition_by: label"
        )
    columns: dict[str, Any] = {
        LABEL_COLUMN: labels,
        INDEX_COLUMN: np.arange(labels.size, dtype=np.int64),
    }
    if users is not None:
        columns[USER_COLUMN] = np.asarray(users)
    partitioner = build_partitioner(config, num_clients, rng)
    where = f"flwr-datasets {config.partitioner}"
    try:
        with warnings.catch_warnings():
            # DirichletPartitioner warns on every redraw and pyarrow on ShardPartitioner's
            # sort; the outcome (a split or one error line) is what the user needs.
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            partitioner.dataset = Dataset.from_dict(columns)
            made = partitioner.num_partitions
            if made != num_clients:
                raise DataError(
                    f"{where} makes {made} partitions but data.num_clients is {num_clients}: "
                    f"set data.num_clients to {made} or change the partitioner's params"
                )
            client_indices = [
                np.asarray(partitioner.load_partition(k)[INDEX_COLUMN], dtype=np.int64)
                for k in range(num_clients)
            ]
    except DataError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as error:
        raise DataError(f"{where} cannot make this split: {_one_line(error)}") from None
    every = np.concatenate(client_indices) if client_indices else np.empty(0, dtype=np.int64)
    if np.bincount(every, minlength=labels.size).max(initial=0) > 1:
        raise DataError(f"{where} put a sample on more than one client; check its params")
    return Partition(
        client_indices=client_indices,
        class_counts=class_counts_of(labels, client_indices, num_classes),
    )


@hookimpl
def fedplug_register_partitioners(register: RegisterPartitioner) -> None:
    # Registers nothing, without error, when flwr-datasets is not installed: `flwr` then
    # shows up in neither `fedplug list` nor the config's list of partitioners.
    if flwr_datasets_installed():
        register(FlwrPartitionConfig, flwr_partition)
