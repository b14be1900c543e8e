"""FedDisk's weights cache: phase 1's result (the raw density ratios) stored as ``.npz``
under a key that identifies the federation, the config and the seed. What the key holds
and why the normalisation is not part of it: docs/algorithms.md, "FedDisk: the cache".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedplug.components import PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import DataError
from fedplug.output_folder import default_file_mode
from fedplug.safe_files import load_npz

from .weights import FedDiskWeights

if TYPE_CHECKING:
    from .config import SampleWeightConfig

WEIGHTS_VERSION = 3
"""Part of :func:`cache_key`; raised whenever the same config and seed would give other
weights, so that weights cached by an older fedplug are recomputed rather than reused
(2: every client draws from its own stream,
:class:`~fedplug.algorithms.feddisk.density.PhaseOneSeeds`; 3: the file holds the raw
ratios, normalised on loading)."""

NORMALISATION_FIELDS = frozenset({"normalisation", "clip_min", "clip_max", "keep_mean"})
"""Config fields applied to the cached ratios on loading: not part of :func:`cache_key`."""


def partition_fingerprint(federation: Federation) -> str:
    """A 16-hex-digit hash identifying a federation's split (see the module docstring):
    client count, each client's size and class counts, and its first, middle and last
    training input and label."""
    digest = hashlib.sha256()
    digest.update(np.int64(federation.num_clients).tobytes())
    for client in federation.clients:
        size = client.num_samples
        digest.update(np.array([client.client_id, size], dtype=np.int64).tobytes())
        digest.update(np.asarray(client.class_counts, dtype=np.int64).tobytes())
        picks = sorted({0, size // 2, size - 1}) if size > 0 else []
        for index in picks:
            digest.update(client.train_x[index].detach().cpu().to(torch.float32).numpy().tobytes())
            digest.update(np.int64(int(client.train_y[index])).tobytes())
    return digest.hexdigest()[:16]


def cache_key(
    dataset_name: str, partition_fingerprint: str, seed: int, config: SampleWeightConfig
) -> str:
    """File stem of the cached ratios: ``<method>-<dataset>-<hash>``, where the hash
    covers the dataset, the partition fingerprint, the seed, every config field that
    changes the ratios (all but ``cache_dir`` and :data:`NORMALISATION_FIELDS`) and
    :data:`WEIGHTS_VERSION`."""
    fields = config.model_dump(exclude={"cache_dir", "seed", *NORMALISATION_FIELDS})
    payload = json.dumps(
        {
            "dataset": dataset_name,
            "partition": partition_fingerprint,
            "seed": int(seed),
            "config": fields,
            "version": WEIGHTS_VERSION,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:20]
    safe_dataset = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset_name) or "dataset"
    return f"{config.name}-{safe_dataset}-{digest}"


def save_weights(path: str | Path, result: FedDiskWeights) -> None:
    """Write ``result``'s raw ratios and cost to ``path`` (.npz), atomically: a reader
    never sees half a file.

    Raises:
        ValueError: ``result`` holds no raw ratios (``ratios`` is None).
    """
    if result.ratios is None:
        raise ValueError("only FedDisk weights that keep their raw density ratios can be cached")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        f"ratios_{index}": np.asarray(r, dtype=np.float64)
        for index, r in enumerate(result.ratios)
    }
    arrays["num_clients"] = np.asarray(len(result.ratios), dtype=np.int64)
    arrays["cost"] = np.array(
        [result.cost.rounds, result.cost.bytes_up, result.cost.bytes_down], dtype=np.int64
    )
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.fchmod(handle, default_file_mode())
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)  # type: ignore[arg-type]  # numpy stubs reject **dict
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


MAX_PHASE_BYTES = 2**50
"""Most bytes a cached phase may say it moved each way (1 PiB: far above any real setup
phase, far below what overflows a sum of costs)."""


def load_weights(path: str | Path, config: SampleWeightConfig) -> FedDiskWeights:
    """Read what :func:`save_weights` wrote and normalise the ratios as ``config`` says
    (:meth:`FedDiskWeights.from_ratios`), with ``allow_pickle=False``: a file holding
    pickled objects is refused (a :class:`DataError` naming it), never unpickled; so is a
    FIFO or device at ``path`` (without waiting on it) and an array header claiming more
    than the file holds (before anything is allocated: :func:`fedplug.safe_files.load_npz`).

    Raises:
        DataError: the file is missing, unreadable, holds a cost outside
            :func:`check_cost`'s range, or does not hold finite, non-negative ratios; the
            message names the file.
    """
    path = Path(path)
    problem = f"cached FedDisk weights {str(path)!r} are unreadable or corrupt"
    advice = "delete the file so that the weights are recomputed"
    try:
        arrays = load_npz(path, what="FedDisk weights cache", advice=advice)
    except FileNotFoundError:
        raise DataError(f"cached FedDisk weights {str(path)!r} do not exist") from None
    try:
        num_clients = int(arrays["num_clients"])
        cost = [int(value) for value in np.asarray(arrays["cost"]).reshape(-1)]
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise DataError(f"{problem} ({type(error).__name__}: {error}); {advice}") from None
    stored = sum(1 for name in arrays if name.startswith("ratios_"))
    if num_clients != stored or any(f"ratios_{k}" not in arrays for k in range(stored)):
        raise DataError(f"{problem} (it says {num_clients} clients but holds {stored} ratio arrays); {advice}")
    check_cost(path, cost, config)
    ratios = [np.asarray(arrays[f"ratios_{k}"], dtype=np.float64) for k in range(num_clients)]
    for index, client_ratios in enumerate(ratios):
        if (
            client_ratios.ndim != 1
            or not np.all(np.isfinite(client_ratios))
            or np.any(client_ratios < 0)
        ):
            raise DataError(f"{problem} (client {index} ratios are not finite and >= 0); {advice}")
    return FedDiskWeights.from_ratios(ratios, PhaseCost(*cost), config)


def check_cost(path: Path, cost: list[int], config: SampleWeightConfig) -> None:
    """Refuse a cached phase cost ``[rounds, bytes_up, bytes_down]`` that no phase of
    ``config`` can have: rounds above the config's ``global_rounds`` (0 for a phase
    without rounds), bytes negative or above :data:`MAX_PHASE_BYTES`. It becomes the
    run's ``setup_rounds`` and byte counts, so a crafted one would be reported as
    measured."""
    max_rounds = int(getattr(config, "global_rounds", 0))
    if (
        len(cost) != 3
        or not 0 <= cost[0] <= max_rounds
        or not all(0 <= value <= MAX_PHASE_BYTES for value in cost[1:])
    ):
        raise DataError(
            f"cached FedDisk weights {str(path)!r} hold a phase cost {cost[:3]} (rounds, bytes up, bytes down) "
            f"outside [0, {max_rounds}] rounds and [0, 2**50] bytes; delete it to recompute"
        )


def cache_path(folder: str | Path, federation: Federation, config: SampleWeightConfig) -> Path:
    """``folder/<cache_key>.npz`` for ``federation`` and ``config`` (its own ``seed``)."""
    key = cache_key(federation.dataset_name, partition_fingerprint(federation), config.seed, config)
    return Path(folder) / f"{key}.npz"


def check_sizes(result: FedDiskWeights, sizes: Sequence[int], source: str) -> None:
    """Raise unless ``result`` holds one weight per sample of clients of ``sizes``.

    Raises:
        DataError: the sizes differ (the message names ``source`` and says what to do).
    """
    held = [int(w.shape[0]) for w in result.weights]
    if held != list(sizes):
        raise DataError(
            f"{source} hold weights for {len(held)} clients with sizes {held[:5]}..., but "
            f"the federation has {len(sizes)} clients with sizes {list(sizes)[:5]}...; delete "
            "the file so that the weights are recomputed"
        )
