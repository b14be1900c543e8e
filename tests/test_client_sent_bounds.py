"""Nothing a client sends grows server state or logs without bound (issue 44, findings 2
and 6).

A client's error text is kept bounded and escaped (:mod:`fedplug.run.client_text`): a
newline and an ANSI escape cannot forge a ``fedplug round`` line in the server's log, and
a 25 MB message every round cannot grow ``checkpoint.pt`` until resume is refused. A
reply's metrics are bounded in size before anything iterates them
(:mod:`fedplug.run.reply_metrics`): a 1,000,000-item list or a 100 KB name is refused
with a short warning, never logged whole; a huge but finite ``train_loss`` averages to a
finite mean. On Flower's loopback grid, the simulator and the FedML coordinator.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import LoopbackGrid, run_on_grid
from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
from fedplug.adapters.flower.messages import weighted_metrics
from fedplug.adapters.flower.nodes import handle_evaluate, handle_query, handle_train
from fedplug.adapters.flower.records import METRICS_KEY, NUM_EXAMPLES
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from test_screening_fedml import coordinator_and_workers, step_replies, tamper

from fedplug.config import validate_experiment
from fedplug.experiment import run_experiment
from fedplug.run.local_training import local_rng, train_locally
from fedplug.simulation import sequential

NUM_CLIENTS = 3
HOSTILE = 1
"""The partition (and client) id of the hostile node."""
FORGED = "fedplug round 1: 3/3 chains accepted, 0 failed"
FORGING_TEXT = f"bad batch\n\x1b[2K\r{FORGED}"
"""An error text that, printed raw, ends the server's log line and writes a forged one."""
MAX_CLIENT_TEXT_CHARS = 500
"""The longest client text kept (``fedplug.run.client_text.MAX_CLIENT_TEXT_CHARS``; stated
here so that this file imports on the code before it, where its tests fail)."""
LONGEST_LOG_LINE = 4096
"""No line a client's reply causes may be longer (a few KB)."""


def experiment(rounds: int = 2, **train: Any) -> Any:
    """A tiny run: three clients of a few samples each, one local step per round."""
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["data"]["dataset"].update({"num_train": 90, "num_test": 30, "num_features": 4})
    data["data"]["partition"] = {"name": "iid"}
    data["train"].update(
        {
            "rounds": rounds,
            "client_fraction": 1.0,
            "batch_size": 64,
            "model": {"name": "mlp", "hidden": [4]},
            **train,
        }
    )
    return validate_experiment(data)


def hostile_app(
    train: Callable[[Message, Context], Message] | None = None,
    evaluate: Callable[[Message, Context], Message] | None = None,
) -> ClientApp:
    """The ready ClientApp on every node; node :data:`HOSTILE` trains and evaluates with
    ``train`` and ``evaluate`` (default: as the others)."""
    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))

    def on(handler: Any, hostile: Any) -> Any:
        def handle(message: Message, context: Context) -> Message:
            if hostile is not None and int(context.node_config["partition-id"]) == HOSTILE:
                return hostile(message, context)
            return handler(message, context)

        return handle

    app.train()(on(handle_train, train))
    app.evaluate()(on(handle_evaluate, evaluate))
    app.query()(handle_query)
    return app


def raising(text: str) -> Callable[[Message, Context], Message]:
    def train(message: Message, context: Context) -> Message:
        raise RuntimeError(text)

    return train


def with_metric(handler: Any, key: str, value: Any) -> Callable[[Message, Context], Message]:
    """``handler``'s reply with ``value`` added to its metrics under ``key``."""

    def handle(message: Message, context: Context) -> Message:
        reply = handler(message, context)
        reply.content[METRICS_KEY][key] = value
        return reply

    return handle


def log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every line the captured records print (a message with a newline prints two)."""
    return [line for record in caplog.records for line in record.getMessage().split("\n")]


# ------------------------------------------------------------------ error texts


def test_an_error_text_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # Prepare: client 1's ClientApp raises with a newline, an ANSI escape and a forged line.
    app = hostile_app(train=raising(FORGING_TEXT))
    # Execute
    with caplog.at_level(logging.INFO):
        result, _ = run_on_grid(
            LoopbackGrid(app, NUM_CLIENTS), experiment(), out_dir=tmp_path / "run", federated_evaluation=False
        )
    # Assert: client 1 is dropped each round; no log line starts with the forged text or
    # holds a raw escape; the escape is shown escaped, in the log and in the records.
    assert [record.failures for record in result.history] == [1, 1]
    lines = log_lines(caplog)
    assert not any(line.lstrip("\x1b[2K\r").startswith(FORGED) for line in lines)
    assert not any("\x1b" in line or "\r" in line for line in lines)
    dropped = [line for line in lines if "dropped client(s) [1]" in line]
    assert dropped and all("bad batch\\n\\x1b[2K\\rfedplug round 1" in line for line in dropped)
    reason = result.history[0].dropped[0]["reason"]
    assert "\n" not in reason and "\\x1b" in reason
    assert "bad batch\\\\n\\\\x1b" in (tmp_path / "run" / "metrics.json").read_text()  # JSON of \\n


def test_a_simulated_clients_exception_is_kept_bounded_and_escaped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: client 1's training raises a 1 MB message holding the forged line.
    training: dict[str, int] = {}

    def rng(seed: int, round_index: int, client_id: int) -> Any:
        training["client"] = client_id  # drawn just before the client trains
        return local_rng(seed, round_index, client_id)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if training["client"] == HOSTILE:
            raise RuntimeError(FORGING_TEXT + "x" * 1_000_000)
        return train_locally(*args, **kwargs)

    monkeypatch.setattr(sequential, "local_rng", rng)
    monkeypatch.setattr(sequential, "train_locally", failing)
    config = experiment(engine="sequential")
    # Execute
    with caplog.at_level(logging.INFO):
        result, _ = run_experiment(config, None)
    # Assert
    reasons = [entry["reason"] for record in result.history for entry in record.dropped]
    assert reasons and all(len(reason) <= MAX_CLIENT_TEXT_CHARS and "\n" not in reason for reason in reasons)
    assert all("characters cut ...]" in reason and reason.endswith("xxx") for reason in reasons)
    assert max(len(line) for line in log_lines(caplog)) <= LONGEST_LOG_LINE
    assert not any(line.startswith(FORGED) for line in log_lines(caplog))


def test_a_fedml_workers_error_text_is_kept_bounded_and_escaped() -> None:
    # Prepare: one round; client 3's worker reports a failure with the forged line.
    config = experiment(rounds=1, failures={"max_failed_fraction": 1.0})
    coordinator, workers = coordinator_and_workers(config)
    replies = step_replies(coordinator, workers)
    tamper(replies, HOSTILE, error=FORGING_TEXT + "x" * 1_000_000, vector=None)
    # Execute
    coordinator.handle_replies(replies)
    # Assert
    (record,) = coordinator.result.history
    (entry,) = record.dropped
    assert entry["clients"] == [HOSTILE]
    assert "\n" not in entry["reason"] and "bad batch\\n\\x1b[2K\\r" in entry["reason"]
    assert len(entry["reason"]) <= MAX_CLIENT_TEXT_CHARS


def test_client_text_is_one_bounded_line_and_stable() -> None:
    from fedplug.run.client_text import client_text

    for text in [FORGING_TEXT, "x" * 25_000_000, "\x1b" * 1000, "\u2028 \x85 \u202e \ud800", "ok"]:
        shown = client_text(text)
        assert len(shown) <= MAX_CLIENT_TEXT_CHARS and shown.isprintable()
        assert client_text(shown) == shown
    assert client_text("ok") == "ok"
    # The beginning and the end are kept (a traceback ends with its exception's line).
    shown = client_text("x" * 1000 + "END")
    assert shown == "x" * 234 + " [... 535 characters cut ...] " + "x" * 231 + "END"
    assert len(shown) <= MAX_CLIENT_TEXT_CHARS


def test_a_client_failing_every_round_with_25_mb_keeps_the_checkpoint_small_and_resumes(
    tmp_path: Path,
) -> None:
    """Issue 44 finding 2's run, 50 rounds: the checkpoint grows only with the rounds."""
    rounds = 50
    config = experiment(rounds=rounds)
    message = FORGING_TEXT + "x" * (25 * 2**20)
    # Prepare: the checkpoint of the same run where every client trains, killed after
    # its last round but one, as the reference size.
    class Killed(Exception):
        pass

    def kill_at(last: int) -> Callable[[Any], None]:
        def kill(record: Any) -> None:
            if record.round == last:
                raise Killed

        return kill

    honest = tmp_path / "honest"
    with pytest.raises(Killed):
        run_on_grid(
            LoopbackGrid(hostile_app(), NUM_CLIENTS),
            config,
            out_dir=honest,
            federated_evaluation=False,
            observers=[kill_at(rounds - 1)],
        )
    reference = (honest / "checkpoint.pt").stat().st_size
    # Execute: client 1 raises 25 MB every round; the ServerApp dies after round 49 ...
    out = tmp_path / "hostile"
    sizes: list[int] = []

    def measure(record: Any) -> None:  # observers run after the round's checkpoint is saved
        sizes.append((out / "checkpoint.pt").stat().st_size)
        assert sizes[-1] < reference + 2**20, f"round {record.round}: checkpoint of {sizes[-1]:,} bytes"

    with pytest.raises(Killed):
        run_on_grid(
            LoopbackGrid(hostile_app(train=raising(message)), NUM_CLIENTS),
            config,
            out_dir=out,
            federated_evaluation=False,
            observers=[measure, kill_at(rounds - 1)],
        )
    # ... and the same run resumes from its checkpoint on fresh nodes.
    trained: list[int] = []
    resumed, _ = run_on_grid(
        LoopbackGrid(hostile_app(train=raising(message)), NUM_CLIENTS),
        config,
        out_dir=out,
        federated_evaluation=False,
        observers=[lambda record: trained.append(record.round)],
    )
    # Assert: every round dropped client 1 and kept its checkpoint within 1 MB of the
    # honest run's; the resume was accepted and trained only the last round.
    assert len(sizes) == rounds - 1
    assert trained == [rounds]
    assert [record.failures for record in resumed.history] == [1] * rounds
    assert (out / "checkpoint.pt").stat().st_size < reference + 2**20
    assert all(len(entry["reason"]) <= MAX_CLIENT_TEXT_CHARS for record in resumed.history for entry in record.dropped)


# ---------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("junk", [0.5] * 1_000_000, "'junk' (a list of 1,000,000 items, more than 1,000)"),
        ("k" * 100_000, 0.5, "(a name of 100,000 characters, more than 128)"),
    ],
    ids=["million-item-list", "100-kb-key"],
)
def test_an_oversized_metric_is_refused_in_a_short_warning(
    key: str, value: Any, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: client 1 adds the metric to its train and evaluate replies alike.
    app = hostile_app(
        train=with_metric(handle_train, key, value), evaluate=with_metric(handle_evaluate, key, value)
    )
    # Execute
    with caplog.at_level(logging.INFO):
        result, _ = run_on_grid(LoopbackGrid(app, NUM_CLIENTS), experiment())
    # Assert: client 1 still trains (no component reads the metric); the metric is
    # refused for train and evaluate replies, each round, in short warnings; no line of
    # the log is over a few KB (Flower logs the averaged metrics each round).
    assert [record.failures for record in result.history] == [0, 0]
    lines = log_lines(caplog)
    assert max(len(line) for line in lines) <= LONGEST_LOG_LINE
    assert sum(named in line for line in lines) == 4  # 2 rounds x (train, evaluate)
    assert sum(len(line) for line in lines) < 200_000


def test_an_oversized_metric_is_left_out_of_the_average() -> None:
    contents = [
        RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES: 1, "loss": 2.0, "junk": [1.0] * 2000})}),
        RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES: 3, "loss": 1.0, "k" * 200: 1.0})}),
    ]
    metrics = weighted_metrics(contents)
    assert dict(metrics.items()) == {"loss": pytest.approx((2.0 + 3.0) / 4)}


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([1.0, 1.7e308], 1.7e308 / 4 * 3 + 1 / 4),
        ([1.7e308, 1.7e308], 1.7e308),
        ([-1.7e308, 1.7e308], 1.7e308 / 2),
    ],
)
def test_a_huge_finite_train_loss_gives_a_finite_mean(losses: list[float], expected: float) -> None:
    # Prepare: weights 1 and 3, finite losses whose weighted sum overflows a float.
    contents = [
        RecordDict({METRICS_KEY: MetricRecord({NUM_EXAMPLES: weight, "train_loss": loss})})
        for weight, loss in zip([1, 3], losses, strict=True)
    ]
    # Execute
    mean = weighted_metrics(contents)["train_loss"]
    # Assert: the weighted mean of finite values is finite (the docstring's promise).
    assert math.isfinite(mean) and mean == pytest.approx(expected)


def test_a_fedml_workers_oversized_metric_is_refused_and_the_client_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = experiment(rounds=1, failures={"max_failed_fraction": 1.0})
    coordinator, workers = coordinator_and_workers(config)
    replies = step_replies(coordinator, workers)
    tamper(replies, HOSTILE, metrics={"junk": [0.5] * 1_000_000, "k" * 100_000: 1.0})
    with caplog.at_level(logging.WARNING):
        coordinator.handle_replies(replies)
    (record,) = coordinator.result.history
    assert record.failures == 0
    lines = log_lines(caplog)
    assert any("'junk' (a list of 1,000,000 items, more than 1,000)" in line for line in lines)
    assert max(len(line) for line in lines) <= LONGEST_LOG_LINE
