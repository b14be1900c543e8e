"""Screening of every reply field, and the poisoning defences of ``train.screening``.

Each attack of issue 29's finding 3 (and the runtime-independent part of finding 2) is
replayed against the round core (:class:`fedplug.run.federated_round.RoundCore`), which every
runtime hands its clients' updates to; the FedML coordinator is driven in process. The
attack is dropped with its reason and the round goes on with the honest clients.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from torch import Tensor

from fedplug.components import (
    MODEL_SHAPE,
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    ReplyExtra,
    RoundPlan,
)
from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.components import Components
from fedplug.run.federated_round import RoundCore
from fedplug.run.round_plan import chain_update, plan_round, round_steps
from fedplug.run.round_screen import unusable
from fedplug.screening import (
    ScreeningConfig,
    ScreeningRules,
    count_problem,
    dtype_problem,
    shape_problem,
)

P = 4
"""Parameters of the hand-made models."""
GLOBAL = torch.full((P,), 0.5)
HONEST = [torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0.0, 1.0, 0.5, 0.5])]
"""Two honest clients' models; their sample-weighted mean is the reference."""
COUNTS = np.array([[10, 10], [5, 15], [20, 0]])
"""The class counts the server holds: clients 0, 1 and 2 hold 20 samples each."""


def train_config(**train: Any) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["train"].update(train)
    return validate_experiment(document).train


def core_for(aggregator: str = "fedavg", class_counts: np.ndarray | None = COUNTS, **train: Any) -> RoundCore:
    train.setdefault("failures", {"max_failed_fraction": 1.0})
    config = train_config(aggregator=aggregator, **train)
    registry = default_registry()
    core = RoundCore(
        config,
        components=Components.build(config, registry, 3),
        num_clients=3,
        class_counts=class_counts,
        client_sizes=None,
        model_bytes=P * 4,
    )
    core.aggregator.initialize(GLOBAL)
    return core


def update(client: int, vector: Tensor, samples: Any = 20, steps: Any = 2, **fields: Any) -> ClientUpdate:
    return ClientUpdate(
        client_id=client, vector=vector, weight=float(samples) if isinstance(samples, (int, float)) else samples,
        num_steps=steps, chain=[client], num_examples=samples, **fields,
    )


def run_round(core: RoundCore, updates: list[ClientUpdate], global_vector: Tensor = GLOBAL) -> Any:
    plan = RoundPlan(chains=[list(u.chain) for u in updates])
    return core.run(0, global_vector, plan, lambda attempt: list(updates))


def honest_mean() -> Tensor:
    return (HONEST[0] + HONEST[1]) / 2


def reasons(attempt: Any) -> dict[int, str]:
    return {chain[-1]: reason for chain, reason in attempt.tally.dropped}


# ---------------------------------------------------------------- finding 3: weight


def test_zeros_claiming_10_to_the_12_samples_do_not_replace_the_global_model() -> None:
    # Prepare: the attack, with and without the class counts on the server.
    attack = update(2, torch.zeros(P), samples=10**12)
    for counts in (COUNTS, None):
        core = core_for(class_counts=counts)
        # Execute
        attempt = run_round(core, [update(0, HONEST[0]), update(1, HONEST[1]), attack])
        # Assert: the attacker is dropped (over the cap of 10**9); the honest mean is kept.
        assert reasons(attempt) == {2: "sent num-examples = 1000000000000, over the cap of 1000000000 (train.screening)"}
        torch.testing.assert_close(attempt.vector, honest_mean())


def test_a_client_claiming_more_samples_than_its_class_counts_is_dropped() -> None:
    # Prepare: 10**8 samples is under the cap, but client 2's class counts sum to 20.
    core = core_for()
    attack = update(2, torch.zeros(P), samples=10**8)
    # Execute
    attempt = run_round(core, [update(0, HONEST[0]), update(1, HONEST[1]), attack])
    # Assert
    assert reasons(attempt) == {
        2: "claimed 100000000 num-examples but its class counts sum to 20 (train.screening.check_num_examples)"
    }
    torch.testing.assert_close(attempt.vector, honest_mean())
    # A chain may claim its members' sum (20 + 20), no more.
    chain = ClientUpdate(client_id=1, vector=HONEST[0], weight=40.0, num_steps=2, chain=[0, 1], num_examples=40)
    assert unusable(chain, (P,), None, rules=core.screening_rules) is None
    too_many = dataclass_replace(chain, num_examples=41, weight=41.0)
    assert "class counts sum to 40" in str(unusable(too_many, (P,), None, rules=core.screening_rules))


def test_without_class_counts_max_weight_fraction_drops_a_client_claiming_most_of_the_round() -> None:
    # Prepare: no class counts; the attacker claims 10**8 samples (under the cap).
    attack = update(2, torch.zeros(P), samples=10**8)
    honest = [update(0, HONEST[0]), update(1, HONEST[1])]
    # Execute: the default (no cap) and a cap of half the round's weight.
    undefended = run_round(core_for(class_counts=None), honest + [attack])
    defended = run_round(core_for(class_counts=None, screening={"max_weight_fraction": 0.5}), honest + [attack])
    # Assert: without the cap the zeros replace the model; with it they are dropped.
    assert float(undefended.vector.abs().max()) < 1e-5
    assert reasons(defended) == {
        2: "claimed 100.0% of the round's aggregation weight (1e+08 of 1e+08), over train.screening.max_weight_fraction=0.5"
    }
    torch.testing.assert_close(defended.vector, honest_mean())


def test_the_weight_fraction_keeps_a_lone_update_and_equal_shares() -> None:
    core = core_for(class_counts=None, screening={"max_weight_fraction": 0.5})
    assert run_round(core, [update(0, HONEST[0])]).tally.failures == 0
    assert run_round(core, [update(0, HONEST[0]), update(1, HONEST[1])]).tally.failures == 0


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        (-5, "sent num-examples = -5, expected a non-negative integer"),
        (math.inf, "sent num-examples = inf, expected a non-negative integer"),
        (math.nan, "sent num-examples = nan, expected a non-negative integer"),
        (2.5, "sent num-examples = 2.5, expected a non-negative integer"),
        ("20", "sent num-examples = '20' of type str, expected a non-negative integer"),
        (True, "sent num-examples = True of type bool, expected a non-negative integer"),
    ],
)
def test_a_num_examples_that_is_not_a_count_gets_its_own_reason(samples: Any, reason: str) -> None:
    core = core_for()
    attempt = run_round(core, [update(0, HONEST[0]), update(1, HONEST[1], samples=samples)])
    assert reasons(attempt) == {1: reason}
    torch.testing.assert_close(attempt.vector, HONEST[0])


# ------------------------------------------------------------------ finding 3: norm


def test_a_model_scaled_by_1e6_is_dropped_by_the_default_norm_ratio() -> None:
    core = core_for()
    attempt = run_round(core, [update(0, HONEST[0]), update(1, HONEST[1] * 1e6)])
    assert reasons(attempt)[1].startswith("sent an update of norm 1.225e+06, over train.screening.max_norm_ratio=10000")
    torch.testing.assert_close(attempt.vector, HONEST[0])


def test_a_boosted_update_is_dropped_by_max_update_norm_when_set() -> None:
    # Prepare: client 1's change to the global model boosted 100 times (norm 70.7): under
    # the default ratio bound, so only max_update_norm stops it.
    boosted = GLOBAL + 100 * (HONEST[1] - GLOBAL)
    honest_change = float(torch.linalg.vector_norm(HONEST[0] - GLOBAL))
    # Execute
    undefended = run_round(core_for(), [update(0, HONEST[0]), update(1, boosted)])
    defended = run_round(core_for(screening={"max_update_norm": 3 * honest_change}), [update(0, HONEST[0]), update(1, boosted)])
    # Assert
    assert undefended.tally.failures == 0
    assert reasons(defended) == {1: "sent an update of norm 70.71, over train.screening.max_update_norm=2.12132"}
    torch.testing.assert_close(defended.vector, HONEST[0])


# ------------------------------------------------------------- finding 3: the extras


def scaffold_update(client: int, vector: Tensor, delta_c: Any) -> ClientUpdate:
    return update(client, vector, extras={"delta_c": delta_c})


@pytest.mark.parametrize(
    ("delta_c", "reason"),
    [
        (torch.full((P,), 1e30), "sent extras['delta_c'] of norm 2e+30, over train.screening.max_norm_ratio=10000"),
        (torch.zeros(P + 1), "sent extras['delta_c'] of shape (5,), expected (4,)"),
        (torch.zeros(P, dtype=torch.complex64), "sent extras['delta_c'] of dtype complex64, expected a real float or integer dtype"),
        (torch.zeros(P, dtype=torch.bool), "sent extras['delta_c'] of dtype bool, expected a real float or integer dtype"),
        (torch.full((P,), math.inf), "returned non-finite extras"),
        ([0.0] * P, "sent extras['delta_c'] as list, expected a dense tensor"),
    ],
)
def test_scaffold_delta_c_out_of_bounds_is_dropped_and_the_control_variate_stays_finite(delta_c: Any, reason: str) -> None:
    core = core_for("scaffold")
    attempt = run_round(core, [scaffold_update(0, HONEST[0], torch.ones(P)), scaffold_update(1, HONEST[1], delta_c)])
    assert reasons(attempt)[1].startswith(reason)
    torch.testing.assert_close(attempt.vector, HONEST[0])
    torch.testing.assert_close(core.aggregator.control, torch.ones(P) / 3)


def test_a_scaffold_reply_without_delta_c_is_dropped() -> None:
    core = core_for("scaffold")
    attempt = run_round(core, [scaffold_update(0, HONEST[0], torch.ones(P)), update(1, HONEST[1])])
    assert reasons(attempt) == {1: "sent no extras ['delta_c'], which the run's components need in every reply"}


def fednova_update(client: int, vector: Tensor, a: Any, steps: int = 2) -> ClientUpdate:
    return update(client, vector, steps=steps, extras={"a": a})


@pytest.mark.parametrize(
    ("a", "reason"),
    [
        (torch.tensor(-1e4), "sent extras['a'] with an entry -10000, below its minimum 0"),
        (torch.tensor(1e30), "sent extras['a'] = 1e+30, which 2 local SGD steps cannot give (FedNova's a_k is 0 or in [1, 3])"),
        (torch.tensor(1e-20), "sent extras['a'] = 1e-20, which 2 local SGD steps cannot give"),
        (torch.tensor([2.0, 2.0]), "sent extras['a'] of shape (2,), expected ()"),
        (torch.tensor(math.nan), "returned non-finite extras"),
    ],
)
def test_fednova_a_out_of_bounds_is_dropped_and_round_2_trains(a: Tensor, reason: str) -> None:
    # Prepare: client 0 honest (2 steps, a = 2), client 1 the attacker.
    core = core_for("fednova")
    # Execute: round 1 with the attack, then an honest round 2 from its model.
    first = run_round(core, [fednova_update(0, HONEST[0], torch.tensor(2.0)), fednova_update(1, HONEST[1], a)])
    second = run_round(core, [fednova_update(0, HONEST[0], torch.tensor(2.0))], first.vector)
    # Assert: FedNova of client 0 alone is its model; round 2 stays finite.
    assert reasons(first)[1].startswith(reason)
    torch.testing.assert_close(first.vector, HONEST[0])
    assert second.tally.failures == 0 and bool(second.vector.isfinite().all())


def test_fednova_accepts_every_a_that_sgd_with_momentum_gives() -> None:
    from fedplug.algorithms.fednova import normalizing_factor

    core = core_for("fednova")
    for steps in (0, 1, 2, 7, 50):
        for momentum in (0.0, 0.5, 0.9, 0.999):
            a = torch.tensor(normalizing_factor(steps, momentum), dtype=torch.float32)
            assert core.aggregator.check_update(fednova_update(0, HONEST[0], a, steps)) is None


# -------------------------------------------------------- a 200 MB extra, a bad model


def test_a_200_mb_extra_is_refused_by_its_shape_before_it_is_read() -> None:
    # Prepare: 50 million float32 elements (200 MB) as a stride-0 view: nothing allocated,
    # and reading it would take seconds, so the check must stop at the shape.
    huge = torch.zeros(1).expand(50_000_000)
    scaffold = core_for("scaffold")
    fedavg = core_for("fedavg")
    # Execute / Assert: declared (SCAFFOLD's delta_c) and undeclared (under FedAvg).
    assert unusable(scaffold_update(0, HONEST[0], huge), (P,), None, rules=scaffold.screening_rules) == (
        "sent extras['delta_c'] of shape (50000000,), expected (4,)"
    )
    attempt = run_round(fedavg, [update(0, HONEST[0]), update(1, HONEST[1], extras={"junk": huge})])
    assert reasons(attempt) == {1: "sent extras['junk'] of 50000000 elements, more than the model's 4"}


@pytest.mark.parametrize(
    ("vector", "reason"),
    [
        (torch.zeros(P, dtype=torch.complex64), "sent parameters of dtype complex64, expected a real floating-point dtype"),
        (torch.zeros(P, dtype=torch.int64), "sent parameters of dtype int64, expected a real floating-point dtype"),
        (torch.zeros(P + 1), "returned (5,) parameters, expected (4,)"),
        (torch.full((P,), math.nan), "returned non-finite (NaN/Inf) parameters"),
        (np.zeros(P, dtype=np.float32), "returned parameters as ndarray, expected a dense tensor"),
        (torch.zeros(P).to_sparse(), "returned parameters as Tensor, expected a dense tensor"),
    ],
)
def test_a_model_of_the_wrong_kind_is_dropped(vector: Any, reason: str) -> None:
    attempt = run_round(core_for(), [update(0, HONEST[0]), update(1, vector)])
    assert reasons(attempt) == {1: reason}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"steps": math.inf}, "sent num-steps = inf, expected a non-negative integer"),
        ({"steps": -1}, "sent num-steps = -1, expected a non-negative integer"),
        ({"steps": 10**10}, "sent num-steps = 10000000000, over the cap of 1000000000 (train.screening)"),
        ({"seconds": math.nan}, "sent seconds = nan, expected a finite number"),
        ({"seconds": -3.0}, "sent seconds = -3, expected a number in [0, 1e+09]"),
        ({"metrics": {"train_loss": 1j}}, "sent metric 'train_loss' = 1j of type complex, expected a number"),
        ({"metrics": {"accuracy": math.nan}}, "sent metric 'accuracy' = nan, expected a finite number"),
    ],
)
def test_every_other_field_out_of_bounds_is_dropped(fields: dict[str, Any], reason: str) -> None:
    attempt = run_round(core_for(), [update(0, HONEST[0]), update(1, HONEST[1], **fields)])
    assert reasons(attempt) == {1: reason}


def test_a_client_id_outside_the_federation_is_dropped() -> None:
    stray = ClientUpdate(client_id=7, vector=HONEST[1], weight=20.0, num_steps=1, chain=[7], num_examples=20)
    assert unusable(stray, (P,), None, rules=core_for().screening_rules) == "sent client id 7, but the run has 3 clients (ids 0-2)"


# ------------------------------------------------- an aggregator that raises on one


class Fragile(Aggregator):
    """The mean of the updates, raising (as a buggy plugin might) on a negative first entry."""

    def aggregate(self, global_vector: Tensor, updates: Any) -> Tensor:
        total, count = torch.zeros_like(global_vector), 0
        for item in updates:
            if float(item.vector[0]) < 0:
                raise TypeError("cannot digest this one")
            total, count = total + item.vector, count + 1
        return total / count


def fragile_core(can_replay: bool = True) -> RoundCore:
    config = train_config(failures={"max_failed_fraction": 1.0, "max_round_retries": 1})
    return RoundCore(
        config, components=replace(Components.build(config, default_registry(), 3), aggregator=Fragile(3)),
        num_clients=3, class_counts=None, client_sizes=None, model_bytes=P * 4, can_replay=can_replay,
    )


def test_an_update_the_aggregator_raises_on_is_dropped_and_the_round_goes_on() -> None:
    bad = update(1, -HONEST[1] - 1)
    # A runtime that hands a list (Flower, FedML; no replay needed): aggregated again at once.
    listed = run_round(fragile_core(can_replay=False), [update(0, HONEST[0]), bad, update(2, HONEST[1])])
    # A runtime that trains lazily (the simulator): the next attempt drops it.
    lazy_core = fragile_core()
    plan = RoundPlan(chains=[[0], [1], [2]])
    lazy = lazy_core.run(0, GLOBAL, plan, lambda attempt: iter([update(0, HONEST[0]), bad, update(2, HONEST[1])]))
    for attempt in (listed, lazy):
        assert reasons(attempt) == {
            1: "its update made the 'fedavg' aggregator fail (TypeError: cannot digest this one)"
        }
        torch.testing.assert_close(attempt.vector, honest_mean())
    assert (listed.attempts, lazy.attempts) == (1, 2)


# ----------------------------------------------------- corruption of extreme scale


def corrupted_run(factor: float, rounds: int = 3, **screening: Any) -> Any:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    document["train"].update(
        rounds=rounds,
        faults={"corruption": {"probability": 0.3, "kind": "scale", "factor": factor}},
        failures={"max_failed_fraction": 1.0},
    )
    if screening:
        document["train"]["screening"] = screening
    result, _ = run_experiment(validate_experiment(document), None)
    return result


def test_a_corruption_of_scale_1e30_is_dropped_and_round_2_trains(caplog: pytest.LogCaptureFixture) -> None:
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedplug.round"):
        result = corrupted_run(1e30)
    # Assert: every corrupted update was dropped by the norm ratio; the run finished.
    history = result.history
    assert len(history) == 3 and all(math.isfinite(record.accuracy) for record in history)
    corrupted = [record.faults_corrupted for record in history]
    assert sum(corrupted) > 0 and [record.failures for record in history] == corrupted
    assert all(
        "over train.screening.max_norm_ratio=10000" in entry["reason"]
        for record in history for entry in record.dropped
    )


# -------------------------------------------------------------------------- config


def test_train_screening_is_strict_and_left_out_of_the_resolved_config_at_its_defaults() -> None:
    document = copy.deepcopy(SMALL_EXPERIMENT)
    assert "screening" not in validate_experiment(document).model_dump(mode="json")["train"]
    document["train"]["screening"] = {"max_update_norm": 5, "max_weight_fraction": 0.5}
    dumped = validate_experiment(document).model_dump(mode="json")["train"]["screening"]
    assert (dumped["max_update_norm"], dumped["max_weight_fraction"], dumped["max_norm_ratio"]) == (5.0, 0.5, 1e4)
    for wrong, message in [
        ({"max_update_norm": 0}, "train.screening.max_update_norm: Input should be greater than 0"),
        ({"max_weight_fraction": 1.5}, "train.screening.max_weight_fraction: Input should be less than or equal to 1"),
        ({"max_update_nrom": 5}, "train.screening.max_update_nrom: unknown key"),
        ({"max_norm_ratio": math.inf}, "train.screening.max_norm_ratio"),
    ]:
        document["train"]["screening"] = wrong
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            validate_experiment(document)


# ------------------------------------------------------------- the pieces, by hand


def test_the_metadata_checks_need_no_data() -> None:
    assert dtype_problem("x", "float32", "float") is None
    assert dtype_problem("x", np.dtype("<U3")) == "sent x of dtype <U3, expected a real float or integer dtype"
    assert dtype_problem("x", "datetime64[s]") == "sent x of dtype datetime64[s], expected a real float or integer dtype"
    assert dtype_problem("x", "object") == "sent x of dtype object, expected a real float or integer dtype"
    assert dtype_problem("x", "int32") is None and dtype_problem("x", "int32", "float") is not None
    assert dtype_problem("x", "torch.raw") == "sent x of an unknown dtype 'torch.raw'"
    assert shape_problem("a", (2,), ReplyExtra(()), (4,)) == "sent extras['a'] of shape (2,), expected ()"
    assert shape_problem("d", (4,), ReplyExtra(MODEL_SHAPE), (4,)) is None
    assert count_problem("n", 10**12, 10**9) == "sent n = 1000000000000, over the cap of 1000000000 (train.screening)"
    assert count_problem("n", 7.0, 10) is None


def test_unusable_keeps_its_signature_and_screens_every_field() -> None:
    honest = chain_update([0], HONEST[0], samples=20, steps=2, extras={}, plan=RoundPlan([[0]]), seconds=0.1)
    assert honest.num_examples == 20 and unusable(honest, (P,), None) is None
    assert unusable(dataclass_replace(honest, num_steps=math.inf), (P,), None) == (
        "sent num-steps = inf, expected a non-negative integer"
    )
    rules = ScreeningRules((P,), config=ScreeningConfig(max_update_norm=0.1))
    assert unusable(honest, (P,), None, rules=rules) is None  # no global model: no norm check
    assert "max_update_norm" in str(unusable(honest, (P,), None, rules=rules, global_vector=GLOBAL))


def test_the_components_declare_their_reply_extras() -> None:
    registry = default_registry()
    config = train_config(aggregator="scaffold")
    scaffold = registry.build("aggregators", config.aggregator, 3).client_needs()
    fednova = registry.build("aggregators", train_config(aggregator="fednova").aggregator, 3).client_needs()
    assert scaffold.reply_extra_shapes == {"delta_c": ReplyExtra(MODEL_SHAPE)}
    assert fednova.reply_extra_shapes == {"a": ReplyExtra((), minimum=0.0)}
    assert (scaffold | fednova).reply_extra_shapes == {"delta_c": ReplyExtra(MODEL_SHAPE), "a": ReplyExtra((), minimum=0.0)}
    assert ClientNeeds() | ClientNeeds() == ClientNeeds()


def test_a_round_that_everyone_dropped_out_of_takes_one_fedml_round() -> None:
    # Prepare: dropout 0.9 empties some rounds' plans (the drop-in's comm_round crashed on them).
    config = train_config(rounds=20, faults={"dropout": {"probability": 0.9}})
    grouper = default_registry().build("groupers", config.grouper)
    plans = [plan_round(config, grouper, 6, index)[0] for index in range(20)]
    # Assert
    assert any(not plan.chains for plan in plans)
    assert [round_steps(plan) for plan in plans] == [1] * 20


def dataclass_replace(item: ClientUpdate, **changes: Any) -> ClientUpdate:
    import dataclasses

    return dataclasses.replace(item, **changes)


# ------------------------------------------- what screening leaves to robust aggregators


@pytest.mark.parametrize(
    "aggregator",
    [
        {"name": "flower", "strategy": "FedMedian"},
        {"name": "flower", "strategy": "FedTrimmedAvg", "beta": 0.34},
        {"name": "flower", "strategy": "Krum", "num_malicious_nodes": 0},
    ],
    ids=lambda aggregator: aggregator["strategy"],
)
def test_a_poisoned_update_within_the_bounds_moves_fedavg_but_not_a_robust_aggregator(aggregator: dict[str, Any]) -> None:
    # Prepare: a boosted model claiming most of the round's weight, inside every default
    # bound (no class counts on the server, norm far under 10**4 x the model's).
    attack = update(2, torch.full((P,), 50.0), samples=10**8)
    honest = [update(0, HONEST[0]), update(1, HONEST[1])]
    # Execute
    fedavg = run_round(core_for(class_counts=None), honest + [attack])
    robust = run_round(core_for(aggregator=aggregator, class_counts=None), honest + [attack])
    # Assert: screening let the attack through both times; FedAvg follows it, while the
    # robust aggregator stays within the honest models' range (every coordinate in [0, 1]).
    assert reasons(fedavg) == {} and reasons(robust) == {}
    assert float(fedavg.vector.min()) > 49.0
    assert float(robust.vector.min()) >= 0.0 and float(robust.vector.max()) <= 1.0
