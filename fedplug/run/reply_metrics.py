"""Size bounds on the metrics a client's reply carries, checked before anything iterates
them.

A reply's metrics are a mapping from the client's names to its numbers; nothing stops a
client from sending a 1,000,000-item list under a name no component reads (seconds of
server time to average, a 53 MB log line when the mean is logged) or a 100 KB name.
:func:`bounded_metrics` looks at each entry's name and size only (``len`` of a list, an
array's ``nbytes``: never its items) and refuses, per entry, a name longer than
:data:`MAX_METRIC_KEY_CHARS`, a list of more than :data:`MAX_METRIC_LIST_ITEMS` items,
whatever is past :data:`MAX_METRICS_BYTES` or :data:`MAX_METRIC_ENTRIES`; the rest is
kept (names escaped by :func:`~fedplug.run.client_text.client_text`). The Flower
strategy's metric averages and the FedML coordinator read a reply's metrics only
through it. Pure functions, no state.
Design: docs/reliability.md, 'Nothing a client sends grows server state without bound'.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedplug.run.client_text import client_text
from fedplug.screening import MAX_METRIC_NAME_CHARS, MAX_METRICS_BYTES

MAX_METRIC_KEY_CHARS = MAX_METRIC_NAME_CHARS
"""Longest metric name kept; a longer one's metric is refused (``num-examples``,
``train_loss``, ``client-accuracy-mean``: honest names are a few dozen characters). The
round core's screen holds the same bound (one constant, in :mod:`fedplug.screening`)."""
MAX_METRIC_LIST_ITEMS = 1_000
"""Most items of one list-valued metric (a per-class accuracy of up to 1,000 classes)."""
MAX_METRIC_ENTRIES = 256
"""Most entries of one reply's metrics looked at; the rest are refused uncounted."""
SHOWN_REFUSALS = 5
"""How many refused entries a warning names (then how many more)."""


@dataclass
class BoundedMetrics:
    """A reply's metrics within the bounds (``kept``: escaped name -> the client's value,
    untouched) and why each other entry was refused (one short phrase each)."""

    kept: dict[str, Any] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def refusals(self) -> str:
        """The refused entries in one bounded phrase (empty when none was)."""
        shown = ", ".join(self.refused[:SHOWN_REFUSALS])
        more = len(self.refused) - SHOWN_REFUSALS
        return shown + (f" and {more} more" if more > 0 else "")


def bounded_metrics(metrics: Mapping[Any, Any]) -> BoundedMetrics:
    """The entries of ``metrics`` within the size bounds, and why the others are not.

    Looks at the first :data:`MAX_METRIC_ENTRIES` entries only, and at each one's name and
    size (:func:`value_size`), never at a list's items: O(entries), whatever the lists
    hold. Refused: a name that is not a string or is longer than
    :data:`MAX_METRIC_KEY_CHARS` characters, a list or array of more than
    :data:`MAX_METRIC_LIST_ITEMS` items, an entry that would take the kept ones past
    :data:`MAX_METRICS_BYTES`, and every entry past :data:`MAX_METRIC_ENTRIES`. A name
    holding newlines or control characters is kept escaped (``train\\nloss``). The
    values themselves (finite? a number?) are the caller's to check.
    """
    bounded = BoundedMetrics()
    used = 0
    for key, value in itertools.islice(metrics.items(), MAX_METRIC_ENTRIES):
        problem = key_problem(key)
        items, size = value_size(value)
        if problem is None and items > MAX_METRIC_LIST_ITEMS:
            problem = f"a list of {items:,} items, more than {MAX_METRIC_LIST_ITEMS:,}"
        if problem is None and used + len(key) + size > MAX_METRICS_BYTES:
            problem = f"past the {MAX_METRICS_BYTES:,} bytes one reply's metrics may hold"
        if problem is not None:
            bounded.refused.append(f"{client_text(key, 60)!r} ({problem})")
            continue
        used += len(key) + size
        bounded.kept[client_text(key, MAX_METRIC_KEY_CHARS)] = value
    beyond = len(metrics) - MAX_METRIC_ENTRIES
    if beyond > 0:
        bounded.refused.append(f"{beyond:,} entries past the first {MAX_METRIC_ENTRIES}")
    return bounded


def key_problem(key: Any) -> str | None:
    """Why ``key`` cannot name a kept metric, or None."""
    if not isinstance(key, str):
        return f"a name of type {type(key).__name__}, not a string"
    if len(key) > MAX_METRIC_KEY_CHARS:
        return f"a name of {len(key):,} characters, more than {MAX_METRIC_KEY_CHARS}"
    return None


def value_size(value: Any) -> tuple[int, int]:
    """``(items, bytes)`` of a metric's value, from its length or ``nbytes`` alone: a
    number is 1 item of 8 bytes, a list or tuple ``len`` items of 8 bytes each (a
    peer's items may be anything; they are not looked at), a string or bytes ``len``
    bytes, an array (numpy, torch) its ``size`` items and ``nbytes``."""
    if isinstance(value, (list, tuple)):
        return len(value), 8 * len(value)
    if isinstance(value, (str, bytes, bytearray)):
        return 1, len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        itemsize = getattr(value, "itemsize", 8)  # numpy's and torch's (2.1+) alike
        return nbytes // max(itemsize if isinstance(itemsize, int) else 8, 1), nbytes
    return 1, 8
