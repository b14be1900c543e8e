"""FedGSP's group-number growth: M = f(r), the number of groups of round r (the paper's
eq. 1-3), clipped to the number of sampled clients."""

from __future__ import annotations

import math
from typing import Literal

GrowthKind = Literal["linear", "log", "exp"]

MAX_GROWTH = 2**62
"""Where :func:`growth` saturates, far above any number of clients, so ``exp`` growth
cannot overflow in late rounds."""


def growth(kind: GrowthKind, round_number: int, alpha: float, beta: float) -> int:
    """The paper's group-number growth function f(r) (eq. 1-3), before clipping.

    - ``linear``: ``beta * floor(alpha * (r - 1) + 1)``
    - ``log``: ``beta * floor(alpha * ln(r) + 1)``
    - ``exp``: ``beta * floor((1 + alpha) ** (r - 1))``

    Args:
        kind: which of the three functions.
        round_number: r, 1-based.
        alpha: growth rate (the paper's default 2.0 with ``log``).
        beta: initial number of groups and growth span (the paper's default 10; an
            integer in the paper, accepted as a float here, the product is floored).

    Returns:
        The number of groups, an int; saturates at :data:`MAX_GROWTH`.
    """
    if round_number < 1:
        raise ValueError(f"round_number is 1-based, got {round_number}")
    if kind == "linear":
        step = math.floor(alpha * (round_number - 1) + 1)
    elif kind == "log":
        step = math.floor(alpha * math.log(round_number) + 1)
    elif kind == "exp":
        exponent = (round_number - 1) * math.log1p(alpha)
        if exponent >= math.log(MAX_GROWTH):
            return MAX_GROWTH
        step = math.floor((1 + alpha) ** (round_number - 1))
    else:
        raise ValueError(f"unknown growth kind {kind!r}; use 'linear', 'log' or 'exp'")
    return min(math.floor(beta * step), MAX_GROWTH)


def num_groups(
    round_number: int,
    num_clients: int,
    kind: GrowthKind = "log",
    alpha: float = 2.0,
    beta: float = 10.0,
) -> int:
    """M = f(r) clipped to [1, num_clients]; arguments as in :func:`growth`."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    return int(min(max(growth(kind, round_number, alpha, beta), 1), num_clients))
