"""The validation split (``data.validation_fraction``): held out of each client's training
samples after the local test split, seeded, never trained on, evaluated every round as
``val_accuracy``/``val_loss``; at 0.0 the federation and every number are exactly those of
before."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedplug.config import validate_experiment
from fedplug.data.build import build_federation, load_dataset
from fedplug.data.federation import SPLIT_STREAM
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry


def experiment(small_experiment: dict[str, Any], **data: Any) -> Any:
    document = copy.deepcopy(small_experiment)
    document["data"].update(data)
    document["train"]["engine"] = "sequential"
    return validate_experiment(document)


def rows(x: torch.Tensor) -> set[bytes]:
    """Each sample's inputs as bytes: the synthetic dataset's rows are all different."""
    return {row.numpy().tobytes() for row in x}


def test_validation_samples_are_disjoint_from_training_and_test_samples(small_experiment: dict[str, Any]) -> None:
    config = experiment(small_experiment, validation_fraction=0.25)
    federation = build_federation(config.data, default_registry())

    validation_x, validation_y = federation.validation_set()

    sizes = federation.clients.validation_sizes
    assert len(validation_y) == sizes.sum() > 0 and (sizes > 0).all()
    held_out = rows(validation_x)
    assert len(held_out) == len(validation_y)
    for client in federation.clients:
        assert not held_out & rows(client.train_x), f"client {client.client_id} trains on validation samples"
        assert not held_out & rows(client.test_x)
    assert not held_out & rows(federation.test_x)
    # Every sample is in exactly one split: the clients' sizes add up to the partition's.
    arrays = federation.clients
    assert (arrays.train_sizes + arrays.test_sizes + sizes == np.diff(arrays.offsets)).all()
    assert federation.class_counts.sum(axis=1).tolist() == arrays.train_sizes.tolist()


def test_the_split_is_seeded(small_experiment: dict[str, Any]) -> None:
    registry = default_registry()
    first = build_federation(experiment(small_experiment, validation_fraction=0.25).data, registry)
    again = build_federation(experiment(small_experiment, validation_fraction=0.25).data, registry)
    other = build_federation(experiment(small_experiment, validation_fraction=0.25, seed=1).data, registry)

    assert torch.equal(first.validation_set()[0], again.validation_set()[0])
    assert not np.array_equal(first.clients.validation_ids(), other.clients.validation_ids())


def test_fraction_zero_is_the_federation_of_before(small_experiment: dict[str, Any]) -> None:
    """Client k's train and test splits are the shuffle of the generator [seed, k, 0x7E57]
    cut at floor(0.2 n_k), as before the validation split existed; a validation split
    takes its samples from the training split only, never the test splits."""
    registry = default_registry()
    config = experiment(small_experiment)
    dataset = load_dataset(config.data, registry)
    plain = build_federation(config.data, registry, dataset=dataset)
    held = build_federation(experiment(small_experiment, validation_fraction=0.3).data, registry, dataset=dataset)
    arrays = plain.clients
    ends = np.cumsum(held.clients.validation_sizes)
    validation_ids = np.split(held.clients.validation_ids(), ends[:-1])

    assert "validation_fraction" not in config.data.model_dump(mode="json")
    assert len(plain.validation_set()[1]) == 0
    for k, client in enumerate(plain.clients):
        own = arrays.indices[arrays.offsets[k] : arrays.offsets[k + 1]]
        shuffled = np.random.default_rng([config.data.seed, k, SPLIT_STREAM]).permutation(own)
        cut = int(np.floor(0.2 * len(own)))
        assert torch.equal(client.train_x, torch.as_tensor(dataset.train_x[shuffled[cut:]], dtype=torch.float32))
        assert torch.equal(client.test_y, torch.as_tensor(dataset.train_y[shuffled[:cut]]))
        assert torch.equal(held.clients[k].test_x, client.test_x)
        held_out = torch.as_tensor(dataset.train_x[validation_ids[k]], dtype=torch.float32)
        assert rows(held.clients[k].train_x) | rows(held_out) == rows(client.train_x)
    assert all(torch.equal(a, b) for a, b in zip(plain.local_test_set()[:2], held.local_test_set()[:2]))


def test_val_accuracy_is_the_global_models_accuracy_on_the_held_out_samples(small_experiment: dict[str, Any]) -> None:
    config = experiment(small_experiment, validation_fraction=0.25)
    registry = default_registry()
    federation = build_federation(config.data, registry)

    result, simulator = run_experiment(config, None, registry=registry, federation=federation)

    dataset = load_dataset(config.data, registry)
    ids = federation.clients.validation_ids()
    x = torch.as_tensor(dataset.train_x[ids], dtype=torch.float32)
    y = torch.as_tensor(dataset.train_y[ids])
    simulator.model.eval()
    with torch.no_grad():
        logits = simulator.model(x)
    last = result.history[-1].as_dict()
    assert last["val_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()), abs=1e-12)
    assert last["val_loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)
    assert all("val_accuracy" in record.metrics for record in result.history)


def test_without_a_validation_split_no_round_reports_one(small_experiment: dict[str, Any]) -> None:
    result, _ = run_experiment(experiment(small_experiment), None)

    assert all("val_accuracy" not in record.as_dict() for record in result.history)


def test_with_feature_noise_a_clients_validation_inputs_carry_its_noise(small_experiment: dict[str, Any]) -> None:
    """Client k's generator shuffles, then draws its training, test and validation noise in
    that order (by hand with numpy), so the training and test inputs keep their noise."""
    config = experiment(small_experiment, validation_fraction=0.25, partition={"name": "feature_noise", "sigma": 0.3})
    registry = default_registry()
    dataset = load_dataset(config.data, registry)
    federation = build_federation(config.data, registry, dataset=dataset)
    arrays = federation.clients
    x = np.asarray(dataset.train_x, dtype=np.float32)

    expected = []
    for k in range(len(arrays)):
        own = arrays.indices[arrays.offsets[k] : arrays.offsets[k + 1]]
        rng = np.random.default_rng([config.data.seed, k, SPLIT_STREAM])
        shuffled = rng.permutation(own)
        test, held = int(arrays.test_sizes[k]), int(arrays.validation_sizes[k])
        std = float(arrays.noise_std[k])
        noisy = [np.clip(x[ids] + rng.normal(0.0, std, size=x[ids].shape).astype(np.float32), 0, 1)
                 for ids in (shuffled[test + held :], shuffled[:test], shuffled[test : test + held])]
        assert np.array_equal(arrays[k].train_x.numpy(), noisy[0]) and np.array_equal(arrays[k].test_x.numpy(), noisy[1])
        expected.append(noisy[2])

    assert np.array_equal(federation.validation_set()[0].numpy(), np.concatenate(expected))
