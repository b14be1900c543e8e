"""Loss transforms composed in the one ``loss_transform`` slot (fedplug/algorithms/composite_loss.py).

The list form and ``{name: composite, parts: [...]}`` are one config; a single loss
transform keeps its resolved config and hash; FedShift + FedProx's batch loss is
FedShift's mean per-sample loss plus FedProx's penalty; FedProx + plain cross-entropy
trains as FedProx alone, bit for bit; compositions the interface cannot make exact are
refused in one line; a part's mistake is named by its path; FedDisk + FedProx runs and
resumes bit for bit from its per-part state. The runtimes' agreement (Flower, FedML) is in
the conformance suites (tests/test_conformance.py, tests/test_conformance_fedml.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from torch.nn import functional as F

from fedplug.components import FederationSummary
from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.local_training import ClientAlgorithm
from fedplug.run_folder import output_fingerprint
from fedplug.simulation.simulator import Simulator

FEDPROX = {"name": "fedprox", "mu": 0.1}
FEDDISK = {
    "name": "feddisk",
    "made_hidden": 8,
    "made_max_epochs": 1,
    "global_rounds": 1,
    "classifier_hidden": 8,
    "classifier_epochs": 1,
}
"""FedDisk's density models, tiny (tests/test_conformance.py's settings)."""


def experiment(loss_transform: Any, **train: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"]["loss_transform"] = loss_transform
    data["train"].update(train)
    return data


def refusal(data: dict[str, Any]) -> list[str]:
    """The problem lines of the config's refusal (after ``invalid config:``)."""
    with pytest.raises(ConfigError) as refused:
        validate_experiment(data)
    lines = str(refused.value).splitlines()
    assert lines[0] == "invalid config:"
    return lines[1:]


# ---------------------------------------------------------------------------- config


def test_the_list_and_the_composite_forms_validate_to_the_same_config() -> None:
    # Prepare
    parts = ["fedshift", {"name": "fedprox", "mu": 0.01}]
    # Execute
    listed = validate_experiment(experiment(parts))
    composite = validate_experiment(experiment({"name": "composite", "parts": parts}))
    resolved = listed.train.model_dump(mode="json")
    # Assert: one config, one hash, one canonical resolved form, which reads back the same.
    assert listed == composite
    assert output_fingerprint(listed) == output_fingerprint(composite)
    assert resolved["loss_transform"] == {
        "name": "composite",
        "parts": [{"name": "fedshift"}, {"name": "fedprox", "mu": 0.01}],
    }
    again = validate_experiment({**experiment(None), "train": resolved})
    assert again.train == listed.train


# Computed on the code before composition (commit 0e2dd2e) for SMALL_EXPERIMENT with this
# loss transform: runs, checkpoints and study records hold these hashes.
OLD_FINGERPRINTS = {
    "fedprox": ({"name": "fedprox", "mu": 0.05}, "9a4cfdfd9444218c117fc1982286671e871da90e36da26c65818264f7a808e4c"),
    "fedshift": ("fedshift", "94007562db454129e897e7235d6c747b12de71a8ba0f95a774a43b2ce4ba6baa"),
}


@pytest.mark.parametrize("name", sorted(OLD_FINGERPRINTS))
def test_a_single_loss_transform_keeps_its_resolved_config_and_hash(name: str) -> None:
    # Prepare
    entry, old_fingerprint = OLD_FINGERPRINTS[name]
    # Execute
    config = validate_experiment(experiment(entry))
    # Assert
    resolved = config.train.model_dump(mode="json")["loss_transform"]
    assert resolved == (entry if isinstance(entry, dict) else {"name": entry})
    assert output_fingerprint(config) == old_fingerprint


def test_two_parts_that_change_the_per_sample_loss_are_refused_in_one_line() -> None:
    lines = refusal(experiment(["fedshift", "reweighting"]))
    assert len(lines) == 1
    assert lines[0].startswith(
        "train.loss_transform.parts: the parts 'fedshift', 'reweighting' each change the per-sample loss"
    )


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        (
            ["fedshift", {"name": "fedprox", "mu": 500}],
            "train.loss_transform.parts.1.mu: Input should be less than or equal to 100",
        ),
        ([{"name": "fedprox", "mu": 0.1, "muu": 1}, "fedshift"], "train.loss_transform.parts.0.muu: unknown key"),
        (["fedshift", "fedprx"], "train.loss_transform.parts.1: unknown loss transform 'fedprx'"),
        (["fedprox"], "train.loss_transform.parts: a composite needs at least two parts"),
    ],
    ids=["out-of-range", "unknown-key", "unknown-name", "one-part"],
)
def test_a_mistake_in_a_part_is_named_by_its_path(parts: list[Any], expected: str) -> None:
    # The list form and the composite form get the same line.
    for form in (parts, {"name": "composite", "parts": parts}):
        lines = refusal(experiment(form))
        assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_a_part_is_validated_exactly_as_it_is_alone() -> None:
    alone = refusal(experiment({"name": "fedprox", "mu": -1}))
    composed = refusal(experiment(["fedshift", {"name": "fedprox", "mu": -1}]))
    assert [line.split(": ", 1)[1] for line in composed] == [line.split(": ", 1)[1] for line in alone]


# ---------------------------------------------------------------------------- the loss


def test_fedshift_plus_fedprox_loss_is_the_shifted_mean_plus_the_proximal_term() -> None:
    # Prepare: two clients of 2 classes; client 0 holds 3 of class 0 and 1 of class 1.
    config = validate_experiment(experiment(["fedshift", {"name": "fedprox", "mu": 0.3}]))
    composite = default_registry().build("loss_transforms", config.train.loss_transform)
    counts = np.array([[3.0, 1.0], [0.0, 4.0]])
    composite.prepare(FederationSummary(counts))
    context = composite.client_context(0, counts[0])
    logits = torch.tensor([[0.2, -0.4], [1.0, 0.5], [-0.3, 0.1]])
    targets = torch.tensor([0, 1, 1])
    params = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    anchor = {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([1.5])}
    # By hand: client 0's smoothed prior P_0 = (4/6, 2/6), client 1's (1/6, 5/6); each
    # weighs n_k / n = 1/2 in the global prior P = (5/12, 7/12); the shift is ln(P_0 / P).
    local = torch.tensor([4 / 6, 2 / 6], dtype=torch.float64)
    prior = torch.tensor([(4 / 6 + 1 / 6) / 2, (2 / 6 + 5 / 6) / 2], dtype=torch.float64)
    shift = (local.log() - prior.log()).float()
    expected_mean = F.cross_entropy(logits + shift, targets, reduction="none").mean()
    expected_penalty = 0.5 * 0.3 * ((1.0**2 + 1.0**2) + 1.0**2)
    # Execute: as the client's loop forms a batch's loss.
    mean = composite.per_sample_loss(logits, targets, torch.arange(3), context).mean()
    penalty = composite.penalty(params, anchor, context)
    # Assert
    torch.testing.assert_close(mean, expected_mean)
    assert float(penalty) == pytest.approx(expected_penalty, rel=1e-6)
    assert set(context) == {"0.fedshift"}  # FedProx has no context; FedShift's is under its key


def test_fedprox_with_plain_cross_entropy_trains_as_fedprox_alone_bit_for_bit() -> None:
    # Prepare
    alone = validate_experiment(experiment(FEDPROX))
    composed = validate_experiment(experiment([FEDPROX, "cross_entropy"]))
    # Execute
    alone_result, alone_simulator = run_experiment(alone, None)
    composed_result, composed_simulator = run_experiment(composed, None)
    # Assert: the same client loop (fused cross-entropy, one penalty) and the same run.
    algorithm = composed_simulator.algorithm
    assert isinstance(algorithm, ClientAlgorithm)
    assert algorithm.plain_cross_entropy and algorithm.has_penalty
    assert torch.equal(alone_simulator.final_vector, composed_simulator.final_vector)
    records = [[(r.accuracy, r.loss) for r in result.history] for result in (alone_result, composed_result)]
    assert records[0] == records[1]


# --------------------------------------------------------------------------- FedDisk


def test_feddisk_plus_fedprox_runs_with_feddisks_weights_and_fedprox_penalty() -> None:
    # Prepare
    composed = validate_experiment(experiment([FEDDISK, FEDPROX], rounds=2))
    feddisk_alone = validate_experiment(experiment(FEDDISK, rounds=2))
    # Execute
    result, simulator = run_experiment(composed, None)
    alone_result, alone_simulator = run_experiment(feddisk_alone, None)
    # Assert: FedDisk's phase ran and reported as it does alone; FedProx's term changed the model.
    assert (result.setup_rounds, result.setup_bytes) == (alone_result.setup_rounds, alone_result.setup_bytes)
    assert result.setup_rounds > 0
    assert result.setup_report == alone_result.setup_report != {}
    assert not torch.equal(simulator.final_vector, alone_simulator.final_vector)
    assert set(simulator.algorithm.loss_transform.client_context(0, np.zeros(4))) == {"0.feddisk"}


class Interrupted(Exception):
    """Stops a run after a round (its checkpoint is written first)."""


def stop_after(rounds: int) -> Any:
    def observer(record: Any) -> None:
        if record.round == rounds:
            raise Interrupted

    return observer


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_resumed_composite_run_is_bit_identical(engine: str, tmp_path: Path) -> None:
    # Prepare: FedDisk + FedProx for 3 rounds, uninterrupted and stopped after round 2.
    config = validate_experiment(experiment([FEDDISK, FEDPROX], engine=engine))
    registry = default_registry()
    federation = build_federation(config.data, registry)
    checkpoint = tmp_path / "checkpoint.pt"
    reference = Simulator(config.train, federation, registry)
    expected = reference.run()
    first = Simulator(config.train, federation, registry, checkpoint_path=checkpoint, observers=[stop_after(2)])
    with pytest.raises(Interrupted):
        first.run()
    # Execute
    resumed = Simulator(config.train, federation, registry, checkpoint_path=checkpoint)
    resumed.prepare()
    restored = resumed.components.loss_transform
    result = resumed.run()
    # Assert: FedDisk's weights came back from the composite's per-part state (no second
    # phase), and the run is the uninterrupted one, bit for bit.
    assert restored.setup_phase() is None
    state = restored.state_dict()
    assert {key.split("/")[0] for key in state} == {"0.feddisk"}
    assert torch.equal(resumed.final_vector, reference.final_vector)
    records = [json.dumps({**vars(r), "seconds": 0}, sort_keys=True, default=str) for r in result.history]
    assert records == [json.dumps({**vars(r), "seconds": 0}, sort_keys=True, default=str) for r in expected.history]


@pytest.mark.parametrize(
    "loss_transform",
    [
        ["fedshift", {"name": "fedprox", "mu": 0.01}],
        {"name": "composite", "parts": [{"name": "fedshift"}, {"name": "fedprox", "mu": 0.01}]},
    ],
    ids=["list", "composite"],
)
def test_a_dotted_path_reaches_a_parts_parameter(loss_transform: Any) -> None:
    # A --set or a tuning trial sets one part's parameter by its index (it used to be
    # dropped without a word, so a search over mu trained one mu only).
    from fedplug.config import apply_override
    from fedplug.study.tuning import with_values

    document = apply_override(experiment(loss_transform), "train.loss_transform.parts.1.mu=0.5")
    assert validate_experiment(document).train.loss_transform.parts[1].mu == 0.5
    resolved = validate_experiment(experiment(loss_transform))
    tuned = with_values(resolved, {"train.loss_transform.parts.1.mu": 0.25}, default_registry())
    assert tuned.train.loss_transform.parts[1].mu == 0.25
    assert resolved.train.loss_transform.parts[1].mu == 0.01  # the config it came from is unchanged
    with pytest.raises(ConfigError, match=r"parts\.2\.mu: the path reaches a list of 2 items here"):
        apply_override(experiment(loss_transform), "train.loss_transform.parts.2.mu=0.5")
