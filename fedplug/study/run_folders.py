"""Which configs give the same results (:func:`config_hash`), and whether a run folder holds
a study's run finished, started, or under other settings (:func:`run_folder_state`)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml

from fedplug.safe_files import read_regular_bytes
from fedplug.study.expansion import StudyRun

IGNORED_CONFIG_FIELDS = ("study", "tracking", "algorithms", "data.root", "train.workers")
"""Fields of a resolved config that cannot change a run's results, left out when a run
folder's ``config.yaml`` is compared with a study's run and from :func:`config_hash`:
``study`` (its name, ``seeds: [train.seed]`` and the target accuracy, which only the
report reads), ``tracking`` (where the run is logged), ``algorithms`` (the pipeline's
matrix; a study run is its ``train``), ``data.root`` (where the dataset files are read
from) and ``train.workers`` (how many processes the parallel engine forks). Engine
``parallel`` is compared as ``sequential``: its results are the sequential engine's, bit
for bit (tests/test_parallel_engine.py)."""


def comparable_config(document: dict[str, Any]) -> dict[str, Any]:
    """A resolved config dict without :data:`IGNORED_CONFIG_FIELDS` (engine ``parallel``
    written as ``sequential``): two runs with equal comparable configs give the same results."""
    comparable = copy.deepcopy(document)
    for dotted in IGNORED_CONFIG_FIELDS:
        *parents, last = dotted.split(".")
        node: Any = comparable
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    train = comparable.get("train")
    if isinstance(train, dict) and train.get("engine") == "parallel":
        train["engine"] = "sequential"
    return comparable


def config_hash(document: dict[str, Any]) -> str:
    """12 hex digits of the SHA-256 of :func:`comparable_config` (keys sorted)."""
    text = json.dumps(comparable_config(document), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_differences(found: Any, wanted: Any, prefix: str = "") -> list[str]:
    """Where two comparable config dicts differ, one ``path=found but the study asks
    wanted`` text per leaf (``(absent)`` for a missing key), in ``wanted``'s key order."""
    if isinstance(found, dict) and isinstance(wanted, dict):
        differences = []
        for key in list(wanted) + [key for key in found if key not in wanted]:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in found:
                differences.append(f"{path} (absent) but the study asks {_short(wanted[key])}")
            elif key not in wanted:
                differences.append(f"{path}={_short(found[key])} but the study has no such setting")
            else:
                differences += config_differences(found[key], wanted[key], path)
        return differences
    return [] if found == wanted else [f"{prefix}={_short(found)} but the study asks {_short(wanted)}"]


def _short(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


class RunFolderState(NamedTuple):
    """What a run folder holds, for one run of a study."""

    status: Literal["new", "partial", "done", "mismatched"]
    """``new``: nothing to reuse; ``partial``: a started run of this config (it resumes
    from its checkpoint); ``done``: finished with this config; ``mismatched``: results,
    a checkpoint or a config of other settings."""
    reason: str = ""
    """For ``mismatched``: why, e.g. ``it was trained with train.rounds=1 but the study asks 20``."""


def run_folder_state(run: StudyRun, folder: str | Path) -> RunFolderState:
    """Whether ``folder`` holds ``run`` finished, started, or under other settings.

    A finished run (``metrics.json``) or a started one (``checkpoint.pt``) counts only
    when its ``config.yaml`` (the resolved config :func:`fedplug.experiment.run_experiment`
    wrote) equals the run's config, :data:`IGNORED_CONFIG_FIELDS` aside.

    Raises:
        ConfigError: the ``config.yaml`` is a FIFO, socket or device (refused in one line,
            not waited on).
    """
    folder = Path(folder)
    has_results = (folder / "metrics.json").is_file() or (folder / "checkpoint.pt").is_file()
    config_path = folder / "config.yaml"
    try:
        stored = yaml.safe_load(
            read_regular_bytes(config_path, what="run config", advice="delete that run folder to train the run again")
        )
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # as is_file() said: no config.yaml
        if has_results:
            return RunFolderState("mismatched", "it holds results but no config.yaml, so its settings are unknown")
        return RunFolderState("new")
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as error:
        return RunFolderState("mismatched", f"its config.yaml is unreadable ({type(error).__name__})")
    if not isinstance(stored, dict):
        return RunFolderState("mismatched", "its config.yaml is not a mapping")
    differences = config_differences(comparable_config(stored), comparable_config(run.config.model_dump(mode="json")))
    if differences:
        more = f" (and {len(differences) - 1} more differences)" if len(differences) > 1 else ""
        verb = "was trained" if (folder / "metrics.json").is_file() else "was started"
        return RunFolderState("mismatched", f"it {verb} with {differences[0]}{more}")
    return RunFolderState("done" if (folder / "metrics.json").is_file() else "partial")


def pending_runs(runs: Iterable[StudyRun], out_dir: str | Path) -> list[StudyRun]:
    """The runs whose folder under ``out_dir`` is ``new`` or ``partial`` (see
    :func:`run_folder_state`); mismatched runs are not pending: they need a decision."""
    out = Path(out_dir)
    return [run for run in runs if run_folder_state(run, out / run.run_id).status in ("new", "partial")]

