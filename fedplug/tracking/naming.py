"""Where ``fedplug run`` logs in MLflow, and under which run name.

- Experiment: ``<study.name>-fedplug-run`` (:func:`command_line_experiment`). The study's
  own experiment (``study.name``) holds the pipeline's runs, each nested under the parent
  run of its ``dvc repro`` or ``dvc exp run``; a quick start on another dataset or a
  one-off variant typed on the command line must not land among them.
- Run name: ``<algorithm>-seed<seed>-<config hash>-<dataset>``
  (:func:`command_line_run_name`), e.g. ``fedprox+fedavgm-seed0-8ecc5e74-synthetic``:
  the algorithm is ``--algorithm``'s entry, else the algorithm slots not at their default;
  the hash (the first 8 characters of the one the default output folder
  ``runs/<dataset>-<algorithm>-<hash>`` carries, of the resolved ``data`` and ``train``
  sections) tells apart two configs that differ elsewhere (a learning rate, the rounds).
  What differs most often comes first, where the UI's narrow name column still shows it,
  as in the pipeline's ``<algorithm>-seed<seed>@<group>``: the hash comes before the
  dataset, which the run's tags and params also hold (with the dataset before it, three
  ``fedavg-seed0-synthetic-...`` rows looked the same). A run is re-opened by the id its
  output folder records (``mlflow_run.json``), never by name, so runs logged under the
  earlier order resume as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

COMMAND_LINE_SUFFIX = "-fedplug-run"
"""Appended to ``study.name`` for the experiment of ``fedplug run``'s runs."""
HASH_LENGTH = 8
"""Characters of the config hash in a run name (the default output folder's name starts
with the same ones)."""


def command_line_experiment(config: Any) -> str:
    """The MLflow experiment of a ``fedplug run``: ``<study.name>-fedplug-run``."""
    return f"{config.study.name}{COMMAND_LINE_SUFFIX}"


def command_line_run_name(config: Any, algorithm: str | None = None) -> str:
    """``<algorithm>-seed<seed>-<config hash>-<dataset>`` for a ``fedplug run``: the short
    hash before the dataset, so that the UI's narrow name column tells two configs apart.

    Args:
        config: the resolved experiment config.
        algorithm: the ``--algorithm`` entry applied (default None: the label is made of
            the algorithm slots, :func:`fedplug.run_folder.algorithm_label`).
    """
    from fedplug.run_folder import algorithm_label, output_fingerprint

    digest = output_fingerprint(config)[:HASH_LENGTH]
    label = algorithm_label(config, algorithm)
    return f"{label}-seed{config.train.seed}-{digest}-{config.data.dataset.name}"


def open_command_line_tracker(
    config: Any, out_dir: str | os.PathLike[str] | None, runtime: str, *,
    algorithm: str | None = None, tags: Mapping[str, str] | None = None, **options: Any
) -> Any:
    """The tracker of one command-line run on ``runtime`` (``simulator``, ``flower``,
    ``fedml``), named (:func:`command_line_run_name`) and tagged (algorithm label, seed,
    runtime, plus ``tags``) alike on every runtime; ``options`` go to
    :func:`fedplug.tracking.open_tracker` (``resume``, ``project_root``, ``enabled``, ...)."""
    from fedplug.tracking.observer import open_tracker

    label = algorithm or config.train.aggregator.name
    run_tags = {
        "fedplug.algorithm": label,
        "fedplug.seed": str(config.train.seed),
        "fedplug.runtime": runtime,
        **dict(tags or {}),
    }
    return open_tracker(
        config, out_dir, run_name=command_line_run_name(config, algorithm), tags=run_tags, **options
    )
