"""CIFAR-10: read from the official python pickles, downloaded through torchvision when
missing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from fedplug.components import ComponentConfig
from fedplug.data.datasets.dataset import Dataset
from fedplug.data.datasets.files import (
    REDOWNLOAD_HINT,
    _to_unit_float,
    _torchvision_download,
    missing_files_error,
    read_pickle,
)
from fedplug.errors import DataError


class Cifar10Config(ComponentConfig):
    """CIFAR-10: 60,000 colour 32x32 images (50k train, 10k test), 10 classes.

    Read from the official python pickles in ``root/cifar-10-batches-py/``, downloaded
    through torchvision when missing. Shape ``(3, 32, 32)``, pixels ``byte / 255``.
    """

    name: Literal["cifar10"] = "cifar10"
    download: bool = True
    """(default true) Fetch missing files with torchvision (needs internet); false raises an
    error explaining where to put them."""


CIFAR10_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{index}" for index in range(1, 6))
CIFAR10_FILES = (*CIFAR10_TRAIN_BATCHES, "test_batch", "batches.meta")


def cifar10_folder(root: Path) -> Path:
    """Where the CIFAR-10 batches live: ``root/cifar-10-batches-py``."""
    return Path(root) / "cifar-10-batches-py"


def _cifar10_ready(folder: Path) -> bool:
    return all((folder / file_name).is_file() for file_name in CIFAR10_FILES)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch: a dict with ``data`` (n x 3072 uint8, channel-major) and ``labels``."""
    batch = read_pickle(path)
    try:
        pixels = np.asarray(batch["data"])
        labels = np.asarray(batch["labels"], dtype=np.int64)
    except (TypeError, KeyError, IndexError, ValueError) as error:
        raise DataError(
            f"{path} is not a CIFAR-10 batch (no 'data' and 'labels': {error}); {REDOWNLOAD_HINT}"
        ) from error
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{path} holds data of dtype {pixels.dtype} and shape {pixels.shape}, expected "
            f"uint8 (n, 3072); {REDOWNLOAD_HINT}"
        )
    out_of_range = labels.size > 0 and (labels.min() < 0 or labels.max() > 9)
    if labels.shape != (pixels.shape[0],) or out_of_range:
        raise DataError(
            f"{path} holds {labels.shape} labels for {pixels.shape[0]} images, or labels "
            f"outside 0..9; {REDOWNLOAD_HINT}"
        )
    return pixels, labels


def load_cifar10(config: Cifar10Config, root: Path) -> Dataset:
    """Load CIFAR-10 from the official python pickles, downloading them first if missing
    and allowed. Shape ``(3, 32, 32)``, pixels ``byte / 255``."""
    root = Path(root)
    folder = cifar10_folder(root)
    reason = None
    if not _cifar10_ready(folder) and config.download:
        reason = _torchvision_download("CIFAR10", root, root)
    if not _cifar10_ready(folder):
        put = (
            f"extract cifar-10-python.tar.gz from {CIFAR10_SOURCE} into {root}, so that {folder} holds "
            f"{', '.join(CIFAR10_FILES)}"
        )
        raise missing_files_error("CIFAR-10", put, reason, config.download)
    meta = read_pickle(folder / "batches.meta")
    if not isinstance(meta, dict) or len(meta.get("label_names", ())) != 10:
        raise DataError(
            f"{folder / 'batches.meta'} does not list CIFAR-10's 10 label_names; {REDOWNLOAD_HINT}"
        )
    train = [_read_cifar_batch(folder / file_name) for file_name in CIFAR10_TRAIN_BATCHES]
    test_pixels, test_labels = _read_cifar_batch(folder / "test_batch")
    return Dataset(
        name="cifar10",
        train_x=_to_unit_float(np.concatenate([pixels for pixels, _ in train]), (3, 32, 32)),
        train_y=np.concatenate([labels for _, labels in train]),
        test_x=_to_unit_float(test_pixels, (3, 32, 32)),
        test_y=test_labels,
        num_classes=10,
        input_shape=(3, 32, 32),
    ).validate(folder)


def prepare_cifar10(config: Cifar10Config, root: Path) -> list[Path]:
    """Download if missing and check; leaves the seven files of ``cifar-10-batches-py``
    (torchvision also keeps ``root/cifar-10-python.tar.gz`` when it downloads)."""
    load_cifar10(config, root)
    return [cifar10_folder(Path(root)) / file_name for file_name in CIFAR10_FILES]
