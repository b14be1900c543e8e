"""Every file fedplug opens is checked, and a re-run says what it did (issue 44,
findings 4, 7 and 11).

A FIFO planted where fedplug reads a file (the output folder's lock, marker and
checkpoint, a partition, the FedDisk cache, a params file, a dataset file) used to block
``open()`` forever; an ``.npz`` member whose header claims 10^12 elements made numpy try to
allocate them; a crafted cached cost was reported as measured; the same command again on
a finished run said it wrote ``metrics.json``. Each test is one of those attacks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedplug.algorithms.feddisk import FedDiskConfig
from fedplug.algorithms.feddisk.cache import load_weights, save_weights
from fedplug.algorithms.feddisk.weights import FedDiskWeights
from fedplug.cli import main
from fedplug.components import PhaseCost
from fedplug.config import read_yaml
from fedplug.data.datasets import MnistConfig, load_mnist, read_idx, read_leaf_json, read_pickle
from fedplug.data.partitions.partition import Partition, load_partition, save_partition
from fedplug.errors import ConfigError, DataError

TINY: dict[str, Any] = {
    "study": {"name": "tiny"},
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 120, "num_test": 40, "num_features": 6, "num_classes": 3},
        "partition": {"name": "iid"},
        "num_clients": 3,
        "seed": 0,
    },
    "train": {"model": {"name": "logreg"}, "rounds": 2, "batch_size": 20, "seed": 0},
}
"""Three clients, two rounds of logistic regression: well under a second of training."""
RUN = "import sys; from fedplug.cli import main; sys.exit(main(sys.argv[1:]))"
"""``fedplug`` in a subprocess, importing whichever fedplug ``PYTHONPATH`` names."""
HANG_SECONDS = 60
"""How long a subprocess may take before it counts as hanging: it starts in a few seconds on
a quiet machine; the margin is for oversubscribed cores (a hanging reader never returns)."""
UNBLOCK_SECONDS = 20.0
"""When :func:`unblocked_after` lets an in-process reader stuck on a FIFO go."""
TERA_ELEMENTS = 10**12


# ------------------------------------------------------------------------------ helpers


def write_config(folder: Path) -> Path:
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def run_in_subprocess(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``fedplug <argv>`` as a user runs it; a run still going after
    :data:`HANG_SECONDS` fails the test (it was waiting on a FIFO)."""
    try:
        return subprocess.run(
            [sys.executable, "-c", RUN, *argv], cwd=cwd, capture_output=True, text=True,
            timeout=HANG_SECONDS, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"fedplug {' '.join(argv)} hung for {HANG_SECONDS} s (waiting on a FIFO?)")


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``fedplug <argv>`` in process: (exit code, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


def one_line(stderr: str) -> str:
    """The single error line of a refused command (no traceback, nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fedplug: error: "), stderr
    return lines[0]


@contextlib.contextmanager
def unblocked_after(fifo: Path, seconds: float = UNBLOCK_SECONDS) -> Iterator[None]:
    """Code that opens ``fifo`` waits for a writer: after ``seconds`` one comes and goes
    at once (the reader then reads an empty file), so that code which waits fails its test
    instead of hanging it. Asserts that the block returned before that."""
    done = threading.Event()

    def writer() -> None:
        if not done.wait(seconds):
            with contextlib.suppress(OSError):  # ENXIO: nobody is reading
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        yield
    finally:
        done.set()
        thread.join()
    assert time.monotonic() - started < seconds, f"waited on the FIFO {fifo} for {seconds} s"


def npy_bytes(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array(stream, array)
    return stream.getvalue()


def tera_header() -> bytes:
    """A ``.npy`` member whose header claims 10^12 float64 elements over 8 data bytes."""
    stream = io.BytesIO()
    header = {"descr": "<f8", "fortran_order": False, "shape": (TERA_ELEMENTS,)}
    np.lib.format.write_array_header_1_0(stream, header)
    return stream.getvalue() + b"\0" * 8


def write_npz(path: Path, members: dict[str, bytes]) -> Path:
    """An uncompressed ``.npz`` (as ``np.savez`` writes) of raw ``.npy`` members."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in members.items():
            archive.writestr(f"{name}.npy", content)
    return path


def a_partition() -> Partition:
    return Partition(
        client_indices=[np.array([0, 1], dtype=np.int64), np.array([2], dtype=np.int64)],
        class_counts=np.array([[1, 1], [0, 1]], dtype=np.int64),
    )


def cached_weights(path: Path, cost: PhaseCost) -> Path:
    result = FedDiskWeights.from_ratios([np.array([1.0, 3.0]), np.array([2.0])], cost, FedDiskConfig())
    save_weights(path, result)
    return path


# ------------------------------------------------------------------ finding 4: a FIFO in --out


@pytest.mark.parametrize("name", [".fedplug-output.lock", ".fedplug-output.json", "checkpoint.pt"])
def test_a_fifo_planted_in_out_is_refused_in_one_line(tmp_path: Path, name: str) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "out"
    if name == "checkpoint.pt":  # a finished run of this config: the marker lists its checkpoint
        code, _, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
        assert code == 0, stderr
        (out / name).unlink()
    else:
        out.mkdir()
    os.mkfifo(out / name)

    started = time.monotonic()
    completed = run_in_subprocess("run", str(config), "--out", str(out), "--quiet", cwd=tmp_path)

    assert completed.returncode == 2, completed.stderr
    line = one_line(completed.stderr)
    assert f"{str(out / name)!r} is a FIFO, not a regular file" in line, line
    assert time.monotonic() - started < HANG_SECONDS


def test_a_fifo_as_the_params_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    with unblocked_after(fifo), pytest.raises(ConfigError) as refused:
        read_yaml(fifo)
    assert str(refused.value) == (
        f"config file {str(fifo)!r} is a FIFO, not a regular file; give a params file (a regular file)"
    )


def test_a_fifo_as_the_partition_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "partition.npz"
    os.mkfifo(fifo)
    with unblocked_after(fifo), pytest.raises(DataError) as refused:
        load_partition(fifo)
    message = str(refused.value)
    assert f"partition file {str(fifo)!r} is a FIFO, not a regular file" in message
    assert "re-run the partition stage" in message and "\n" not in message


def test_a_fifo_as_the_feddisk_cache_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "feddisk-synthetic-0123.npz"
    os.mkfifo(fifo)
    with unblocked_after(fifo), pytest.raises(DataError) as refused:
        load_weights(fifo, FedDiskConfig())
    assert f"FedDisk weights cache {str(fifo)!r} is a FIFO, not a regular file" in str(refused.value)


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("train-images-idx3-ubyte", read_idx),
        ("data_batch_1", read_pickle),
        ("all_data_0.json", lambda path: read_leaf_json([path])),
    ],
    ids=["idx", "cifar-pickle", "femnist-json"],
)
def test_a_fifo_among_the_dataset_files_is_refused(tmp_path: Path, name: str, read: Any) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    with unblocked_after(fifo), pytest.raises(DataError) as refused:
        read(fifo)
    assert f"{str(fifo)!r} is a FIFO, not a regular file" in str(refused.value)


# ------------------------------------------------------------- finding 7: crafted .npz files


def test_a_partition_header_claiming_10_to_the_12_elements_is_refused_before_allocation(tmp_path: Path) -> None:
    path = write_npz(
        tmp_path / "partition.npz",
        {"indices": tera_header(), "offsets": npy_bytes(np.array([0, 0])), "class_counts": npy_bytes(np.zeros((1, 2)))},
    )
    with pytest.raises(DataError) as refused:
        load_partition(path)
    message = str(refused.value)
    assert f"{path} is not a valid partition file: its array 'indices' claims shape (1000000000000,)" in message
    assert "in 8 bytes of data" in message and "re-run the partition stage" in message


def test_a_feddisk_cache_header_claiming_10_to_the_12_elements_is_refused_before_allocation(tmp_path: Path) -> None:
    path = write_npz(
        tmp_path / "feddisk.npz",
        {
            "ratios_0": tera_header(),
            "num_clients": npy_bytes(np.asarray(1, dtype=np.int64)),
            "cost": npy_bytes(np.zeros(3, dtype=np.int64)),
        },
    )
    with pytest.raises(DataError) as refused:
        load_weights(path, FedDiskConfig())
    message = str(refused.value)
    assert "its array 'ratios_0' claims shape (1000000000000,)" in message
    assert "delete the file so that the weights are recomputed" in message


def test_an_mnist_cache_header_claiming_10_to_the_12_elements_gets_the_same_check(tmp_path: Path) -> None:
    members = {key: npy_bytes(np.zeros((1, 28, 28), np.uint8)) for key in ("train_x", "test_x")}
    members |= {"train_y": tera_header(), "test_y": npy_bytes(np.zeros(1, np.int64))}
    write_npz(tmp_path / "mnist" / "mnist.npz", members)
    with pytest.raises(DataError, match=r"its array 'train_y' claims shape \(1000000000000,\)"):
        load_mnist(MnistConfig(download=False), tmp_path)


def test_a_cached_phase_cost_of_2_to_the_62_is_refused(tmp_path: Path) -> None:
    path = cached_weights(tmp_path / "feddisk.npz", PhaseCost(2**62, 10, 12))
    with pytest.raises(DataError) as refused:
        load_weights(path, FedDiskConfig())
    message = str(refused.value)
    assert f"{str(path)!r} hold a phase cost [{2**62}, 10, 12]" in message and "delete it to recompute" in message
    for cost in (PhaseCost(3, 2**62, 12), PhaseCost(3, 10, -1), PhaseCost(FedDiskConfig().global_rounds + 1, 0, 0)):
        with pytest.raises(DataError, match="delete it to recompute"):
            load_weights(cached_weights(tmp_path / "feddisk.npz", cost), FedDiskConfig())
    # A cost a phase of this config can have is kept.
    assert load_weights(cached_weights(tmp_path / "feddisk.npz", PhaseCost(7, 10, 12)), FedDiskConfig()).cost == (
        PhaseCost(7, 10, 12)
    )


@pytest.mark.parametrize(
    ("arrays", "reason"),
    [
        ({"class_counts": np.array([[3, -1], [0, 1]])}, "class counts that are not non-negative integers"),
        ({"class_counts": np.array([[2**62] * 4 + [2], [0] * 4 + [1]])}, "a class count above the 3 samples"),
        ({"indices": np.array([0, -1, 2])}, "indices below 0"),
        ({"noise_std": np.array([0.1, np.nan])}, "noise_std is not one finite, non-negative value per client"),
    ],
    ids=["negative-count", "count-wrapping-the-sum", "negative-index", "nan-noise"],
)
def test_a_partition_with_impossible_counts_is_refused(tmp_path: Path, arrays: dict[str, Any], reason: str) -> None:
    stored = {"indices": np.array([0, 1, 2]), "offsets": np.array([0, 2, 3]), "class_counts": np.array([[1, 1], [0, 1]])}
    path = tmp_path / "partition.npz"
    np.savez(path, **(stored | arrays))
    with pytest.raises(DataError) as refused:
        load_partition(path)
    assert f"partition file {path} is inconsistent ({reason}" in str(refused.value)


def test_a_well_formed_partition_and_cache_still_load(tmp_path: Path) -> None:
    save_partition(tmp_path / "partition.npz", a_partition())
    loaded = load_partition(tmp_path / "partition.npz")
    assert [indices.tolist() for indices in loaded.client_indices] == [[0, 1], [2]]
    assert loaded.class_counts.tolist() == [[1, 1], [0, 1]]
    weights = load_weights(cached_weights(tmp_path / "w.npz", PhaseCost(7, 10, 12)), FedDiskConfig())
    assert [w.tolist() for w in weights.weights] == [[0.5, 1.5], [1.0]]


# ------------------------------------------------------- finding 11: a re-run that trained nothing


@pytest.mark.parametrize("flags", [(), ("--no-track",)], ids=["plain", "no-track"])
def test_a_rerun_of_a_finished_run_says_there_was_nothing_to_do(tmp_path: Path, flags: tuple[str, ...]) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "out"
    code, first, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
    assert code == 0, stderr
    assert f"after 2 rounds; wrote {out / 'metrics.json'}" in first
    metrics = json.loads((out / "metrics.json").read_text())

    code, again, stderr = run_cli("run", str(config), "--out", str(out), "--quiet", *flags)

    assert code == 0, stderr
    assert f"nothing to do: {out} already holds the finished run of this config (2 rounds" in again
    assert "pass --no-resume to train again" in again and "wrote" not in again
    assert json.loads((out / "metrics.json").read_text())["final_accuracy"] == metrics["final_accuracy"]
