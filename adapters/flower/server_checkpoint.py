"""The checkpoint of a :class:`~.strategy.FedplugStrategy` run: which run a file holds
(:func:`run_fingerprint`) and what is saved after every round (:func:`save_run`), in the
run state every runtime shares (:class:`fedplug.run.state.RunState`). No client states:
on Flower they live on the nodes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import Tensor

from fedplug.components import PhaseCost
from fedplug.run.checkpoint import save_checkpoint
from fedplug.run.results import RoundRecord
from fedplug.run.state import RunState

from .node_sampling import NodeRule
from .priors import NodeDirectory


def run_fingerprint(
    train_config: Any,
    message_config: dict[str, Any],
    num_classes: int | None,
    directory: NodeDirectory,
    layout: list[tuple[str, tuple[int, ...]]],
    rule: NodeRule,
) -> str:
    """Identifies a run: the train config, what the nodes are told, the clients and
    their counts, the model's layout and the sampling rule."""
    counts = directory.class_counts
    identity = {
        "train": train_config.model_dump(mode="json"),
        "message_config": {key: str(value) for key, value in message_config.items()},
        "num_classes": num_classes,
        "num_clients": directory.num_clients,
        "class_counts": counts.tolist() if counts is not None else None,
        "layout": [[name, list(shape)] for name, shape in layout],
        "sampling": None
        if rule.num_clients is not None
        else [rule.fraction_train, rule.min_train_nodes, rule.min_available_nodes],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def save_run(
    path: Path,
    fingerprint: str,
    vector: Tensor,
    history: list[RoundRecord],
    setup_cost: PhaseCost,
    setup_seconds: float,
    components: dict[str, Any],
) -> None:
    """Save the run after a round: its :class:`RunState`, without client states."""
    state = RunState.capture(fingerprint, vector, history, setup_cost, setup_seconds, components, {})
    save_checkpoint(path, state.to_dict())
