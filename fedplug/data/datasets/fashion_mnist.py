"""Fashion-MNIST: read from its four official IDX files, downloaded through torchvision
when missing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fedplug.components import ComponentConfig
from fedplug.data.datasets.dataset import Dataset
from fedplug.data.datasets.files import (
    _idx_dataset,
    _read_idx_set,
    find_or_download_idx_files,
    idx_files_wanted,
)


class FashionMnistConfig(ComponentConfig):
    """Fashion-MNIST: 70,000 grey 28x28 clothing images (60k train, 10k test), 10 classes.

    Read from the four official IDX files in ``root/FashionMNIST/raw/`` (``.gz`` or not),
    downloaded through torchvision when missing. Pixels are ``byte / 255``.
    """

    name: Literal["fashion_mnist"] = "fashion_mnist"
    download: bool = True
    """(default true) Fetch missing files with torchvision (needs internet); false raises an
    error explaining where to put them."""


FASHION_MNIST_SOURCE = "https://github.com/zalandoresearch/fashion-mnist (its data/fashion folder)"


def fashion_mnist_folder(root: Path) -> Path:
    """Where torchvision's ``FashionMNIST`` keeps the IDX files: ``root/FashionMNIST/raw``."""
    return Path(root) / "FashionMNIST" / "raw"


def _fashion_mnist_files(config: FashionMnistConfig, root: Path) -> dict[str, Path]:
    folder = fashion_mnist_folder(root)
    put = idx_files_wanted(folder, FASHION_MNIST_SOURCE)
    return find_or_download_idx_files(
        folder, Path(root), "FashionMNIST", config.download, "Fashion-MNIST", put
    )


def load_fashion_mnist(config: FashionMnistConfig, root: Path) -> Dataset:
    """Load Fashion-MNIST from its IDX files, downloading them first if missing and
    allowed. Shape ``(1, 28, 28)``, pixels ``byte / 255``."""
    files = _fashion_mnist_files(config, root)
    arrays = _read_idx_set(files, num_classes=10)
    return _idx_dataset("fashion_mnist", arrays, files["train_x"].parent)


def prepare_fashion_mnist(config: FashionMnistConfig, root: Path) -> list[Path]:
    """Download if missing and check; leaves the four IDX files it read (torchvision keeps
    both the ``.gz`` and the extracted files in the same folder)."""
    load_fashion_mnist(config, root)
    return sorted(_fashion_mnist_files(config, root).values())
