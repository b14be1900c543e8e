"""The server's bounded wait for the workers' replies (``train.failures.client_timeout_seconds``).

:class:`StepDeadlines` says when a step's replies are due (``tasks x T + margin``, or
:data:`DEFAULT_STEP_WAIT_SECONDS` without T), which workers missed it, and which replies
are late or duplicate and must be discarded. No FedML import here: the tests drive this
class with their own clock.
Design: docs/fedml.md, 'Design notes: deadlines and the server'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from fedplug.deadline import REPLY_MARGIN_SECONDS, grace_period

from .coordinator import Coordinator

DEFAULT_STEP_WAIT_SECONDS = 3600.0
"""How long the server waits for a step's replies when ``client_timeout_seconds`` is
unset (Flower's default bound of one exchange)."""


def reply_margin(training_seconds: float) -> float:
    """The margin added to ``training_seconds``: ``max(2 s, 10%)``."""
    return grace_period(training_seconds, REPLY_MARGIN_SECONDS)


class StepDeadlines:
    """Which replies of the current step the server takes, and when a step or the run's
    end is overdue.

    Args:
        coordinator: the server state (its ``step``, ``message`` and ``finished``).
        clock: seconds, monotonic (default :func:`time.monotonic`).
    """

    def __init__(
        self, coordinator: Coordinator, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.coordinator = coordinator
        self.clock = clock
        self.step = -1
        self.started: float | None = None
        """When the current step's instructions went out (``None``: not yet)."""
        self.answered: set[int] = set()
        self.timed_out: set[int] = set()
        """Worker slots that missed a deadline in this run."""

    @property
    def active(self) -> bool:
        """Whether the server bounds its wait: always (T, else :data:`DEFAULT_STEP_WAIT_SECONDS`)."""
        return True

    def start_step(self) -> None:
        """The current step's instructions went out: start its clock."""
        self.step = self.coordinator.step
        self.started = self.clock()
        self.answered = set()

    def seconds_allowed(self) -> float | None:
        """How long after the instructions the current step's replies are due: ``tasks x
        T`` plus a margin, or :data:`DEFAULT_STEP_WAIT_SECONDS` without T. After the last
        step: the margin, for the workers' final status."""
        timeout = self.coordinator.timeout
        if self.coordinator.finished:
            training = 0.0
        elif timeout is None:
            return DEFAULT_STEP_WAIT_SECONDS
        else:
            training = self.coordinator.most_tasks() * timeout
        return training + reply_margin(training)

    def due_at(self) -> float | None:
        allowed = self.seconds_allowed()
        if allowed is None or self.started is None:
            return None
        return self.started + allowed

    def take(self, slot: int, message: Any) -> str | None:
        """Count worker ``slot``'s reply ``message`` for the current step, or say why it is
        discarded (it is for another step, or the slot already answered this one)."""
        step = message.get("fedplug_step") if isinstance(message, dict) else None
        if step != self.coordinator.step or self.coordinator.finished:
            return (
                f"discarded a late reply of worker {slot} (MPI rank {slot + 1}) for step {step}; "
                f"the server is at step {self.coordinator.step}"
            )
        if slot in self.answered:
            return (
                f"discarded a second reply of worker {slot} (MPI rank {slot + 1}) for step {step} "
                "(its first, or its timeout, was already counted)"
            )
        self.answered.add(slot)
        return None

    def overdue(self, workers: int) -> list[int]:
        """The slots whose reply to the current step is overdue now (none while the
        step's time lasts, or after the last step)."""
        due = self.due_at()
        if due is None or self.coordinator.finished or self.clock() < due:
            return []
        return [slot for slot in range(workers) if slot not in self.answered]

    def timeout_reply(self, slot: int) -> dict[str, Any]:
        """The reply that stands for worker ``slot``'s missing one: every task of the step
        failed. Marks the slot as one that missed a deadline."""
        self.timed_out.add(slot)
        allowed = self.seconds_allowed() or 0.0
        return self.coordinator.timeout_reply(slot, allowed)

    def abandoned(self, finished_slots: Iterable[int]) -> list[int]:
        """After the last step: the slots that missed a deadline during the run and have
        not finished within the margin (empty while the margin lasts, or when every such
        slot finished)."""
        due = self.due_at()
        if not self.coordinator.finished or due is None or self.clock() < due:
            return []
        finished = set(finished_slots)
        return sorted(slot for slot in self.timed_out if slot not in finished)
