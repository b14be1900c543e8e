"""Rank 0: FedML's cross-silo server with a bounded wait for the workers' replies.

:func:`run_server` does what FedML's ``init_server`` does for the cross-silo FedAvg flow,
with :class:`DeadlineServerManager` in place of FedML's manager: it adds
:class:`.deadlines.StepDeadlines` to FedML's message loop, so a silent, late or stuck
worker no longer stalls the run.
Design: docs/fedml.md, 'Design notes: deadlines and the server'.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from fedml.core.distributed.communication.message import Message
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
from fedml.cross_silo.server.message_define import MyMessage

from .coordinator import Coordinator
from .deadlines import StepDeadlines

logger = logging.getLogger("fedplug.adapters.fedml")

DEADLINE_TICK = "fedplug_deadline_tick"
"""The message type the watcher puts into FedML's receive queue when a deadline passed."""
WATCH_INTERVAL_SECONDS = 0.1


class DeadlineServerManager(FedMLServerManager):
    """FedML's cross-silo server manager whose wait for the workers has a deadline (see
    the module docstring). ``coordinator`` is the fedplug server state."""

    def __init__(
        self,
        args: Any,
        aggregator: FedMLAggregator,
        comm: Any,
        rank: int,
        size: int,
        backend: str,
        coordinator: Coordinator,
    ) -> None:
        super().__init__(args, aggregator, comm, rank, size, backend)
        self.coordinator = coordinator
        self.deadlines = StepDeadlines(coordinator)
        self.abandoned: list[int] = []
        """Worker slots given up on after the last step (empty: every worker finished)."""
        self._stop_watching = threading.Event()
        self._tick_pending = threading.Event()

    # ------------------------------------------------------------------ FedML's loop

    def register_message_receive_handlers(self) -> None:
        super().register_message_receive_handlers()
        self.register_message_receive_handler(DEADLINE_TICK, self.handle_deadline_tick)

    def run(self) -> None:
        watcher = None
        if self.deadlines.active:
            watcher = threading.Thread(
                target=self._watch, name="fedplug-step-deadline", daemon=True
            )
            watcher.start()
        try:
            super().run()
        finally:
            self._stop_watching.set()
            if watcher is not None:
                watcher.join()

    def send_init_msg(self) -> None:
        super().send_init_msg()
        self.deadlines.start_step()

    def handle_message_receive_model_from_client(self, msg_params: Any) -> None:
        slot = self.client_real_ids.index(msg_params.get(MyMessage.MSG_ARG_KEY_SENDER))
        if self.deadlines.active:
            answer = msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
            discarded = self.deadlines.take(slot, answer)
            if discarded is not None:
                logger.warning("%s", discarded)
                return
        step = self.coordinator.step
        super().handle_message_receive_model_from_client(msg_params)
        if self.coordinator.step != step:  # FedML aggregated and sent the next step
            self.deadlines.start_step()

    def handle_deadline_tick(self, msg_params: Any) -> None:
        """On FedML's loop: answer for the workers whose reply is overdue, or give up on
        those that have not finished after the last step."""
        self._tick_pending.clear()
        step = self.coordinator.step
        for slot in self.deadlines.overdue(len(self.client_real_ids)):
            if self.coordinator.step != step:  # cannot happen: the last one closes the step
                break
            logger.warning(
                "step %d: worker %d (MPI rank %d) sent no reply within %.1fs; its tasks fail",
                self.coordinator.step,
                slot,
                slot + 1,
                self.deadlines.seconds_allowed() or 0.0,
            )
            self.handle_message_receive_model_from_client(self._timeout_message(slot))
        finished = [
            slot
            for slot, sender in enumerate(self.client_real_ids)
            if self.client_finished_mapping.get(str(sender), False)
        ]
        due = self.deadlines.due_at()
        if not self.coordinator.finished or due is None or self.deadlines.clock() < due:
            return
        self._stop_watching.set()  # the one decision left is taken now
        abandoned = self.deadlines.abandoned(finished)
        if abandoned:
            self.abandoned = abandoned
            logger.warning(
                "the run is over; worker(s) %s (MPI rank(s) %s) missed a deadline and have not "
                "finished: giving up on them",
                abandoned,
                [slot + 1 for slot in abandoned],
            )
            self._stop_loop()

    def _timeout_message(self, slot: int) -> Message:
        message = Message(
            MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER,
            self.client_real_ids[slot],
            self.get_sender_id(),
        )
        message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, self.deadlines.timeout_reply(slot))
        message.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, 0)
        return message

    def finish(self) -> None:
        """FedML's end of the run (every worker finished), with the receive queue emptied
        first: FedML 0.9.6 empties a non-empty queue with ``Queue.get_no_wait``, which does
        not exist, so a pending :data:`DEADLINE_TICK` would fail the run at its end."""
        self._stop_watching.set()
        self._drain()
        try:
            super().finish()
        except AttributeError:  # a message arrived after the drain (see above)
            from mpi4py import MPI

            if not MPI.Is_finalized():
                MPI.Finalize()

    def _stop_loop(self) -> None:
        """End FedML's message loop without ``MPI.Finalize`` (which would wait for the
        rank given up on)."""
        self._stop_watching.set()
        self._drain()
        try:
            self.com_manager.stop_receive_message()
        except AttributeError:  # FedML's Queue.get_no_wait (see finish); the loop stops anyway
            pass

    def _drain(self) -> None:
        """Drop the messages FedML's loop has not handled (the run is over)."""
        pending = self.com_manager.q_receiver
        while True:
            try:
                pending.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------------ the watcher

    def _watch(self) -> None:
        """Put a :data:`DEADLINE_TICK` into FedML's receive queue whenever a deadline has
        passed (at most one pending at a time); every decision is taken on the loop."""
        inbox = self.com_manager.q_receiver
        while not self._stop_watching.wait(WATCH_INTERVAL_SECONDS):
            due = self.deadlines.due_at()
            if due is None or self.deadlines.clock() < due or self._tick_pending.is_set():
                continue
            self._tick_pending.set()
            inbox.put(Message(DEADLINE_TICK, self.get_sender_id(), self.get_sender_id()))


def run_server(
    args: Any, device: Any, dataset: list[Any], server_aggregator: Any, coordinator: Coordinator
) -> list[int]:
    """Run FedML's cross-silo server (rank 0) with :class:`DeadlineServerManager`, as
    FedML's ``init_server`` runs its own; return the worker slots given up on after the
    last step (normally none)."""
    (
        train_data_num,
        _test_data_num,
        train_data_global,
        test_data_global,
        train_data_local_num_dict,
        train_data_local_dict,
        test_data_local_dict,
        _class_num,
    ) = dataset
    server_aggregator.set_id(0)
    aggregator = FedMLAggregator(
        train_data_global,
        test_data_global,
        train_data_num,
        train_data_local_dict,
        test_data_local_dict,
        train_data_local_num_dict,
        args.worker_num,
        device,
        args,
        server_aggregator,
    )
    manager = DeadlineServerManager(
        args, aggregator, args.comm, args.rank, args.worker_num, args.backend, coordinator
    )
    manager.run()
    return manager.abandoned
