"""Stage ``pretrain_density``: FedDisk's phase 1 (density models and sample weights),
computed once per algorithm entry that needs it, before any training.

Reads ``data``, ``train.loss_transform``, ``train.device`` and ``algorithms``. For every
label of ``algorithms`` it writes a folder ``data/density/<label>/``:

- when the label's loss transform is FedDisk or FedDiskAb (any
  :class:`~fedplug.algorithms.feddisk.SampleWeightConfig`): the weights file
  ``<cache_key>.npz`` (the per-sample density ratios and the phase's cost, from the loss
  transform's ``prepare`` and setup phase run as the simulator runs them;
  :func:`~fedplug.algorithms.feddisk.cache_key`), ``info.json`` (its key, and the rounds and
  bytes of the MADE phase) and ``timing.json`` (the seconds it took; not hashed by DVC);
- otherwise only ``info.json`` saying that no density model is needed (cheap: the dataset
  is not even loaded when no label needs one).

The train stage of ``<label>`` depends on ``data/density/<label>`` alone and points the loss
transform's ``cache_dir`` there, so it trains on exactly these weights. The DVC output is
``persist``: a weights file whose key still matches is kept rather than recomputed when some
other algorithm's params change; files whose key no longer matches, and folders of labels no
longer in ``algorithms``, are removed.

It deletes only files it wrote: the folder's marker (:mod:`fedplug.output_folder`) lists
them, and a stale weights file or label folder is removed only when listed (a file the user
put in a label folder stays, and so does that folder). An ``--out`` that is not empty and
holds no marker (``--out data``, a folder of your own) is refused with one line and left
as it was, unless it has exactly the layout this stage wrote before markers existed (label
folders holding an ``info.json`` of that label and ``.npz`` weights), which is adopted. The
marker (``.fedplug-output.json``) is part of the DVC output; the lock file next to it is in
``.dvcignore``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DENSITY_DIR,
    PARTITION_DIR,
    algorithm_labels,
    load_federation,
    merged_train_slot,
    read_params,
    run_main,
    section,
    set_torch_threads,
    validate_component,
    validate_device,
)

INFO_NAME = "info.json"
TIMING_NAME = "timing.json"
"""Beside ``info.json``, the seconds the weights took to compute: a measured time, in
``.dvcignore`` so that the hashed output reproduces byte for byte on a re-run."""
PURPOSE = "fedplug pipeline stage pretrain_density"
"""The fingerprint in this stage's output marker: what the folder is for (its content
changes with the params; the stage itself replaces what is stale)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument(
        "--partition", default=str(PARTITION_DIR / "partition.npz"), help="partition file"
    )
    parser.add_argument(
        "--out", default=str(DENSITY_DIR), help=f"output folder (default {DENSITY_DIR})"
    )
    args = parser.parse_args(argv)

    from fedplug.algorithms.feddisk import SampleWeightConfig
    from fedplug.config import DEFAULT_COMPONENTS, validate_section
    from fedplug.plugins import default_registry

    params = read_params(args.params)
    registry = default_registry()
    labels = algorithm_labels(params)
    needing: dict[str, tuple[Any, str]] = {}
    names: dict[str, str] = {}
    for label in labels:
        where = f"algorithms.{label}.loss_transform"
        slot = merged_train_slot(params, label, "loss_transform") or DEFAULT_COMPONENTS["loss_transform"]
        loss_transform = validate_component(registry, "loss_transforms", slot, where)
        names[label] = loss_transform.name
        if isinstance(loss_transform, SampleWeightConfig):
            device = validate_device(
                merged_train_slot(params, label, "device"), f"algorithms.{label}.device"
            )
            needing[label] = (loss_transform, device)

    from fedplug.output_folder import claim, write_text

    # Refuses a folder this stage did not write (its files stay untouched), or one another
    # process is writing; held until every file is written.
    with claim(args.out, PURPOSE, legacy=legacy_layout, force_option=None) as owned:
        out = owned.path
        existing = {
            PurePosixPath(name).name: out / name for name in owned.files if name.endswith(".npz")
        }
        federations: dict[str, Any] = {}
        if needing:
            set_torch_threads()
            data_config = validate_section("data", section(params, "data"), registry)
        for label in labels:
            folder = out / label
            folder.mkdir(parents=True, exist_ok=True)
            if label not in needing:
                info: dict[str, Any] = {
                    "algorithm": label,
                    "loss_transform": names[label],
                    "needs_density": False,
                }
                keep = {INFO_NAME}
            else:
                loss_transform, device = needing[label]
                if device not in federations:
                    from fedplug.simulation.simulator import resolve_device

                    federations[device] = load_federation(
                        data_config, registry, resolve_device(device), args.partition
                    )
                info = ensure_weights(
                    label, loss_transform, federations[device], folder, existing, registry, owned
                )
                keep = {INFO_NAME, TIMING_NAME, info["file"]}
                write_text(folder / TIMING_NAME, json.dumps({"seconds": info.pop("seconds")}) + "\n")
            for stale in [name for name in owned.files if name.startswith(f"{label}/")]:
                if stale[len(label) + 1 :] not in keep:
                    owned.remove(stale)
            write_text(folder / INFO_NAME, json.dumps(info, indent=2) + "\n")
        for stale in [name for name in owned.files if PurePosixPath(name).parts[0] not in labels]:
            owned.remove(stale)  # a label no longer in `algorithms`: its emptied folder goes too
    print(f"pretrain_density: density weights for {sorted(needing) or 'no algorithm'}")
    return 0


def legacy_layout(folder: Path) -> list[str] | None:
    """The files of a density folder written before output markers existed (label folders
    holding their ``info.json`` and ``.npz`` weights, nothing else), or None when the
    folder holds anything else: it is then not this stage's and is refused."""
    found = []
    for entry in os.scandir(folder):
        if entry.name.startswith(".fedplug-output"):
            continue
        if not entry.is_dir(follow_symlinks=False):
            return None
        info = _read_info(Path(entry.path))
        if info is None or info.get("algorithm") != entry.name:
            return None
        for item in os.scandir(entry.path):
            if not item.is_file(follow_symlinks=False) or not (
                item.name == INFO_NAME or item.name.endswith(".npz")
            ):
                return None
            found.append(f"{entry.name}/{item.name}")
    return found


def ensure_weights(
    label: str,
    loss_transform: Any,
    federation: Any,
    folder: Path,
    existing: dict[str, Path],
    registry: Any,
    owned: Any,
) -> dict[str, Any]:
    """Make ``folder/<cache_key>.npz`` exist (kept, copied from another label's folder with
    the same key, or computed), list it in the output marker (``owned``) and return the
    label's ``info.json`` content."""
    from fedplug.output_folder import write_through_path

    from fedplug.algorithms.feddisk import cache_key, load_weights, partition_fingerprint
    from fedplug.setup_phase import prepare_loss_transform

    key = cache_key(
        federation.dataset_name,
        partition_fingerprint(federation),
        loss_transform.seed,
        loss_transform,
    )
    file_name = f"{key}.npz"
    target = folder / file_name
    previous = _read_info(folder) or {}
    source = existing.get(file_name)
    if target.exists() and previous.get("cache_key") == key:
        seconds, status = _read_seconds(folder), "kept"
    elif source is not None and source.exists() and source != target:
        write_through_path(target, lambda temporary: shutil.copyfile(source, temporary))
        seconds, status = (
            _read_seconds(source.parent),
            f"copied from {source.parent.name}",
        )
    else:
        owned.remove(f"{folder.name}/{file_name}")
        started = time.perf_counter()
        transform = registry.build(
            "loss_transforms", loss_transform.model_copy(update={"cache_dir": str(folder)})
        )
        prepare_loss_transform(transform, federation)  # FedDisk's phase 1 runs here, once
        seconds, status = time.perf_counter() - started, "computed"
    owned.record(f"{folder.name}/{file_name}")
    cost = load_weights(target, loss_transform).cost
    print(f"pretrain_density: {label}: {loss_transform.name} weights {status} ({key})")
    return {
        "algorithm": label,
        "loss_transform": loss_transform.name,
        "needs_density": True,
        "cache_key": key,
        "file": file_name,
        "seconds": seconds,
        "setup_rounds": cost.rounds,
        "setup_bytes_up": cost.bytes_up,
        "setup_bytes_down": cost.bytes_down,
    }


def _read_info(folder: Path, name: str = INFO_NAME) -> dict[str, Any] | None:
    try:
        info = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _read_seconds(folder: Path) -> float | None:
    """The seconds ``folder``'s weights took to compute (its ``timing.json``), or None."""
    seconds = (_read_info(folder, TIMING_NAME) or {}).get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else None


if __name__ == "__main__":
    run_main(main)
