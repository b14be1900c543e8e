"""Restoring a run from its checkpoint, checked before anything trains on it.

:func:`~fedplug.simulation.checkpoint.load_checkpoint` guarantees a file of this config,
bounded in size and structure. A file with the right fingerprint can still be damaged or
edited: keys removed, values of the wrong type, a NaN or a truncated global model. Without
a check, such a state surfaces as a ``KeyError: 'history'`` traceback, or worse, loads: the
first round then trains from a NaN model and every client's update is dropped as
non-finite, blaming the clients for the server's file. :func:`restore_run` checks every
part the runtimes read (the simulator's and the Flower strategy's), loads the components'
states through their own ``load_state_dict``, and turns any mismatch into one line:
what is wrong, and "start over with --no-resume or delete it".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedplug.components import PhaseCost
from fedplug.errors import TrainingError
from fedplug.simulation.checkpoint_bounds import ADVICE
from fedplug.simulation.results import RoundRecord
from fedplug.simulation.vectors import all_finite, move_tensors

NUMBER_FIELDS = {item.name for item in fields(RoundRecord) if item.type in ("int", "float")}
"""Fields of a round record that must be numbers (``dropped`` and ``metrics`` are checked
apart)."""


@dataclass
class RestoredRun:
    """What a runtime continues from: the parts of a checkpoint, checked."""

    global_vector: Tensor
    """The global model, finite and of the model's size, on the requested device."""
    history: list[RoundRecord]
    """The finished rounds, numbered 1, 2, ... in order."""
    setup_cost: PhaseCost
    setup_seconds: float
    client_states: dict[int, dict[str, Any]]
    """Per-client state by client id (empty for a runtime that keeps none)."""


def restore_run(
    path: Path,
    state: Mapping[str, Any],
    *,
    model_size: int,
    components: Mapping[str, Any],
    device: torch.device | str = "cpu",
    num_clients: int | None = None,
) -> RestoredRun:
    """Check ``state`` (a :func:`load_checkpoint` result) and load it.

    Args:
        path: the checkpoint, for messages.
        state: the loaded checkpoint.
        model_size: number of parameters of the global model.
        components: the live components by checkpoint key (``"aggregator"``,
            ``"grouper"``, ``"loss_transform"``): each key must be in the checkpoint, and
            each component's ``load_state_dict`` receives its part. The aggregator is
            first initialised with the global vector, so its own fresh state tells the
            shapes its checkpointed tensors must have.
        device: where the global vector and the client states go.
        num_clients: check the checkpoint's ``client_states`` (a dict keyed by client ids
            below this number); None: the runtime keeps no client states.

    Raises:
        TrainingError: one line naming the file, what is wrong, and what to do.
    """
    damaged = _Damaged(path)
    missing = [key for key in ("global_vector", "history", "setup_cost", *components) if key not in state]
    if num_clients is not None and "client_states" not in state:
        missing.append("client_states")
    if missing:
        raise damaged(f"it lacks {', '.join(repr(key) for key in missing)}")
    vector = _global_vector(damaged, state["global_vector"], model_size).to(device)
    history = _history(damaged, state["history"])
    setup_cost = _setup_cost(damaged, state["setup_cost"])
    seconds = state.get("setup_seconds", 0.0)
    if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
        raise damaged(f"its 'setup_seconds' is {_describe(seconds)}, not a non-negative number")
    client_states: dict[int, dict[str, Any]] = {}
    if num_clients is not None:
        client_states = move_tensors(_client_states(damaged, state["client_states"], num_clients), device)
    for key, component in components.items():
        part = state[key]
        if not isinstance(part, dict):
            raise damaged(f"its {key!r} state is {_describe(part)}, not a dict")
        _check_finite(damaged, part, f"its {key!r} state")
        template = None
        if key == "aggregator":
            component.initialize(vector)
            template = component.state_dict()
        try:
            component.load_state_dict(move_tensors(part, device) if key == "aggregator" else part)
        except Exception as error:  # whatever the component's own reading raises
            raise damaged(
                f"its {key!r} state does not fit {type(component).__name__} "
                f"({type(error).__name__}: {_first_line(error)})"
            ) from None
        if template is not None:
            _check_shapes(damaged, component.state_dict(), template, key)
    return RestoredRun(vector, history, setup_cost, float(seconds), client_states)


class _Damaged:
    """Builds the one-line error for one checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, what: str) -> TrainingError:
        return TrainingError(f"checkpoint {str(self.path)!r} is damaged: {what}; {ADVICE}")


def _global_vector(damaged: _Damaged, value: Any, model_size: int) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise damaged(f"its 'global_vector' is {_describe(value)}, not a float tensor")
    if value.dim() != 1 or value.numel() != model_size:
        raise damaged(
            f"its 'global_vector' has shape {tuple(value.shape)}, but the model has "
            f"{model_size} parameters"
        )
    if not all_finite(value):
        raise damaged("its 'global_vector' holds NaN or infinite values")
    return value


def _history(damaged: _Damaged, value: Any) -> list[RoundRecord]:
    if not isinstance(value, list):
        raise damaged(f"its 'history' is {_describe(value)}, not a list of round records")
    history = []
    for index, entry in enumerate(value):
        where = f"its history[{index}]"
        if not isinstance(entry, dict):
            raise damaged(f"{where} is {_describe(entry)}, not a round record")
        for name in sorted(NUMBER_FIELDS - {"round"}):
            if name in entry and not _is_number(entry[name]):
                raise damaged(f"{where}[{name!r}] is {_describe(entry[name])}, not a number")
        if entry.get("round") != index + 1 or not _is_number(entry.get("round")):
            raise damaged(f"{where} is round {_describe(entry.get('round'))}, not round {index + 1}")
        metrics = entry.get("metrics", {})
        if not isinstance(metrics, dict) or not all(_is_number(item) for item in metrics.values()):
            raise damaged(f"{where}['metrics'] is not a dict of numbers")
        dropped = entry.get("dropped") or []
        if not isinstance(dropped, list) or not all(isinstance(item, dict) for item in dropped):
            raise damaged(f"{where}['dropped'] is not a list of dicts")
        try:
            history.append(RoundRecord.from_dict(entry))
        except (TypeError, ValueError) as error:  # a required field missing
            raise damaged(f"{where} is incomplete ({_first_line(error)})") from None
    return history


def _setup_cost(damaged: _Damaged, value: Any) -> PhaseCost:
    names = [item.name for item in fields(PhaseCost)]
    if (
        not isinstance(value, dict)
        or set(value) != set(names)
        or not all(_is_number(value[name]) and int(value[name]) == value[name] >= 0 for name in names)
    ):
        raise damaged(f"its 'setup_cost' is not a dict of non-negative integers {', '.join(names)}")
    return PhaseCost(**{name: int(value[name]) for name in names})


def _client_states(damaged: _Damaged, value: Any, num_clients: int) -> dict[int, dict[str, Any]]:
    if not isinstance(value, dict):
        raise damaged(f"its 'client_states' is {_describe(value)}, not a dict")
    for client, client_state in value.items():
        if type(client) is not int or not 0 <= client < num_clients:
            raise damaged(f"its 'client_states' names client {client!r}, not one of 0..{num_clients - 1}")
        if not isinstance(client_state, dict):
            raise damaged(f"its 'client_states'[{client}] is {_describe(client_state)}, not a dict")
        _check_finite(damaged, client_state, f"its 'client_states'[{client}]")
    return value


def _check_finite(damaged: _Damaged, value: Any, where: str) -> None:
    """Every floating tensor and array in ``value`` finite."""
    if isinstance(value, Tensor):
        if value.is_floating_point() and not all_finite(value.detach().reshape(-1)):
            raise damaged(f"{where} holds NaN or infinite values")
    elif isinstance(value, np.ndarray):
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise damaged(f"{where} holds NaN or infinite values")
    elif isinstance(value, dict):
        for item in value.values():
            _check_finite(damaged, item, where)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_finite(damaged, item, where)


def _check_shapes(damaged: _Damaged, loaded: Any, template: Any, where: str) -> None:
    """Tensors the fresh component has and the loaded one has at the same place must
    have the same shape (a place only one of them fills, e.g. a buffer not created
    before the first round, is not compared)."""
    if isinstance(loaded, Tensor) and isinstance(template, Tensor):
        if loaded.shape != template.shape:
            raise damaged(
                f"its {where!r} state holds a tensor of shape {tuple(loaded.shape)} where "
                f"this run's has {tuple(template.shape)}"
            )
    elif isinstance(loaded, dict) and isinstance(template, dict):
        for key in loaded.keys() & template.keys():
            _check_shapes(damaged, loaded[key], template[key], f"{where}.{key}")
    elif isinstance(loaded, (list, tuple)) and isinstance(template, (list, tuple)):
        if len(loaded) == len(template):
            for index, (item, fresh) in enumerate(zip(loaded, template)):
                _check_shapes(damaged, item, fresh, f"{where}[{index}]")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _describe(value: Any) -> str:
    if value is None:
        return "missing"
    if isinstance(value, Tensor):
        return f"a tensor of dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}" if len(text) <= 40 else f"a {type(value).__name__}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else "no message"
