"""Phases that run on the clients' data before round 1, the same way on every runtime.

A component that must learn from the clients' own data before training (FedDisk's
density models) declares a :class:`SetupPhase`: a conversation whose server side yields
one :class:`SetupStep` at a time and receives every client's :class:`SetupReply`. The simulator and
FedML run it in one process (:func:`run_in_process`), Flower over messages.
Design: docs/round.md, 'Components describe themselves' and 'Design notes: setup phase'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import Tensor

from fedplug.components import ComponentHooks, Context, PhaseCost
from fedplug.errors import TrainingError
from fedplug.schema import MessageSchema, PlainValue, Scalar, SchemaViolation, TensorField

NO_COST = PhaseCost(0, 0, 0)
"""The cost of no phase."""

Value = int | float | str | bool
"""A plain value a step or a reply carries."""

ReportValue = int | float | str | bool | list[int] | list[float]
"""A value of a client's report: a plain value or a list of numbers (a histogram's counts)."""

MAX_SETUP_ELEMENTS = 10**8
"""The most elements one tensor of a client's setup reply may hold by default (400 MB of
float32; a phase's messages carry small models such as FedDisk's MADEs)."""

PLAIN_REPORT = MessageSchema("client report", unknown=PlainValue())
"""The report rule of a phase that declares nothing more (:meth:`SetupPhase.report_schema`):
any names, each value as :class:`~fedplug.schema.PlainValue` allows, 1 MiB in all."""


@dataclass(frozen=True)
class ReplySchema:
    """What the server accepts in every client's reply to one step: its values and tensors
    (:class:`~fedplug.schema.MessageSchema` each), and what the runtime screens as it
    screens a round's reply (``train.screening``)."""

    values: MessageSchema = field(default_factory=lambda: MessageSchema("setup value", unknown=Scalar()))
    tensors: MessageSchema = field(
        default_factory=lambda: MessageSchema(
            "setup tensor", unknown=TensorField(max_elements=MAX_SETUP_ELEMENTS), max_bytes=1 << 40
        )
    )
    sample_count: str | None = None
    """The value that claims the client's training samples: at most its class counts'
    sum where the server holds them (``train.screening.check_num_examples``) and at most
    ``train.screening.max_num_examples``."""
    reference: Mapping[str, Tensor] | None = field(default=None, compare=False)
    """The parameters the reply's tensors were trained from (what the server sent): their
    change is bounded like a round's update (``train.screening.max_norm_ratio``,
    ``max_update_norm``). None: the tensors are not a model's."""


DEFAULT_REPLY = ReplySchema()
"""The reply rule of a step whose phase declares nothing more: plain values (finite
numbers, strings, bools) and finite tensors of at most :data:`MAX_SETUP_ELEMENTS`."""


@dataclass(frozen=True)
class SetupStep:
    """One message from the server to every client: a step name, tensors, and values."""

    name: str
    tensors: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    final: bool = False
    """The phase's last step: every client adds its :meth:`SetupPhase.client_report` to
    its reply (the runtime does, after :meth:`SetupPhase.client`)."""
    expects: ReplySchema | None = field(default=None, compare=False)
    """What the server accepts in the replies (:meth:`SetupPhase.reply_schema`; None:
    :data:`DEFAULT_REPLY`). Stays on the server: never sent to the clients."""


@dataclass(frozen=True)
class SetupReply:
    """One client's answer to a :class:`SetupStep`."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    report: dict[str, ReportValue] = field(default_factory=dict)
    """The client's :meth:`SetupPhase.client_report`, in the reply to a ``final`` step
    (empty in any other)."""


class SetupReplies(dict[int, SetupReply]):
    """``{client id: reply}`` of one step, as the server's side receives it; that side may
    :meth:`drop` a client whose reply it cannot use (a phase that
    :attr:`~SetupPhase.tolerates_dropped_clients`); the runtime then leaves the client out
    of the later steps and of the run."""

    def __init__(self, replies: Mapping[int, SetupReply] = ()) -> None:  # type: ignore[assignment]
        super().__init__(replies)
        self.dropped: dict[int, str] = {}
        """client id -> why it was dropped, in the order dropped."""

    def drop(self, client: int, reason: str) -> None:
        """Leave ``client`` out of this step's replies and of the rest of the run;
        ``reason`` says what it sent (a phrase after "client 3 ...")."""
        self.pop(client, None)
        self.dropped.setdefault(client, reason)


class ClientInputs(Protocol):
    """What a client's side of a phase reads: its own training data."""

    client_id: int
    train_x: Tensor
    train_y: Tensor


class SetupPhase(ABC):
    """A phase before round 1, driven by the server in steps (see the module docstring)."""

    name: str
    """Short name; on Flower, the message type is ``train.<name>``."""
    tolerates_dropped_clients: bool = False
    """The server's side goes on without a client missing from a step's replies (it reads
    the clients of each step's replies, not all of them): a runtime then drops a client
    whose reply breaks the phase's schema or screen, instead of stopping the run."""

    @abstractmethod
    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        """The server's side: yield each step, receive ``{client id: reply}`` for every
        client, and return the phase's traffic (its rounds and bytes)."""

    @abstractmethod
    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        """One client's answer to ``step``. ``state`` persists between the steps of this
        client (tensors and plain values only, so a runtime can store it)."""

    def clients(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        """The answers of several clients to ``step`` in one call, in the order of ``data``
        (``states[i]`` is client ``data[i]``'s state); what :func:`run_in_process` calls.
        The default asks :meth:`client` for each in turn; a phase may override it to work
        on all of them at once (FedDisk trains its clients' MADEs vectorised), as long as
        every client's reply and state are what :meth:`client` would give."""
        return [self.client(step, client, state) for client, state in zip(data, states)]

    @abstractmethod
    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        """After the last step, where every client's ``state`` is at hand (in one
        process): keep what training needs (the simulator's path)."""

    @abstractmethod
    def client_context(self, state: dict[str, Any]) -> Context:
        """After the last step, on a client that kept its own ``state`` (a Flower node):
        the loss transform's context for that client."""

    def client_report(self, state: dict[str, Any]) -> dict[str, ReportValue]:
        """After the ``final`` step, on the client: what the run's setup report needs of
        this client's ``state``, small (summary numbers, never raw data or weights). The
        runtime sends it in the reply to the final step (:attr:`SetupReply.report`), where
        the server side assembles the report from every client's. Default: nothing."""
        return {}

    def report_schema(self) -> MessageSchema:
        """What the server accepts in a client's :meth:`client_report`, checked before the
        server's side reads it. Default: :data:`PLAIN_REPORT` (any names, plain values).
        A phase that reads its reports declares their fields, bounds and size."""
        return PLAIN_REPORT

    def reply_schema(self, step: SetupStep) -> ReplySchema:
        """What the server accepts in the replies to ``step``: the step's
        :attr:`~SetupStep.expects`, else :data:`DEFAULT_REPLY`."""
        return step.expects if step.expects is not None else DEFAULT_REPLY

    def check_data(self, state: dict[str, Any], num_samples: int) -> None:
        """On a client that kept its own ``state``, before each round's training: raise
        :class:`fedplug.errors.DataError` when what the phase left no longer fits the
        client's training data of ``num_samples`` samples (default: no check)."""


def with_client_report(phase: SetupPhase, step: SetupStep, reply: SetupReply, state: dict[str, Any]) -> SetupReply:
    """``reply`` with the client's :meth:`SetupPhase.client_report` of ``state`` when
    ``step`` is the phase's final one (what every runtime does on the client)."""
    if not step.final:
        return reply
    return replace(reply, report=checked_report(phase.client_report(state)))


def checked_report(report: Mapping[str, ReportValue]) -> dict[str, ReportValue]:
    """``report`` when every value is a string, a bool, a finite number or a list of
    finite numbers of one type (all ints or all floats): what every runtime can carry
    (:data:`PLAIN_REPORT`).

    Raises:
        ValueError: the first entry that is not (the text names it).
    """
    return PLAIN_REPORT.check(report)


def checked_reply(phase: SetupPhase, step: SetupStep, reply: SetupReply) -> SetupReply:
    """``reply`` to ``step`` decoded against what ``phase`` declares for it
    (:meth:`SetupPhase.reply_schema`, and :meth:`SetupPhase.report_schema` for the
    report of a ``final`` step's reply).

    Raises:
        SchemaViolation: the first field that breaks them (the text names it).
    """
    schema = phase.reply_schema(step)
    values = schema.values.check(reply.values)
    tensors = schema.tensors.check(reply.tensors)
    report = phase.report_schema().check(reply.report) if step.final else dict(reply.report)
    return SetupReply(tensors=tensors, values=values, report=report)


def run_in_process(phase: SetupPhase, clients: list[ClientInputs]) -> PhaseCost:
    """Run ``phase`` with every client in this process (the simulator's and FedML's
    path): each step goes to every client at once (:meth:`SetupPhase.clients`), in id
    order; the replies to the ``final`` step carry each client's report."""
    clients = sorted(clients, key=lambda client: client.client_id)
    ids = [client.client_id for client in clients]
    states: dict[int, dict[str, Any]] = {client_id: {} for client_id in ids}
    conversation = phase.server(len(clients))
    replies = SetupReplies()
    try:
        step = next(conversation)
        while True:
            answers = phase.clients(step, clients, [states[client_id] for client_id in ids])
            replies = SetupReplies(
                {
                    client_id: _checked_in_process(
                        phase, step, client_id, with_client_report(phase, step, answer, states[client_id])
                    )
                    for answer, client_id in zip(answers, ids, strict=True)
                }
            )
            step = conversation.send(replies)
            _refuse_drops(phase, replies)
    except StopIteration as stop:
        cost = stop.value
        _refuse_drops(phase, replies)
    phase.finish(states)
    return cost if cost is not None else PhaseCost(0, 0, 0)


def _checked_in_process(phase: SetupPhase, step: SetupStep, client: int, reply: SetupReply) -> SetupReply:
    """``reply`` decoded against ``phase``'s schemas (:func:`checked_reply`). In one
    process every client runs the phase's own code, so a violation is the phase's bug:
    one line naming the phase, the step, the client and the field, and the run stops (the
    simulator's clients cannot be left out of a run, unlike a Flower node).

    Raises:
        TrainingError: the reply breaks the schema.
    """
    try:
        return checked_reply(phase, step, reply)
    except SchemaViolation as violation:
        raise TrainingError(
            f"setup phase {phase.name!r}, step {step.name!r}: client {client}'s reply breaks what the "
            f"phase declares ({violation}); the phase's client side and its schema disagree (a bug in "
            "the component)"
        ) from None


def _refuse_drops(phase: SetupPhase, replies: SetupReplies) -> None:
    """In one process, a client the server's side dropped stops the run (one line)."""
    for client, reason in replies.dropped.items():
        raise TrainingError(
            f"setup phase {phase.name!r}: its server side dropped client {client}, which {reason}; "
            "in one process every client runs the phase's own code, so this is a bug in the component"
        )


def prepare_in_process(components: Iterable[ComponentHooks], federation: Any) -> PhaseCost:
    """Prepare ``components`` (a run's :class:`~fedplug.run.components.Components`, or
    any of its slots) in one process that holds the whole ``federation``: every one's
    :meth:`~fedplug.components.ComponentHooks.prepare`, then :func:`setup_in_process`.
    The returned cost adds up all of them."""
    components = list(components)
    cost = NO_COST
    for component in components:
        cost = cost + (component.prepare(federation) or NO_COST)
    return cost + setup_in_process(components, federation)


def setup_in_process(components: Iterable[ComponentHooks], federation: Any) -> PhaseCost:
    """Run the setup phase of every one of ``components`` that declares one (whatever its
    slot, in the order given; ask after they have prepared) with every client of
    ``federation`` in this process (:func:`run_in_process`); their costs added up."""
    cost = NO_COST
    clients: list[ClientInputs] | None = None
    for component in components:
        phase = component.setup_phase()
        if phase is None:
            continue
        if clients is None:
            clients = [
                PhaseInputs(index, client.train_x, client.train_y)
                for index, client in enumerate(federation.clients)
            ]
        cost = cost + run_in_process(phase, clients)
    return cost


def prepare_loss_transform(loss_transform: ComponentHooks, federation: Any) -> PhaseCost:
    """:func:`prepare_in_process` of one component (a loss transform, or any slot's)."""
    return prepare_in_process([loss_transform], federation)


@dataclass(frozen=True)
class PhaseInputs:
    """One client's :class:`ClientInputs`, as a runtime hands them to a phase."""

    client_id: int
    train_x: Tensor
    train_y: Tensor
