"""One hostile node in FedDisk's setup phase on Flower is dropped, never the run (issue 44,
findings 1 and 8).

Client 1 runs the ready ClientApp, then tampers with its reply to a phase-1 step the way
an attacker (or a broken ClientApp) could: a malformed weight report in the last reply
(finding 1), an absurd sample count with scaled MADE parameters (finding 8). The server
checks every reply against the schema FedDisk declares and screens it like a round's
reply; the node is dropped with one warning naming it, and the run finishes without it:
never sampled, its report left out of ``metrics.json``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import LoopbackGrid, run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.loopback import FIRST_NODE_ID
from fedplug.adapters.flower.nodes import (
    EXPERIMENT_ID,
    experiment_message_config,
    handle_evaluate,
    handle_query,
    handle_setup_phase,
    handle_train,
)
from fedplug.adapters.flower.records import CONFIG_KEY
from fedplug.adapters.flower.setup_phase import REPORT_KEY, STEP, TENSORS_KEY, VALUES_KEY, load_phase_state
from flwr.app import Array, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from fedplug.algorithms.feddisk import SAMPLE_WEIGHT_KEY, FedDiskConfig, FedDiskPhase
from fedplug.config import validate_experiment
from fedplug.errors import TrainingError

NUM_CLIENTS = 3
HOSTILE = 1
"""The partition (and client) id of the hostile node."""
HOSTILE_NODE = FIRST_NODE_ID + HOSTILE
FEDDISK = {
    "name": "feddisk",
    "made_hidden": 8,
    "made_max_epochs": 2,
    "made_batch_size": 32,
    "global_rounds": 2,
    "classifier_epochs": 5,
    "classifier_lr": 0.5,
    "made_lr": 0.05,
}
"""FedDisk small enough for a second per run, with weights that are not all 1."""
LOGGERS = ("fedplug.adapters.flower", "flwr.fedplug", "fedplug.round")

Tamper = Callable[[str, RecordDict], None]
"""``(step name, reply content)``: what the hostile node does to its phase-1 reply."""


def experiment(**train: Any) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update({"rounds": 2, "client_fraction": 1.0, "loss_transform": FEDDISK, **train})
    return validate_experiment(data)


def force(record: Any, key: str, value: Any) -> None:
    """Store ``value`` under ``key`` even where the record's type check would refuse it (a
    peer that does not use Flower's Python API is not bound by it)."""
    record.__dict__["_data"][key] = value


def hostile_app(tamper: Tamper) -> ClientApp:
    """The ready ClientApp on every node; node :data:`HOSTILE` tampers with its phase-1
    replies."""
    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.train()(handle_train)
    app.evaluate()(handle_evaluate)

    @app.train("feddisk")
    def feddisk(message: Message, context: Context) -> Message:
        reply = handle_setup_phase(message, context)
        if int(context.node_config["partition-id"]) == HOSTILE:
            tamper(str(message.content[CONFIG_KEY][STEP]), reply.content)
        return reply

    return app


def in_report(change: Callable[[Any], None]) -> Tamper:
    def tamper(step: str, content: RecordDict) -> None:
        if REPORT_KEY in content.config_records:
            change(content.config_records[REPORT_KEY])

    return tamper


def set_report(key: str, value: Any) -> Tamper:
    return in_report(lambda report: force(report, key, value))


def remove_report(key: str) -> Tamper:
    return in_report(lambda report: report.__dict__["_data"].pop(key))


REPORT_ATTACKS: dict[str, tuple[Tamper, str]] = {
    "missing-histogram": (remove_report("histogram_counts"), "'histogram_counts' is missing"),
    "empty-histogram": (set_report("histogram_counts", []), "has 0 items, expected 40"),
    "41-bins": (set_report("histogram_counts", [1] * 41), "has 41 items, expected 40"),
    "histogram-string": (set_report("histogram_counts", "40 bins"), "expected a list"),
    "one-count": (set_report("histogram_counts", [5]), "has 1 items, expected 40"),
    "negative-counts": (set_report("histogram_counts", [-5] * 40), "item 0 is -5"),
    "int64-max": (set_report("histogram_counts", [2**63 - 1] + [0] * 39), "item 0 is 9223372036854775807"),
    "html-statistic": (set_report("median", "<script>alert(1)</script>"), "'median' is '<script>"),
    "counts-of-other-samples": (set_report("histogram_counts", [1] * 40), "a weight histogram of 40 samples"),
}
"""Finding 1: each malformed report, and the reason the server logs."""


def run_with(tamper: Tamper, out: Path | None = None, **train: Any) -> tuple[Any, Any, LoopbackGrid]:
    grid = LoopbackGrid(hostile_app(tamper), NUM_CLIENTS)
    result, strategy = run_on_grid(grid, experiment(**train), out_dir=out, federated_evaluation=True)
    return result, strategy, grid


def trained_nodes(grid: LoopbackGrid) -> set[int]:
    return {
        message.metadata.dst_node_id
        for message in grid.delivered
        if message.metadata.message_type in (MessageType.TRAIN, MessageType.EVALUATE)
    }


def dropped_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "dropped" in record.getMessage()]


def node_weights(grid: LoopbackGrid, config: Any, client: int) -> torch.Tensor:
    namespace = f"fedplug.{experiment_message_config(config)[EXPERIMENT_ID]}"
    state = load_phase_state(grid.contexts[FIRST_NODE_ID + client], namespace, "feddisk")
    return FedDiskPhase(FedDiskConfig()).client_context(state)[SAMPLE_WEIGHT_KEY]


@pytest.fixture(autouse=True)
def capture(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    for name in LOGGERS:
        caplog.set_level(logging.INFO, logger=name)
    return caplog


@pytest.mark.parametrize("attack", sorted(REPORT_ATTACKS))
def test_a_malformed_report_drops_that_node_and_the_run_finishes_without_it(
    attack: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: node 1 sends one malformed report of finding 1.
    tamper, reason = REPORT_ATTACKS[attack]
    # Execute
    result, strategy, grid = run_with(tamper, tmp_path / "run")
    # Assert: both rounds ran; node 1 was dropped with one line naming it and the reason,
    # and never trained or evaluated.
    assert [record.round for record in result.history] == [1, 2]
    assert strategy.run.dropped.keys() == {HOSTILE}
    [line] = dropped_lines(caplog)
    assert f"client {HOSTILE} (node {HOSTILE_NODE})" in line and reason in line and "\n" not in line
    assert HOSTILE_NODE not in trained_nodes(grid)
    assert trained_nodes(grid) == {FIRST_NODE_ID, FIRST_NODE_ID + 2}
    # metrics.json: node 1's entries are null, the histogram counts exactly the honest
    # clients' samples (nothing wrapped, nothing broadcast, no text among the numbers).
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    report = metrics["setup_report"]
    honest = [node_weights(grid, experiment(), client).numel() for client in (0, 2)]
    counts = report["sample_weight.histogram"]["counts"]
    assert len(counts) == 40 and all(0 <= count for count in counts) and sum(counts) == sum(honest)
    for name in ("min", "median", "max", "mean", "std"):
        entries = report[f"sample_weight.{name}"]
        assert entries[HOSTILE] is None
        assert all(isinstance(entries[client], float) for client in (0, 2))


def scaled_made_and_samples(samples: int, scale: float) -> Tamper:
    """Finding 8: claim ``samples`` in every reply that counts samples, and send the MADE
    parameters times ``scale``."""

    def tamper(step: str, content: RecordDict) -> None:
        values = content.config_records[VALUES_KEY]
        if "num-samples" in values:
            force(values, "num-samples", samples)
        tensors = content.array_records.get(TENSORS_KEY)
        for name in list(tensors.keys()) if tensors is not None else []:
            tensors[name] = Array(tensors[name].numpy() * np.float32(scale))

    return tamper


REFERENCES: dict[str, list[torch.Tensor]] = {}


def reference_weights(step: str) -> list[torch.Tensor]:
    """The honest clients' weights when client 1 leaves the phase at ``step`` for a reason
    that says nothing about its data (a value missing from its reply)."""
    if step not in REFERENCES:
        missing = {"range": "num-samples", "local": "validation-nll"}[step]

        def leave(name: str, content: RecordDict) -> None:
            if name == step:
                content.config_records[VALUES_KEY].__dict__["_data"].pop(missing)

        _, strategy, grid = run_with(leave)
        assert f"'{missing}' is missing" in strategy.run.dropped[HOSTILE]
        REFERENCES[step] = [node_weights(grid, experiment(), client) for client in (0, 2)]
    return REFERENCES[step]


@pytest.mark.parametrize(
    ("samples", "scale", "step", "reason"),
    [
        (10**15, 1000.0, "range", "expected an integer in [0, 1000000000]"),
        (10**8, 1.0, "range", "but its class counts sum to"),
        (None, 1e6, "local", "over train.screening.max_norm_ratio"),
    ],
    ids=["finding-8", "more-samples-than-class-counts", "made-scaled-1e6"],
)
def test_setup_phase_poisoning_is_screened_like_a_round(
    samples: int | None, scale: float, step: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: node 1 claims samples its class counts do not hold and/or sends MADEs
    # scaled far beyond the model it was sent; the weights of a phase that node 1 left
    # at the same step, harmlessly.
    reference = reference_weights(step)
    caplog.clear()

    def tamper(name: str, content: RecordDict) -> None:
        honest = content.config_records[VALUES_KEY].get("num-samples", 0)
        scaled_made_and_samples(samples if samples is not None else int(honest), scale)(name, content)

    # Execute
    result, strategy, grid = run_with(tamper)
    # Assert: dropped at its first poisoned reply, with the reason; the honest clients'
    # weights are those of a phase without client 1 (not shifted by its claim), mean 1.
    assert strategy.run.dropped.keys() == {HOSTILE}
    [line] = dropped_lines(caplog)
    assert reason in line and f"step {step!r}: client {HOSTILE} (node {HOSTILE_NODE})" in line
    assert HOSTILE_NODE not in trained_nodes(grid)
    assert len(result.history) == 2
    for client, weights in zip((0, 2), reference, strict=True):
        held = node_weights(grid, experiment(), client)
        torch.testing.assert_close(held, weights, rtol=0, atol=1e-6)
        assert abs(float(held.mean()) - 1.0) < 1e-3


def test_a_boosted_made_under_the_ratio_is_dropped_by_max_update_norm() -> None:
    # Prepare: x1000 parameters with an honest sample count pass the default ratio (10^4);
    # train.screening.max_update_norm set, as for rounds, drops them.
    def tamper(step: str, content: RecordDict) -> None:
        claimed = content.config_records[VALUES_KEY].get("num-samples")
        if claimed is not None and step != "range":
            scaled_made_and_samples(int(claimed), 1000.0)(step, content)

    # Execute
    _, strategy, _ = run_with(tamper, screening={"max_update_norm": 1000.0})
    # Assert
    assert list(strategy.run.dropped) == [HOSTILE]
    assert "max_update_norm=1000" in strategy.run.dropped[HOSTILE]


def test_too_many_dropped_nodes_stop_the_run_in_one_line() -> None:
    # Prepare: with max_failed_fraction 0.2, dropping 1 of 3 clients is too many.
    tamper, _ = REPORT_ATTACKS["41-bins"]
    # Execute / Assert
    with pytest.raises(TrainingError) as raised:
        run_with(tamper, failures={"max_failed_fraction": 0.2})
    message = str(raised.value)
    assert "\n" not in message and "1 of 3 clients dropped" in message
    assert f"client {HOSTILE} (node {HOSTILE_NODE})" in message and "max_failed_fraction=0.2" in message


class Killed(BaseException):
    """Stands for the ServerApp being killed after a round."""


def test_a_resumed_run_drops_the_same_node_again_and_finishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a run with node 1 sending 41 bins, killed after round 1 (checkpoint kept).
    tamper, _ = REPORT_ATTACKS["41-bins"]

    def kill_after_round_1(record: Any) -> None:
        if record.round == 1:
            raise Killed

    out = tmp_path / "run"
    grid = LoopbackGrid(hostile_app(tamper), NUM_CLIENTS)
    with pytest.raises(Killed):
        run_on_grid(grid, experiment(), out_dir=out, observers=[kill_after_round_1])
    assert (out / "checkpoint.pt").exists()
    # Execute: the same command again on restarted nodes.
    result, strategy, grid = run_with(tamper, out)
    # Assert: the phase dropped node 1 again (one line each time), the run resumed after
    # round 1 and finished round 2 without it.
    assert strategy.run.offset == 1 and [record.round for record in result.history] == [1, 2]
    assert len(dropped_lines(caplog)) == 2
    assert HOSTILE_NODE not in trained_nodes(grid)
    assert json.loads((out / "metrics.json").read_text())["setup_report"]["sample_weight.median"][HOSTILE] is None
