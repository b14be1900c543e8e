"""The screen of a round: which of the chains' outcomes stream on to the aggregator, and a
tally of the rest, each dropped with a logged reason.

:class:`~fedplug.run.federated_round.RoundCore` runs every runtime's outcomes through
:func:`screen`; the field-by-field checks are :mod:`fedplug.screening`'s. Kept apart from
the round core so that a runtime can screen one reply (:func:`unusable`) without the round.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fedplug.components import ClientUpdate
from fedplug.run.client_text import client_text
from fedplug.run.vectors import tensors_num_bytes
from fedplug.screening import ScreeningRules, l2_norm, update_problem

logger = logging.getLogger("fedplug.round")


@dataclass(frozen=True)
class ClientFailure:
    """A chain whose training raised, timed out, or sent nothing usable. ``reason`` is
    kept bounded and escaped (:func:`~fedplug.run.client_text.client_text`): it often
    holds the client's own text (an exception's message, an error reply)."""

    chain: list[int]
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", client_text(self.reason))


Outcome = ClientUpdate | ClientFailure
"""What a runtime reports for each chain of a round."""


@dataclass
class Tally:
    """What screening let through and dropped in one attempt of a round."""

    accepted: int = 0
    failures: int = 0
    bytes_up: int = 0
    dropped: list[tuple[list[int], str]] = field(default_factory=list)
    corrupted: int = 0
    """Updates ``train.faults.corruption`` corrupted (whether screening dropped them or not)."""
    straggler_timeouts: int = 0
    """Chains ``train.faults.stragglers`` made time out (also in ``failures``)."""


def unusable(
    update: ClientUpdate,
    expected_shape: tuple[int, ...],
    timeout: float | None,
    required_metrics: tuple[str, ...] = (),
    *,
    rules: ScreeningRules | None = None,
    global_vector: Tensor | None = None,
) -> str | None:
    """Why ``update`` cannot be aggregated, or ``None`` when it can: every field screened
    by :func:`fedplug.screening.update_problem`. ``required_metrics``: the reply metrics
    the components ask for (:attr:`ClientNeeds.reply_metrics`), each of which must be
    present and finite. ``rules``: the run's other bounds (declared extras,
    ``train.screening``, the class counts; :attr:`RoundCore.screening_rules`), of which
    ``expected_shape``, ``timeout`` and ``required_metrics`` replace the model's shape,
    the timeout and (when given) the required metrics. ``global_vector``: the round's
    global model, for the norm bounds (None: not checked)."""
    rules = with_round_bounds(rules, expected_shape, timeout, required_metrics)
    return update_problem(update, rules, global_vector)


def with_round_bounds(
    rules: ScreeningRules | None,
    expected_shape: tuple[int, ...],
    timeout: float | None,
    required_metrics: tuple[str, ...],
) -> ScreeningRules:
    """``rules`` (default: none but the model's shape) with this round's model shape,
    timeout and, when given, required metrics."""
    base = rules if rules is not None else ScreeningRules(tuple(expected_shape))
    return dataclasses.replace(
        base,
        model_shape=tuple(expected_shape),
        timeout=timeout,
        required_metrics=tuple(required_metrics) or base.required_metrics,
    )


UpdateCheck = Callable[[ClientUpdate], "str | None"]
"""A component's own check of an update (:meth:`fedplug.components.Aggregator.check_update`)."""


def screen(
    outcomes: Iterable[Outcome],
    expected_shape: tuple[int, ...],
    *,
    timeout: float | None,
    model_bytes: int,
    round_number: int,
    tally: Tally,
    required_metrics: tuple[str, ...] = (),
    rules: ScreeningRules | None = None,
    global_vector: Tensor | None = None,
    check: UpdateCheck | None = None,
    excluded: dict[tuple[int, ...], str] | None = None,
) -> Iterator[ClientUpdate]:
    """Pass on the usable updates of ``outcomes``, in order; count and log the rest
    (:func:`unusable` says why, with ``rules`` and ``global_vector``; then ``check``, the
    aggregator's own). ``excluded``: chains (as tuples) to drop with the given reason
    (updates the aggregator failed on in an earlier pass of the round)."""
    rules = with_round_bounds(rules, expected_shape, timeout, required_metrics)
    global_norm = l2_norm(global_vector) if global_vector is not None else None
    for outcome in outcomes:
        if isinstance(outcome, ClientFailure):
            drop(tally, list(outcome.chain), outcome.reason, round_number)
            continue
        key = chain_key(outcome) if excluded else None
        if key is not None and excluded and key in excluded:
            reason: str | None = excluded[key]
        else:
            reason = update_problem(outcome, rules, global_vector, global_norm)
            if reason is None and check is not None:
                reason = _checked(check, outcome)
        if reason is not None:
            drop(tally, list(outcome.chain), reason, round_number)
            continue
        tally.accepted += 1
        tally.bytes_up += update_bytes(outcome, model_bytes)
        yield outcome


def drop(tally: Tally, chain: list[int], reason: str, round_number: int) -> None:
    """Count a dropped chain in ``tally`` and log why. The reason is made safe first
    (:func:`~fedplug.run.client_text.client_text`: at most 500 characters, one line): it
    is kept in the round's record, so in ``metrics.json`` and in every later checkpoint."""
    reason = client_text(reason)
    tally.failures += 1
    tally.dropped.append((chain, reason))
    logger.warning("round %d: dropped client(s) %s: %s", round_number, chain, reason)


def _checked(check: UpdateCheck, update: ClientUpdate) -> str | None:
    """``check(update)``; an exception it raises is a reason too (it read the update)."""
    try:
        return check(update)
    except Exception as error:  # noqa: BLE001 - a bad update must not stop the server
        shown = client_text(error, 200)
        return f"failed the aggregator's check ({type(error).__name__}: {shown})"


def update_bytes(update: ClientUpdate, model_bytes: int) -> int:
    """What ``update`` sent up: one model per chain member, plus its extras."""
    return len(update.chain) * model_bytes + tensors_num_bytes(update.extras)


def retract(tally: Tally, update: ClientUpdate, reason: str, round_number: int, model_bytes: int) -> None:
    """Move an update :func:`screen` accepted to the dropped ones of ``tally``."""
    tally.accepted -= 1
    tally.bytes_up -= update_bytes(update, model_bytes)
    drop(tally, list(update.chain), reason, round_number)


class HandedUpdates:
    """The updates an aggregator reads, remembering the last one handed out and whether
    it read them all (so that an error it raises can be traced to one update)."""

    def __init__(self, updates: Iterable[ClientUpdate]) -> None:
        self.updates = updates
        self.last: ClientUpdate | None = None
        self.exhausted = False

    def __iter__(self) -> Iterator[ClientUpdate]:
        iterator = iter(self.updates)
        while True:
            self.last = None  # an error while the next update is fetched is no update's fault
            try:
                update = next(iterator)
            except StopIteration:
                self.exhausted = True
                return
            self.last = update
            yield update


def chain_key(outcome: Outcome) -> tuple[Any, ...] | None:
    """The chain of ``outcome`` as a dictionary key (None when it holds something
    unhashable, which screening drops anyway)."""
    key = tuple(outcome.chain or [getattr(outcome, "client_id", None)])
    try:
        hash(key)
    except TypeError:
        return None
    return key
