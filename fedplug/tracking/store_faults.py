"""Why a local MLflow store cannot be used, in one line (``tracking.on_error`` follows it).

A ``sqlite:///.../mlflow.db`` that another writer locks, that is not a database, that is
read-only or whose disk is full fails deep inside sqlalchemy, under an outer message that
names none of this (sqlalchemy's 80-line traceback, MLflow's "Query-invoked autoflush",
fedplug's "refused to create experiment"). :func:`store_fault` walks the exception chain
(``__cause__``, ``__context__``, a sqlalchemy error's ``.orig``) down to sqlite's own
error and names the cause; :class:`StoreUnavailable` carries it from
:meth:`fedplug.tracking.MlflowTracker.open` to :func:`fedplug.tracking.open_tracker`,
which trains untracked (``continue``) or stops before training (``stop``). A store that
fails later, mid-run, is an outage of :class:`fedplug.tracking.outage.Outbox`. Design:
docs/reliability.md, section 8.4.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

from fedplug.errors import TrackingError


@dataclass(frozen=True)
class StoreFault:
    """What is wrong with a tracking store, in words a user can act on."""

    problem: str
    """Follows the store's URI: ``is locked by another writer``."""
    detail: str
    """The database's own words: ``database is locked``."""
    fixed_when: str
    """When running the same command again will log the run: ``it is free``."""

    @property
    def reason(self) -> str:
        """``the store is locked by another writer: database is locked``."""
        return f"the store {self.problem}: {self.detail}"


SQLITE_FAULTS = (
    ("database is locked", "is locked by another writer", "it is free"),
    ("database table is locked", "is locked by another writer", "it is free"),
    ("file is not a database", "is not a valid MLflow store", "it is repaired or moved away"),
    ("database disk image is malformed", "is not a valid MLflow store", "it is repaired or moved away"),
    ("attempt to write a readonly database", "is read-only", "it is writable"),
    ("database or disk is full", "cannot grow: the disk is full", "there is space"),
    ("unable to open database file", "cannot be opened", "it can be opened"),
)
"""sqlite's error messages (``sqlite3.Error``'s text, as sqlite3_errstr words them), what
each says about the store, and when a re-run will get through."""


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it: its ``__cause__`` and ``__context__`` (also
    under ``raise ... from None``) and a sqlalchemy ``DBAPIError``'s ``.orig``, each once."""
    seen: set[int] = set()
    waiting: list[BaseException] = [error]
    while waiting:
        current = waiting.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for behind in (getattr(current, "orig", None), current.__cause__, current.__context__):
            if isinstance(behind, BaseException):
                waiting.append(behind)


def store_fault(error: BaseException) -> StoreFault | None:
    """The store fault behind ``error`` (an ``sqlite3.Error`` anywhere in its chain whose
    message sqlite uses for a locked, corrupt, read-only, full or unopenable database), or
    None when the store is not to blame."""
    for cause in exception_chain(error):
        if not isinstance(cause, sqlite3.Error):
            continue
        text = str(cause).strip()
        lowered = text.lower()
        for marker, problem, fixed_when in SQLITE_FAULTS:
            if marker in lowered:
                detail = text.splitlines()[0][:160] if text else marker
                return StoreFault(problem, detail, fixed_when)
    return None


class StoreUnavailable(TrackingError):
    """The tracking store at ``uri`` cannot be used (:attr:`fault` says why); raised by a
    backend while it opens, before anything was logged."""

    def __init__(self, uri: str, fault: StoreFault) -> None:
        super().__init__(f"tracking: {uri} {fault.problem} ({fault.detail})")
        self.uri = uri
        self.fault = fault

    def going_on(self, *, rerun_logs_it: bool) -> str:
        """The one warning of ``tracking.on_error: continue``: the run trains untracked;
        with ``rerun_logs_it`` (an output folder that keeps its finished run, as
        ``fedplug run``'s) the same command logs it later."""
        if rerun_logs_it:
            return (f"{self}; training goes on untracked -- run the same command again once "
                    f"{self.fault.fixed_when} to log this run")
        return f"{self}; training goes on, and this run is not logged there"

    def stopping(self) -> str:
        """The one line of ``tracking.on_error: stop``, before anything trained."""
        return (f"{self}, and tracking.on_error is 'stop': nothing was trained; run the same command again "
                f"once {self.fault.fixed_when}, or set tracking.on_error: continue to train untracked")
