"""The TensorBoard backend (``tracking.backends: [mlflow, tensorboard]``): event files
written with ``torch.utils.tensorboard`` into ``<run output folder>/tensorboard/``.

Each round's metrics are scalars at ``global_step = round`` (``accuracy``, ``loss``,
``bytes_up``, ...); the summary metrics go under ``summary/`` at the last round; params
are one text entry (``params``). See them with ``tensorboard --logdir runs``.

Resuming: on opening, the rounds the folder's event files already hold are read back
(:attr:`TensorBoardTracker.logged_rounds`), and the writer purges anything logged after
the last of them, so a resumed run never holds a step twice. Every round is flushed to
disk at once, so a killed run loses nothing it reported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedplug.errors import TrackingError
from fedplug.run.results import RoundRecord, RunResult
from fedplug.tracking.payloads import params_payload, round_metrics, summary_metrics

STEP_METRIC = "accuracy"
"""The scalar whose steps tell which rounds a folder holds."""


def logged_steps(folder: str | os.PathLike[str], tag: str = STEP_METRIC) -> set[int]:
    """The steps of scalar ``tag`` in the event files under ``folder`` (empty when none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = Path(folder)
    if not folder.is_dir():
        return set()
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    if tag not in accumulator.Tags().get("scalars", []):
        return set()
    return {int(event.step) for event in accumulator.Scalars(tag)}


class TensorBoardTracker:
    """Logs one training run as TensorBoard scalars; a :class:`~fedplug.tracking.TrackerBackend`."""

    def __init__(self, writer: Any, folder: Path, logged_rounds: set[int]) -> None:
        self.writer = writer
        self.folder = folder
        """The folder holding the event files."""
        self.logged_rounds = logged_rounds
        self.resumed = bool(logged_rounds)

    @classmethod
    def open(cls, folder: str | os.PathLike[str], *, resume: bool = True) -> TensorBoardTracker:
        """Write event files into ``folder``; continue the rounds it holds when ``resume``,
        else start over (older event files are removed)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackingError(
                "tracking.backends names tensorboard, which is not installed; install it "
                "(pip install 'fedplug[tensorboard]') or remove it from tracking.backends"
            ) from None
        folder = Path(folder)
        if not resume and folder.is_dir():
            for events in folder.glob("events.out.tfevents.*"):
                events.unlink()
        held = logged_steps(folder) if resume else set()
        # Steps after the last one held were never reported as done: purge them.
        purge_step = max(held) + 1 if held else None
        writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step, flush_secs=5)
        return cls(writer, folder, held)

    def log_params(self, params: Mapping[str, Any]) -> None:
        payload = params_payload(params)
        self.writer.add_text("params", "\n".join(f"    {key}: {value}" for key, value in sorted(payload.items())))
        self.writer.flush()

    def log_round(self, record: RoundRecord) -> None:
        if record.round in self.logged_rounds:
            return
        for key, value in round_metrics(record).items():
            self.writer.add_scalar(key, value, global_step=record.round)
        self.writer.flush()
        self.logged_rounds.add(record.round)

    def log_result(self, result: RunResult) -> None:
        for record in result.history:
            self.log_round(record)
        step = len(result.history)
        for key, value in summary_metrics(result).items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=step)
        derived = {f"derived.{key}": value for key, value in result.derived_params.items()}
        if derived:
            self.writer.add_text("derived", json.dumps(params_payload(derived), indent=2))
        self.writer.flush()

    def log_model(self, model: Any, input_example: Any, *, registered_model_name: str | None = None) -> str | None:
        """TensorBoard keeps no models: nothing to do."""
        return None

    def log_artifacts(self, paths: Mapping[str, str | os.PathLike[str]]) -> None:
        """TensorBoard keeps no files: nothing to do."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.writer.add_text("tags", "\n".join(f"    {key}: {value}" for key, value in sorted(tags.items())))
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()

    def fail(self) -> None:
        self.writer.close()
