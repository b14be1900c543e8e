"""A test-only plugin for the timeout tests: a loss transform whose client side hangs.

Loss transform ``timeout_hang``: cross-entropy, except that the clients of each entry of
``hangs`` hang in :meth:`~fedplug.components.LossTransform.client_context`, where every
runtime asks for a client's loss constants before it trains:

- forever (``seconds: null``), or for ``seconds``;
- every time they train, or only ``times`` trainings from their ``first`` (counted in
  this process);
- interruptible (the default: a loop of short sleeps, which both of
  :func:`fedplug.deadline.deadline`'s mechanisms interrupt), or, with
  ``ignore_interrupt``, swallowing :class:`~fedplug.deadline.ClientTimeout` and sleeping
  on: a hang that only the runtime's own bound (a message timeout) can get past.

"Forever" ends when :data:`RELEASE` is set, so an in-process test can free its threads
when it is done; in another process (a Ray actor, an MPI rank) nothing sets it.

Registered through the ordinary plugin mechanism: :func:`timeout_registry` in process,
or the entry point ``timeout_plugins`` (this module) for processes that load installed
plugins (:func:`write_entry_point`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Literal

import numpy as np
from torch import Tensor
from torch.nn import functional as F

from pydantic import BaseModel, ConfigDict

from fedplug.components import ComponentConfig, Context, LossTransform
from fedplug.deadline import ClientTimeout
from fedplug.hookspecs import RegisterLossTransform, hookimpl
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry

HANG = "timeout_hang"
PLUGIN_NAME = "timeout_plugins"
SLEEP_CHUNK_SECONDS = 0.02

RELEASE = threading.Event()
"""Set it to end every hang of this process (tests free their threads with it)."""
_TRAINED: dict[int, int] = {}
"""How many times each client has started training in this process."""


class HangSpec(BaseModel):
    """Which clients hang, when and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clients: tuple[int, ...]
    """Clients that hang."""
    seconds: float | None = None
    """How long they hang (``None``: until :data:`RELEASE` is set, i.e. forever)."""
    first: int = 0
    """Each client's first hanging training, counted from 0 in this process."""
    times: int | None = None
    """How many trainings hang from ``first`` on (``None``: all)."""
    ignore_interrupt: bool = False
    """Swallow ClientTimeout and keep hanging: the deadline cannot end this hang."""
    fail_instead: bool = False
    """Raise at once instead of hanging (a run to compare with: the same clients fail)."""
    sleep_seconds: float = SLEEP_CHUNK_SECONDS
    """Length of each sleep: a long one is a single blocking C call, which only the timer
    signal interrupts (a deadline outside the main thread interrupts between sleeps)."""

    def applies(self, client_id: int, training: int) -> bool:
        return (
            client_id in self.clients
            and training >= self.first
            and (self.times is None or training < self.first + self.times)
        )


class HangConfig(ComponentConfig):
    """Cross-entropy; chosen clients hang before they train (test only)."""

    name: Literal["timeout_hang"] = "timeout_hang"
    hangs: tuple[HangSpec, ...] = ()
    """The hangs; the first that applies to a client's training is the one it does."""


def reset() -> None:
    """Forget how often each client trained, and arm :data:`RELEASE` again."""
    _TRAINED.clear()
    RELEASE.clear()


def hang(seconds: float | None, ignore_interrupt: bool, chunk: float = SLEEP_CHUNK_SECONDS) -> None:
    """Sleep ``seconds`` (``None``: until :data:`RELEASE`), ``chunk`` seconds at a time."""
    end = None if seconds is None else time.monotonic() + seconds
    while True:
        try:  # the whole step: an interrupt may land anywhere in it
            if RELEASE.is_set() or (end is not None and time.monotonic() >= end):
                return
            time.sleep(chunk)
        except ClientTimeout:
            if not ignore_interrupt:
                raise


class Hang(LossTransform):
    """Hangs in :meth:`client_context` for the chosen clients; plain cross-entropy."""

    def __init__(self, config: HangConfig) -> None:
        self.config = config

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        training = _TRAINED.get(client_id, 0)
        _TRAINED[client_id] = training + 1
        for spec in self.config.hangs:
            if spec.applies(client_id, training):
                if spec.fail_instead:
                    raise RuntimeError(f"injected failure on client {client_id}")
                hang(spec.seconds, spec.ignore_interrupt, spec.sleep_seconds)
                break
        return {}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        return F.cross_entropy(logits, targets, reduction="none")


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(HANG, HangConfig, Hang)


_REGISTRY: Registry | None = None


def timeout_registry() -> Registry:
    """The built-in components plus ``timeout_hang`` (built once per process)."""
    global _REGISTRY
    if _REGISTRY is None:
        import sys

        manager = new_plugin_manager(autoload=False)
        manager.register(sys.modules[__name__], name=PLUGIN_NAME)
        _REGISTRY = collect_registry(manager)
    return _REGISTRY


def install_everywhere() -> Registry:
    """Make :func:`fedplug.plugins.default_registry` return :func:`timeout_registry` in
    this process (what a node that builds its components from the installed plugins
    reads); return it."""
    import fedplug.plugins

    registry = timeout_registry()
    fedplug.plugins.default_registry = lambda: registry  # type: ignore[assignment]
    return registry


def write_entry_point(site: Path) -> Path:
    """A ``*.dist-info`` folder under ``site`` declaring this module as a ``fedplug``
    plugin: put ``site`` and this module's folder on ``PYTHONPATH`` and every Python
    started with it loads the plugin like an installed one. Returns ``site``."""
    info = site / "fedplug_timeout_plugins-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fedplug-timeout-plugins\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(f"[fedplug]\n{PLUGIN_NAME} = {PLUGIN_NAME}\n")
    return site
