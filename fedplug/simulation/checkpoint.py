"""Per-round checkpoints, written atomically so a crash never leaves a torn file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fedplug.errors import TrainingError

CHECKPOINT_VERSION = 1


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` via a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    torch.save({"version": CHECKPOINT_VERSION, **state}, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def load_checkpoint(path: Path, fingerprint: str) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if there is one for this exact config, else ``None``."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise TrainingError(
            f"checkpoint {str(path)!r} is unreadable ({type(error).__name__}); delete it to start over"
        ) from None
    if not isinstance(state, dict) or "fingerprint" not in state:
        raise TrainingError(
            f"checkpoint {str(path)!r} is not a fedplug checkpoint; delete it to start over or choose another --out"
        )
    if state.get("version") != CHECKPOINT_VERSION or state.get("fingerprint") != fingerprint:
        raise TrainingError(
            f"checkpoint {str(path)!r} belongs to a different config; delete it or choose another --out"
        )
    return state
