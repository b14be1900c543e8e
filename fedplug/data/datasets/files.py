"""What the loaders share: a pickle reader that runs no code, the IDX format of the
MNIST-style datasets, and fetching missing files with torchvision."""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedplug.data.datasets.dataset import Dataset
from fedplug.errors import DataError
from fedplug.safe_files import open_regular

REDOWNLOAD_HINT = (
    "delete it and load the dataset again with `download: true` (or re-run the pipeline's "
    "download stage) to fetch a fresh copy"
)


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


@contextmanager
def open_data_file(path: Path, hint: str = REDOWNLOAD_HINT) -> Iterator[BinaryIO]:
    """``path`` open for binary reading, through gzip when it ends in ``.gz``; anything but
    a regular file (a FIFO, a device) is refused in one line ending with ``hint``, without
    waiting on it (:func:`fedplug.safe_files.open_regular`)."""
    with open_regular(path, what="dataset file", advice=hint, error=DataError) as raw:
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as unpacked:
                yield unpacked  # type: ignore[misc]
        else:
            yield raw


def read_pickle(path: Path, hint: str = REDOWNLOAD_HINT) -> Any:
    """Read a (possibly gzipped) pickle of numpy arrays, as Python 2 era datasets ship
    them (``latin1`` decoding). Raises :class:`~fedplug.errors.DataError` naming ``path``
    and ending with ``hint`` (default: delete and download again) when it cannot be read."""
    try:
        with open_data_file(path, hint) as stream:
            return _ArrayUnpickler(stream, encoding="latin1").load()
    except DataError:
        raise
    except Exception as error:  # every way a damaged pickle can fail
        raise DataError(f"{path} is not a readable pickle ({error}); {hint}") from error


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (``*-ubyte``, optionally ``.gz``) into a uint8 array.

    The format (LeCun's MNIST page): two zero bytes, a type byte (0x08 = unsigned byte, the
    only type MNIST-style datasets use), the number of dimensions ``d``, then ``d``
    big-endian uint32 sizes, then the data in C order.
    """
    try:
        with open_data_file(path) as stream:
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


def find_or_download_idx_files(
    folder: Path, root: Path, torchvision_name: str, download: bool, what: str, put: str
) -> dict[str, Path]:
    """The four IDX files in ``folder``; when one is missing and ``download`` is set,
    torchvision's ``torchvision_name`` dataset fetches them into ``folder`` (under
    ``root``) first.

    Raises:
        DataError: still missing: :func:`missing_files_error` for ``what``, saying ``put``
            (where the files go) and why the download failed, if it did.
    """
    files = _find_idx_files(folder)
    reason = None
    if files is None and download:
        reason = _torchvision_download(torchvision_name, root, folder)
        files = _find_idx_files(folder)
    if files is None:
        raise missing_files_error(what, put, reason, download)
    return files


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
