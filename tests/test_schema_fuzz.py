"""A fuzz suite over every field a client sends, drawn from the declared schemas (issue 44,
Build items 1 and 10).

The schemas of :mod:`fedplug.run.reply_schemas` (the round reply, the evaluation reply,
the error reply) and FedDisk's setup schemas (its step replies and its report,
:meth:`~fedplug.algorithms.feddisk.FedDiskPhase.report_schema`) give hypothesis
strategies of valid and invalid values for every field (:mod:`fedplug.schema_strategies`).
First the round core's screen (:func:`fedplug.screening.update_problem`) is held to the
round reply's schema: it accepts exactly the values the schema accepts, field by field
(two independent paths). Then one hostile client whose fields are drawn from the
strategies meets each runtime: the simulator's round core, the Flower loopback grid (train,
evaluate and error replies, and a FedDisk run's setup replies and report) and FedML's
coordinator in process. The server never raises, at most the hostile client is dropped
(in one log line naming it), the global model stays finite, nothing outside the schemas'
bounds reaches the records or ``metrics.json``, and no log line is over a few KB.

Derandomised and without an example database, so ``make test`` runs the same examples
every time; ``max_examples`` is set per test so the file takes well under a minute.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedplug.components import ClientNeeds, ClientUpdate, ReplyExtra, RoundPlan
from fedplug.config import validate_experiment
from fedplug.run.reply_schemas import (
    EXTRAS,
    METRICS,
    Nested,
    error_reply_schema,
    evaluation_reply_schema,
    round_reply_schema,
    update_fields,
)
from fedplug.schema import MessageSchema, SchemaViolation
from fedplug.schema_strategies import invalid_messages, invalid_values, valid_messages, valid_values
from fedplug.screening import ScreeningConfig, ScreeningRules, update_problem

P = 6
K = 4
GLOBAL = torch.linspace(-0.5, 0.5, P)
FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
"""Every test's settings; each sets its own ``max_examples`` (:func:`fuzz`)."""


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)

NEEDS: dict[str, ClientNeeds] = {
    "fedavg": ClientNeeds(),
    "scaffold": ClientNeeds(reply_extras=("delta_c",), reply_extra_shapes={"delta_c": ReplyExtra("model")}),
    "fednova": ClientNeeds(reply_extras=("a",), reply_extra_shapes={"a": ReplyExtra((), minimum=0.0)}),
    "train-loss": ClientNeeds(reply_metrics=("train_loss",)),
    "undeclared-shape": ClientNeeds(reply_extras=("b",)),
}
"""What the run's components ask of every reply: the reply extras and metrics of
SCAFFOLD, FedNova and Flower's QFedAvg, and an extra declared without a shape."""
SCREENING = ScreeningConfig(max_num_examples=1000, max_num_steps=50)


# ------------------------------------------------------------- values from a schema


def values_of(kind: Any, valid: bool) -> st.SearchStrategy[Any]:
    """Values of a field of ``kind``, valid or invalid, from :mod:`fedplug.schema_strategies`
    (a nested message: whole messages, and for an invalid one also undeclared entries of
    invalid values, names too long, and things that are not mappings)."""
    if not isinstance(kind, Nested):
        return valid_values(kind) if valid else invalid_values(kind)
    schema = kind.schema
    if valid:
        return valid_messages(schema)
    unknown = schema.unknown if not isinstance(schema.unknown, str) else None
    hostile_entries = st.dictionaries(
        st.one_of(st.text(max_size=8), st.text(min_size=129, max_size=140), st.integers(0, 3)),
        invalid_values(unknown) if unknown is not None else st.integers(),
        min_size=1,
        max_size=2,
    )
    return st.one_of(
        invalid_messages(schema) if schema.fields else st.nothing(),
        st.tuples(valid_messages(schema), hostile_entries).map(lambda pair: {**pair[0], **pair[1]}),
        st.sampled_from([None, "metrics", [1.0], 3.0]),
    )


def field_values(schema: MessageSchema) -> st.SearchStrategy[tuple[str, Any]]:
    """``(field, value)``: one field of ``schema`` and a valid or invalid value of it."""
    return st.one_of(
        [
            st.tuples(st.just(name), values_of(kind, valid))
            for name, kind in schema.fields.items()
            for valid in (True, False)
        ]
    )


def accepts(schema: MessageSchema, message: Any) -> str | None:
    """Why ``schema`` refuses ``message``, or None."""
    try:
        schema.check(message)
    except SchemaViolation as violation:
        return str(violation)
    return None


# ------------------------------------------- the screen and the schema agree


def honest_update(needs: ClientNeeds, client: int = 1, vector: torch.Tensor = GLOBAL) -> ClientUpdate:
    """A reply both the schema and the screen accept: a small step, the declared extras,
    the asked-for metrics."""
    extras: dict[str, torch.Tensor] = {}
    for name in needs.reply_extras:
        declared = needs.reply_extra_shapes.get(name)
        shape = (P,) if declared is None or declared.shape == "model" else declared.shape
        extras[name] = torch.full(shape, 5.0 if shape == () else 0.05)  # FedNova's a_k of 5 steps
    step = torch.sin(torch.arange(P, dtype=torch.float32) + client) * 0.1
    return ClientUpdate(
        client_id=client, vector=vector + step, weight=40.0 + client, num_steps=5, extras=extras, chain=[client],
        seconds=0.01, metrics=dict.fromkeys(needs.reply_metrics, 0.7), num_examples=40 + client,
    )  # fmt: skip


def with_field(update: ClientUpdate, name: str, value: Any) -> ClientUpdate:
    changed = replace(update, chain=[])  # the screen then reads the client id as sent
    setattr(changed, name, value)
    return changed


def rules_for(needs: ClientNeeds, timeout: float | None) -> ScreeningRules:
    return ScreeningRules(
        model_shape=(P,),
        timeout=timeout,
        required_metrics=needs.reply_metrics,
        extras=dict(needs.reply_extra_shapes),
        required_extras=needs.reply_extras,
        num_clients=K,
        config=SCREENING,
    )


@st.composite
def screened_fields(draw: st.DrawFn) -> tuple[str, float | None, str, Any]:
    components = draw(st.sampled_from(sorted(NEEDS)))
    timeout = draw(st.sampled_from([None, 30.0]))
    schema = round_reply_schema(SCREENING, NEEDS[components], P, K, timeout)
    name, value = draw(field_values(schema))
    return components, timeout, name, value


@fuzz(200)
@given(drawn=screened_fields())
def test_the_screen_accepts_exactly_what_the_round_reply_schema_accepts(
    drawn: tuple[str, float | None, str, Any],
) -> None:
    # Prepare: an honest reply with one field replaced by a value drawn from the schema's
    # strategies, valid or not.
    components, timeout, name, value = drawn
    needs = NEEDS[components]
    schema = round_reply_schema(SCREENING, needs, P, K, timeout)
    update = with_field(honest_update(needs), name, value)
    # Execute: the two independent paths.
    refused_by_schema = accepts(schema, update_fields(update))
    refused_by_screen = update_problem(update, rules_for(needs, timeout))
    # Assert: both accept it, or both refuse it.
    assert (refused_by_schema is None) == (refused_by_screen is None), (
        f"{components}: {name} = {value!r:.200}: schema says {refused_by_schema!r}, screen says {refused_by_screen!r}"
    )


@pytest.mark.parametrize("components", sorted(NEEDS))
def test_the_honest_reply_passes_both(components: str) -> None:
    # The equivalence above must not hold merely because both refuse everything.
    needs = NEEDS[components]
    update = honest_update(needs)
    assert accepts(round_reply_schema(SCREENING, needs, P, K), update_fields(update)) is None
    assert update_problem(update, rules_for(needs, None)) is None


# ------------------------------------------------------------ logs and records


class Lines(logging.Handler):
    """Every log line of the loggers fedplug and Flower log to, while installed."""

    LOGGERS = ("fedplug", "flwr")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Lines:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            self._levels = getattr(self, "_levels", {}) | {name: logger.level}
            logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(self._levels[name])

    def dropped(self, client: int) -> list[str]:
        """The lines that drop ``client``."""
        return [line for line in self.lines if "dropped" in line and f"{client}" in line]

    def assert_bounded(self) -> None:
        """No line over a few KB, none that holds a newline or an escape a client sent."""
        for line in self.lines:
            assert len(line) <= MAX_LINE, f"a {len(line):,}-character log line: {line[:200]!r}"
            assert "\x1b" not in line and "\nfedplug round" not in line, f"a forged line in {line[:200]!r}"


MAX_LINE = 4096
"""The longest log line a client can cause."""
MAX_REASON = 500
"""The longest reason kept in a round's record (:data:`fedplug.run.client_text.MAX_CLIENT_TEXT_CHARS`)."""
FORGED = "\n\x1b[32mfedplug round 1: 3/3 chains accepted, 0 failed\x1b[0m"
"""Finding 2's forged log line."""

error_texts = st.one_of(
    st.text(max_size=60),
    st.text(alphabet=st.sampled_from("ab\n\r\t\x1b\x00\u2028[]"), max_size=80),
    st.integers(600, 200_000).map(lambda size: "x" * size + FORGED),
    st.just(FORGED),
)
"""An error reply's text (:func:`~fedplug.run.reply_schemas.error_reply_schema` keeps any
text, cut and escaped): short, with control characters, up to 200 KB, a forged line."""


@fuzz(30)
@given(text=error_texts)
def test_the_error_reply_schema_keeps_any_text_as_one_bounded_line(text: str) -> None:
    # Execute
    kept = error_reply_schema().check({"reason": text})["reason"]
    # Assert: never refused (the reply fails its client anyway), kept short and on one line.
    assert len(kept) <= MAX_REASON and kept.isprintable()
    assert kept == text or len(text) > MAX_REASON or not text.isprintable()


def assert_kept_reasons_bounded(dropped: list[dict[str, Any]]) -> None:
    for entry in dropped:
        reason = entry["reason"]
        assert len(reason) <= MAX_REASON and reason.isprintable(), f"kept reason {reason[:200]!r}"


# ------------------------------------------------- (a) the simulator's round core

ROUND_CORE_AGGREGATORS: dict[str, Any] = {
    "fedavg": "fedavg",
    "scaffold": "scaffold",
    "fednova": "fednova",
    "qfedavg": {"name": "flower", "strategy": "QFedAvg", "q": 0.1, "client_learning_rate": 0.5},
}
HOSTILE_CLIENT = 2


@functools.cache
def round_core_config(aggregator: str) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["data"]["num_clients"] = K
    document["train"].update(aggregator=ROUND_CORE_AGGREGATORS[aggregator], failures={"max_failed_fraction": 1.0})
    return validate_experiment(document).train


def round_core(aggregator: str) -> Any:
    from fedplug.plugins import default_registry
    from fedplug.run.components import Components
    from fedplug.run.federated_round import RoundCore

    config = round_core_config(aggregator)
    core = RoundCore(
        config, components=Components.build(config, default_registry(), K), num_clients=K,
        class_counts=np.full((K, 2), 50), client_sizes=None, model_bytes=P * 4,
    )  # fmt: skip
    core.aggregator.initialize(GLOBAL)
    return core


def needs_of(rules: ScreeningRules) -> ClientNeeds:
    """The components' needs a round core screens against (:attr:`RoundCore.screening_rules`)."""
    return ClientNeeds(
        reply_extras=rules.required_extras, reply_extra_shapes=dict(rules.extras), reply_metrics=rules.required_metrics
    )


@functools.cache
def core_schema(aggregator: str) -> MessageSchema:
    rules = round_core(aggregator).screening_rules
    return round_reply_schema(rules.config, needs_of(rules), P, K, rules.timeout)


@st.composite
def hostile_round_replies(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]]]:
    aggregator = draw(st.sampled_from(sorted(ROUND_CORE_AGGREGATORS)))
    changes = draw(st.lists(field_values(core_schema(aggregator)), min_size=1, max_size=3))
    return aggregator, changes


@fuzz(30)
@given(drawn=hostile_round_replies())
def test_the_round_core_drops_at_most_the_hostile_client(drawn: tuple[str, list[tuple[str, Any]]]) -> None:
    # Prepare: K clients; client 2's reply with one to three fields drawn from the round
    # reply's schema, valid or not.
    aggregator, changes = drawn
    core = round_core(aggregator)
    needs = needs_of(core.screening_rules)
    updates = [honest_update(needs, client) for client in range(K)]
    for name, value in changes:
        setattr(updates[HOSTILE_CLIENT], name, value)
    refused = accepts(core_schema(aggregator), update_fields(replace(updates[HOSTILE_CLIENT], chain=[])))
    plan = RoundPlan(chains=[[client] for client in range(K)])
    # Execute
    with Lines() as log:
        attempt = core.run(0, GLOBAL, plan, lambda attempt: list(updates))
    # Assert: the model is finite; at most client 2 was dropped, and it was when the schema
    # refuses its reply, in one bounded line naming it.
    assert attempt.vector.shape == GLOBAL.shape and bool(attempt.vector.isfinite().all())
    dropped = {client for chain, _ in attempt.tally.dropped for client in chain}
    assert dropped <= {HOSTILE_CLIENT}
    if refused is not None:
        assert dropped == {HOSTILE_CLIENT}, f"the schema refuses it ({refused}) but the round core kept it"
        assert len(log.dropped(HOSTILE_CLIENT)) == 1
    assert_kept_reasons_bounded([{"reason": reason} for _, reason in attempt.tally.dropped])
    log.assert_bounded()


# ------------------------------------------------------ (b) the Flower loopback grid

NODES = 3
HOSTILE_NODE_CLIENT = 1
FLOWER_NEEDS = {"fedavg": NEEDS["fedavg"], "scaffold": NEEDS["scaffold"], "qfedavg": NEEDS["train-loss"]}
FLOWER_AGGREGATORS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "scaffold": {"aggregator": {"name": "scaffold"}},
    "qfedavg": {"aggregator": ROUND_CORE_AGGREGATORS["qfedavg"]},
}


@functools.cache
def flower_experiment(aggregator: str) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["data"]["num_clients"] = NODES
    document["train"].update({"rounds": 1, "client_fraction": 1.0, **FLOWER_AGGREGATORS[aggregator]})
    return validate_experiment(document)


@functools.cache
def flower_model_size() -> int:
    from fedplug.data.build import build_federation
    from fedplug.plugins import default_registry
    from fedplug.run.model import build_model

    config = flower_experiment("fedavg")
    registry = default_registry()
    federation = build_federation(config.data, registry)
    model = build_model(config.train, registry, federation, federation.device)
    return sum(parameter.numel() for parameter in model.parameters())


def flower_schema(aggregator: str) -> MessageSchema:
    """The train reply's schema on Flower: the round reply's but the aggregation weight
    (Flower's server derives it from ``num-examples``)."""
    config = flower_experiment(aggregator).train
    full = round_reply_schema(config.screening, FLOWER_NEEDS[aggregator], flower_model_size(), NODES)
    return replace(full, fields={name: kind for name, kind in full.fields.items() if name != "weight"})


def force(record: Any, key: str, value: Any) -> None:
    """Store ``value`` even where the record's own type check would refuse it (a peer that
    does not use Flower's Python API is not bound by it)."""
    record.__dict__["_data"][key] = value


def as_wire_array(value: Any) -> Any:
    """A tensor or array as Flower's ``Array``; anything else as it is."""
    from flwr.app import Array

    try:
        if isinstance(value, torch.Tensor):
            value = value.detach().numpy()
        if isinstance(value, np.ndarray):
            return Array(np.ascontiguousarray(value))
    except (TypeError, RuntimeError, ValueError):
        pass
    return value


def set_model(record: Any, value: Any) -> None:
    """``value`` (a flat model, or anything) as the reply's model record: a flat array of
    the model's size split into its layers, any other array or value in the first layer."""
    from flwr.app import Array

    names = list(record.keys())
    array = value.detach().numpy() if isinstance(value, torch.Tensor) and value.layout == torch.strided else value
    if isinstance(array, np.ndarray) and array.shape == (flower_model_size(),):
        start = 0
        for name in names:
            shape = record[name].shape
            size = math.prod(shape)
            record[name] = Array(np.ascontiguousarray(array[start : start + size].reshape(shape)))
            start += size
        return
    force(record, names[0], as_wire_array(value))


def apply_train_field(content: Any, name: str, value: Any) -> None:
    """One round-reply field of a Flower train reply set to ``value``."""
    from flwr.app import ArrayRecord

    from fedplug.adapters.flower import records

    wire = {"client_id": records.CLIENT_ID, "num_examples": records.NUM_EXAMPLES, "num_steps": records.NUM_STEPS,
            "seconds": records.SECONDS}  # fmt: skip
    metrics = content.metric_records[records.METRICS_KEY]
    if name in wire:
        force(metrics, wire[name], value)
    elif name == "vector":
        set_model(content.array_records[records.MODEL_KEY], value)
    elif name == EXTRAS and isinstance(value, dict):
        extras = ArrayRecord()
        for key, item in value.items():
            force(extras, key, as_wire_array(item))
        force(content, records.EXTRAS_KEY, extras)
    elif name == EXTRAS:
        force(content, records.EXTRAS_KEY, value)
    elif name == METRICS and isinstance(value, dict):
        for key, item in value.items():
            force(metrics, key, item)
    elif name == METRICS:
        force(metrics, "train_loss", value)


SCALAR_FIELDS = ("client_id", "num_examples", "num_steps", "seconds")
"""The fields a runtime reads as sent (no conversion on the way): a value the schema
refuses there must drop the client on every runtime."""


@st.composite
def flower_attacks(draw: st.DrawFn) -> dict[str, Any]:
    aggregator = draw(st.sampled_from(sorted(FLOWER_AGGREGATORS)))
    evaluation = evaluation_reply_schema(flower_experiment(aggregator).train.screening)
    return {
        "aggregator": aggregator,
        "train": draw(st.lists(field_values(flower_schema(aggregator)), max_size=2)),
        "evaluate": draw(st.lists(st.one_of(field_values(evaluation), metric_entries()), max_size=2)),
        "error": draw(st.one_of(st.none(), st.none(), st.none(), error_texts)),
        "evaluate_error": draw(st.one_of(st.none(), st.none(), error_texts)),
    }


def metric_entries() -> st.SearchStrategy[tuple[str, Any]]:
    """An evaluation reply's entry the schema does not name: a finite number or list (valid)
    or non-finite, a string, a 1,001-item list or a 129-character name (invalid)."""
    values = st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(st.floats(0, 1), max_size=5),
        st.sampled_from([math.nan, math.inf, 10**400, "<b>1</b>", [0.5] * 1001, None, b"\0"]),
    )
    return st.tuples(st.one_of(st.sampled_from(["f1", "loss2"]), st.text(min_size=129, max_size=129)), values)


def flower_app(attack: dict[str, Any]) -> Any:
    """The ready ClientApp on every node; node 1 sends the attack's train reply fields,
    evaluate reply entries and error texts."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from fedplug.adapters.flower import records
    from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
    from fedplug.adapters.flower.nodes import handle_evaluate, handle_query, handle_train

    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)

    def hostile(context: Context) -> bool:
        return int(context.node_config["partition-id"]) == HOSTILE_NODE_CLIENT

    @app.train()
    def train(message: Message, context: Context) -> Message:
        reply = handle_train(message, context)
        if hostile(context):
            if attack["error"] is not None:
                raise RuntimeError(attack["error"])
            for name, value in attack["train"]:
                apply_train_field(reply.content, name, value)
        return reply

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        reply = handle_evaluate(message, context)
        if hostile(context):
            if attack["evaluate_error"] is not None:
                raise RuntimeError(attack["evaluate_error"])
            for name, value in attack["evaluate"]:
                force(reply.content.metric_records[records.METRICS_KEY], name, value)
        return reply

    return app


def assert_metrics_file_bounded(path: Path) -> None:
    """``metrics.json`` is JSON (no NaN, no infinity), its accuracies in [0, 1] and its
    kept reasons bounded."""
    text = path.read_text()
    metrics = json.loads(text, parse_constant=lambda name: pytest.fail(f"metrics.json holds {name}"))
    for record in metrics["history"]:
        for key in ("accuracy", "client_accuracy_mean", "client_accuracy_std"):
            assert record[key] is None or 0.0 <= record[key] <= 1.0, f"{key} = {record[key]}"
        assert record["loss"] is None or 0.0 <= record["loss"] < math.inf
        assert_kept_reasons_bounded(record["dropped"])
    assert len(text) < 64 * 1024, f"metrics.json of {len(text):,} bytes"


@fuzz(20)
@given(attack=flower_attacks())
def test_one_hostile_flower_node_is_at_most_dropped(attack: dict[str, Any]) -> None:
    import tempfile

    from fedplug.adapters.flower import LoopbackGrid, run_on_grid

    # Prepare: node 1's train and evaluate replies carry fields drawn from the schemas
    # (or it raises with a drawn text).
    refused_scalars = [
        name for name, value in attack["train"]
        if name in SCALAR_FIELDS and flower_schema(attack["aggregator"]).fields[name].problem(value)
    ]  # fmt: skip
    # Execute
    with tempfile.TemporaryDirectory() as folder, Lines() as log:
        out = Path(folder) / "run"
        result, strategy = run_on_grid(
            LoopbackGrid(flower_app(attack), NODES), flower_experiment(attack["aggregator"]), out_dir=out,
            federated_evaluation=True,
        )  # fmt: skip
        # Assert: the round finished without more than node 1, which is dropped in one
        # line when it raised or sent a refused field; the model is finite; nothing
        # outside the schemas' bounds is kept; no log line is over a few KB.
        (record,) = result.history
        dropped = {client for entry in record.dropped for client in entry["clients"]}
        assert dropped <= {HOSTILE_NODE_CLIENT}
        if attack["error"] is not None or refused_scalars:
            assert dropped == {HOSTILE_NODE_CLIENT}, f"kept despite {refused_scalars or 'its error'}"
            assert len(log.dropped(HOSTILE_NODE_CLIENT)) == 1
        assert bool(torch.isfinite(strategy.final_vector).all())
        assert_metrics_file_bounded(out / "metrics.json")
        log.assert_bounded()


# ------------------------------------------- (b) the Flower grid: FedDisk's setup phase

FEDDISK = {
    "name": "feddisk", "made_hidden": 8, "made_max_epochs": 2, "made_batch_size": 32, "global_rounds": 2,
    "classifier_epochs": 5, "classifier_lr": 0.5, "made_lr": 0.05,
}  # fmt: skip
"""FedDisk small enough for a fraction of a second per run (tests/test_setup_phase_hostile.py's)."""


@functools.cache
def feddisk_experiment() -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["data"]["num_clients"] = NODES
    document["train"].update({"rounds": 1, "client_fraction": 1.0, "loss_transform": FEDDISK})
    return validate_experiment(document)


@functools.cache
def feddisk_schemas() -> tuple[MessageSchema, MessageSchema]:
    """FedDisk's own declarations: its first step's reply values and its report."""
    from fedplug.algorithms.feddisk import FedDiskPhase

    phase = FedDiskPhase(feddisk_experiment().train.loss_transform)
    first_step = next(phase.server(NODES))
    return phase.reply_schema(first_step).values, phase.report_schema()


@st.composite
def feddisk_attacks(draw: st.DrawFn) -> dict[str, list[tuple[str, Any]]]:
    range_values, report = feddisk_schemas()
    return {
        "range": draw(st.lists(field_values(range_values), max_size=1)),
        "report": draw(st.lists(field_values(report), min_size=1, max_size=2)),
    }


def feddisk_app(attack: dict[str, list[tuple[str, Any]]]) -> Any:
    """The ready ClientApp; node 1 sets the drawn fields of its first step's values and of
    its report."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare
    from fedplug.adapters.flower.nodes import handle_evaluate, handle_query, handle_setup_phase, handle_train
    from fedplug.adapters.flower.records import CONFIG_KEY
    from fedplug.adapters.flower.setup_phase import REPORT_KEY, STEP, VALUES_KEY

    app = ClientApp()
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    app.query()(handle_query)
    app.train()(handle_train)
    app.evaluate()(handle_evaluate)

    @app.train("feddisk")
    def feddisk(message: Message, context: Context) -> Message:
        reply = handle_setup_phase(message, context)
        if int(context.node_config["partition-id"]) != HOSTILE_NODE_CLIENT:
            return reply
        records = reply.content.config_records
        if str(message.content[CONFIG_KEY][STEP]) == "range":
            for name, value in attack["range"]:
                force(records[VALUES_KEY], name, value)
        if REPORT_KEY in records:
            for name, value in attack["report"]:
                force(records[REPORT_KEY], name, value)
        return reply

    return app


@fuzz(10)
@given(attack=feddisk_attacks())
def test_one_hostile_feddisk_node_is_at_most_dropped_from_the_setup_phase(
    attack: dict[str, list[tuple[str, Any]]],
) -> None:
    import tempfile

    from fedplug.adapters.flower import LoopbackGrid, run_on_grid

    # Prepare: node 1's first-step values and report fields drawn from FedDisk's schemas.
    range_values, report = feddisk_schemas()
    refused = [name for name, value in attack["range"] if range_values.fields[name].problem(value)]
    refused += [name for name, value in attack["report"] if report.fields[name].problem(value)]
    # Execute
    with tempfile.TemporaryDirectory() as folder, Lines() as log:
        out = Path(folder) / "run"
        result, strategy = run_on_grid(LoopbackGrid(feddisk_app(attack), NODES), feddisk_experiment(), out_dir=out)
        # Assert: the run finished; node 1 was dropped, in one line, when a field was
        # refused; metrics.json's setup report counts only in-bound numbers.
        assert [record.round for record in result.history] == [1]
        assert set(strategy.run.dropped) <= {HOSTILE_NODE_CLIENT}
        if refused:
            assert set(strategy.run.dropped) == {HOSTILE_NODE_CLIENT}, f"kept despite {refused}"
            assert len(log.dropped(HOSTILE_NODE_CLIENT)) == 1
        setup = json.loads((out / "metrics.json").read_text())["setup_report"]
        counts = setup["sample_weight.histogram"]["counts"]
        assert len(counts) == 40 and all(isinstance(count, int) and 0 <= count <= 10**9 for count in counts)
        for name in ("min", "median", "max", "mean", "std"):
            entries = setup[f"sample_weight.{name}"]
            assert all(entry is None or (isinstance(entry, float) and 0 <= entry < 1e6) for entry in entries)
        assert bool(torch.isfinite(strategy.final_vector).all())
        log.assert_bounded()


# ------------------------------------------------------- (c) FedML's coordinator

FEDML_FIELDS = {"num_examples": "num_samples", "num_steps": "num_steps", "seconds": "seconds", "vector": "vector",
                "extras": "extras", "metrics": "metrics"}  # fmt: skip
"""The round reply's fields as a FedML worker's ``TaskResult`` names them (its client id
and chain index are the protocol's: a result for another task stops the step)."""


@functools.cache
def fedml_experiment(aggregator: str) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["train"].update(
        {"rounds": 1, "client_fraction": 1.0, "failures": {"max_failed_fraction": 1.0},
         **FLOWER_AGGREGATORS[aggregator]}
    )  # fmt: skip
    return validate_experiment(document)


def fedml_schema(aggregator: str) -> MessageSchema:
    config = fedml_experiment(aggregator)
    full = round_reply_schema(
        config.train.screening, FLOWER_NEEDS[aggregator], flower_model_size(), config.data.num_clients
    )
    return replace(full, fields={name: kind for name, kind in full.fields.items() if name in FEDML_FIELDS})


@st.composite
def fedml_attacks(draw: st.DrawFn) -> dict[str, Any]:
    aggregator = draw(st.sampled_from(sorted(FLOWER_AGGREGATORS)))
    return {
        "aggregator": aggregator,
        "client": draw(st.integers(0, 5)),
        "fields": draw(st.lists(field_values(fedml_schema(aggregator)), min_size=1, max_size=3)),
        "error": draw(st.one_of(st.none(), st.none(), error_texts)),
    }


@fuzz(15)
@given(attack=fedml_attacks())
def test_one_hostile_fedml_worker_result_is_at_most_dropped(attack: dict[str, Any]) -> None:
    from fedplug.adapters.fedml.coordinator import Coordinator
    from fedplug.adapters.fedml.protocol import plan_rounds
    from fedplug.adapters.fedml.worker import Worker
    from fedplug.data.build import build_federation
    from fedplug.plugins import default_registry
    from fedplug.run.model import build_model

    # Prepare: one round on two workers; one client's result carries drawn fields (or
    # the worker reports a drawn error text for it).
    config = fedml_experiment(attack["aggregator"])
    registry = default_registry()
    federation = build_federation(config.data, registry)
    schedule = plan_rounds(config.train, registry, federation.class_counts)
    coordinator = Coordinator(config.train, federation, registry, schedule, 2)
    workers = []
    for slot in range(2):
        model = build_model(config.train, registry, federation, federation.device)
        workers.append(Worker(config.train, federation, registry, model, slot, 2))
    replies = []
    for slot, worker in enumerate(workers):
        worker.receive(coordinator.message[slot])
        replies.append(worker.train(coordinator.step))
    client = attack["client"]
    schema = fedml_schema(attack["aggregator"])
    refused = [name for name, value in attack["fields"] if name != METRICS and schema.fields[name].problem(value)]
    for message in replies:
        for result in message["results"]:
            if result.client_id == client:
                for name, value in attack["fields"]:
                    setattr(result, FEDML_FIELDS[name], value)
                result.error = attack["error"]
    # Execute
    with Lines() as log:
        coordinator.handle_replies(replies)
    # Assert: at most that client dropped (in one line), always when a field was refused
    # or it failed; a finite model; bounded reasons and log lines.
    (record,) = coordinator.result.history
    dropped = {member for entry in record.dropped for member in entry["clients"]}
    assert dropped <= {client}
    if refused or attack["error"] is not None:
        assert dropped == {client}, f"kept despite {refused or 'its error'}"
        assert len(log.dropped(client)) == 1
    assert bool(coordinator.global_vector.isfinite().all())
    assert_kept_reasons_bounded(record.dropped)
    log.assert_bounded()
