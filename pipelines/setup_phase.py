"""Stage ``setup``: every setup phase the configured components keep in a file, computed
once per algorithm entry, before any training.

Reads ``data``, ``train.<slot>`` of the four algorithm slots, ``train.device`` and
``algorithms``. For every label of ``algorithms`` it writes a folder ``data/setup/<label>/``:

- ``info.json``: for each component of the label whose config names a setup file
  (:meth:`fedplug.components.ComponentConfig.setup_file`), its slot, name, file and the
  rounds and bytes of its setup phase; an empty list when none does (cheap: the dataset is
  not even loaded when no label needs a setup phase);
- each such file, written by the component's own ``prepare`` and setup phase run as the
  simulator runs them, with its ``cache_dir`` pointing at the folder;
- ``timing.json``: the seconds the files took to compute, in all (``seconds``) and per file
  (``files``); not hashed by DVC.

The train stage of ``<label>`` depends on ``data/setup/<label>`` alone and points every
component's ``cache_dir`` there, so it trains on exactly these results. The DVC output is
``persist``: a file whose name (a key of the data and parameters) still matches is kept
rather than recomputed when some other algorithm's params change, and copied when another
label has the same one; files no longer named, and folders of labels no longer in
``algorithms``, are removed.

It deletes only files it wrote: the folder's marker (:mod:`fedplug.output_folder`) lists
them, and a stale file or label folder is removed only when listed (a file the user put in
a label folder stays, and so does that folder). An ``--out`` that is not empty and holds no
marker (``--out data``, a folder of your own) is refused with one line and left as it was,
unless it has exactly the layout this stage wrote before markers existed (label folders
holding an ``info.json`` of that label and the file it names), which is adopted. The marker
(``.fedplug-output.json``) is part of the DVC output; the lock file next to it is in
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
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PARTITION_DIR,
    SETUP_DIR,
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

from fedplug.safe_files import read_regular_bytes

INFO_NAME = "info.json"
TIMING_NAME = "timing.json"
"""Beside ``info.json``, the seconds the setup files took to compute: a measured time, in
``.dvcignore`` so that the hashed output reproduces byte for byte on a re-run."""
PURPOSE = "fedplug pipeline stage setup"
"""The fingerprint in this stage's output marker: what the folder is for (its content
changes with the params; the stage itself replaces what is stale)."""


class SetupWork(NamedTuple):
    """One component of one label that keeps its setup phase in a file."""

    slot: str
    config: Any
    device: str


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument(
        "--partition", default=str(PARTITION_DIR / "partition.npz"), help="partition file"
    )
    parser.add_argument("--out", default=str(SETUP_DIR), help=f"output folder (default {SETUP_DIR})")
    args = parser.parse_args(argv)

    from fedplug.config import ALGORITHM_SLOTS, DEFAULT_COMPONENTS, validate_section
    from fedplug.output_folder import claim, write_text
    from fedplug.plugins import default_registry

    params = read_params(args.params)
    registry = default_registry()
    labels = algorithm_labels(params)
    candidates = {label: configured_components(params, label, registry, ALGORITHM_SLOTS, DEFAULT_COMPONENTS)
                  for label in labels}
    federations: dict[str, Any] = {}

    def federation_on(device: str) -> Any:
        if device not in federations:
            from fedplug.run.model import resolve_device

            set_torch_threads()
            data_config = validate_section("data", section(params, "data"), registry)
            federations[device] = load_federation(data_config, registry, resolve_device(device), args.partition)
        return federations[device]

    needing = []
    # Refuses a folder this stage did not write (its files stay untouched), or one another
    # process is writing; held until every file is written.
    with claim(args.out, PURPOSE, legacy=legacy_layout, force_option=None) as owned:
        out = owned.path
        existing = {PurePosixPath(name).name: out / name for name in owned.files}
        for label in labels:
            folder = out / label
            folder.mkdir(parents=True, exist_ok=True)
            entries, seconds = [], {}
            for work in candidates[label]:
                if not _may_keep_files(work.config):
                    continue
                federation = federation_on(work.device)
                file_name = work.config.setup_file(federation)
                if file_name is None:
                    continue
                entry, took = ensure_setup_file(label, work, file_name, federation, folder, existing, registry, owned)
                entries.append(entry)
                seconds[file_name] = took
            keep = {INFO_NAME} | ({TIMING_NAME} if entries else set()) | {entry["file"] for entry in entries}
            if entries:
                needing.append(label)
                total = sum(value or 0.0 for value in seconds.values())
                write_text(folder / TIMING_NAME, json.dumps({"seconds": total, "files": seconds}) + "\n")
            for stale in [name for name in owned.files if name.startswith(f"{label}/")]:
                if stale[len(label) + 1 :] not in keep:
                    owned.remove(stale)
            write_text(folder / INFO_NAME, json.dumps({"algorithm": label, "setup": entries}, indent=2) + "\n")
        for stale in [name for name in owned.files if PurePosixPath(name).parts[0] not in labels]:
            owned.remove(stale)  # a label no longer in `algorithms`: its emptied folder goes too
    print(f"setup: setup phases for {sorted(needing) or 'no algorithm'}")
    return 0


def configured_components(params: dict[str, Any], label: str, registry: Any, slots: tuple[str, ...],
                          defaults: dict[str, Any]) -> list[SetupWork]:
    """The validated configs of ``label``'s algorithm slots (each on the label's device)."""
    device = validate_device(merged_train_slot(params, label, "device"), f"algorithms.{label}.device")
    works = []
    for slot in slots:
        data = merged_train_slot(params, label, slot) or defaults[slot]
        config = validate_component(registry, f"{slot}s", data, f"algorithms.{label}.{slot}")
        works.append(SetupWork(slot, config, device))
    return works


def _may_keep_files(config: Any) -> bool:
    """Whether ``config`` can keep a setup file: it has a ``cache_dir`` and overrides
    :meth:`~fedplug.components.ComponentConfig.setup_file` (checked before any data is
    loaded, so a study without setup phases stays cheap)."""
    from fedplug.components import ComponentConfig

    return "cache_dir" in type(config).model_fields and type(config).setup_file is not ComponentConfig.setup_file


def legacy_layout(folder: Path) -> list[str] | None:
    """The files of a setup folder written before output markers existed (label folders
    holding their ``info.json`` and the file it names, nothing else), or None when the
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
        named = {INFO_NAME, TIMING_NAME, info.get("file")} | {item.get("file") for item in info.get("setup") or []
                                                              if isinstance(item, dict)}
        for item in os.scandir(entry.path):
            if not item.is_file(follow_symlinks=False) or item.name not in named:
                return None
            found.append(f"{entry.name}/{item.name}")
    return found


def ensure_setup_file(label: str, work: SetupWork, file_name: str, federation: Any, folder: Path,
                      existing: dict[str, Path], registry: Any, owned: Any) -> tuple[dict[str, Any], float | None]:
    """Make ``folder/<file_name>`` exist (kept, copied from another label's folder with the
    same name, or computed by running the component's setup), list it in the output marker
    (``owned``); returns the ``info.json`` entry and the seconds it took to compute."""
    from fedplug.components import SLOT_KINDS
    from fedplug.output_folder import write_through_path
    from fedplug.setup_phase import prepare_in_process

    target = folder / file_name
    previous = {item.get("file") for item in (_read_info(folder) or {}).get("setup") or [] if isinstance(item, dict)}
    source = existing.get(file_name)
    if target.exists() and file_name in previous:
        seconds, status = _read_seconds(folder, file_name), "kept"
    elif source is not None and source.exists() and source != target:
        write_through_path(target, lambda temporary: shutil.copyfile(source, temporary))
        seconds, status = _read_seconds(source.parent, file_name), f"copied from {source.parent.name}"
    else:
        owned.remove(f"{folder.name}/{file_name}")
        started = time.perf_counter()
        config = work.config.model_copy(update={"cache_dir": str(folder)})
        arguments = (federation.num_clients,) if work.slot == "aggregator" else ()
        component = registry.build(SLOT_KINDS[work.slot], config, *arguments)
        prepare_in_process([component], federation)  # the component writes its file here, once
        seconds, status = time.perf_counter() - started, "computed"
    owned.record(f"{folder.name}/{file_name}")
    cost = work.config.setup_file_cost(target)
    print(f"setup: {label}: {work.slot} {work.config.name}: {file_name} {status}")
    entry = {
        "slot": work.slot,
        "component": work.config.name,
        "file": file_name,
        "setup_rounds": cost.rounds,
        "setup_bytes_up": cost.bytes_up,
        "setup_bytes_down": cost.bytes_down,
    }
    return entry, seconds


def _read_info(folder: Path, name: str = INFO_NAME) -> dict[str, Any] | None:
    """``folder``'s ``name`` (None: missing or not a JSON object); a FIFO, socket or
    device there is refused in one line, not waited on."""
    try:
        info = json.loads(read_regular_bytes(folder / name, advice="delete it and run the setup stage again"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _read_seconds(folder: Path, file_name: str) -> float | None:
    """The seconds ``folder``'s ``file_name`` took to compute (its ``timing.json``), or None."""
    seconds = ((_read_info(folder, TIMING_NAME) or {}).get("files") or {}).get(file_name)
    return float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None


if __name__ == "__main__":
    run_main(main)
