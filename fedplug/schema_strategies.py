"""Hypothesis strategies generated from :mod:`fedplug.schema`: for every field kind, values
its :meth:`~fedplug.schema.FieldKind.problem` accepts and, separately, values it refuses;
for a :class:`~fedplug.schema.MessageSchema`, whole messages of either sort. What a fuzz
suite over every client-sent field draws from.

hypothesis is a test dependency (``pip install -e '.[test]'``), imported when a strategy
is built, so importing this module never needs it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedplug.schema import (
    Count,
    Counts,
    FieldKind,
    Flag,
    MessageSchema,
    PlainValue,
    Real,
    Reals,
    Scalar,
    TensorField,
    Text,
)

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

WRONG_TYPES: tuple[Any, ...] = (None, "<b>7</b>", b"\x00", [], {}, True, complex(1, 1))
"""Values of no field's kind but their own (text, bool): each kind's invalid values
include those it does not accept."""


def _st() -> Any:
    import hypothesis.strategies as st

    return st


def valid_values(kind: FieldKind) -> SearchStrategy[Any]:
    """Values ``kind`` accepts."""
    st = _st()
    if isinstance(kind, Count):
        return st.integers(kind.low, kind.high)
    if isinstance(kind, Real):
        return st.floats(kind.low, kind.high, allow_nan=False, allow_infinity=False)
    if isinstance(kind, Text):
        return st.text(max_size=kind.max_length)
    if isinstance(kind, Flag):
        return st.booleans()
    if isinstance(kind, Counts):
        size = _sizes(kind.length, kind.max_length)
        return st.lists(st.integers(kind.low, kind.high), **size)
    if isinstance(kind, Reals):
        size = _sizes(kind.length, kind.max_length)
        return st.lists(st.floats(kind.low, kind.high, allow_nan=False, allow_infinity=False), **size)
    if isinstance(kind, TensorField):
        return _tensors(kind)
    if isinstance(kind, (PlainValue, Scalar)):
        numbers = st.one_of(st.integers(-(2**62), 2**62), st.floats(allow_nan=False, allow_infinity=False))
        plain = st.one_of(st.text(max_size=min(kind.max_length, 50)), st.booleans(), numbers)
        if isinstance(kind, Scalar):
            return plain
        return st.one_of(plain, st.lists(st.integers(0, 10**6), max_size=20), st.lists(st.floats(0, 1), max_size=20))
    raise TypeError(f"no strategy for the field kind {type(kind).__name__}")


def invalid_values(kind: FieldKind) -> SearchStrategy[Any]:
    """Values ``kind`` refuses: out of bounds, non-finite, of the wrong length, shape or
    type; every one is checked against ``kind`` itself, so a value the kind happens to
    accept is never drawn."""
    st = _st()
    if isinstance(kind, Count):
        candidates = st.one_of(
            st.integers(max_value=kind.low - 1),
            st.integers(min_value=kind.high + 1),
            st.sampled_from([2**63 - 1, 2**64, -(2**63), 0.5, math.inf, math.nan, "1"]),
        )
    elif isinstance(kind, Real):
        edges = [math.inf, -math.inf, math.nan] if not kind.allow_nonfinite else []
        candidates = st.one_of(
            st.floats(min_value=kind.high, exclude_min=True) if kind.high < math.inf else st.nothing(),
            st.floats(max_value=kind.low, exclude_max=True) if kind.low > -math.inf else st.nothing(),
            st.sampled_from([*edges, 10**400, "0.5"]),
        )
    elif isinstance(kind, Text):
        candidates = st.text(min_size=kind.max_length + 1, max_size=kind.max_length + 20)
    elif isinstance(kind, (Counts, Reals)):
        candidates = _invalid_lists(kind)
    elif isinstance(kind, TensorField):
        candidates = st.sampled_from(_invalid_tensors(kind))
    else:
        candidates = st.nothing()
    return st.one_of(candidates, st.sampled_from(WRONG_TYPES)).filter(lambda value: kind.problem(value) is not None)


def valid_messages(schema: MessageSchema) -> SearchStrategy[dict[str, Any]]:
    """Messages ``schema`` accepts: every required field and some optional ones, valid."""
    st = _st()
    required = {name: valid_values(kind) for name, kind in schema.fields.items() if not kind.optional}
    optional = {name: valid_values(kind) for name, kind in schema.fields.items() if kind.optional}
    return st.fixed_dictionaries(required, optional=optional).filter(lambda message: _accepted(schema, message))


def invalid_messages(schema: MessageSchema) -> SearchStrategy[dict[str, Any]]:
    """Messages ``schema`` refuses: a valid message with one field replaced by an invalid
    value, one required field removed, or (when unknown keys are refused) one added."""
    st = _st()
    choices = []
    for name, kind in schema.fields.items():
        choices.append(st.tuples(st.just(name), invalid_values(kind)))
    required = [name for name, kind in schema.fields.items() if not kind.optional]
    strategies = []
    if choices:
        strategies.append(
            st.tuples(valid_messages(schema), st.one_of(choices)).map(lambda pair: {**pair[0], pair[1][0]: pair[1][1]})
        )
    if required:
        strategies.append(
            st.tuples(valid_messages(schema), st.sampled_from(required)).map(
                lambda pair: {key: value for key, value in pair[0].items() if key != pair[1]}
            )
        )
    if schema.unknown == "refuse":
        strategies.append(valid_messages(schema).map(lambda message: {**message, "<script>": 1}))
    return st.one_of(strategies).filter(lambda message: not _accepted(schema, message))


def _accepted(schema: MessageSchema, message: dict[str, Any]) -> bool:
    try:
        schema.check(message)
    except ValueError:
        return False
    return True


def _sizes(length: int | None, max_length: int | None) -> dict[str, int]:
    if length is not None:
        return {"min_size": length, "max_size": length}
    return {"max_size": min(max_length if max_length is not None else 50, 50)}


def _invalid_lists(kind: Counts | Reals) -> SearchStrategy[Any]:
    st = _st()
    length = kind.length if kind.length is not None else 1
    wrong_lengths = [length + 1] + ([length - 1] if kind.length else [])
    if kind.max_length is not None and kind.length is None:
        wrong_lengths = [kind.max_length + 1]
    good = kind.low if isinstance(kind, Counts) else max(kind.low, min(kind.high, 0.0))
    bad_items = [kind.low - 1, kind.high + 1, 2**63 - 1, math.nan, math.inf, "5", None]
    return st.one_of(
        st.sampled_from(wrong_lengths).map(lambda size: [good] * size),
        st.tuples(st.integers(0, length - 1), st.sampled_from(bad_items)).map(
            lambda pair: [good] * pair[0] + [pair[1]] + [good] * (length - pair[0] - 1)
        ),
    )


def _tensors(kind: TensorField) -> SearchStrategy[torch.Tensor]:
    st = _st()
    if kind.shape is not None:
        shapes = st.just(tuple(kind.shape))
    else:
        limit = min(kind.element_bound, 64)
        shapes = st.integers(0, limit).map(lambda size: (size,))
    return st.tuples(shapes, st.integers(0, 2**31 - 1)).map(
        lambda pair: torch.randn(pair[0], generator=torch.Generator().manual_seed(pair[1]))
    )


def _invalid_tensors(kind: TensorField) -> list[Any]:
    shape = tuple(kind.shape) if kind.shape is not None else (2,)
    size = math.prod(shape)
    too_many = (kind.element_bound + 1,)
    invalid: list[Any] = [
        torch.full(shape, math.nan) if size else torch.full((1,), math.nan),
        torch.full(shape, math.inf) if size else torch.full((1,), math.inf),
        torch.ones(shape, dtype=torch.complex64),
        torch.ones(shape, dtype=torch.bool),
        np.ones(shape, dtype="U3"),
        torch.ones((*shape, 2)),
        [0.0] * size,
    ]
    if math.prod(too_many) <= 10**7:
        invalid.append(torch.zeros(too_many))
    return invalid
