"""Any component's setup phase (:class:`fedplug.setup_phase.SetupPhase`), whatever its
slot, over Flower messages: the server drives the phase, every node answers for its own
client and keeps its client's state in ``context.state``.

Each step is one ``train.<phase name>`` message to every node; a node that fails stops
the run with a :class:`~fedplug.errors.TrainingError` naming the step, client and node.
Design: docs/flower.md, 'Design notes: setup_phase'.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid
from pydantic import ValidationError
from torch import Tensor

from fedplug.components import SLOT_KINDS, PhaseCost
from fedplug.errors import ConfigError, TrainingError
from fedplug.registry import Registry
from fedplug.setup_phase import (
    ClientInputs,
    ReportValue,
    SetupPhase,
    SetupReply,
    SetupStep,
    Value,
    checked_report,
    with_client_report,
)

from .decoding import MalformedReply, decode_array, to_tensor
from .records import CLIENT_ID, CONFIG_KEY, record_to_tensors, tensors_to_record

logger = logging.getLogger("fedplug.adapters.flower")

STEP = "fedplug.setup-step"
"""The ``config`` entry naming the step."""
FINAL = "fedplug.setup-final"
"""The ``config`` entry that marks the phase's last step (present and True only there)."""
VALUES_KEY = "fedplug.setup-values"
TENSORS_KEY = "fedplug.setup-tensors"
REPORT_KEY = "fedplug.setup-report"
MAX_SETUP_ELEMENTS = 10**8
"""The most elements one tensor of a node's setup reply may hold (400 MB of float32; a
phase's messages carry small models such as FedDisk's MADEs)."""


def message_type(phase: SetupPhase) -> str:
    """``train.<phase name>``: the type of every message of ``phase``."""
    return f"train.{phase.name}"


# ------------------------------------------------------------------------- server


def run_setup_phase(
    grid: Grid,
    node_of: Mapping[int, int],
    phase: SetupPhase,
    *,
    message_config: Mapping[str, Any],
    timeout: float | None,
) -> PhaseCost:
    """Run ``phase`` with every client of ``node_of`` on its node (see the module docstring).

    Args:
        grid: the ServerApp's grid.
        node_of: client id -> node id, for every client.
        phase: a component's setup phase.
        message_config: entries for every message's ``config`` record (the experiment).
        timeout: bound of each exchange, seconds (None: no bound).

    Returns:
        The phase's traffic, as its server side reports it.

    Raises:
        TrainingError: a node failed or replied malformed (the message names the step,
            the client and the node).
    """
    node_of = dict(sorted(node_of.items()))
    conversation = phase.server(len(node_of))
    try:
        step = next(conversation)
        while True:
            replies = _exchange(grid, node_of, phase, step, message_config, timeout)
            try:
                step = conversation.send(replies)
            except (ValueError, TypeError, RuntimeError, KeyError, IndexError) as error:
                # Well-typed replies the phase still cannot combine (tensors of shapes
                # that disagree, say): one line, not the phase's traceback.
                raise TrainingError(
                    f"setup phase {phase.name!r}, step {step.name!r}: the server could not "
                    f"use the nodes' replies ({type(error).__name__}: {error}); a node "
                    "replied malformed, so the run stops"
                ) from error
    except StopIteration as stop:
        cost = stop.value
    return cost if cost is not None else PhaseCost(0, 0, 0)


def _exchange(
    grid: Grid,
    node_of: Mapping[int, int],
    phase: SetupPhase,
    step: SetupStep,
    message_config: Mapping[str, Any],
    timeout: float | None,
) -> dict[int, SetupReply]:
    """``step`` to every node; every client's reply, or a TrainingError naming the first
    client that failed."""
    tensors = tensors_to_record(step.tensors) if step.tensors else None
    messages = []
    for client, node in node_of.items():
        content = RecordDict(
            {
                CONFIG_KEY: ConfigRecord(
                    {
                        **message_config,
                        CLIENT_ID: client,
                        STEP: step.name,
                        **({FINAL: True} if step.final else {}),
                    }
                ),
                VALUES_KEY: ConfigRecord(dict(step.values)),
            }
        )
        if tensors is not None:
            content[TENSORS_KEY] = tensors
        messages.append(
            Message(
                content,
                dst_node_id=node,
                message_type=message_type(phase),
                group_id=f"{phase.name}-{step.name}",
            )
        )
    received = {
        reply.metadata.src_node_id: reply
        for reply in grid.send_and_receive(messages, timeout=timeout)
    }
    replies = {}
    for client, node in node_of.items():
        reply = received.get(node)
        if reply is None:
            reason = f"sent no reply within {timeout}s"
        elif reply.has_error():
            reason = f"raised: {reply.error.reason}"
        elif VALUES_KEY not in reply.content.config_records:
            reason = f"replied without a {VALUES_KEY!r} record"
        else:
            try:
                replies[client] = decode_setup_reply(reply.content)
                continue
            except ValueError as error:
                reason = f"replied malformed: {error}"
        raise TrainingError(
            f"setup phase {phase.name!r}, step {step.name!r}: client {client} (node {node}) "
            f"{reason}. The phase needs every client, so the run stops. (A ClientApp answers "
            f"these messages with @app.train({phase.name!r}) returning "
            "trainer.setup_phase(data, message, context); the ready client_app does.)"
        )
    return replies


def decode_setup_reply(content: RecordDict) -> SetupReply:
    """A node's answer to a step, decoded defensively (:mod:`.decoding`): every tensor a
    ``numpy.ndarray`` of a real dtype, at most :data:`MAX_SETUP_ELEMENTS` elements and
    finite; every value an int, float, str or bool, numbers finite; the client report
    (when there is one) as :func:`fedplug.setup_phase.checked_report` allows.

    Raises:
        ValueError: the first field that breaks these rules (the text says which).
    """
    tensors: dict[str, Tensor] = {}
    arrays = content.array_records.get(TENSORS_KEY)
    for key in arrays.keys() if arrays is not None else []:
        array = decode_array(arrays[key], key, max_elements=MAX_SETUP_ELEMENTS)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise MalformedReply(f"sent tensor {key!r} with non-finite (NaN/Inf) values")
        tensors[key] = to_tensor(array)
    values: dict[str, Value] = {}
    for key, value in content.config_records[VALUES_KEY].items():
        if isinstance(value, float) and not math.isfinite(value):
            raise MalformedReply(f"sent value {key!r} = {value}, not finite")
        if not isinstance(value, (int, float, str, bool)):
            raise MalformedReply(
                f"sent value {key!r} as {type(value).__name__}, not an int, float, str or bool"
            )
        values[key] = value
    report_record = content.config_records.get(REPORT_KEY)
    report: dict[str, ReportValue] = {}
    if report_record is not None:
        try:
            report = checked_report(
                {key: list(value) if isinstance(value, (list, tuple)) else value for key, value in report_record.items()}
            )
        except ValueError as error:
            raise MalformedReply(f"sent a malformed client report: {error}") from None
    return SetupReply(tensors=tensors, values=values, report=report)


# --------------------------------------------------------------------------- node


def answer_setup_step(
    phase: SetupPhase,
    data: ClientInputs,
    message: Message,
    context: Context,
    namespace: str,
    device: torch.device | str = "cpu",
) -> Message:
    """Do the step ``message`` carries on this node's client ``data`` and reply; the
    client's state stays in ``context.state``.

    Raises:
        ConfigError: the message is of another phase than ``phase``.
    """
    if message.metadata.message_type != message_type(phase):
        raise ConfigError(
            f"a {message.metadata.message_type!r} message arrived, but this node answers it with "
            f"the setup phase {phase.name!r} ({message_type(phase)!r})"
        )
    content = message.content
    config = content.config_records.get(CONFIG_KEY, ConfigRecord())
    step = SetupStep(
        name=str(config.get(STEP, "")),
        tensors=record_to_tensors(content.array_records.get(TENSORS_KEY), device),
        values=dict(content.config_records.get(VALUES_KEY, ConfigRecord())),
        final=bool(config.get(FINAL, False)),
    )
    state = load_phase_state(context, namespace, phase.name, device)
    reply = with_client_report(phase, step, phase.client(step, data, state), state)
    save_phase_state(context, namespace, phase.name, state)
    records = RecordDict({VALUES_KEY: ConfigRecord(dict(reply.values))})
    if reply.tensors:
        records[TENSORS_KEY] = tensors_to_record(reply.tensors)
    if step.final:
        records[REPORT_KEY] = ConfigRecord(dict(reply.report))
    return Message(records, reply_to=message)


def _state_keys(namespace: str, name: str) -> tuple[str, str]:
    prefix = f"{namespace}.setup.{name}"
    return f"{prefix}.tensors", f"{prefix}.values"


def load_phase_state(
    context: Context, namespace: str, name: str, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """The state the client side of phase ``name`` keeps on this node (empty before its
    first step)."""
    tensors_key, values_key = _state_keys(namespace, name)
    state: dict[str, Any] = dict(context.state.config_records.get(values_key, ConfigRecord()))
    state.update(record_to_tensors(context.state.array_records.get(tensors_key), device))
    return state


def save_phase_state(context: Context, namespace: str, name: str, state: Mapping[str, Any]) -> None:
    """Keep ``state`` (tensors and plain values) in ``context.state`` for the next step.

    Raises:
        TypeError: a value is neither a tensor nor an int, float, str or bool.
    """
    tensors: dict[str, Tensor] = {}
    values: dict[str, Value] = {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            tensors[key] = value
        elif isinstance(value, (int, float, str, bool)):
            values[key] = value
        else:
            raise TypeError(
                f"setup phase {name!r} keeps {key!r} of type {type(value).__name__} in a client's "
                "state; only tensors and int, float, str or bool values can be kept"
            )
    tensors_key, values_key = _state_keys(namespace, name)
    context.state[tensors_key] = tensors_to_record(tensors)
    context.state[values_key] = ConfigRecord(values)


# ---------------------------------------------------------------------- discovery


def setup_phase_names(registry: Registry) -> list[str]:
    """The names of the setup phases the components of ``registry`` (of every slot)
    declare with their default config: the actions a ready ClientApp answers. A
    component whose config has no defaults cannot be built here; its users register its
    handler themselves."""
    names: list[str] = []
    for kind in SLOT_KINDS.values():
        for registration in registry.entries(kind):
            try:
                config = registration.config_class()
            except ValidationError:
                continue
            arguments = (1,) if kind == SLOT_KINDS["aggregator"] else ()
            phase = registration.factory(config, *arguments).setup_phase()
            if phase is not None and phase.name not in names:
                names.append(phase.name)
    return names


def register_setup_phases(app: Any, handler: Any, names: Iterable[str]) -> None:
    """``app.train(name)(handler)`` for every phase name of ``names``."""
    for name in names:
        app.train(name)(handler)
