"""Per-round checkpoints, written atomically so a crash never leaves a torn file, and read
back without running code from the file.

:func:`save_checkpoint` stores a state that ``torch.load(weights_only=True)`` can read
(numpy values as tagged tensors, :func:`to_storable`); :func:`load_checkpoint` checks
size, fingerprint and structure before anything copies what it read.
Design and formats: docs/reliability.md, 'Design notes: checkpoint'.
"""

from __future__ import annotations

import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from fedplug.errors import FedplugError, PluginError, TrainingError
from fedplug.run.checkpoint_bounds import ADVICE, check_file_size, check_structure
from fedplug.safe_files import open_regular

CHECKPOINT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Formats :func:`load_checkpoint` reads (see the module docstring)."""

NDARRAY_TAG = "__fedplug_ndarray__"
NUMPY_SCALAR_TAG = "__fedplug_numpy_scalar__"

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_REFUSED_NAME = re.compile(r"GLOBAL (\S+) was not an allowed global|whose module (\S+) is blocked")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` via a unique temporary file in the same folder and an
    atomic rename (:func:`fedplug.output_folder.write_atomically`: two writers never share
    a temporary name, and a symlink planted at either name is never written through).

    Raises:
        PluginError: the state holds a value a weights-only load would refuse (the
            message names where it sits, e.g. ``state['aggregator']['rng']``).
        OutputError: the disk is full; the previous checkpoint is kept.
    """
    from fedplug.output_folder import write_atomically

    storable = to_storable({"version": CHECKPOINT_VERSION, **state}, "state")
    write_atomically(path, lambda handle: torch.save(storable, handle), what="checkpoint")


def read_checkpoint(path: Path) -> Any:
    """Whatever ``path`` holds, read without running code (numpy values restored).

    Raises:
        TrainingError: the file is unreadable, or names a class or function other than
            tensors and plain values (one line naming the file; nothing of it ran).
    """
    state = load_weights_only(path, "checkpoint", "delete it to start over")
    check_structure(path, state, os.stat(path).st_size)
    return from_storable(state)


def load_checkpoint(path: Path, fingerprint: str, max_bytes: int | None = None) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if there is one for this exact config, else ``None``.

    Checked in the order that keeps a crafted file cheap (see
    :mod:`fedplug.run.checkpoint_bounds`): its size against ``max_bytes`` before it
    is read; then, unpickled weights only with shared references still shared, its
    fingerprint and format; then its structure (depth, expanded size, tensors within their
    storage); only then are numpy values restored, which copies the tree. Whether its
    content fits the run (keys, types, shapes, finite values) is
    :meth:`fedplug.run.state.RunState.from_dict`'s check.

    Args:
        path: the checkpoint file.
        fingerprint: the run's config fingerprint.
        max_bytes: the largest file a checkpoint of this run can be
            (:func:`~fedplug.run.checkpoint_bounds.checkpoint_size_bound`); None:
            no bound.

    Raises:
        TrainingError: the file is too large, unreadable or refused, is not a fedplug
            checkpoint, belongs to another config or format, is crafted to expand, or has
            no list of round records.
    """
    if not path.exists():
        return None
    check_file_size(path, max_bytes)
    state = load_weights_only(path, "checkpoint", "delete it to start over")
    if not isinstance(state, dict) or "fingerprint" not in state:
        raise TrainingError(
            f"checkpoint {str(path)!r} is not a fedplug checkpoint; delete it to start over "
            "or choose another --out"
        )
    version = state.get("version")
    if isinstance(version, int) and version > max(READABLE_VERSIONS):
        raise TrainingError(
            f"checkpoint {str(path)!r} has format {version}, newer than this fedplug reads "
            f"({max(READABLE_VERSIONS)}); upgrade fedplug, or delete it to start over"
        )
    if version not in READABLE_VERSIONS or state.get("fingerprint") != fingerprint:
        raise TrainingError(
            f"checkpoint {str(path)!r} belongs to a different config; delete it or choose "
            "another --out"
        )
    check_structure(path, state, os.stat(path).st_size)
    history = state.get("history")
    if not isinstance(history, list) or not all(isinstance(record, dict) for record in history):
        raise TrainingError(
            f"checkpoint {str(path)!r} is damaged: its 'history' is "
            f"{'missing' if history is None else 'not a list of round records'}; {ADVICE}"
        )
    return from_storable(state)


def load_weights_only(
    path: Path, what: str, advice: str, error: type[FedplugError] = TrainingError
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with one-line errors.

    Args:
        path: the file.
        what: what the file is, first word of the message (``"checkpoint"``).
        advice: what the user should do, the message's end (``"delete it to start over"``).
        error: the error class raised.

    Raises:
        ``error``: the file names a class or function a weights-only load refuses (the
            message names them: nothing of the file ran), or cannot be read at all.
    """
    # Opened here, not by torch: a FIFO planted at ``path`` is refused at once instead of
    # blocking ``torch.load`` until a writer comes.
    try:
        handle = open_regular(path, what=what, advice=advice, error=error)
    except OSError as failure:  # missing, no permission
        raise error(f"{what} {str(path)!r} is unreadable ({type(failure).__name__}); {advice}") from None
    with handle:
        return _load_opened(handle, path, what, advice, error)


def _load_opened(handle: BinaryIO, path: Path, what: str, advice: str, error: type[FedplugError]) -> Any:
    """:func:`load_weights_only` of the file already open as ``handle``."""
    try:
        return torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as failure:
        handle.seek(0)
        refused = _refused_names(handle, failure)
        if refused:
            raise error(
                f"{what} {str(path)!r} holds {', '.join(refused[:3])}, not only tensors and plain "
                f"values; fedplug does not load it because unpickling it could run code: {advice} "
                "(load only files fedplug wrote)"
            ) from None
        raise error(f"{what} {str(path)!r} is unreadable (UnpicklingError); {advice}") from None
    except Exception as failure:  # a truncated zip, a torn write, not a torch file
        kind = type(failure).__name__
        raise error(f"{what} {str(path)!r} is unreadable ({kind}); {advice}") from None


def _refused_names(handle: BinaryIO, failure: Exception) -> list[str]:
    """The globals that made a weights-only load refuse the file open as ``handle`` (read
    from the file's pickle without running it, else from torch's message); empty when it
    is just corrupt."""
    try:
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(handle))
    except Exception:  # not a zip checkpoint (garbage, or torch's legacy format)
        names = []
    if names:
        return names
    return [a or b for a, b in _REFUSED_NAME.findall(str(failure))]


# ----------------------------------------------------------------------- state values


def to_storable(value: Any, where: str) -> Any:
    """``value`` with numpy arrays and scalars replaced by tagged tensors, checked to
    hold nothing a weights-only load refuses.

    Raises:
        PluginError: a value of another type; the message names ``where`` it sits.
    """
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise _unstorable(value, where)
        return value
    if isinstance(value, np.ndarray):
        return {NDARRAY_TAG: _array_to_tensor(value, where)}
    if isinstance(value, np.generic):
        return {NUMPY_SCALAR_TAG: _array_to_tensor(np.asarray(value), where)}
    if isinstance(value, _PLAIN):
        if type(value) not in _PLAIN:  # an IntEnum, a str subclass: pickled by class
            raise _unstorable(value, where)
        return value
    if type(value) in (dict, OrderedDict):
        converted = {
            _storable_key(key, where): to_storable(item, f"{where}[{key!r}]")
            for key, item in value.items()
        }
        return OrderedDict(converted) if type(value) is OrderedDict else converted
    if type(value) in (list, tuple):
        items = [to_storable(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return items if type(value) is list else tuple(items)
    if type(value) is set:
        return {_storable_key(item, where) for item in value}
    if isinstance(value, torch.Size):
        return value
    raise _unstorable(value, where)


def from_storable(value: Any) -> Any:
    """Undo :func:`to_storable`: tagged tensors become numpy arrays and scalars again."""
    if type(value) in (dict, OrderedDict):
        if len(value) == 1:
            (tag, item), = value.items()
            if tag == NDARRAY_TAG and isinstance(item, torch.Tensor):
                return item.numpy()
            if tag == NUMPY_SCALAR_TAG and isinstance(item, torch.Tensor):
                return item.numpy()[()]
        converted = {key: from_storable(item) for key, item in value.items()}
        return OrderedDict(converted) if type(value) is OrderedDict else converted
    if type(value) is list:
        return [from_storable(item) for item in value]
    if type(value) is tuple:
        return tuple(from_storable(item) for item in value)
    return value


def _array_to_tensor(array: np.ndarray, where: str) -> torch.Tensor:
    # A native-order, writable copy: torch.from_numpy takes neither byte-swapped nor
    # read-only arrays, and the copy leaves the component's own array alone.
    native = np.array(array, dtype=array.dtype.newbyteorder("="), order="C")
    try:
        return torch.from_numpy(native)
    except TypeError:  # object, string and datetime arrays have no tensor dtype
        raise _unstorable(array, where) from None


def _storable_key(key: Any, where: str) -> Any:
    """A dict key or set member: numpy integers become ints (equal, and equally hashed)."""
    if isinstance(key, np.generic):
        return key.item()
    if type(key) in _PLAIN or (type(key) is tuple and all(type(part) in _PLAIN for part in key)):
        return key
    raise _unstorable(key, where)


def _unstorable(value: Any, where: str) -> PluginError:
    kind = type(value)
    described = f"a {kind.__module__}.{kind.__qualname__}"
    if isinstance(value, np.ndarray):
        described = f"a numpy array of dtype {value.dtype}"
    return PluginError(
        f"checkpoint {where} holds {described}, which a checkpoint cannot store safely; "
        "state_dict() must return tensors, numpy arrays of numbers and plain Python values "
        "(dict, list, tuple, str, int, float, bool, None)"
    )
