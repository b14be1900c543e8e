"""Stage ``pretrain_density``: FedDisk's phase 1 (density models and sample weights),
computed once per algorithm entry that needs it, before any training.

Reads ``data``, ``train.loss_transform``, ``train.device`` and ``algorithms``. For every
label of ``algorithms`` it writes a folder ``data/density/<label>/``:

- when the label's loss transform is FedDisk or FedDiskAb (any
  :class:`~fedplug.algorithms.feddisk.SampleWeightConfig`): the weights file
  ``<cache_key>.npz`` (the per-sample density ratios and the phase's cost, from the loss
  transform's ``prepare`` and setup phase run as the simulator runs them;
  :func:`~fedplug.algorithms.feddisk.cache_key`) and ``info.json`` (its key, the time it
  took, and the rounds and bytes of the MADE phase);
- otherwise only ``info.json`` saying that no density model is needed (cheap: the dataset
  is not even loaded when no label needs one).

The train stage of ``<label>`` depends on ``data/density/<label>`` alone and points the loss
transform's ``cache_dir`` there, so it trains on exactly these weights. The DVC output is
``persist``: a weights file whose key still matches is kept rather than recomputed when some
other algorithm's params change; files whose key no longer matches, and folders of labels no
longer in ``algorithms``, are removed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
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

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    existing = {path.name: path for path in out.glob("*/*.npz")}
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
                label, loss_transform, federations[device], folder, existing, registry
            )
            keep = {INFO_NAME, info["file"]}
        for stale in folder.iterdir():
            if stale.name not in keep:
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        (folder / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    for folder in out.iterdir():
        if folder.name not in labels:
            shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    print(f"pretrain_density: density weights for {sorted(needing) or 'no algorithm'}")
    return 0


def ensure_weights(
    label: str,
    loss_transform: Any,
    federation: Any,
    folder: Path,
    existing: dict[str, Path],
    registry: Any,
) -> dict[str, Any]:
    """Make ``folder/<cache_key>.npz`` exist (kept, copied from another label's folder with
    the same key, or computed) and return the label's ``info.json`` content."""
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
        seconds, status = previous.get("seconds"), "kept"
    elif source is not None and source.exists() and source != target:
        shutil.copy2(source, target)
        seconds, status = (
            (_read_info(source.parent) or {}).get("seconds"),
            f"copied from {source.parent.name}",
        )
    else:
        target.unlink(missing_ok=True)
        started = time.perf_counter()
        transform = registry.build(
            "loss_transforms", loss_transform.model_copy(update={"cache_dir": str(folder)})
        )
        prepare_loss_transform(transform, federation)  # FedDisk's phase 1 runs here, once
        seconds, status = time.perf_counter() - started, "computed"
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


def _read_info(folder: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((folder / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


if __name__ == "__main__":
    run_main(main)
