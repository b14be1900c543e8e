"""The result of a partitioner: :class:`Partition` (each client's sample indices, held
compactly by :class:`ClientIndices`, and the K x C class counts), and its ``.npz`` file."""

from __future__ import annotations

import operator
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from fedplug.errors import DataError
from fedplug.output_folder import default_file_mode
from fedplug.safe_files import load_npz


class ClientIndices(Sequence[np.ndarray]):
    """K clients' index arrays held as one flat int64 array and K + 1 offsets: client k
    is ``flat[offsets[k]:offsets[k + 1]]`` (a view). Reads like a list of K arrays,
    without one Python object per client."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat = np.asarray(flat, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)

    @classmethod
    def from_sizes(cls, flat: np.ndarray, sizes: np.ndarray) -> ClientIndices:
        """``flat`` cut into consecutive parts of ``sizes``."""
        return cls(flat, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        client = operator.index(index)
        if client < 0:
            client += len(self)
        if not 0 <= client < len(self):
            raise IndexError(f"client {index} is out of range; there are {len(self)} clients")
        return self.flat[self.offsets[client] : self.offsets[client + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for client in range(len(self)):
            yield self.flat[self.offsets[client] : self.offsets[client + 1]]


def flat_indices(client_indices: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``client_indices`` as one int64 array and K + 1 offsets (no copy for a
    :class:`ClientIndices`)."""
    if isinstance(client_indices, ClientIndices):
        return client_indices.flat, client_indices.offsets
    parts = [np.asarray(indices, dtype=np.int64).reshape(-1) for indices in client_indices]
    sizes = np.array([len(part) for part in parts], dtype=np.int64)
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return flat, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Partition:
    """A split of a training set over K clients.

    ``eq=False`` because numpy arrays have no single truth value; compare partitions
    field by field.
    """

    client_indices: Sequence[np.ndarray]
    """One int64 array per client: the indices into the training set it holds (a list,
    or a :class:`ClientIndices`, as the built-in partitioners return)."""
    class_counts: np.ndarray
    """K x C int64 matrix N: ``class_counts[k, c]`` samples of class c on client k."""
    noise_std: np.ndarray | None = None
    """Per-client standard deviation of Gaussian input noise (length K), set only by
    ``feature_noise``; ``None`` means clean inputs."""

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """n_k of every client (length K, int64)."""
        if isinstance(self.client_indices, ClientIndices):
            return np.diff(self.client_indices.offsets)
        return np.array([len(indices) for indices in self.client_indices], dtype=np.int64)

    def validate(self, num_samples: int) -> None:
        """Check the partition against a training set of ``num_samples`` samples.

        Raises :class:`DataError` when an index is out of range, a sample sits on two
        clients, or ``class_counts``/``noise_std`` disagree with the client lists.
        """
        regenerate = "re-run the partition stage to regenerate it"
        if self.class_counts.ndim != 2 or self.class_counts.shape[0] != self.num_clients:
            raise DataError(
                f"partition has {self.num_clients} clients but class_counts has shape "
                f"{self.class_counts.shape}; {regenerate}"
            )
        if not np.array_equal(self.class_counts.sum(axis=1), self.sizes):
            raise DataError(
                f"partition class_counts rows do not add up to client sizes; {regenerate}"
            )
        if self.noise_std is not None and self.noise_std.shape != (self.num_clients,):
            raise DataError(
                f"partition noise_std has shape {self.noise_std.shape}, expected "
                f"({self.num_clients},); {regenerate}"
            )
        every = flat_indices(self.client_indices)[0]
        if every.size and (every.min() < 0 or every.max() >= num_samples):
            raise DataError(
                f"partition indexes samples outside 0..{num_samples - 1}: it was made for "
                f"another dataset; {regenerate}"
            )
        if np.bincount(every, minlength=num_samples).max(initial=0) > 1:
            raise DataError(f"partition puts a sample on more than one client; {regenerate}")


def _how_to_regenerate(path: Path) -> str:
    return (
        f"delete {path} and re-run the partition stage (e.g. `dvc repro partition`) "
        "to regenerate it"
    )


def save_partition(path: str | os.PathLike[str], partition: Partition) -> None:
    """Write ``partition`` to one ``.npz`` file at exactly ``path``.

    Keys: ``indices`` (all clients' indices concatenated, int64), ``offsets`` (K+1 int64:
    client k is ``indices[offsets[k]:offsets[k+1]]``), ``class_counts`` (K x C int64) and,
    when set, ``noise_std`` (K float64). The file is written beside ``path`` and renamed
    into place, so a crash never leaves a half-written partition.
    """
    path = Path(path)
    flat, offsets = flat_indices(partition.client_indices)
    arrays: dict[str, np.ndarray] = {
        "indices": flat,
        "offsets": offsets,
        "class_counts": np.asarray(partition.class_counts, dtype=np.int64),
    }
    if partition.noise_std is not None:
        arrays["noise_std"] = np.asarray(partition.noise_std, dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(handle, default_file_mode())
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)  # type: ignore[arg-type]
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_partition(path: str | os.PathLike[str]) -> Partition:
    """Read a partition written by :func:`save_partition`.

    Raises :class:`DataError` naming ``path`` when the file is missing, not a regular file
    (a FIFO is refused without waiting on it), unreadable, has an array header claiming
    more than the file holds (refused before anything is allocated:
    :func:`fedplug.safe_files.load_npz`), or is inconsistent (offsets that do not cover
    the indices, negative or fractional class counts, counts that do not match the client
    sizes, negative indices, noise that is not finite and non-negative).
    """
    path = Path(path)
    advice = _how_to_regenerate(path)
    try:
        arrays = load_npz(path, what="partition file", advice=advice)
    except FileNotFoundError:
        raise DataError(f"partition file {path} does not exist; {advice}") from None
    missing = {"indices", "offsets", "class_counts"} - set(arrays)
    if missing:
        raise DataError(
            f"partition file {path} is corrupt or not a fedplug partition (it lacks "
            f"{', '.join(sorted(missing))}); {advice}"
        )
    indices, offsets, class_counts = arrays["indices"], arrays["offsets"], arrays["class_counts"]
    noise_std = arrays.get("noise_std")
    problem = _inconsistency(indices, offsets, class_counts, noise_std)
    if problem is not None:
        raise DataError(f"partition file {path} is inconsistent ({problem}); {advice}")
    return Partition(
        client_indices=ClientIndices(indices.astype(np.int64, copy=False), offsets),
        class_counts=class_counts.astype(np.int64, copy=False),
        noise_std=None if noise_std is None else noise_std.astype(np.float64, copy=False),
    )


def _inconsistency(
    indices: np.ndarray, offsets: np.ndarray, class_counts: np.ndarray, noise_std: np.ndarray | None
) -> str | None:
    """What in a loaded partition's arrays cannot be a partition, or None."""
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        return "indices are not a vector of integers"
    if indices.size and indices.min() < 0:
        return "indices below 0"
    if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
        return "offsets are not a vector of integers"
    if offsets[0] != 0 or offsets[-1] != indices.size or np.any(np.diff(offsets) < 0):
        return "offsets do not cover the indices in order"
    if class_counts.ndim != 2 or class_counts.shape[0] != offsets.size - 1:
        return f"class counts of shape {class_counts.shape} for {offsets.size - 1} clients"
    if not np.issubdtype(class_counts.dtype, np.integer) or (class_counts.size and class_counts.min() < 0):
        return "class counts that are not non-negative integers"
    if class_counts.size and class_counts.max() > indices.size:  # before summing: no wrap-around
        return f"a class count above the {indices.size} samples it indexes"
    if not np.array_equal(class_counts.sum(axis=1, dtype=np.int64), np.diff(offsets)):
        return "class counts do not add up to the client sizes"
    if noise_std is not None and (
        noise_std.shape != (offsets.size - 1,)
        or not np.issubdtype(noise_std.dtype, np.floating)
        or not np.all(np.isfinite(noise_std))
        or np.any(noise_std < 0)
    ):
        return "noise_std is not one finite, non-negative value per client"
    return None
