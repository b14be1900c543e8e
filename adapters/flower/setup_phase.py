"""Any component's setup phase (:class:`fedplug.setup_phase.SetupPhase`), whatever its
slot, over Flower messages: the server drives the phase, every node answers for its own
client and keeps its client's state in ``context.state``.

Each step is one ``train.<phase name>`` message to every node; a node that fails stops
the run with a :class:`~fedplug.errors.TrainingError` naming the step, client and node.
Every reply is decoded against the schemas the phase declares and screened like a round's
reply; a node that breaks them is dropped from a phase that can go on without it (the run
then never samples it), else stops the run in one line.
Design: docs/flower.md, 'Design notes: setup_phase'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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
from fedplug.run.client_text import client_text
from fedplug.schema import MessageSchema, SchemaViolation
from fedplug.screening import ScreeningConfig, claimed_samples_problem, parameters_change_problem
from fedplug.setup_phase import (
    DEFAULT_REPLY,
    PLAIN_REPORT,
    ClientInputs,
    ReplySchema,
    ReportValue,
    SetupPhase,
    SetupReplies,
    SetupReply,
    SetupStep,
    Value,
    with_client_report,
)

from .decoding import MalformedReply, decode_array, to_tensor
from .records import CLIENT_ID, CONFIG_KEY, record_to_tensors, tensors_to_record
from .reply_matching import answering_replies

logger = logging.getLogger("fedplug.adapters.flower")

STEP = "fedplug.setup-step"
"""The ``config`` entry naming the step."""
FINAL = "fedplug.setup-final"
"""The ``config`` entry that marks the phase's last step (present and True only there)."""
VALUES_KEY = "fedplug.setup-values"
TENSORS_KEY = "fedplug.setup-tensors"
REPORT_KEY = "fedplug.setup-report"


def message_type(phase: SetupPhase) -> str:
    """``train.<phase name>``: the type of every message of ``phase``."""
    return f"train.{phase.name}"


# ------------------------------------------------------------------------- server


@dataclass(frozen=True)
class SetupScreen:
    """What the server screens every setup reply against besides the phase's schemas, as
    it screens a round's replies: ``train.screening``, the clients' class counts summed
    where it holds them, and how many clients a phase may lose
    (``train.failures.max_failed_fraction`` of them)."""

    config: ScreeningConfig = field(default_factory=ScreeningConfig)
    max_samples: np.ndarray | None = None
    """Client k's class counts summed (None: the server holds none)."""
    max_failed_fraction: float = 0.5


def run_setup_phase(
    grid: Grid,
    node_of: Mapping[int, int],
    phase: SetupPhase,
    *,
    message_config: Mapping[str, Any],
    timeout: float | None,
    screen: SetupScreen | None = None,
) -> PhaseCost:
    """:func:`drive_setup_phase`'s cost (for a caller that does not sample nodes later)."""
    cost, _ = drive_setup_phase(
        grid, node_of, phase, message_config=message_config, timeout=timeout, screen=screen
    )
    return cost


def drive_setup_phase(
    grid: Grid,
    node_of: Mapping[int, int],
    phase: SetupPhase,
    *,
    message_config: Mapping[str, Any],
    timeout: float | None,
    screen: SetupScreen | None = None,
) -> tuple[PhaseCost, dict[int, str]]:
    """Run ``phase`` with every client of ``node_of`` on its node (see the module docstring).

    Every reply is decoded against what the phase declares for its step
    (:meth:`~fedplug.setup_phase.SetupPhase.reply_schema`, and
    :meth:`~fedplug.setup_phase.SetupPhase.report_schema` for the last step's reports) and
    screened like a round's reply (``screen``). When the phase
    :attr:`~fedplug.setup_phase.SetupPhase.tolerates_dropped_clients`, a client whose
    reply breaks them (or that the phase's server side drops) is dropped with one
    warning naming the client, its node and the reason: it gets no later step, and the
    caller leaves it out of the run. Otherwise the run stops with one line.

    Args:
        grid: the ServerApp's grid.
        node_of: client id -> node id, for every client.
        phase: a component's setup phase.
        message_config: entries for every message's ``config`` record (the experiment).
        timeout: bound of each exchange, seconds (None: no bound).
        screen: the screening bounds (default: ``train.screening``'s defaults, no class
            counts, half the clients may be dropped).

    Returns:
        The phase's traffic, as its server side reports it, and the dropped clients
        (client id -> reason).

    Raises:
        TrainingError: a node failed, replied malformed to a phase that needs every
            client, or more than ``max_failed_fraction`` of the clients (or all) were
            dropped (the message names the step, and the client and node).
    """
    screen = screen if screen is not None else SetupScreen()
    node_of = dict(sorted(node_of.items()))
    active = dict(node_of)
    dropped: dict[int, str] = {}
    conversation = phase.server(len(node_of))
    cost = None
    try:
        step = next(conversation)
        while True:
            replies = _exchange(grid, active, phase, step, message_config, timeout, screen)
            asked = step
            try:
                step = conversation.send(replies)
            except StopIteration:
                _leave_out(phase, asked, replies, active, dropped, node_of, screen)
                raise
            except (ValueError, TypeError, RuntimeError, KeyError, IndexError) as error:
                # Well-typed replies the phase still cannot combine (tensors of shapes
                # that disagree, say): one line, not the phase's traceback.
                raise TrainingError(
                    f"setup phase {phase.name!r}, step {asked.name!r}: the server could not "
                    f"use the nodes' replies ({type(error).__name__}: {error}); a node "
                    "replied malformed, so the run stops"
                ) from error
            _leave_out(phase, asked, replies, active, dropped, node_of, screen)
    except StopIteration as stop:
        cost = stop.value
    return (cost if cost is not None else PhaseCost(0, 0, 0)), dropped


def _leave_out(
    phase: SetupPhase,
    step: SetupStep,
    replies: SetupReplies,
    active: dict[int, int],
    dropped: dict[int, str],
    node_of: Mapping[int, int],
    screen: SetupScreen,
) -> None:
    """Take the clients dropped at ``step`` (by the runtime or the phase) out of
    ``active``, each with one warning line.

    Raises:
        TrainingError: more than ``max_failed_fraction`` of the clients, or all of them,
            are dropped.
    """
    for client, reason in replies.dropped.items():
        if client in dropped:
            continue
        dropped[client] = reason
        active.pop(client, None)
        logger.warning(
            "setup phase %r, step %r: client %d (node %d) dropped, it %s; the run goes on without it",
            phase.name,
            step.name,
            client,
            node_of[client],
            reason,
        )
    limit = screen.max_failed_fraction * len(node_of)
    if dropped and (not active or len(dropped) > limit):
        named = "; ".join(f"client {client} (node {node_of[client]}) {reason}" for client, reason in dropped.items())
        raise TrainingError(
            f"setup phase {phase.name!r}: {len(dropped)} of {len(node_of)} clients dropped, over "
            f"train.failures.max_failed_fraction={screen.max_failed_fraction:g} ({named[:600]}); the run stops"
        )


def _exchange(
    grid: Grid,
    node_of: Mapping[int, int],
    phase: SetupPhase,
    step: SetupStep,
    message_config: Mapping[str, Any],
    timeout: float | None,
    screen: SetupScreen,
) -> SetupReplies:
    """``step`` to every node of ``node_of``; every client's decoded, screened reply. A
    reply that breaks the phase's schema or the screen is left out and its client listed
    in :attr:`~fedplug.setup_phase.SetupReplies.dropped` (when the phase tolerates it).

    Raises:
        TrainingError: a node failed or sent nothing, or (for a phase that needs every
            client) replied malformed; the text names the first such client and node.
    """
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
    replies_received = grid.send_and_receive(messages, timeout=timeout)
    received = {
        reply.metadata.src_node_id: reply
        for reply in answering_replies(
            messages, replies_received, f"setup phase {phase.name!r}, step {step.name!r}"
        )
    }
    expects = phase.reply_schema(step)
    report = phase.report_schema() if step.final else None
    replies = SetupReplies()
    for client, node in node_of.items():
        reply = received.get(node)
        if reply is None:
            reason = f"sent no reply within {timeout}s"
        elif reply.has_error():
            reason = f"raised: {client_text(reply.error.reason)}"
        elif VALUES_KEY not in reply.content.config_records:
            reason = f"replied without a {VALUES_KEY!r} record"
        else:
            try:
                decoded = decode_setup_reply(reply.content, expects, report)
                problem = screen_setup_reply(decoded, expects, screen, client)
            except ValueError as error:
                problem = f"replied malformed: {error}"
            if problem is None:
                replies[client] = decoded
                continue
            reason = client_text(problem)  # bounded and single-line: it reaches a log line
            if phase.tolerates_dropped_clients:
                replies.drop(client, reason)
                continue
        raise TrainingError(
            f"setup phase {phase.name!r}, step {step.name!r}: client {client} (node {node}) "
            f"{reason}. The phase needs every client, so the run stops. (A ClientApp answers "
            f"these messages with @app.train({phase.name!r}) returning "
            "trainer.setup_phase(data, message, context); the ready client_app does.)"
        )
    return replies


def screen_setup_reply(
    reply: SetupReply, expects: ReplySchema, screen: SetupScreen, client: int
) -> str | None:
    """Why ``client``'s decoded ``reply`` fails the screen a round's reply would, or None:
    its claimed sample count (``expects.sample_count``) against
    ``train.screening.max_num_examples`` and its class counts, its parameters' change
    from ``expects.reference`` against the norm bounds
    (:mod:`fedplug.screening`)."""
    if expects.sample_count is not None and expects.sample_count in reply.values:
        held = None
        if screen.max_samples is not None and 0 <= client < len(screen.max_samples):
            held = int(screen.max_samples[client])
        claimed = reply.values[expects.sample_count]
        if reason := claimed_samples_problem(expects.sample_count, claimed, held, screen.config):
            return reason
    if expects.reference is not None and reply.tensors:
        return parameters_change_problem(reply.tensors, expects.reference, screen.config)
    return None


def decode_setup_reply(
    content: RecordDict, expects: ReplySchema = DEFAULT_REPLY, report: MessageSchema | None = PLAIN_REPORT
) -> SetupReply:
    """A node's answer to a step, decoded defensively against what the phase declares
    (``expects``; ``report``: the client report's schema, None: a report is ignored):
    every tensor a ``numpy.ndarray`` of a real dtype, its ``.npy`` header read and
    bounded by its field (:mod:`.decoding`) before any data is converted, then checked
    (shape, finite values); every value and the report's fields as their schemas say.

    Raises:
        ValueError: the first field that breaks these rules (the text says which).
    """
    tensors: dict[str, Tensor] = {}
    arrays = content.array_records.get(TENSORS_KEY)
    for key in arrays.keys() if arrays is not None else []:
        bound = expects.tensors.element_bound(key)
        if bound is None:
            if expects.tensors.unknown == "ignore":
                continue
            raise MalformedReply(f"sent tensor {key!r}, which the step does not expect")
        tensors[key] = to_tensor(decode_array(arrays[key], key, max_elements=bound))
    tensors = _checked(expects.tensors, tensors, "")
    values = _checked(expects.values, dict(content.config_records[VALUES_KEY].items()), "")
    report_record = content.config_records.get(REPORT_KEY)
    checked_report: dict[str, ReportValue] = {}
    if report_record is not None and report is not None:
        plain = {key: list(value) if isinstance(value, (list, tuple)) else value for key, value in report_record.items()}
        checked_report = _checked(report, plain, "sent a malformed client report: ")
    return SetupReply(tensors=tensors, values=values, report=checked_report)


def _checked(schema: MessageSchema, mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    try:
        return schema.check(mapping)
    except SchemaViolation as violation:
        raise MalformedReply(f"{prefix}{violation}") from None


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
