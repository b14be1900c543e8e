"""Declared schemas for what a client sends: every field's kind and bounds, checked
before the server computes with it.

The component that reads a message declares its :class:`MessageSchema` (FedDisk declares
the fields of its setup report, :meth:`fedplug.setup_phase.SetupPhase.report_schema`); a
runtime calls :meth:`MessageSchema.check` on what arrived and gets the decoded values or
one :class:`SchemaViolation` naming the field and the reason, e.g. ``report field
'histogram_counts' has 41 items, expected 40``. Numbers are compared with their bounds
as Python numbers before any arithmetic, so a count of ``2**63 - 1`` is refused instead of
wrapping in an int64 sum, and ``1e308`` instead of overflowing a mean to infinity.
Hypothesis strategies of valid and invalid values for every field kind:
:mod:`fedplug.schema_strategies`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

MAX_COUNT = 10**9
"""The default upper bound of a count (``train.screening.max_num_examples``' default)."""
MAX_REAL = 1e12
"""The default bound of a real's magnitude."""
NUMBER_BYTES = 8
"""What a number or a bool counts towards a message's total bytes."""


class SchemaViolation(ValueError):
    """A field breaks its schema; ``str()`` is one line naming the field and the reason."""

    def __init__(self, message: str, field_name: str, reason: str) -> None:
        super().__init__(f"{message} field {field_name!r} {reason}")
        self.field_name = field_name
        self.reason = reason


class FieldKind(Protocol):
    """One field's kind: its bounds, and whether a message may leave it out."""

    optional: bool

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not of this kind (a phrase after the field's name), or None."""

    def decode(self, value: Any) -> Any:
        """``value`` (which passed :meth:`problem`) as the server keeps it."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    """An int or float (Python or numpy), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def count_problem(value: Any, low: int, high: int) -> str | None:
    """Why ``value`` is not an integer count in ``[low, high]`` (an integral float such
    as ``5.0`` counts; a bool, a string, a fraction, NaN or infinity does not), or None."""
    if not _is_number(value):
        return f"is {_short(value)} of type {type(value).__name__}, expected an integer"
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if not math.isfinite(number) or number != math.floor(number):
            return f"is {_short(value)}, expected an integer"
    if not low <= value <= high:  # exact for any int size, before any conversion
        return f"is {_short(value)}, expected an integer in [{low}, {high}]"
    return None


def real_problem(value: Any, low: float, high: float, allow_nonfinite: bool = False) -> str | None:
    """Why ``value`` is not a finite real in ``[low, high]`` (NaN and infinities too, with
    ``allow_nonfinite``), or None. A huge int is compared as it is, never converted."""
    if not _is_number(value):
        return f"is {_short(value)} of type {type(value).__name__}, expected a number"
    if not isinstance(value, numbers.Integral) and not math.isfinite(float(value)):
        return None if allow_nonfinite else f"is {float(value)}, expected a finite number"
    if not low <= value <= high:
        return f"is {_short(value)}, expected a number in [{low:g}, {high:g}]"
    return None


@dataclass(frozen=True)
class Count:
    """An integer count in ``[low, high]``."""

    low: int = 0
    high: int = MAX_COUNT
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        return count_problem(value, self.low, self.high)

    def decode(self, value: Any) -> int:
        return int(value)


@dataclass(frozen=True)
class Real:
    """A finite real in ``[low, high]``; ``allow_nonfinite`` also lets NaN and the
    infinities through (a diverged model's loss, which the reader handles)."""

    low: float = -MAX_REAL
    high: float = MAX_REAL
    optional: bool = False
    allow_nonfinite: bool = False

    def problem(self, value: Any) -> str | None:
        return real_problem(value, self.low, self.high, self.allow_nonfinite)

    def decode(self, value: Any) -> float:
        return float(value)


@dataclass(frozen=True)
class Text:
    """A string of at most ``max_length`` characters."""

    max_length: int = 200
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"is {_short(value)} of type {type(value).__name__}, expected a string"
        if len(value) > self.max_length:
            return f"is a string of {len(value)} characters, expected at most {self.max_length}"
        return None

    def decode(self, value: Any) -> str:
        return str(value)


@dataclass(frozen=True)
class Flag:
    """A bool."""

    optional: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (bool, np.bool_)):
            return f"is {_short(value)} of type {type(value).__name__}, expected a bool"
        return None

    def decode(self, value: Any) -> bool:
        return bool(value)


def _length_problem(value: Any, length: int | None, max_length: int | None) -> str | None:
    if not isinstance(value, (list, tuple)):
        return f"is {_short(value)} of type {type(value).__name__}, expected a list"
    if length is not None and len(value) != length:
        return f"has {len(value)} items, expected {length}"
    if max_length is not None and len(value) > max_length:
        return f"has {len(value)} items, expected at most {max_length}"
    return None


def _items_problem(
    value: Any, length: int | None, max_length: int | None, item_problem: Any
) -> str | None:
    """Why ``value`` is not a list of the stated length whose every item passes
    ``item_problem`` (a function of one item: a phrase, or None), or None."""
    if reason := _length_problem(value, length, max_length):
        return reason
    for index, item in enumerate(value):
        if reason := item_problem(item):
            return f"item {index} {reason}"
    return None


@dataclass(frozen=True)
class Counts:
    """A list of integer counts, each in ``[low, high]``: exactly ``length`` of them, or
    at most ``max_length``."""

    length: int | None = None
    max_length: int | None = 10_000
    low: int = 0
    high: int = MAX_COUNT
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        return _items_problem(
            value, self.length, self.max_length, lambda item: count_problem(item, self.low, self.high)
        )

    def decode(self, value: Any) -> list[int]:
        return [int(item) for item in value]


@dataclass(frozen=True)
class Reals:
    """A list of finite reals, each in ``[low, high]``: exactly ``length`` of them, or at
    most ``max_length``."""

    length: int | None = None
    max_length: int | None = 10_000
    low: float = -MAX_REAL
    high: float = MAX_REAL
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        return _items_problem(
            value, self.length, self.max_length, lambda item: real_problem(item, self.low, self.high)
        )

    def decode(self, value: Any) -> list[float]:
        return [float(item) for item in value]


@dataclass(frozen=True)
class PlainValue:
    """What any runtime can carry in a report: a string (at most ``max_length``
    characters), a bool, a finite number, or a list of at most ``max_items`` finite
    numbers of one type (all ints or all floats). The rule of a report whose reader
    declares nothing more."""

    max_length: int = 10_000
    max_items: int = 100_000
    optional: bool = True

    def problem(self, value: Any) -> str | None:
        if isinstance(value, str):
            return Text(self.max_length).problem(value)
        if isinstance(value, bool):
            return None
        items = value if isinstance(value, list) else [value]
        if len(items) > self.max_items:
            return f"has {len(items)} items, expected at most {self.max_items}"
        finite = all(
            _is_number(item) and (isinstance(item, numbers.Integral) or math.isfinite(item)) for item in items
        )
        if not finite or len({type(item) for item in items}) > 1:
            return (
                f"= {_short(value)} is not a string, a bool, a finite number or a list of finite "
                "numbers of one type"
            )
        return None

    def decode(self, value: Any) -> Any:
        return list(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class Scalar:
    """An int, float, str or bool, numbers finite: a setup step's plain value when its
    reader declares nothing more."""

    max_length: int = 10_000
    optional: bool = True

    def problem(self, value: Any) -> str | None:
        if isinstance(value, str):
            return Text(self.max_length).problem(value)
        if isinstance(value, bool):
            return None
        if not _is_number(value):
            return f"= {_short(value)} as {type(value).__name__}, not an int, float, str or bool"
        if not isinstance(value, numbers.Integral) and not math.isfinite(float(value)):
            return f"is {float(value)}, not finite"
        return None

    def decode(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class TensorField:
    """A dense tensor (torch or numpy) of a real float or integer dtype and finite
    values: of exactly ``shape``, or of at most ``max_elements`` elements."""

    shape: tuple[int, ...] | None = None
    max_elements: int | None = 10**8
    optional: bool = False

    @property
    def element_bound(self) -> int:
        """The most elements a tensor of this field holds (what a decoder may allocate)."""
        if self.shape is not None:
            return math.prod(self.shape)
        return self.max_elements if self.max_elements is not None else MAX_COUNT

    def problem(self, value: Any) -> str | None:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return f"is a {value.layout} tensor, expected a dense one"
            kind = "f" if value.is_floating_point() else ("c" if value.is_complex() else "iu")
            if value.dtype == torch.bool:
                kind = "b"
            shape = tuple(value.shape)
        elif isinstance(value, np.ndarray):
            kind, shape = value.dtype.kind, tuple(value.shape)
        else:
            return f"is {_short(value)} of type {type(value).__name__}, expected a tensor"
        if kind not in ("f", "iu", "i", "u"):
            return f"has dtype {value.dtype}, expected a real float or integer dtype"
        if self.shape is not None and shape != tuple(self.shape):
            return f"has shape {shape}, expected {tuple(self.shape)}"
        if math.prod(shape) > self.element_bound:
            return f"has {math.prod(shape)} elements, expected at most {self.element_bound}"
        if kind == "f" and not _all_finite(value):
            return "holds non-finite (NaN/Inf) values"
        return None

    def decode(self, value: Any) -> Any:
        return value


def _all_finite(value: torch.Tensor | np.ndarray) -> bool:
    if isinstance(value, np.ndarray):
        return bool(np.isfinite(value).all())
    return bool(torch.isfinite(value).all())


def value_bytes(value: Any) -> int:
    """What ``value`` counts towards a message's total bytes: a string's UTF-8 length, a
    tensor's data, 8 per number or list item (read without converting anything)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return NUMBER_BYTES * max(len(value), 1)
    return NUMBER_BYTES


@dataclass(frozen=True)
class MessageSchema:
    """A message's named fields, what to do with keys it does not name, and its size.

    Args:
        message: what the message is, the first word of every violation ("report").
        fields: each field's kind; a kind with ``optional=False`` must be present.
        unknown: a key not in ``fields``: ``"refuse"`` it, ``"ignore"`` it (left out of
            the decoded message), or check and keep it as the given kind.
        max_bytes: the most bytes the message may hold (:func:`value_bytes` of every
            value plus every key's length), checked before any field.
    """

    message: str
    fields: Mapping[str, FieldKind] = field(default_factory=dict)
    unknown: Literal["refuse", "ignore"] | FieldKind = "refuse"
    max_bytes: int = 1 << 20

    def check(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        """The decoded message (declared fields and kept unknown keys).

        Raises:
            SchemaViolation: the first field that breaks the schema.
        """
        total = 0
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise SchemaViolation(self.message, _short(key), "is not a string key")
            total += len(key) + value_bytes(value)
            if total > self.max_bytes:
                raise SchemaViolation(
                    self.message, key[:40], f"takes the message over its {self.max_bytes} bytes"
                )
        decoded: dict[str, Any] = {}
        for name, kind in self.fields.items():
            if name not in mapping:
                if not kind.optional:
                    raise SchemaViolation(self.message, name, "is missing")
                continue
            if reason := kind.problem(mapping[name]):
                raise SchemaViolation(self.message, name, reason)
            decoded[name] = kind.decode(mapping[name])
        for key, value in mapping.items():
            if key in self.fields:
                continue
            if self.unknown == "ignore":
                continue
            if self.unknown == "refuse":
                raise SchemaViolation(
                    self.message, key[:40], f"is not one of the declared fields {sorted(self.fields)}"
                )
            if reason := self.unknown.problem(value):
                raise SchemaViolation(self.message, key[:40], reason)
            decoded[key] = self.unknown.decode(value)
        return decoded

    def element_bound(self, name: str) -> int | None:
        """The most elements a tensor under ``name`` may hold (what a decoder may allocate
        before :meth:`check`), or None when the schema refuses or ignores that name or
        declares no tensor there."""
        kind = self.fields.get(name, self.unknown)
        return kind.element_bound if isinstance(kind, TensorField) else None
