"""The run between rounds, as one object: what every runtime checkpoints and resumes from.

A :class:`RunState` is the whole checkpoint, the same for the simulator and the Flower
strategy; :meth:`RunState.to_dict` is the file's content (format 3),
:meth:`RunState.from_dict` checks a loaded one line by line before anything trains on it,
and :meth:`RunState.load_into` hands the components their states.
Design and formats: docs/reliability.md, 'Design notes: state'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedplug.components import PhaseCost
from fedplug.errors import TrainingError
from fedplug.run.checkpoint import load_checkpoint
from fedplug.run.checkpoint_bounds import ADVICE, checkpoint_size_bound
from fedplug.run.results import RoundRecord
from fedplug.run.vectors import all_finite, move_tensors

NUMBER_FIELDS = {item.name for item in fields(RoundRecord) if item.type in ("int", "float")}
"""Fields of a round record that must be numbers (``dropped`` and ``metrics`` are checked
apart)."""
COMPONENT_KEYS = ("aggregator", "grouper", "loss_transform")
"""The components whose ``state_dict`` a checkpoint holds, under these keys."""
STATE_KEYS = ("global_vector", "history", "setup_cost", "setup_seconds", *COMPONENT_KEYS, "client_states")
"""What :meth:`RunState.to_dict` holds besides the fingerprint (and the file's format)."""
FLOWER_FORMAT_2_GAPS = {"loss_transform", "client_states", "setup_seconds"}
"""What a checkpoint of the Flower strategy before format 3 lacks."""


@dataclass
class RunState:
    """The state of a run after its last finished round: what a checkpoint holds."""

    fingerprint: str
    """The config's fingerprint (a checkpoint resumes only the run it belongs to)."""
    global_vector: Tensor
    """The global model, as one flat vector."""
    history: list[RoundRecord]
    """The finished rounds, numbered 1, 2, ... in order; the next round's index is their
    number."""
    setup_cost: PhaseCost
    setup_seconds: float
    """The setup phase's cost and wall time (restored, not re-measured, on a resume)."""
    component_states: dict[str, dict[str, Any]]
    """Each component's ``state_dict`` by :data:`COMPONENT_KEYS` key."""
    client_states: dict[int, dict[str, Any]]
    """Per-client state by client id (empty where the clients keep their own)."""

    @classmethod
    def capture(
        cls,
        fingerprint: str,
        global_vector: Tensor,
        history: list[RoundRecord],
        setup_cost: PhaseCost,
        setup_seconds: float,
        components: Mapping[str, Any],
        client_states: Mapping[int, dict[str, Any]],
    ) -> RunState:
        """The live run's state, its tensors copied to the CPU: ``components`` by
        :data:`COMPONENT_KEYS` key (each one's ``state_dict`` is taken), and the clients
        that hold state (an empty state is no state: the engines create it on first use)."""
        return cls(
            fingerprint,
            global_vector.detach().cpu(),
            list(history),
            setup_cost,
            float(setup_seconds),
            {key: move_tensors(components[key].state_dict(), "cpu") for key in COMPONENT_KEYS},
            move_tensors({client: state for client, state in client_states.items() if state}, "cpu"),
        )

    @property
    def rounds_done(self) -> int:
        """The finished rounds: a resumed run continues with this round index."""
        return len(self.history)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's content: ``fingerprint`` and :data:`STATE_KEYS`, of plain
        values and tensors (round records as dicts)."""
        return {
            "fingerprint": self.fingerprint,
            "global_vector": self.global_vector,
            "history": [vars(record) for record in self.history],
            "setup_cost": asdict(self.setup_cost),
            "setup_seconds": self.setup_seconds,
            **self.component_states,
            "client_states": self.client_states,
        }

    @classmethod
    def from_dict(
        cls,
        path: Path,
        state: Mapping[str, Any],
        *,
        model_size: int,
        device: torch.device | str = "cpu",
        num_clients: int,
    ) -> RunState:
        """Check ``state`` (a :func:`~fedplug.run.checkpoint.load_checkpoint`
        result) and make it a run state, its global vector and client states on ``device``.

        Args:
            path: the checkpoint, for messages.
            state: the loaded checkpoint.
            model_size: number of parameters of the global model.
            device: where the global vector and the client states go.
            num_clients: K; client states must be keyed by ids below it.

        Raises:
            TrainingError: one line naming the file, what is wrong, and what to do.
        """
        damaged = _Damaged(path)
        missing = [key for key in STATE_KEYS if key not in state]
        if missing and state.get("version", 0) < 3 and set(missing) <= FLOWER_FORMAT_2_GAPS:
            raise TrainingError(
                f"checkpoint {str(path)!r} was written by an older fedplug's Flower strategy "
                f"(format {state.get('version')}), which did not save "
                f"{', '.join(repr(key) for key in missing)}; it cannot be resumed: delete it or "
                "pass another checkpoint_path to start over"
            )
        if missing:
            raise damaged(f"it lacks {', '.join(repr(key) for key in missing)}")
        vector = _global_vector(damaged, state["global_vector"], model_size).to(device)
        history = _history(damaged, state["history"])
        setup_cost = _setup_cost(damaged, state["setup_cost"])
        seconds = state["setup_seconds"]
        if not _is_number(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise damaged(f"its 'setup_seconds' is {_describe(seconds)}, not a non-negative number")
        client_states = move_tensors(_client_states(damaged, state["client_states"], num_clients), device)
        component_states = {}
        for key in COMPONENT_KEYS:
            part = state[key]
            if not isinstance(part, dict):
                raise damaged(f"its {key!r} state is {_describe(part)}, not a dict")
            _check_finite(damaged, part, f"its {key!r} state")
            component_states[key] = part
        return cls(
            str(state["fingerprint"]), vector, history, setup_cost, float(seconds), component_states, client_states
        )

    def load_into(
        self, path: Path, components: Mapping[str, Any], device: torch.device | str = "cpu"
    ) -> None:
        """Hand each of ``components`` (by :data:`COMPONENT_KEYS` key, all three) its
        state through its own ``load_state_dict``. The aggregator is first initialised
        with the global vector, so its own fresh state tells the shapes its checkpointed
        tensors must have.

        Raises:
            TrainingError: a state does not fit its component (one line, as
                :meth:`from_dict`'s).
        """
        damaged = _Damaged(path)
        for key in COMPONENT_KEYS:
            component, part = components[key], self.component_states[key]
            template = None
            if key == "aggregator":
                component.initialize(self.global_vector)
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


def resume_run(
    path: Path,
    fingerprint: str,
    *,
    initial_vector: Tensor,
    num_clients: int,
    rounds: int,
    components: Mapping[str, Any],
    num_samples: int = 0,
    device: torch.device | str = "cpu",
) -> RunState | None:
    """The run checkpointed at ``path``, checked (:meth:`RunState.from_dict`) and its
    states loaded into ``components`` (:meth:`RunState.load_into`); ``None`` when there
    is no checkpoint. ``initial_vector`` (the model's), K, R and the clients' samples
    bound the file's size (:func:`~fedplug.run.checkpoint_bounds.checkpoint_size_bound`).

    Raises:
        TrainingError: the file is of another config, too large, unreadable or damaged
            (one line saying what to do).
    """
    model_bytes = initial_vector.numel() * initial_vector.element_size()
    size_bound = checkpoint_size_bound(model_bytes, num_clients, num_samples, rounds)
    state = load_checkpoint(path, fingerprint, size_bound)
    if state is None:
        return None
    restored = RunState.from_dict(
        path, state, model_size=initial_vector.numel(), device=device, num_clients=num_clients
    )
    restored.load_into(path, components, device)
    return restored


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
        # None: a checkpoint written before rounds named their clients.
        clients, chains = entry.get("clients"), entry.get("chains")
        if clients is not None and not _client_ids(clients):
            raise damaged(f"{where}['clients'] is not a list of client ids")
        if chains is not None and not (isinstance(chains, list) and all(_client_ids(chain) for chain in chains)):
            raise damaged(f"{where}['chains'] is not a list of lists of client ids")
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
    elif isinstance(loaded, (list, tuple)) and isinstance(template, (list, tuple)) and len(loaded) == len(template):
        for index, (item, fresh) in enumerate(zip(loaded, template)):
            _check_shapes(damaged, item, fresh, f"{where}[{index}]")


def _client_ids(value: Any) -> bool:
    """Whether ``value`` is a list of client ids (non-negative ints)."""
    return isinstance(value, list) and all(
        isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)) and item >= 0 for item in value
    )


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
