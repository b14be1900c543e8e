"""Deadlines that interrupt a client's work (``train.failures.client_timeout_seconds``).

Every runtime trains a client inside :func:`deadline`, which raises
:class:`ClientTimeout` *in the client's code* once the time is up (a ``SIGALRM`` timer in
the main thread, an asynchronous exception in any other), so the runtime can drop that
client and go on with the round. Deadlines nest without extending each other.
Design and limits: docs/reliability.md, 'Design notes: deadline'.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ClientTimeout(Exception):
    """A client's work ran past its deadline and was interrupted.

    ``what`` and ``seconds`` are those of the :func:`deadline` that fired (``None`` when
    raised by hand), so a caller with nested deadlines can tell which one it was."""

    def __init__(self, message: str = "", *, what: str | None = None, seconds: float | None = None) -> None:
        super().__init__(message)
        self.what = what
        self.seconds = seconds


KILL_MARGIN_SECONDS = 1.0
"""The least time past a deadline a process that can kill a client's worker grants the
worker's own ``SIGALRM`` first (the parallel engine)."""
REPLY_MARGIN_SECONDS = 2.0
"""The least time past a deadline a server waits for replies: a client's failure reply,
sent at its deadline, must still reach it (Flower, FedML)."""
MARGIN_FRACTION = 0.1
"""... or this fraction of the deadline's seconds, when larger."""
LONGEST_CLIENT_TIMEOUT_SECONDS = 1_000_000.0
"""The largest ``train.failures.client_timeout_seconds`` (about 11.6 days). The parallel
engine waits for its workers with ``poll``, whose timeout is a C int of milliseconds
(at most 2**31 - 1 ms, about 24.8 days): T plus its kill margin must stay below that."""
LONGEST_TIMER_SECONDS = 100_000_000.0
"""The longest a timer is armed for (about 3.2 years). ``setitimer`` and
``threading.Event.wait`` overflow above about 9.2e9 s (``OverflowError: timestamp out of
range``); a deadline further away than this (a vectorised block of many chains times T,
or a T a Flower server sent) cannot fire within any run, so it is armed for this long."""


def grace_period(seconds: float, least: float) -> float:
    """The margin a runtime adds to a deadline of ``seconds`` before it acts on a client
    that has not answered: ``least`` or :data:`MARGIN_FRACTION` of ``seconds``, whichever
    is more."""
    return max(least, MARGIN_FRACTION * seconds)


def timeout_message(what: str, seconds: float) -> str:
    """The message of a :class:`ClientTimeout` (one wording for every runtime)."""
    return f"{what} ran past train.failures.client_timeout_seconds={seconds:g} and was interrupted"


@contextmanager
def deadline(seconds: float | None, what: str = "client") -> Iterator[None]:
    """Run the body for at most ``seconds`` (``None``: no limit); raise
    :class:`ClientTimeout` ("<what> ran past ...") in it when the time is up."""
    if seconds is None:
        yield
        return
    if not seconds > 0:  # also NaN
        raise ValueError(f"a deadline must be positive, got {seconds}")
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with _alarm(seconds, what):
            yield
    else:
        with _watchdog(seconds, what):
            yield


def timer_seconds(seconds: float) -> float:
    """``seconds`` as a timer can be armed with: at most :data:`LONGEST_TIMER_SECONDS`."""
    return min(seconds, LONGEST_TIMER_SECONDS)


@contextmanager
def _alarm(seconds: float, what: str) -> Iterator[None]:
    outer_handler = signal.getsignal(signal.SIGALRM)
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    armed_seconds = timer_seconds(seconds)
    if outer_remaining and outer_remaining < armed_seconds:
        yield  # the outer deadline comes first; it stays in charge
        return
    started = time.monotonic()
    armed = [True]

    def interrupt(signum: int, frame: object) -> None:
        if armed[0]:  # a signal handled after the body ended is dropped
            armed[0] = False
            raise ClientTimeout(timeout_message(what, seconds), what=what, seconds=seconds)

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, armed_seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        # signal.signal() runs any handler still pending first: ours, disarmed above
        signal.signal(signal.SIGALRM, outer_handler if outer_handler is not None else signal.SIG_DFL)
        if outer_remaining:
            # re-arm the outer deadline with what is left of it (at least a tick, so a
            # deadline that passed while the inner one ran still fires)
            left = outer_remaining - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)


@contextmanager
def _watchdog(seconds: float, what: str) -> Iterator[None]:
    target = threading.get_ident()
    done = threading.Event()
    fired = threading.Event()
    lock = threading.Lock()

    def fire() -> None:
        if done.wait(timer_seconds(seconds)):
            return
        with lock:
            if done.is_set():
                return
            exception = type("ClientTimeout", (ClientTimeout,), {"__init__": _fixed_init(what, seconds)})
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(exception))
            fired.set()

    watcher = threading.Thread(target=fire, name="fedplug-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if fired.is_set():
                # the exception may still be pending if the body ended just before it
                # was delivered: clear it so it cannot surface in the caller
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
        watcher.join()


def _fixed_init(what: str, seconds: float):  # noqa: ANN202 - an __init__ for the async exception class
    """``PyThreadState_SetAsyncExc`` instantiates the class with no arguments: this
    ``__init__`` gives it the deadline's message and attributes."""

    def __init__(self: ClientTimeout, *args: object) -> None:
        ClientTimeout.__init__(self, timeout_message(what, seconds), what=what, seconds=seconds)

    return __init__
