"""What a run records: one :class:`RoundRecord` per round and a :class:`RunResult`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
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
    compute_seconds_model: float = 0.0
    """The FedGSP cost model's compute time for this round (paper eq. 15-17)."""
    communication_seconds_model: float = 0.0
    """The cost model's communication time for this round."""
    faults_dropout: int = 0
    """Clients ``train.faults.dropout`` kept out of the round: sampled clients that
    dropped out, plus those its trace lists as unavailable."""
    faults_stragglers: int = 0
    """Clients of the round's plan that ``train.faults.stragglers`` slows down."""
    faults_straggler_timeouts: int = 0
    """Chains dropped because a straggler's modelled time exceeded
    ``train.failures.client_timeout_seconds`` (also counted in ``failures``)."""
    faults_corrupted: int = 0
    """Updates ``train.faults.corruption`` corrupted (those screening dropped are also
    counted in ``failures``)."""
    dropped: list[dict[str, Any]] = field(default_factory=list)
    """What was dropped from the round and why: ``{"clients": [...], "reason": "..."}``
    per dropout, failed chain and screened-out update (the final attempt's)."""
    clients: list[int] | None = None
    """The clients that trained in the round, chain by chain (the plan's members, which
    ``participants`` counts; one whose update failed is also named in ``dropped``). None
    in a record written before fedplug recorded them (an older checkpoint)."""
    chains: list[list[int]] | None = None
    """Each chain's members in training order, when a grouper chained clients (a chain
    of more than one); None when every client trained alone, as ``clients`` then says."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the components report about the round themselves
    (:meth:`fedplug.components.Grouper.round_metrics`: ``cpd_median``, ``cpd_mean``);
    written beside the fixed fields."""

    def as_dict(self) -> dict[str, Any]:
        """The record as one flat dict: the fixed fields, then the components' metrics
        (``dropped``, ``clients`` and ``chains`` are the lists)."""
        values = asdict(self)
        metrics = values.pop("metrics")
        return {key: _json_number(value) for key, value in {**values, **metrics}.items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RoundRecord":
        """Read :meth:`as_dict`'s output back (null numbers as NaN)."""
        names = {item.name for item in fields(cls)} - {"metrics"}
        fixed = {key: (float("nan") if value is None else value) for key, value in values.items() if key in names}
        fixed["dropped"] = [dict(entry) for entry in values.get("dropped") or []]
        clients, chains = values.get("clients"), values.get("chains")
        fixed["clients"] = None if clients is None else [int(client) for client in clients]
        fixed["chains"] = None if chains is None else [[int(client) for client in chain] for chain in chains]
        if isinstance(values.get("metrics"), dict):  # asdict()'s form, as checkpoints hold it
            metrics = dict(values["metrics"])
        else:
            metrics = {key: (float("nan") if value is None else float(value)) for key, value in values.items() if key not in names}
        return cls(**fixed, metrics=metrics)


@dataclass
class RunResult:
    history: list[RoundRecord]
    target_accuracy: float | None
    setup_rounds: int = 0
    """Communication rounds spent before training (FedDisk's MADE phase)."""
    setup_bytes: int = 0
    setup_seconds: float = 0.0
    """Wall time of the loss transform's preparation and setup phase in this run (FedDisk's
    density estimation; about 0 when it loads a cached result); not in ``total_seconds``."""
    derived_params: dict[str, Any] = field(default_factory=dict)
    """Values computed from the config that a reader wants to see (FedAvgM's effective
    learning rate)."""
    setup_report: dict[str, Any] = field(default_factory=dict)
    """What the loss transform's setup reports about its result
    (:meth:`fedplug.components.LossTransform.setup_report`: FedDisk's per-client
    sample-weight quantiles and their histogram), JSON-ready; ``setup_report`` in
    metrics.json. Filled by every runtime from its loss transform
    (:meth:`fedplug.run.federated_round.RoundCore.run_result`); empty where the setup's result
    stays on the clients (Flower)."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunResult:
        """Read ``dataclasses.asdict(result)`` back (a FedML rank's ``run_result.json``);
        runs build theirs with :meth:`fedplug.run.federated_round.RoundCore.run_result`."""
        history = [RoundRecord.from_dict(record) for record in values["history"]]
        return cls(**{**values, "history": history})

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
        return rounds_to_target((record.as_dict() for record in self.history), self.target_accuracy)

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
            "setup_seconds": self.setup_seconds,
            "final_loss": _json_number(self.history[-1].loss) if self.history else None,
            "derived": self.derived_params,
            "setup_report": self.setup_report,
            "history": [record.as_dict() for record in self.history],
        }


WALL_CLOCK_KEYS = ("total_seconds", "setup_seconds")
"""The measured (machine- and load-dependent) values of :meth:`RunResult.summary`; each
round's are ``seconds``. Everything else in ``metrics.json`` is a function of the config."""

BESIDE_HASHED_ROUND_KEYS = {"seconds": "round_seconds", "clients": "round_clients", "chains": "round_chains"}
"""Round keys a pipeline keeps beside the files DVC hashes, under these names: the measured
``seconds``, and the rounds' client ids (:attr:`RoundRecord.clients`, ``chains``), which
are reproducible but came after the committed runs were hashed: kept beside them, adding
them moved no committed hash (the MLflow run shows them per round)."""


def split_wall_clock(summary: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(reproducible, timings)`` of a :meth:`RunResult.summary`: the summary without its
    measured times, and those times (``total_seconds``, ``setup_seconds`` and the rounds'
    ``seconds`` as ``round_seconds``). Files a pipeline commits keep only the first, so a
    re-run on another machine writes them byte for byte. The rounds' client ids go with
    the times (``round_clients``, ``round_chains``; :data:`BESIDE_HASHED_ROUND_KEYS`)."""
    reproducible = {key: value for key, value in summary.items() if key not in WALL_CLOCK_KEYS}
    timings: dict[str, Any] = {key: summary[key] for key in WALL_CLOCK_KEYS if key in summary}
    history = summary.get("history")
    if isinstance(history, list):
        reproducible["history"] = [
            {key: value for key, value in record.items() if key not in BESIDE_HASHED_ROUND_KEYS} for record in history
        ]
        for key, name in BESIDE_HASHED_ROUND_KEYS.items():
            if key == "seconds" or any(key in record for record in history):
                timings[name] = [record.get(key) for record in history]
    return reproducible, timings


def first_round_reaching(history: Iterable[Mapping[str, Any]], target: float) -> Mapping[str, Any] | None:
    """The first round whose accuracy is at least ``target``, or None when none is.

    ``history`` holds rounds as :meth:`RoundRecord.as_dict` writes them (``metrics.json``'s
    ``history``); a null or NaN accuracy never reaches the target.
    """
    for record in history:
        accuracy = record.get("accuracy")
        if accuracy is not None and accuracy >= target:
            return record
    return None


def rounds_to_target(history: Iterable[Mapping[str, Any]], target: float) -> int | None:
    """The number of :func:`first_round_reaching`'s round (1-based), or None."""
    reached = first_round_reaching(history, target)
    return None if reached is None else int(reached["round"])


def _json_number(value: Any) -> Any:
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
