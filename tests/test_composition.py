"""Every combination of the four algorithm slots that makes sense runs; the others are
rejected by config validation with a reason."""

from __future__ import annotations

import itertools
import math

import pytest

from fedplug.config import validate_experiment
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment

SAMPLERS = [{"name": "uniform"}, {"name": "iwds"}]
LOSS_TRANSFORMS = [
    {"name": "cross_entropy"},
    {"name": "fedprox", "mu": 0.01},
    {"name": "fedshift"},
    {"name": "reweighting"},
    {"name": "feddisk", "made_max_epochs": 1, "global_rounds": 1, "classifier_epochs": 1},
]
AGGREGATORS = [
    {"name": "fedavg"},
    {"name": "fedavgm", "momentum": 0.9},
    {"name": "fedadam"},
    {"name": "fedyogi"},
    {"name": "fedadagrad"},
    {"name": "fednova"},
    {"name": "scaffold"},
]
GROUPERS = [{"name": "none"}, {"name": "fedgsp", "mode": "naive", "fixed_groups": 2, "group_fraction": 1.0}]

# Chains hand one client's model to the next: per-client control variates (SCAFFOLD) and
# per-client step normalisation (FedNova) have no meaning along them.
CHAIN_INCOMPATIBLE = {"scaffold", "fednova"}


def _combinations():
    for sampler, loss, aggregator, grouper in itertools.product(SAMPLERS, LOSS_TRANSFORMS, AGGREGATORS, GROUPERS):
        # FedDisk's density phase is the slow part: pair it with every aggregator and
        # grouper once, with the default sampler.
        if loss["name"] == "feddisk" and sampler["name"] != "uniform":
            continue
        yield pytest.param(sampler, loss, aggregator, grouper, id="-".join(part["name"] for part in (sampler, loss, aggregator, grouper)))


@pytest.mark.parametrize("sampler,loss_transform,aggregator,grouper", list(_combinations()))
def test_slot_combination_runs_one_round_or_is_rejected_with_a_reason(
    small_experiment, sampler, loss_transform, aggregator, grouper
):
    train = small_experiment["train"]
    train.update(rounds=1, sampler=sampler, loss_transform=loss_transform, aggregator=aggregator, grouper=grouper)
    if grouper["name"] == "fedgsp":
        train["client_fraction"] = 1.0
    if grouper["name"] == "fedgsp" and aggregator["name"] in CHAIN_INCOMPATIBLE:
        with pytest.raises(ConfigError, match=rf"incompatible combination: .*{aggregator['name']}"):
            validate_experiment(small_experiment)
        return
    result, simulator = run_experiment(validate_experiment(small_experiment), None)
    record = result.history[0]
    assert record.failures == 0
    assert math.isfinite(record.loss) and 0.0 <= record.accuracy <= 1.0
    assert simulator.final_vector.isfinite().all()
