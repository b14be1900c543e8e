"""A tracking server that stops answering never stops training (``tracking.on_error``):
requests run with bounded retries (:func:`bounded_http_requests`), and an :class:`Outbox`
keeps the calls a dead server did not take and sends them when it answers again. The
design: docs/reliability.md, section 8.4, "Why a dead server costs a bounded wait".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fedplug.errors import TrackingError
from fedplug.tracking.store_faults import store_fault

logger = logging.getLogger("fedplug.tracking")

HTTP_MAX_RETRIES = 2
"""Retries of one request (MLflow's default: 7, with a backoff that grows to minutes)."""
HTTP_BACKOFF_FACTOR = 1
"""Seconds before the first retry, doubled for each further one."""
HTTP_TIMEOUT_SECONDS = 10
"""Seconds to wait for one answer (MLflow's default: 120)."""
PROBE_SECONDS = 30.0
"""While the server is unreachable, how often a logging call checks whether it is back."""

SQL_STORE_LOGGER = "mlflow.store.db.utils"
"""MLflow's logger that prints a failing SQL store's traceback before the error is raised."""

OnError = Literal["continue", "stop"]

_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(HTTP_MAX_RETRIES),
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(HTTP_BACKOFF_FACTOR),
    "MLFLOW_HTTP_REQUEST_TIMEOUT": str(HTTP_TIMEOUT_SECONDS),
}


@contextmanager
def bounded_http_requests() -> Iterator[None]:
    """MLflow's HTTP retries and timeout bounded for the calls inside (the variables the
    user set are left as they are), restored afterwards; the retries' and a failing SQL
    store's log lines kept quiet (the error raised says it in one line)."""
    added = [name for name in _BOUNDS if name not in os.environ]
    for name in added:
        os.environ[name] = _BOUNDS[name]
    # urllib3 warns once per retry ("Retrying (Retry(total=1, ...))"): the outage gets
    # fedplug's one warning instead.
    retries = logging.getLogger("urllib3.connectionpool")
    level = retries.level
    retries.setLevel(logging.ERROR)
    # MLflow logs a failing SQL store's traceback ("SQLAlchemy database error", "engine
    # could not be created") before raising: the error raised gets fedplug's one line.
    sql_store = logging.getLogger(SQL_STORE_LOGGER)
    sql_level = sql_store.level
    sql_store.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        retries.setLevel(level)
        sql_store.setLevel(sql_level)
        for name in added:
            os.environ.pop(name, None)


def failures() -> tuple[type[BaseException], ...]:
    """What a call to an unreachable or failing tracking store raises."""
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)  # requests' connection errors are OSErrors


def refused(error: BaseException) -> bool:
    """True when the store answered and refused the call (an HTTP 4xx: an invalid value,
    a deleted run), as opposed to not answering or failing inside (5xx, no connection).
    A local store that is locked, corrupt, read-only or full fails every call alike
    (:func:`~fedplug.tracking.store_faults.store_fault`): not a refusal of this call."""
    status = getattr(error, "get_http_status_code", None)
    return status is not None and 400 <= int(status()) < 500 and store_fault(error) is None


def reason_of(error: BaseException) -> str:
    """A short, one-line reason for ``error`` (MLflow's messages quote whole URLs; a
    store fault is named by its cause, not by sqlalchemy's outer text)."""
    fault = store_fault(error)
    if fault is not None:
        return fault.reason
    text = str(getattr(error, "message", None) or error)
    lowered = text.lower()
    for marker, reason in (
        ("connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("name or service not known", "unknown host"),
        ("max retries exceeded", "no answer"),
    ):
        if marker in lowered:
            return reason
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first[:160]


@dataclass
class _Call:
    what: str
    method: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Outbox:
    """Sends a run's tracking calls, in order, through an outage of the tracking store.

    Args:
        uri: the tracking URI (probed at ``/health`` when it is a server).
        run_id: for messages.
        on_error: ``"continue"`` keeps failed calls and sends them later; ``"stop"`` raises.
    """

    uri: str
    run_id: str
    on_error: OnError = "continue"
    pending: list[_Call] = field(default_factory=list)
    """Calls not sent yet, oldest first."""
    _next_probe: float = 0.0

    def send(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)``, or None when it is kept for later.

        Raises:
            TrackingError: the call failed and ``on_error`` is ``"stop"`` (one line).
        """
        call = _Call(what, method, args, kwargs)
        if self.pending and not self.flush():
            self.pending.append(call)
            return None
        try:
            with bounded_http_requests():
                return method(*args, **kwargs)
        except failures() as error:
            if refused(error):  # the store answered "no": waiting would not change that
                raise TrackingError(
                    f"MLflow could not {what} for run {self.run_id}: {reason_of(error)}"
                ) from None
            self._failed(call, error)
            return None

    def flush(self, *, now: bool = False) -> bool:
        """Send the kept calls if the store answers again (probed at most every
        :data:`PROBE_SECONDS`, or at once with ``now``); True when none is left."""
        if not self.pending:
            return True
        if not now and time.monotonic() < self._next_probe:
            return False
        from fedplug.tracking.mlflow_store import check_server

        try:
            check_server(self.uri)
        except TrackingError:
            self._next_probe = time.monotonic() + PROBE_SECONDS
            return False
        sent = 0
        while self.pending:
            call = self.pending[0]
            try:
                with bounded_http_requests():
                    call.method(*call.args, **call.kwargs)
            except failures() as error:
                if not refused(error):
                    self._next_probe = time.monotonic() + PROBE_SECONDS
                    return False
                logger.warning("MLflow refused to %s for run %s: %s", call.what, self.run_id, reason_of(error))
            else:
                sent += 1
            self.pending.pop(0)
        logger.info("MLflow at %s answers again: sent the %d tracking calls kept meanwhile", self.uri, sent)
        return True

    def close(self) -> bool:
        """One last try to send what is kept; True when nothing is left unsent (else a
        warning says how to send the rest)."""
        if self.flush(now=True):
            return True
        logger.warning(
            "MLflow at %s still does not answer: %d tracking calls of run %s are unsent; "
            "training finished and its results are on disk; run the same command again once "
            "the server answers to send them",
            self.uri,
            len(self.pending),
            self.run_id,
        )
        return False

    def _failed(self, call: _Call, error: BaseException) -> None:
        reason = reason_of(error)
        if self.on_error == "stop":
            raise TrackingError(
                f"MLflow at {self.uri} could not {call.what} for run {self.run_id} ({reason}) "
                "and tracking.on_error is 'stop'; the checkpoint is kept: run the same command "
                "again to resume, or set tracking.on_error: continue"
            ) from None
        self.pending.append(call)
        self._next_probe = time.monotonic() + PROBE_SECONDS
        logger.warning(
            "MLflow at %s could not %s for run %s (%s); training goes on, and the metrics "
            "are kept and sent when it answers again (or when the same command runs again)",
            self.uri,
            call.what,
            self.run_id,
            reason,
        )
