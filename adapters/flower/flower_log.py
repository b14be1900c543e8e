"""fedplug's errors in Flower's log as one line each, not a traceback.

A fedplug error (:class:`~fedplug.errors.FedplugError`) already says what to fix, so
when it ends a ServerApp, Flower's records of it ("Simulation raised an exception" with
``exc_info``, or a record whose message is ``traceback.format_exc()``, as
``flwr.simulation.run_simulation`` logs) become that line:
``fedplug stopped the run: <message>``. Any other exception keeps its traceback.
:class:`FedplugErrorsInOneLine` does it; :func:`report_fedplug_errors_in_one_line` puts
it on Flower's ``flwr`` logger and its handlers once per process
(:class:`~fedplug.adapters.flower.FedplugStrategy` and the ready apps call it).
Design: docs/flower.md, 'Design notes: errors in Flower's log'.
"""

from __future__ import annotations

import logging
import re

from fedplug.errors import FedplugError

FLOWER_LOGGER = "flwr"
TRACEBACK_HEADER = "Traceback (most recent call last):"
STOPPED = "fedplug stopped the run: "
_LAST_FEDPLUG_ERROR = re.compile(r"^fedplug\.errors\.(\w+): ", re.MULTILINE)


def fedplug_error_of(error: BaseException | None) -> FedplugError | None:
    """The fedplug error ``error`` is, or was raised from (Flower wraps a ServerApp's
    exception: ``RuntimeError(...) from ex``); None when there is none."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, FedplugError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def one_line(message: str) -> str:
    """``fedplug stopped the run: <message>`` on one line (a multi-line message joined
    by spaces)."""
    return STOPPED + " ".join(message.split())


def fedplug_line_of_traceback(text: str) -> str | None:
    """The one line of a formatted traceback whose final exception is a fedplug error
    (``fedplug.errors.TrainingError: ...`` with no traceback after it); else None."""
    if not text.lstrip().startswith(TRACEBACK_HEADER):
        return None
    found = None
    for found in _LAST_FEDPLUG_ERROR.finditer(text):
        pass
    if found is None:
        return None
    rest = text[found.end() :]
    if TRACEBACK_HEADER in rest:
        return None  # another exception followed the fedplug error
    return one_line(rest)


class FedplugErrorsInOneLine(logging.Filter):
    """On Flower's logger and handlers: a record of a fedplug error loses its traceback
    and says the error in one line; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = fedplug_error_of(record.exc_info[1] if record.exc_info else None)
        if error is not None:
            record.msg, record.args = one_line(str(error)), None
            record.exc_info, record.exc_text = None, None
            return True
        if record.exc_info is None and isinstance(record.msg, str):
            line = fedplug_line_of_traceback(record.getMessage())
            if line is not None:
                record.msg, record.args = line, None
        return True


def report_fedplug_errors_in_one_line() -> None:
    """Install :class:`FedplugErrorsInOneLine` on Flower's logger and each of its
    handlers, once per process (calling it again adds nothing)."""
    flower_log = logging.getLogger(FLOWER_LOGGER)
    for holder in (flower_log, *flower_log.handlers):
        if not any(isinstance(each, FedplugErrorsInOneLine) for each in holder.filters):
            holder.addFilter(FedplugErrorsInOneLine())
