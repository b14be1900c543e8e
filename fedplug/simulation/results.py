"""What a run records: one :class:`RoundRecord` per round and a :class:`RunResult`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RoundRecord:
    """Metrics of one round (1-based ``round``), as written to ``metrics.json``."""

    round: int
    accuracy: float
    loss: float
    client_accuracy_mean: float
    client_accuracy_std: float
    bytes_up: int
    bytes_down: int
    cumulative_bytes: int
    """All traffic so far, pre-training phases (FedDisk's MADE rounds) included."""
    seconds: float
    participants: int
    failures: int
    cpd_median: float
    cpd_mean: float
    compute_seconds_model: float = 0.0
    """The FedGSP cost model's compute time for this round (paper eq. 15-17)."""
    communication_seconds_model: float = 0.0
    """The cost model's communication time for this round."""

    def as_dict(self) -> dict[str, Any]:
        return {key: _json_number(value) for key, value in asdict(self).items()}


@dataclass
class RunResult:
    history: list[RoundRecord]
    target_accuracy: float | None
    setup_rounds: int = 0
    """Communication rounds spent before training (FedDisk's MADE phase)."""
    setup_bytes: int = 0
    derived_params: dict[str, Any] = field(default_factory=dict)
    """Values computed from the config that a reader wants to see (FedAvgM's effective
    learning rate)."""

    @property
    def final_accuracy(self) -> float:
        return self.history[-1].accuracy if self.history else float("nan")

    @property
    def best_accuracy(self) -> float:
        return max((record.accuracy for record in self.history), default=float("nan"))

    @property
    def rounds_to_target(self) -> int | None:
        if self.target_accuracy is None:
            return None
        for record in self.history:
            if record.accuracy >= self.target_accuracy:
                return record.round
        return None

    @property
    def total_bytes(self) -> int:
        return self.history[-1].cumulative_bytes if self.history else self.setup_bytes

    def summary(self) -> dict[str, Any]:
        """The content of ``metrics.json``."""
        return {
            "final_accuracy": _json_number(self.final_accuracy),
            "best_accuracy": _json_number(self.best_accuracy),
            "rounds": len(self.history),
            "target_accuracy": self.target_accuracy,
            "rounds_to_target": self.rounds_to_target,
            "effective_rounds": len(self.history) + self.setup_rounds,
            "setup_rounds": self.setup_rounds,
            "total_bytes": self.total_bytes,
            "total_seconds": sum(record.seconds for record in self.history),
            "final_loss": _json_number(self.history[-1].loss) if self.history else None,
            "derived": self.derived_params,
            "history": [record.as_dict() for record in self.history],
        }


def _json_number(value: Any) -> Any:
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
