"""Declared schemas for client-sent messages (issue 44, build item 1): the field kinds of
:mod:`fedplug.schema` on hand-made values, FedDisk's report schema against each malformed
report of finding 1, the schema applied in one process, and the hypothesis strategies
generated from the schemas."""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedplug.algorithms.feddisk import FedDiskConfig, FedDiskPhase, client_weight_summary
from fedplug.algorithms.feddisk.weights import HISTOGRAM_BINS, WEIGHT_STATS, weight_report_schema
from fedplug.components import PhaseCost
from fedplug.errors import TrainingError
from fedplug.schema import (
    Count,
    Counts,
    Flag,
    MessageSchema,
    PlainValue,
    Real,
    Reals,
    SchemaViolation,
    TensorField,
    Text,
)
from fedplug.schema_strategies import invalid_messages, invalid_values, valid_messages, valid_values
from fedplug.setup_phase import (
    ClientInputs,
    PhaseInputs,
    ReplySchema,
    SetupPhase,
    SetupReplies,
    SetupReply,
    SetupStep,
    checked_reply,
    run_in_process,
)

# ------------------------------------------------------------------- field kinds


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (-1, "is -1, expected an integer in [0, 100]"),
        (101, "is 101, expected an integer in [0, 100]"),
        (2**63 - 1, "is 9223372036854775807, expected an integer in [0, 100]"),
        (2**200, "expected an integer in [0, 100]"),
        (2.5, "is 2.5, expected an integer"),
        (math.nan, "is nan, expected an integer"),
        (math.inf, "is inf, expected an integer"),
        (True, "of type bool, expected an integer"),
        ("7", "of type str, expected an integer"),
        (None, "of type NoneType, expected an integer"),
    ],
)
def test_a_count_outside_its_bounds_or_not_an_integer_is_refused(value: Any, reason: str) -> None:
    assert reason in (Count(0, 100).problem(value) or "")


def test_a_count_accepts_integers_and_integral_floats_in_bounds() -> None:
    count = Count(0, 100)
    assert [count.problem(value) for value in (0, 100, 5.0, np.int64(7), np.float32(3.0))] == [None] * 5
    assert count.decode(5.0) == 5 and isinstance(count.decode(np.int64(7)), int)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (1.7e308, "is 1.7e+308, expected a number in [-10, 10]"),
        (10**400, "expected a number in [-10, 10]"),  # compared as an int, never float()'d
        (-11, "is -11, expected a number in [-10, 10]"),
        (math.nan, "is nan, expected a finite number"),
        (-math.inf, "is -inf, expected a finite number"),
        ("<b>1</b>", "of type str, expected a number"),
        (False, "of type bool, expected a number"),
        (complex(1, 0), "of type complex, expected a number"),
    ],
)
def test_a_real_outside_its_bounds_or_not_finite_is_refused(value: Any, reason: str) -> None:
    assert reason in (Real(-10, 10).problem(value) or "")


def test_a_real_may_let_non_finite_values_through_when_its_reader_handles_them() -> None:
    nll = Real(0.0, math.inf, allow_nonfinite=True)
    assert nll.problem(math.nan) is None and nll.problem(math.inf) is None
    assert nll.problem(-1.0) == "is -1.0, expected a number in [0, inf]"


def test_text_and_flags() -> None:
    assert Text(5).problem("abcde") is None
    assert Text(5).problem("abcdef") == "is a string of 6 characters, expected at most 5"
    assert "expected a string" in (Text(5).problem(5) or "")
    assert Flag().problem(True) is None and "expected a bool" in (Flag().problem(1) or "")


@pytest.mark.parametrize(
    ("kind", "value", "reason"),
    [
        (Counts(length=3), [1, 2], "has 2 items, expected 3"),
        (Counts(length=3), [1, 2, 3, 4], "has 4 items, expected 3"),
        (Counts(length=3), "1 2 3", "of type str, expected a list"),
        (Counts(length=3, high=10), [1, 11, 2], "item 1 is 11, expected an integer in [0, 10]"),
        (Counts(length=3), [1, -2, 2], "item 1 is -2"),
        (Counts(max_length=2), [1, 2, 3], "has 3 items, expected at most 2"),
        (Reals(length=2, low=0, high=1), [0.5, 2.0], "item 1 is 2.0, expected a number in [0, 1]"),
        (Reals(length=2), [0.5, math.nan], "item 1 is nan, expected a finite number"),
        (Reals(max_length=1), [0.5, 0.5], "has 2 items, expected at most 1"),
    ],
)
def test_a_list_of_the_wrong_length_or_with_a_bad_item_is_refused(kind: Any, value: Any, reason: str) -> None:
    assert reason in (kind.problem(value) or "")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (torch.ones(2, 4), "has shape (2, 4), expected (2, 3)"),
        (torch.ones(2, 3, dtype=torch.complex64), "expected a real float or integer dtype"),
        (torch.ones(2, 3, dtype=torch.bool), "expected a real float or integer dtype"),
        (np.ones((2, 3), dtype="U2"), "expected a real float or integer dtype"),
        (torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]]), "holds non-finite (NaN/Inf) values"),
        (np.full((2, 3), np.inf), "holds non-finite (NaN/Inf) values"),
        ([[0.0] * 3] * 2, "of type list, expected a tensor"),
        (torch.ones(2, 3).to_sparse(), "expected a dense one"),
    ],
)
def test_a_tensor_of_another_shape_dtype_or_with_non_finite_values_is_refused(value: Any, reason: str) -> None:
    assert reason in (TensorField(shape=(2, 3)).problem(value) or "")


def test_a_tensor_field_bounds_its_elements_and_accepts_real_dtypes() -> None:
    field = TensorField(max_elements=6)
    assert field.problem(torch.ones(7)) == "has 7 elements, expected at most 6"
    assert [field.problem(value) for value in (torch.ones(6), np.arange(6), torch.ones(2, 3, dtype=torch.int8))] == [
        None
    ] * 3
    assert TensorField(shape=(4, 5)).element_bound == 20


# ----------------------------------------------------------------- message schema

SCHEMA = MessageSchema(
    "report",
    {"counts": Counts(length=3), "mean": Real(0, 10, optional=True), "label": Text(8, optional=True)},
    max_bytes=200,
)


def test_a_message_is_decoded_with_its_optional_fields_left_out() -> None:
    assert SCHEMA.check({"counts": [1, 2, 3.0], "label": "ab"}) == {"counts": [1, 2, 3], "label": "ab"}


@pytest.mark.parametrize(
    ("message", "text"),
    [
        ({}, "report field 'counts' is missing"),
        ({"counts": [1, 2, 3, 4]}, "report field 'counts' has 4 items, expected 3"),
        ({"counts": [1, 2, 3], "mean": 11}, "report field 'mean' is 11, expected a number in [0, 10]"),
        ({"counts": [1, 2, 3], "extra": 1}, "report field 'extra' is not one of the declared fields"),
        ({"counts": [1, 2, 3], "label": "x" * 300}, "report field 'label' takes the message over its 200 bytes"),
        ({"counts": [1, 2, 3], 7: 1}, "report field '7' is not a string key"),
    ],
)
def test_a_message_that_breaks_its_schema_raises_one_violation_naming_the_field(
    message: dict[Any, Any], text: str
) -> None:
    with pytest.raises(SchemaViolation) as raised:
        SCHEMA.check(message)
    assert str(raised.value).startswith(text) and "\n" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_a_huge_value_under_an_unknown_key_is_refused_by_the_bytes_bound_before_any_check() -> None:
    # Prepare: a 1,000,000-item list (8 MB on the wire) that no field names.
    schema = MessageSchema("metrics", {"loss": Real()}, unknown="ignore", max_bytes=4096)
    # Execute / Assert: refused by its size, named by its key.
    with pytest.raises(SchemaViolation, match="'junk' takes the message over its 4096 bytes"):
        schema.check({"loss": 0.5, "junk": [0] * 1_000_000})
    assert schema.check({"loss": 0.5, "junk": [0] * 10}) == {"loss": 0.5}


def test_unknown_keys_can_be_checked_against_a_kind_and_kept() -> None:
    schema = MessageSchema("client report", unknown=PlainValue())
    assert schema.check({"a": [1, 2], "b": "x", "c": True}) == {"a": [1, 2], "b": "x", "c": True}
    for bad in ([1, 2.5], [True], None, math.nan, [math.inf]):
        with pytest.raises(SchemaViolation, match="client report field 'x'"):
            schema.check({"x": bad})


# -------------------------------------------------------------- FedDisk's report

FEDDISK_REPORT = weight_report_schema(5.0)


def honest_report() -> dict[str, Any]:
    weights = np.random.default_rng(0).uniform(0.2, 3.0, size=40)
    return client_weight_summary(weights, 5.0)


def test_an_honest_feddisk_report_passes_its_schema() -> None:
    report = honest_report()
    assert FEDDISK_REPORT.check(report) == report
    # A client without samples sends only its (empty) histogram.
    assert FEDDISK_REPORT.check(client_weight_summary(np.zeros(0), 5.0)) == {"histogram_counts": [0] * 40}
    assert FedDiskPhase(FedDiskConfig()).report_schema() == FEDDISK_REPORT


FINDING_1 = {
    "missing": (lambda report: report.pop("histogram_counts"), "report field 'histogram_counts' is missing"),
    "empty": (lambda report: report.update(histogram_counts=[]), "has 0 items, expected 40"),
    "41 bins": (lambda report: report.update(histogram_counts=[0] * 41), "has 41 items, expected 40"),
    "a string": (lambda report: report.update(histogram_counts="40"), "expected a list"),
    "[5]": (lambda report: report.update(histogram_counts=[5]), "has 1 items, expected 40"),
    "negative": (lambda report: report.update(histogram_counts=[-1] * 40), "item 0 is -1"),
    "2**63-1": (
        lambda report: report.update(histogram_counts=[2**63 - 1] * 40),
        "item 0 is 9223372036854775807, expected an integer in [0, 1000000000]",
    ),
    "HTML statistic": (lambda report: report.update(median="<img src=x onerror=alert(1)>"), "field 'median' is '<img"),
    "weight above clip_max": (lambda report: report.update(max=1e6), "field 'max' is 1000000.0"),
    "unknown key": (lambda report: report.update(note="hi"), "field 'note' is not one of the declared fields"),
}


@pytest.mark.parametrize("attack", sorted(FINDING_1))
def test_each_malformed_report_of_finding_1_is_refused_by_feddisks_schema(attack: str) -> None:
    change, text = FINDING_1[attack]
    report = honest_report()
    change(report)
    with pytest.raises(SchemaViolation) as raised:
        FEDDISK_REPORT.check(report)
    assert text in str(raised.value)


def test_the_41_bin_report_is_named_in_the_issues_words() -> None:
    report = {**honest_report(), "histogram_counts": [1] * (HISTOGRAM_BINS + 1)}
    with pytest.raises(SchemaViolation) as raised:
        FEDDISK_REPORT.check(report)
    assert str(raised.value) == "report field 'histogram_counts' has 41 items, expected 40"
    assert set(WEIGHT_STATS) <= set(FEDDISK_REPORT.fields)


# --------------------------------------------------------- the schema in one process


class LyingPhase(SetupPhase):
    """One final step; its client side reports a histogram of 41 bins while its server
    side declares 40 (a plugin whose two sides disagree)."""

    name = "lying"

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        yield SetupStep("only", final=True)
        return PhaseCost(1, 0, 0)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        return SetupReply(values={"n": int(data.train_y.numel())})

    def client_report(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"histogram_counts": [1] * 41}

    def report_schema(self) -> MessageSchema:
        return MessageSchema("report", {"histogram_counts": Counts(length=40)})

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        pass

    def client_context(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


def test_in_one_process_a_reply_breaking_the_phases_schema_is_one_line_naming_phase_client_and_field() -> None:
    clients = [PhaseInputs(client, torch.zeros(4, 2), torch.zeros(4)) for client in range(2)]
    with pytest.raises(TrainingError) as raised:
        run_in_process(LyingPhase(), clients)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "\n" not in message
    assert "setup phase 'lying', step 'only': client 0's reply" in message
    assert "report field 'histogram_counts' has 41 items, expected 40" in message


def test_a_steps_declared_values_are_checked_against_what_a_client_sent() -> None:
    expects = ReplySchema(MessageSchema("'range' reply value", {"num-samples": Count(0, 10**9)}))
    step = SetupStep("range", expects=expects)
    phase = LyingPhase()
    assert checked_reply(phase, step, SetupReply(values={"num-samples": 400})).values == {"num-samples": 400}
    with pytest.raises(SchemaViolation, match=r"'range' reply value field 'num-samples' is 1000000000000000"):
        checked_reply(phase, step, SetupReply(values={"num-samples": 10**15}))
    with pytest.raises(SchemaViolation, match="setup tensor field 'w' is not one of the declared fields"):
        checked_reply(
            phase,
            SetupStep("range", expects=ReplySchema(tensors=MessageSchema("setup tensor"))),
            SetupReply(tensors={"w": torch.ones(2)}),
        )


def test_a_phase_server_side_drops_a_client_from_the_replies() -> None:
    replies = SetupReplies({0: SetupReply(), 1: SetupReply()})
    replies.drop(1, "sent nonsense")
    assert list(replies) == [0] and replies.dropped == {1: "sent nonsense"}


# ------------------------------------------------------------ strategies from schemas

KINDS = [
    Count(0, 100),
    Real(-5.0, 5.0),
    Text(6),
    Flag(),
    Counts(length=4, high=50),
    Reals(max_length=3, low=0.0, high=1.0),
    TensorField(shape=(2, 3)),
    TensorField(max_elements=8),
]


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_the_strategies_draw_values_each_kind_accepts_and_values_it_refuses(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS))
    assert kind.problem(data.draw(valid_values(kind))) is None
    assert kind.problem(data.draw(invalid_values(kind))) is not None


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_the_strategies_draw_whole_feddisk_reports_the_schema_accepts_and_refuses(data: st.DataObject) -> None:
    assert set(FEDDISK_REPORT.check(data.draw(valid_messages(FEDDISK_REPORT)))) >= {"histogram_counts"}
    with pytest.raises(SchemaViolation):
        FEDDISK_REPORT.check(data.draw(invalid_messages(FEDDISK_REPORT)))
