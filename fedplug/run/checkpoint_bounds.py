"""Bounds a checkpoint must keep before anything walks or copies it.

:func:`check_file_size` (before the file is read) and :func:`check_structure` (after the
weights-only unpickling) refuse, each with one line, a file too large for the run, a
structure nested too deep or expanding past the file's bytes, and tensors that address
more elements than their storage holds.
Design: docs/reliability.md, 'Design notes: checkpoint_bounds'.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from fedplug.errors import TrainingError

MAX_DEPTH = 100
"""Deepest nesting of containers a checkpoint may have (fedplug's own are about 6 deep)."""
NODE_ALLOWANCE = 10_000
"""Expanded nodes allowed beyond one per byte of the file (a tiny file's state)."""
SLACK_BYTES = 64 * 2**20
"""What :func:`checkpoint_size_bound` allows beyond the model-sized parts (records,
component metadata, pickle and zip overhead)."""

ADVICE = "start over with --no-resume or delete it"


def checkpoint_size_bound(model_bytes: int, num_clients: int, num_samples: int = 0, rounds: int = 0) -> int:
    """The most bytes a checkpoint of such a run can need: the global model, server state
    of up to 16 model copies (momentum, control variates, Adam's moments), two model
    copies of state per client (SCAFFOLD's control variates), 64 bytes of state per
    training sample (FedDisk's sample weights) and about 4 KB plus 640 bytes per client
    of record per round (a dropped client's id and its reason, which
    :func:`~fedplug.run.client_text.client_text` cuts to 500 characters), plus
    :data:`SLACK_BYTES`."""
    return (
        (2 * num_clients + 17) * model_bytes
        + 64 * num_samples
        + rounds * (4096 + 640 * num_clients)
        + SLACK_BYTES
    )


def check_file_size(path: Path, max_bytes: int | None) -> None:
    """Refuse ``path`` when it is larger than ``max_bytes`` (None: no bound), before it
    is read into memory."""
    if max_bytes is None:
        return
    size = os.stat(path).st_size
    if size > max_bytes:
        raise TrainingError(
            f"checkpoint {str(path)!r} is {size:,} bytes, more than a checkpoint of this run "
            f"can hold ({max_bytes:,}); it is not this run's, or damaged: {ADVICE}"
        )


def check_structure(path: Path, value: Any, file_bytes: int) -> None:
    """Refuse a loaded checkpoint whose expanded tree is deeper than :data:`MAX_DEPTH`,
    has more nodes than ``file_bytes + NODE_ALLOWANCE``, or holds a tensor addressing
    more elements than its storage; visits each distinct object once."""
    limit = file_bytes + NODE_ALLOWANCE
    expanded: dict[int, int] = {}  # id -> nodes of its expanded tree (``value`` keeps ids unique)
    # Iterative post-order: (object, depth, children pushed?)
    stack: list[tuple[Any, int, bool]] = [(value, 0, False)]
    while stack:
        item, depth, expanded_children = stack.pop()
        key = id(item)
        if key in expanded:
            continue
        children = _children(item)
        if children is None:
            if isinstance(item, torch.Tensor):
                _check_tensor(path, item)
            expanded[key] = 1
            continue
        if not expanded_children:
            if depth >= MAX_DEPTH:
                raise TrainingError(
                    f"checkpoint {str(path)!r} is nested more than {MAX_DEPTH} levels deep, "
                    f"which no fedplug checkpoint is: it is crafted or damaged; {ADVICE}"
                )
            stack.append((item, depth, True))
            stack.extend((child, depth + 1, False) for child in children if id(child) not in expanded)
            continue
        total = 1 + sum(expanded[id(child)] for child in children)
        if total > limit:
            raise TrainingError(
                f"checkpoint {str(path)!r} expands to more than {limit:,} values from "
                f"{file_bytes:,} bytes (shared references, as a crafted file has): {ADVICE}"
            )
        expanded[key] = total


def _children(item: Any) -> list[Any] | None:
    """The values a container holds (keys and values of a dict), None for a leaf."""
    if type(item) in (dict, OrderedDict):
        return [part for pair in item.items() for part in pair]
    if type(item) in (list, tuple, set):
        return list(item)
    return None


def _check_tensor(path: Path, tensor: torch.Tensor) -> None:
    stored = tensor.untyped_storage().nbytes()
    if tensor.numel() and tensor.numel() * tensor.element_size() > stored:
        raise TrainingError(
            f"checkpoint {str(path)!r} holds a tensor of shape {tuple(tensor.shape)} over "
            f"{stored:,} stored bytes (crafted or damaged); {ADVICE}"
        )
