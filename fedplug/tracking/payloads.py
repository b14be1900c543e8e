"""What a tracker logs of a run, whichever backend: the per-round and summary metrics,
the params as strings, and the run's tags. Shared by the MLflow and TensorBoard backends."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from fedplug.run.results import RoundRecord, RunResult

MAX_PARAM_VALUE_LENGTH = 6000


def round_metrics(record: RoundRecord) -> dict[str, float]:
    """The metrics logged for one round: every finite number of
    :meth:`RoundRecord.as_dict` (the components' metrics, e.g. ``cpd_median``, included)
    except the round itself, which is the step."""
    values = record.as_dict()
    del values["round"]
    return {key: float(value) for key, value in values.items() if _finite_number(value)}


def summary_metrics(result: RunResult) -> dict[str, float]:
    """The run's final metrics (logged without a step): final and best accuracy, rounds
    to target (only when reached), total bytes and seconds, setup rounds."""
    summary = result.summary()
    keys = (
        "final_accuracy",
        "best_accuracy",
        "rounds_to_target",
        "total_bytes",
        "total_seconds",
        "setup_rounds",
        "effective_rounds",
    )
    return {key: float(summary[key]) for key in keys if _finite_number(summary.get(key))}


def params_payload(flat: Mapping[str, Any]) -> dict[str, str]:
    """MLflow param values as strings (lists as JSON, None as ``"None"``), cut to the
    6000 characters MLflow stores."""
    payload = {}
    for key, value in flat.items():
        text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
        payload[key] = text[:MAX_PARAM_VALUE_LENGTH]
    return payload


def run_tags(config: Any, algorithm: str, seed: int) -> dict[str, str]:
    """Tags of a run: dataset, partition, the four algorithm slots, label and seed.

    ``config`` is the resolved experiment config (``config.data``, ``config.train``).
    """
    tags = {
        "dataset": config.data.dataset.name,
        "partition": config.data.partition.name,
        "fedplug.algorithm": algorithm,
        "fedplug.seed": str(seed),
    }
    for slot in ("sampler", "loss_transform", "aggregator", "grouper"):
        tags[slot] = getattr(config.train, slot).name
    return tags


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
