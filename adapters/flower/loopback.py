"""An in-process Flower grid: a ServerApp's messages go straight to ClientApps in this
process, no Ray, no network.

For unit tests and for debugging a strategy step by step. Each node has its own
:class:`~flwr.app.Context` (``partition-id`` / ``num-partitions`` in its node config, a
``state`` that persists between messages, as on a real SuperNode); messages and
replies are deep-copied on the way, as serialisation would, so neither side can see the
other's objects. A ClientApp that raises gets an error reply, as under the Flower
runtimes. Delivery is sequential, in message order, in the caller's thread (so a node's
:func:`fedplug.deadline.deadline` interrupts with a timer signal, as in a Ray actor or a
``flwr-clientapp`` process); each message gets an id, which its reply names in
``reply_to_message_id``. Like a custom grid, it neither dedupes replies nor checks
their ``src_node_id``: the server keeps only replies that answer its own messages, once,
from the node each went to (:mod:`.reply_matching`).

The two Flower internals a grid needs (``Run``, ``TaskIdentity``) come from
:mod:`.internals`, the one module of fedplug outside Flower's public API.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedplug.flower_internals import (
    CLIENT_APP_RAISED_EXCEPTION,
    LOOPBACK_RUN_ID,
    SERVER_NODE_ID,
    empty_run,
    ensure_task_identity,
)

__all__ = [
    "CLIENT_APP_RAISED_EXCEPTION",
    "FIRST_NODE_ID",
    "LOOPBACK_RUN_ID",
    "SERVER_NODE_ID",
    "LoopbackGrid",
    "ensure_task_identity",
]

FIRST_NODE_ID = 1000


class LoopbackGrid(Grid):
    """Nodes ``FIRST_NODE_ID + k`` (k = 0..num_nodes-1) running ``client_app``.

    Args:
        client_app: the ClientApp every node runs.
        num_nodes: how many nodes.
        node_configs: per-node node config (default: ``partition-id=k``,
            ``num-partitions=num_nodes``).
        run_config: the run config every context carries.
    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        node_configs: list[dict[str, int | float | str | bool]] | None = None,
        run_config: Mapping[str, int | float | str | bool] | None = None,
    ) -> None:
        ensure_task_identity()
        self.client_app = client_app
        if node_configs is None:
            node_configs = [
                {"partition-id": k, "num-partitions": num_nodes} for k in range(num_nodes)
            ]
        self.contexts = {
            FIRST_NODE_ID + k: Context(
                run_id=LOOPBACK_RUN_ID,
                node_id=FIRST_NODE_ID + k,
                node_config=dict(node_configs[k]),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for k in range(num_nodes)
        }
        self.connected = set(self.contexts)
        """Node ids that answer; remove one to simulate a node that left."""
        self.delivered: list[Message] = []
        """Every message delivered, in order (what the server sent)."""
        self._run = empty_run(LOOPBACK_RUN_ID)
        self._pending: dict[str, Message] = {}
        self._pushed = 0

    def set_run(self, run: Any) -> None:
        # A Run from Flower 1.35 on, a run id before: stored, never read here.
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.connected)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = f"loopback-{self._pushed}"
            self._pushed += 1
            # As Flower's grids do: the id goes into the message, so that its reply names
            # it (``reply_to_message_id``) and a caller can match replies to messages.
            message.metadata.__dict__["_message_id"] = message_id
            self._pending[message_id] = message
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for message_id in message_ids:
            message = self._pending.pop(message_id, None)
            if message is None:
                continue
            reply = self._deliver(message)
            if reply is not None:
                replies.append(reply)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))

    def _deliver(self, message: Message) -> Message | None:
        self.delivered.append(message)
        node_id = message.metadata.dst_node_id
        if node_id not in self.connected:
            return None
        incoming = copy.deepcopy(message)
        context = self.contexts[node_id]
        try:
            reply = self.client_app(incoming, context)
        except Exception as error:  # noqa: BLE001  # the runtimes reply with an error, so do we
            reason = f"{type(error)}:<'{error}'>"
            return Message(
                Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=incoming
            )
        return copy.deepcopy(reply)
