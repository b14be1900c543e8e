"""Run one experiment end to end and write its outputs (the I/O edge of the library)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

from fedplug.data.build import build_federation
from fedplug.output_folder import claim, inspect, write_atomically
from fedplug.plugins import default_registry
from fedplug.registry import Registry
from fedplug.run.checkpoint import read_checkpoint
from fedplug.run.model import resolve_device
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run_folder import (
    output_fingerprint,
    run_folder_layout,
    run_info,
    write_json,
    write_yaml,
)
from fedplug.simulation.simulator import RoundObserver, Simulator
from fedplug.threads import announce_threads, choose_run_threads


class ExperimentOptions(TypedDict, total=False):
    """The keyword options of :func:`run_experiment` and :func:`prepare_experiment`; each
    may be left out."""

    registry: Registry | None
    """Where components are looked up by name (default: :func:`fedplug.plugins.default_registry`)."""
    observers: Iterable[RoundObserver]
    """Called after every round (default: none)."""
    resume: bool
    """Continue from ``out_dir/checkpoint.pt`` when there is one (default True)."""
    federation: Any
    """The clients' data, already built (default: built from ``config.data``)."""
    force: bool
    """Replace a fedplug folder of another config (default False;
    :func:`fedplug.output_folder.claim`); the run then starts over."""
    threads: int | None
    """torch's threads, over ``train.threads`` (``fedplug run --threads``; default None:
    :func:`fedplug.threads.choose_run_threads` decides)."""


def run_experiment(
    config: Any, out_dir: str | os.PathLike[str] | None, **options: Unpack[ExperimentOptions]
) -> tuple[RunResult, Simulator]:
    """Build the federation, train, and (when ``out_dir`` is given) write
    ``metrics.json``, ``config.yaml`` (the resolved config), ``run_info.json`` and a
    per-round ``checkpoint.pt`` there: :func:`prepare_experiment`, then
    :func:`train_experiment` (``options``: :class:`ExperimentOptions`)."""
    resume = resumes(config, out_dir, options)
    simulator = prepare_experiment(config, out_dir, **options)
    return train_experiment(config, simulator, out_dir, resume=resume, force=options.get("force", False)), simulator


def resumes(config: Any, out_dir: str | os.PathLike[str] | None, options: ExperimentOptions) -> bool:
    """Whether the run continues from ``out_dir``'s checkpoint: ``resume`` is asked for
    (the default) and the folder is not one of another config that ``force`` replaces
    (that checkpoint is deleted when the folder is claimed).

    Raises:
        ConfigError: ``out_dir`` is refused (:func:`fedplug.output_folder.inspect`).
    """
    replaced = replaces_output(config, out_dir, options.get("force", False))  # refuses even without resume
    return options.get("resume", True) and not replaced


def replaces_output(config: Any, out_dir: str | os.PathLike[str] | None, force: bool) -> bool:
    """Whether writing ``config``'s run to ``out_dir`` replaces another config's fedplug
    folder (only with ``force``): its checkpoint is then not resumed but deleted.

    Raises:
        ConfigError: ``out_dir`` is refused (:func:`fedplug.output_folder.inspect`).
    """
    if out_dir is None:
        return False
    fingerprint = output_fingerprint(config)
    return inspect(out_dir, fingerprint, force=force, legacy=run_folder_layout(fingerprint)) == "replace"


def prepare_experiment(
    config: Any, out_dir: str | os.PathLike[str] | None, **options: Unpack[ExperimentOptions]
) -> Simulator:
    """Everything that can refuse a run, before anything is written: ``out_dir`` (a folder
    fedplug did not write, or of another config without ``force``, or one another run
    holds: :func:`fedplug.output_folder.inspect`), the federation, the simulator, and the
    checkpoint in ``out_dir`` when resuming (a corrupt one, or one of another config, is
    refused). More observers can join ``simulator.observers`` before
    :func:`train_experiment`. torch's threads are chosen first (the data is loaded with
    them too) and said by :func:`train_experiment`, once the run can no longer be refused."""
    registry = options.get("registry") or default_registry()
    resume = resumes(config, out_dir, options)
    choose_run_threads(config.train, options.get("threads"), announce=False)
    checkpoint = Path(out_dir) / "checkpoint.pt" if out_dir is not None else None
    federation = options.get("federation")
    if federation is None:
        federation = build_federation(config.data, registry, resolve_device(config.train.device))
    simulator = Simulator(
        config.train,
        federation,
        registry,
        target_accuracy=config.study.target_accuracy,
        checkpoint_path=checkpoint,
        observers=options.get("observers", ()),
    )
    # Refuse a corrupt checkpoint, or one of another config, and data the loss transform's
    # setup phase cannot use, before anything is printed or written: out_dir keeps the
    # config.yaml that belongs to its checkpoint.
    simulator.prepare(resume=resume)
    return simulator


def train_experiment(
    config: Any,
    simulator: Simulator,
    out_dir: str | os.PathLike[str] | None,
    *,
    resume: bool = True,
    force: bool = False,
) -> RunResult:
    """Train a prepared experiment and write its files to ``out_dir`` (when given), which
    is claimed meanwhile (:func:`fedplug.output_folder.claim`: locked against a second run,
    marked with :func:`output_fingerprint`; ``force`` as in :func:`run_experiment`)."""
    announce_threads()
    if out_dir is None:
        return simulator.run(resume=resume)
    out = Path(out_dir)
    fingerprint = output_fingerprint(config)
    with claim(out, fingerprint, force=force, legacy=run_folder_layout(fingerprint)):
        write_yaml(out / "config.yaml", config.model_dump(mode="json"))
        write_json(out / "run_info.json", run_info())
        result = simulator.run(resume=resume)
        write_json(out / "metrics.json", result.summary())
        state = simulator.model.state_dict()
        write_atomically(out / "model.pt", lambda handle: torch.save(state, handle), what="model")
    return result


def checkpointed_rounds(out_dir: str | os.PathLike[str]) -> list[RoundRecord]:
    """The rounds the checkpoint in ``out_dir`` holds (empty without a readable one).

    A resumed run's tracker logs them before training continues, so its steps stay in
    order; :func:`run_experiment` still refuses a checkpoint of another config."""
    path = Path(out_dir) / "checkpoint.pt"
    if not path.is_file():
        return []
    try:
        state = read_checkpoint(path)  # weights only: a crafted file is refused, not run
        return [RoundRecord.from_dict(record) for record in state["history"]]
    except Exception:  # unreadable, refused or foreign: prepare_experiment reports it
        return []
