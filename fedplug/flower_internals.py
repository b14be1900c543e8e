"""The only Flower internals fedplug touches: for the in-process grid
(:class:`fedplug.adapters.flower.loopback.LoopbackGrid`) and for building messages outside
a Flower run (the ``flower`` aggregator). It imports nothing from fedplug, so both use it.

:data:`INTERNALS` says where each lives for the installed version; a Flower upgrade that
moves one fails ``tests/test_flower_api.py`` naming it.
Design: docs/flower.md, 'Design notes: flower_internals'.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

LOOPBACK_RUN_ID = 1
SERVER_NODE_ID = 1
CLIENT_APP_RAISED_EXCEPTION = 2
"""Flower's ``ErrorCode.CLIENT_APP_RAISED_EXCEPTION`` (``flwr.common.constant``, not
public; ``tests/test_flower_user_errors.py`` checks the value)."""


@dataclass(frozen=True)
class Internal:
    """One private Flower symbol: where it lives from ``since`` (a Flower version) on."""

    name: str
    locations: tuple[tuple[tuple[int, int], str], ...]
    """``((since_version, module), ...)``, newest first; the first whose version the
    installed Flower reaches is where the symbol must be."""

    def module(self, flower: tuple[int, int]) -> str | None:
        """The module that holds the symbol in Flower ``flower`` (None: it had none)."""
        for since, module in self.locations:
            if flower >= since:
                return module
        return None


INTERNALS = {
    "Run": Internal("Run", (((1, 35), "flwr.supercore.run"), ((0, 0), "flwr.common.typing"))),
    "TaskIdentity": Internal("TaskIdentity", (((1, 38), "flwr.supercore.task_identity"),)),
}


def flower_version() -> tuple[int, int]:
    """The installed Flower's (major, minor)."""
    major, minor = version("flwr").split(".")[:2]
    return int(major), int("".join(character for character in minor if character.isdigit()))


def internal(name: str) -> Any | None:
    """The private Flower symbol ``name`` (a key of :data:`INTERNALS`) for the installed
    version, or None when that version does not have it.

    Raises:
        ImportError: the installed Flower should have it and does not (an upgrade moved
            it); the message names the symbol and the module.
    """
    flower = flower_version()
    module_name = INTERNALS[name].module(flower)
    if module_name is None:
        return None
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        raise ImportError(
            f"Flower {version('flwr')} has no {module_name}.{name}, which fedplug's LoopbackGrid "
            f"needs (fedplug/flower_internals.py says where it lives in each version)"
        ) from None


def missing_internals() -> list[str]:
    """``module.name`` of every internal the installed Flower should have and does not."""
    missing = []
    for name in INTERNALS:
        try:
            internal(name)
        except ImportError:
            missing.append(f"{INTERNALS[name].module(flower_version())}.{name}")
    return missing


def empty_run(run_id: int = LOOPBACK_RUN_ID) -> Any:
    """An empty ``Run`` for ``Grid.run``."""
    return internal("Run").create_empty(run_id=run_id)


def ensure_task_identity() -> None:
    """Give this process the identity a ServerApp has under a Flower runtime, which the
    :class:`~flwr.app.Message` constructor reads (left alone when one is set; nothing to
    do before Flower 1.38)."""
    identity = internal("TaskIdentity")
    if identity is None:
        return
    try:
        _ = (identity.run_id, identity.node_id, identity.task_id)
    except RuntimeError:
        identity.run_id = LOOPBACK_RUN_ID
        identity.node_id = SERVER_NODE_ID
        identity.task_id = 1
