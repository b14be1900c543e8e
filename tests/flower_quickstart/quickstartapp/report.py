"""Not part of Flower's quickstart: the ServerApp's result as JSON, for
tests/test_flower_quickstart.py to check what ran."""

import dataclasses
import json
from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import Result, Strategy


def rounds_of(metrics_by_round: dict[int, Any]) -> dict[str, dict[str, float]]:
    """Flower's ``{round: MetricRecord}`` as JSON-ready ``{"round": {name: value}}``."""
    return {str(r): {k: float(v) for k, v in m.items()} for r, m in metrics_by_round.items()}


def save_result(path: str, result: Result, strategy: Strategy) -> None:
    """Write the Result's metrics per round and, for fedplug's strategy, its train
    config and run record to ``path`` (nothing when ``path`` is empty)."""
    if not path:
        return
    report: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "train": rounds_of(result.train_metrics_clientapp),
        "evaluate": rounds_of(result.evaluate_metrics_clientapp),
        "central": rounds_of(result.evaluate_metrics_serverapp),
    }
    run_result = getattr(strategy, "run_result", None)
    if run_result is not None:
        report["fedplug_config"] = strategy.config.model_dump(mode="json")
        report["fedplug_run"] = dataclasses.asdict(run_result)
    Path(path).write_text(json.dumps(report, default=str))
