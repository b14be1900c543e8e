"""The capability exchange: before any client trains, the server asks ONE node what its
ClientApp provides, and stops with one line when the config needs more.

Client side: every fedplug piece given the ClientApp (``RoundSampler(..., app=app)``,
``FedplugLoss(..., app=app)``, ``FedplugTrainer.from_config(..., app=app)``,
``answer_class_counts``, the ready ``make_client_app``) declares its components with
:func:`declare`; the first declaration on an app registers one ``@app.query("fedplug")``
handler, which answers a :data:`CAPABILITY_QUERY` message with a ConfigRecord
:data:`CAPABILITIES_KEY` holding

- ``components``: ``"<slot>=<name>"`` for every component a piece runs on the client
  (``"<slot>=*"``: the ready ClientApp, which builds whatever the server's config names);
- ``handlers``: the message types the app answers (``"query.default"``,
  ``"train.feddisk"``, ...), read from the app when the probe arrives.

The first declaration also installs :func:`configuration_errors_as_replies` on the app,
a Flower mod around every handler: a fedplug :class:`~fedplug.errors.ConfigError` raised
inside one (FedplugLoss's optimiser check at the first ``optimizer.step()``) becomes an
error reply whose reason starts with :data:`CONFIGURATION_ERROR`, not an exception that
the simulation engine logs with its traceback on every node; the server stops the run
at the first such reply (:func:`configuration_error_in`).

Server side: :func:`probe_client_app` sends the query to one node (every SuperNode of a
Flower run executes the same ClientApp, so one answer describes them all) and
:func:`missing_pieces` compares the answer with what the config needs. A stock ClientApp
answers with Flower's "No query function registered with name 'fedplug'" error; one
node, so at most one such error reaches the log.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedplug.errors import ConfigError, TrainingError
from fedplug.flower_internals import CLIENT_APP_RAISED_EXCEPTION
from fedplug.run.client_text import MAX_CONFIGURATION_LINE_CHARS, client_text

from .reply_matching import answering_replies
from .requirements import Component, own_loop_pieces

CAPABILITY_ACTION = "fedplug"
CAPABILITY_QUERY = f"query.{CAPABILITY_ACTION}"
"""The probe's message type (Flower 1.41: ``<category>.<action>``, the action an identifier)."""
CAPABILITIES_KEY = "fedplug.capabilities"
COMPONENTS = "components"
HANDLERS = "handlers"
ANY_COMPONENT = "*"
CLIENT_SLOTS = ("sampler", "loss_transform", "aggregator")
"""The ``train`` slots with a client side (the grouper is the server's)."""
NO_HANDLER = f"No query function registered with name '{CAPABILITY_ACTION}'"
"""What Flower 1.41 answers the probe with when no fedplug piece was given the app."""
CLASS_COUNT_HANDLER = "query.default"
GUIDE = "docs/flower.md, 'Client-side algorithms'"
CONFIGURATION_ERROR = "fedplug configuration error: "
"""How the reason of a reply from :func:`configuration_errors_as_replies` starts."""

Handler = Callable[[Message, Context], Message]
"""A ClientApp handler (Flower's ``ClientAppCallable``)."""

_declared: weakref.WeakKeyDictionary[ClientApp, set[tuple[str, str]]] = (
    weakref.WeakKeyDictionary()
)
"""app -> the (slot, name) pairs its fedplug pieces declared."""


# ----------------------------------------------------------------------- client side


def declare(app: ClientApp, components: Mapping[str, str]) -> None:
    """Declare that ``app`` runs these client-side components (slot -> name); register
    the app's capability handler the first time a piece declares anything on it."""
    first = app not in _declared
    declared = _declared.setdefault(app, set())
    declared.update(components.items())
    if first:
        install_reply_mod(app)
        app.query(CAPABILITY_ACTION)(CapabilityHandler(app, declared))


def configuration_errors_as_replies(
    message: Message, context: Context, call_next: Handler
) -> Message:
    """A Flower mod: a fedplug ConfigError raised by the handler becomes an error reply
    (reason :data:`CONFIGURATION_ERROR` + the error's line), which the server turns into
    one line; any other exception goes on to Flower unchanged."""
    try:
        return call_next(message, context)
    except ConfigError as error:
        reason = CONFIGURATION_ERROR + " ".join(str(error).split())
        return Message(Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)


def install_reply_mod(app: ClientApp) -> None:
    """Put :func:`configuration_errors_as_replies` around ``app``'s handlers, once:
    those registered later get it from ``app._mods`` (Flower wraps a handler in the
    app's mods when it is registered), those already registered are wrapped here."""
    mods = getattr(app, "_mods", None)
    handlers = getattr(app, "_registered_funcs", None)
    if not isinstance(mods, list) or not isinstance(handlers, dict):
        return  # a Flower release that renamed them: errors keep Flower's handling
    if configuration_errors_as_replies in mods:
        return
    mods.append(configuration_errors_as_replies)
    for name, handler in handlers.items():
        handlers[name] = _with_reply_mod(handler)


def _with_reply_mod(handler: Handler) -> Handler:
    def wrapped(message: Message, context: Context) -> Message:
        return configuration_errors_as_replies(message, context, handler)

    return wrapped


def configuration_error_in(reply: Message) -> str | None:
    """The client's one line when ``reply`` is a fedplug configuration-error reply
    (:func:`configuration_errors_as_replies`), else None."""
    if not reply.has_error():
        return None
    reason = client_text(reply.error.reason, MAX_CONFIGURATION_LINE_CHARS)
    if not reason.startswith(CONFIGURATION_ERROR):
        return None
    return reason[len(CONFIGURATION_ERROR) :]


def stop_at_configuration_error(replies: Iterable[Message]) -> None:
    """Stop the run at the first configuration-error reply: every node runs the same
    ClientApp, so retrying or counting it as one client's failure cannot help.

    Raises:
        TrainingError: the client's line, naming its node.
    """
    for reply in replies:
        line = configuration_error_in(reply)
        if line is not None:
            raise TrainingError(
                f"node {reply.metadata.src_node_id} refused to train: {line}"
            )


class CapabilityHandler:
    """The app's ``@app.query("fedplug")`` handler. It holds the app and the declared set
    itself, not a weak reference: the simulation engine pickles the ClientApp into each
    Ray actor, where the registry above is empty."""

    def __init__(self, app: ClientApp, declared: set[tuple[str, str]]) -> None:
        self.app = app
        self.declared = declared

    def __call__(self, message: Message, context: Context) -> Message:
        record = capability_record(self.declared, handlers_of(self.app))
        return Message(RecordDict({CAPABILITIES_KEY: record}), reply_to=message)


def handlers_of(app: ClientApp | None) -> list[str]:
    """The message types ``app`` answers (Flower keeps them in ``_registered_funcs``;
    empty when a Flower release renames it)."""
    return sorted(getattr(app, "_registered_funcs", {}) or {})


def capability_record(components: Iterable[tuple[str, str]], handlers: Sequence[str]) -> ConfigRecord:
    """The reply's ConfigRecord (lists only when non-empty: Flower types lists by their items)."""
    record = ConfigRecord()
    pairs = sorted(f"{slot}={name}" for slot, name in components)
    if pairs:
        record[COMPONENTS] = pairs
    if handlers:
        record[HANDLERS] = list(handlers)
    return record


# ----------------------------------------------------------------------- server side


@dataclass(frozen=True)
class Capabilities:
    """What one node's ClientApp said it provides."""

    components: frozenset[tuple[str, str]]
    handlers: frozenset[str]

    def names(self, slot: str) -> list[str]:
        return sorted(name for declared, name in self.components if declared == slot)

    def runs(self, slot: str, name: str) -> bool:
        names = self.names(slot)
        return name in names or ANY_COMPONENT in names


def parse_capabilities(record: ConfigRecord) -> Capabilities:
    """The :class:`Capabilities` in a reply's record (missing entries: none)."""
    pairs = [str(item).partition("=") for item in record.get(COMPONENTS, []) or []]
    return Capabilities(
        components=frozenset((slot, name) for slot, _, name in pairs),
        handlers=frozenset(str(item) for item in record.get(HANDLERS, []) or []),
    )


def needs_client_pieces(components: Sequence[Component], setup_phases: Sequence[str]) -> bool:
    """Whether the config needs a fedplug piece in the ClientApp: a client side, state,
    payload, extras or a setup phase. Reply metrics alone do not count (the quickstart
    replies ``train_loss``), nor do class counts alone (a server-side grouper's): any
    ``@app.query()`` handler may answer those, and the class-count query is then the
    check (:func:`.priors.gather_class_counts` asks one node first)."""
    if setup_phases:
        return True
    for entry in components:
        needs = entry.component.client_needs()
        if (
            needs.client_side
            or needs.client_state
            or needs.server_payload
            or needs.reply_extras
        ):
            return True
    return False


def missing_pieces(
    capabilities: Capabilities,
    components: Sequence[Component],
    setup_phases: Sequence[str],
    *,
    class_counts: bool,
) -> list[str]:
    """What the ClientApp lacks for this config, one phrase each (empty: nothing)."""
    missing = []
    for entry in components:
        needs = entry.component.client_needs()
        if not (needs.client_side or needs.client_state or needs.reply_extras):
            continue
        if capabilities.runs(entry.slot, entry.name):
            continue
        has = capabilities.names(entry.slot)
        piece = own_loop_pieces([entry])[0]
        if has:
            missing.append(
                f"train.{entry.slot} is {entry.name!r} on the server but {', '.join(map(repr, has))} "
                f"in the ClientApp: build its {piece.split('(')[0]} with the server's config ({piece})"
            )
        else:
            missing.append(f"train.{entry.slot} {entry.name!r} runs on the client: add {piece}")
    handlers = capabilities.handlers
    if class_counts and CLASS_COUNT_HANDLER not in handlers:
        missing.append(
            "the server asks every node for its class counts: add FedplugLoss(..., app=app, "
            "data=<context -> trainset>) or answer_class_counts(app, <context -> trainset>)"
        )
    for phase in setup_phases:
        if f"train.{phase}" not in handlers:
            missing.append(
                f"the setup phase {phase!r} runs before round 1: add FedplugLoss(..., app=app, "
                f"data=<context -> trainset>) (or @app.train({phase!r}) returning "
                "FedplugTrainer.setup_phase(data, message, context))"
            )
    return missing


def what_to_add(components: Sequence[Component], setup_phases: Sequence[str]) -> str:
    """What a ClientApp without fedplug pieces must add, in a phrase: the own-loop
    pieces, or fedplug's own loop."""
    pieces = own_loop_pieces(components, setup_phases[0] if setup_phases else None)
    own_loop = " and ".join(pieces) if pieces else "fedplug's client pieces"
    return (
        f"add {own_loop} to its @app.train() loop, or train with "
        "FedplugTrainer.from_config(train_config, app=app).fit"
    )


def provided_line(capabilities: Capabilities) -> str:
    """The INFO line saying what the ClientApp provides."""
    pairs = ", ".join(f"train.{slot} {name!r}" for slot, name in sorted(capabilities.components))
    return f"fedplug: the ClientApp provides {pairs or 'no client-side component'}"


def probe_client_app(
    grid: Grid, node_ids: Sequence[int], to_add: str, timeout: float | None
) -> Capabilities:
    """Ask the first of ``node_ids`` what its ClientApp provides (one node: every
    SuperNode of a run executes the same ClientApp).

    Raises:
        TrainingError: the app answers no capability query (a stock ClientApp: the line
            says what to add, ``to_add``), the node failed otherwise,
            or it did not answer within ``timeout``.
    """
    node = min(node_ids)
    message = Message(RecordDict(), dst_node_id=node, message_type=CAPABILITY_QUERY)
    with quiet_flower(NO_HANDLER):
        replies = grid.send_and_receive([message], timeout=timeout)
        replies = answering_replies([message], replies, "fedplug's capability query")
    if not replies:
        raise TrainingError(f"node {node} did not answer fedplug's capability query within {timeout}s")
    reply = replies[0]
    if reply.has_error():
        if NO_HANDLER in reply.error.reason:
            raise TrainingError(
                f"the ClientApp runs no fedplug client piece (node {node} does not answer "
                f"{CAPABILITY_QUERY!r}), so no client trained: {to_add} ({GUIDE})"
            )
        raise TrainingError(
            f"node {node} failed fedplug's capability query: {client_text(reply.error.reason)}"
        )
    record = reply.content.config_records.get(CAPABILITIES_KEY, ConfigRecord())
    return parse_capabilities(record)


FLOWER_BACKEND_ERROR = "An exception was raised when processing a message by"
"""The line Flower's simulation engine logs before a ClientApp's exception (dropped with
the probe's expected one: the probe goes to one node, so nothing else is in flight)."""


class _DropRecords(logging.Filter):
    """Drops the records that carry ``text`` (Flower's log of the probe's expected error)
    and the simulation engine's line announcing it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.text in message or message.startswith(FLOWER_BACKEND_ERROR):
            return False
        return not (record.exc_info and self.text in str(record.exc_info[1]))


@contextmanager
def quiet_flower(text: str) -> Iterator[None]:
    """For the probe's duration, drop Flower's records of its expected failure (the
    simulation engine logs a stock ClientApp's ValueError with its traceback in the
    ServerApp's process); fedplug's one line replaces them."""
    dropped = _DropRecords(text)
    loggers = [logging.getLogger("flwr")]
    for logger in loggers:
        logger.addFilter(dropped)
        for handler in logger.handlers:
            handler.addFilter(dropped)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropped)
            for handler in logger.handlers:
                handler.removeFilter(dropped)
