"""Which replies of one exchange the server takes: those that answer a message it sent,
once each, from the node that message went to.

A grid hands the server whatever replies it pulled. Flower's grids stamp every pushed
message with an id that its reply names (``reply_to_message_id``); a grid that does not
dedupe (the loopback grid, a custom grid) may still hand over two replies to one message,
or a reply whose ``src_node_id`` names another node. Taken as they come, the second reply
advances a chain twice (``ValueError: chain [2] has no member left to train``) and the
forged one fails the honest node's chain. Every exchange of the server (rounds,
evaluation, the class-count and capability queries, setup phases) therefore keeps only
:func:`answering_replies`, and each reply it leaves out is named in one warning line.

This module depends on Flower alone, so that every exchange, setup phases included, can
use it without an import cycle (:mod:`.round_exchange` re-exports it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import Message

logger = logging.getLogger("flwr.fedplug")  # a child of Flower's logger: printed by its handlers

MAX_ID_CHARS = 64
"""How much of a message id a warning quotes (a custom grid may put anything there)."""


def answering_replies(
    sent: Iterable[Message], replies: Iterable[Message], exchange: str
) -> list[Message]:
    """The replies that answer ``sent``, in the order they came.

    A reply is taken when its ``reply_to_message_id`` names a message of ``sent`` that no
    earlier reply answered, and its ``src_node_id`` is the node that message went to
    (``dst_node_id``). A message the grid gave no id (``""``: a grid that does not stamp
    ids) is answered by the first reply from its node that names no id either. Every
    other reply is left out with one warning line naming it and why (``exchange`` says
    which exchange, e.g. ``"round 3's train messages"``).

    Args:
        sent: the messages of the exchange, after the grid pushed them (Flower's grids
            write each one's id into it).
        replies: what the grid returned for them.
        exchange: the exchange, for the warning.
    """
    by_id: dict[str, Message] = {}
    without_id: dict[int, Message] = {}
    for message in sent:
        if message.metadata.message_id:
            by_id[message.metadata.message_id] = message
        else:
            without_id.setdefault(message.metadata.dst_node_id, message)
    answered: set[int] = set()
    taken = []
    for reply in replies:
        message = _message_answered(reply, by_id, without_id)
        problem = _why_not_taken(reply, message, answered)
        if problem is not None:
            logger.warning(
                "%s: ignored a reply from node %s to message %r: %s",
                exchange,
                reply.metadata.src_node_id,
                str(reply.metadata.reply_to_message_id)[:MAX_ID_CHARS],
                problem,
            )
            continue
        assert message is not None  # no problem means a message was found
        answered.add(id(message))
        taken.append(reply)
    return taken


def _message_answered(
    reply: Message, by_id: dict[str, Message], without_id: dict[int, Message]
) -> Message | None:
    """The message of the exchange that ``reply`` says it answers (``None``: none)."""
    reply_to = reply.metadata.reply_to_message_id
    if reply_to:
        return by_id.get(reply_to)
    return without_id.get(reply.metadata.src_node_id)


def _why_not_taken(reply: Message, message: Message | None, answered: set[int]) -> str | None:
    """Why ``reply`` is left out (``None``: it is taken)."""
    if message is None:
        return "it answers no message of this exchange"
    if id(message) in answered:
        return "a second reply to a message already answered"
    if reply.metadata.src_node_id != message.metadata.dst_node_id:
        return (
            f"that message went to node {message.metadata.dst_node_id}, not to "
            f"node {reply.metadata.src_node_id}"
        )
    return None
