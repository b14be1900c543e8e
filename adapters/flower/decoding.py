"""Defensive decoding of what a node sends back: every number and every array of a reply
is checked before the server computes with it.

Every violation is a :class:`MalformedReply`, a ``ValueError`` whose text is the reason
logged when the client is dropped; the round goes on without it.
Design: docs/flower.md, 'Design notes: decoding'.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch
from numpy.lib import format as npy_format
from torch import Tensor

NUMPY_STYPE = "numpy.ndarray"
"""The only serialisation type the server decodes (Flower's ``SType.NUMPY``)."""
REAL_KINDS = frozenset("fiu")
"""numpy dtype kinds accepted: floating point, signed and unsigned integers."""
MAX_NUM_EXAMPLES = 10**9
"""Largest ``num-examples`` a reply may state where the run sets no other
(``train.screening.max_num_examples``, whose default this is; an evaluate reply's bound):
far above any real client, far below what overflows a float32 weight sum."""
MAX_NUM_STEPS = 10**9
"""Largest ``fedplug.num-steps`` a reply may state where the run sets no other
(``train.screening.max_num_steps``)."""
MAX_SECONDS = 10.0**9
"""Largest ``fedplug.seconds`` a reply may state (about 31 years)."""
MAX_HEADER_BYTES = 10_000
"""Longest ``.npy`` header read (numpy's own default bound)."""


class MalformedReply(ValueError):
    """A field of a node's reply the server refuses; the text says which and why (it is
    the logged reason the client is dropped)."""


def parse_number(value: Any, key: str) -> float:
    """``value`` as a float (it may be non-finite; callers that need finite say so).

    Raises:
        MalformedReply: ``value`` is not an int or a float.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedReply(f"sent {key!r} as {type(value).__name__}, not a number")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf if value > 0 else -math.inf


def parse_integer(value: Any, key: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``.

    Raises:
        MalformedReply: not a number, not finite, not integral, or out of range.
    """
    number = parse_number(value, key)
    if isinstance(value, int):
        integral = value
    elif math.isfinite(number) and number.is_integer():
        integral = int(number)
    else:
        raise MalformedReply(f"sent {key!r} = {value!r}, not an integer")
    if not low <= integral <= high:
        raise MalformedReply(f"sent {key!r} = {integral}, outside [{low}, {high}]")
    return integral


def finite_number(value: Any, key: str, low: float = -math.inf, high: float = math.inf) -> float:
    """``value`` as a finite float in ``[low, high]``.

    Raises:
        MalformedReply: not a number, not finite, or out of range.
    """
    number = parse_number(value, key)
    if not math.isfinite(number):
        raise MalformedReply(f"sent {key!r} = {number}, not finite")
    if not low <= number <= high:
        raise MalformedReply(f"sent {key!r} = {number:g}, outside [{low:g}, {high:g}]")
    return number


def _header(data: bytes, name: str) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """``(shape, fortran_order, dtype, data offset)`` of the ``.npy`` bytes ``data``."""
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(
                stream, max_header_size=MAX_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(
                stream, max_header_size=MAX_HEADER_BYTES
            )
        else:
            raise MalformedReply(f"sent array {name!r} in .npy format {version}, not 1.0 or 2.0")
    except MalformedReply:
        raise
    # Hostile bytes can make numpy's header parser raise almost anything (ValueError,
    # EOFError, SyntaxError, TypeError, ...): each is the same malformed array.
    except Exception as error:  # noqa: BLE001
        raise MalformedReply(
            f"sent array {name!r} whose bytes are not a .npy array ({type(error).__name__})"
        ) from None
    return tuple(shape), bool(fortran), dtype, stream.tell()


def decode_array(
    array: Any,
    name: str,
    *,
    shape: tuple[int, ...] | None = None,
    max_elements: int | None = None,
) -> np.ndarray:
    """The ndarray a reply's ``Array`` holds, checked before it is converted.

    Args:
        array: the reply's :class:`flwr.app.Array` (any object: nothing is assumed).
        name: the entry's name, for the reason.
        shape: the shape the server expects (``None``: any shape, bounded by
            ``max_elements``); a scalar ``()`` also accepts ``(1,)``, the shape
            ``np.ascontiguousarray`` (and so Flower's ``Array`` of a 0-d tensor) sends,
            and is returned as ``()``.
        max_elements: the most elements accepted when no shape is given.

    Raises:
        MalformedReply: another stype, a dtype that is not a real float or integer, a
            shape other than ``shape`` or more than ``max_elements`` elements, or bytes
            that are not exactly that array.
    """
    stype = getattr(array, "stype", None)
    if stype != NUMPY_STYPE:
        raise MalformedReply(
            f"sent array {name!r} serialised as {stype!r}, not {NUMPY_STYPE!r}"
        )
    data = getattr(array, "data", None)
    if not isinstance(data, bytes):
        raise MalformedReply(f"sent array {name!r} without bytes")
    found, fortran, dtype, offset = _header(data, name)
    if dtype.kind not in REAL_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise MalformedReply(
            f"sent array {name!r} of dtype {dtype}, not a real float or integer dtype"
        )
    if any(not isinstance(size, int) or size < 0 for size in found):
        raise MalformedReply(f"sent array {name!r} of shape {found}")
    scalar_as_vector = shape == () and found == (1,)  # how np.ascontiguousarray sends a scalar
    if shape is not None and found != tuple(shape) and not scalar_as_vector:
        raise MalformedReply(f"returned {name!r} of shape {found}, expected {tuple(shape)}")
    elements = math.prod(found)
    if max_elements is not None and elements > max_elements:
        raise MalformedReply(
            f"sent array {name!r} of {elements} elements, more than the {max_elements} accepted"
        )
    if len(data) - offset != elements * dtype.itemsize:
        raise MalformedReply(
            f"sent array {name!r} of {len(data) - offset} data bytes, its header says "
            f"{elements * dtype.itemsize}"
        )
    values = np.frombuffer(data, dtype=dtype, count=elements, offset=offset)
    return values.reshape(shape if scalar_as_vector else found, order="F" if fortran else "C")


def to_tensor(array: np.ndarray) -> Tensor:
    """A tensor holding a decoded array (a copy): in the native byte order (torch has no
    other), with unsigned integers wider than 8 bits as int64 (torch computes little with
    its unsigned types).

    Raises:
        MalformedReply: a uint64 value beyond the int64 range.
    """
    if array.dtype.kind == "u" and array.dtype.itemsize > 1:
        if array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise MalformedReply(f"sent integers beyond the int64 range ({int(array.max())})")
        return torch.from_numpy(array.astype(np.int64))
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))
