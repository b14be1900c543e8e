"""flwr-datasets both ways, offline on ``datasets.Dataset.from_dict`` data.

- fedplug -> Flower: :class:`FedplugPartitioner` gives, for every fedplug partitioner, the
  rows fedplug's own partitioner assigns (same generator as ``fedplug run``).
- Flower -> fedplug: ``data.partition.name: flwr`` gives the rows flwr-datasets' own
  ``load_partition`` returns, in ``fedplug run`` too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
import pluggy
import pytest
import yaml

pytest.importorskip("flwr_datasets", reason="flwr-datasets comes with fedplug[flower]")

from datasets import ClassLabel, Dataset, Features, Image  # noqa: E402
from flwr_datasets import partitioner as flwr_partitioners  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from fedplug import hookspecs  # noqa: E402
from fedplug.adapters.flower.partitioners import FedplugPartitioner  # noqa: E402
from fedplug.cli import main  # noqa: E402
from fedplug.components import ComponentConfig  # noqa: E402
from fedplug.config import validate_section  # noqa: E402
from fedplug.data import flwr_partitions, partitions  # noqa: E402
from fedplug.data.flwr_partitions import FlwrPartitionConfig, flwr_partition  # noqa: E402
from fedplug.data.partitions import Partition, add_feature_noise  # noqa: E402
from fedplug.errors import ConfigError, DataError  # noqa: E402
from fedplug.plugins import collect_registry, default_registry  # noqa: E402

NUM_CLASSES = 4
NUM_CLIENTS = 8
PER_CLASS = 50
SEED = 3
PARTITION_SEED_TAG = 0xDA7A
"""The tag of fedplug.data.build.make_partition's generator: default_rng([seed, 0xDA7A])."""


def labels_and_users() -> tuple[np.ndarray, np.ndarray]:
    """200 labels of 4 classes in a scrambled order and 10 writers (ids 100, 103, ...)."""
    order = np.random.default_rng(7).permutation(NUM_CLASSES * PER_CLASS)
    labels = np.repeat(np.arange(NUM_CLASSES), PER_CLASS)[order]
    users = 100 + 3 * (np.arange(labels.size) % 10)
    return labels, users


def hf_dataset() -> Dataset:
    labels, users = labels_and_users()
    inputs = np.random.default_rng(1).random((labels.size, 3), dtype=np.float32)
    return Dataset.from_dict(
        {"id": np.arange(labels.size), "x": inputs, "label": labels, "writer": users}
    )


BUILTIN_PARTITIONS: list[dict[str, Any]] = [
    {"name": "iid"},
    {"name": "dirichlet_class", "alpha": 0.5, "min_size": 5},
    {"name": "dirichlet_client", "alpha": 1.0},
    {"name": "dirichlet_size", "beta": 0.5, "min_size": 5},
    {"name": "shards", "shards_per_client": 2},
    {"name": "llt", "alpha_l": 0.9},
    {"name": "feature_noise", "sigma": 0.2},
    {"name": "natural"},
]


def fedplug_own(partition: dict[str, Any]) -> Partition:
    """fedplug's partitioner called as fedplug.data.build.make_partition calls it."""
    labels, users = labels_and_users()
    registration = default_registry().get("partitioners", partition["name"])
    config = registration.config_class.model_validate(partition)
    rng = np.random.default_rng([SEED, PARTITION_SEED_TAG])
    # fedplug's writers are indices into the sorted writer ids.
    writers = np.unique(users, return_inverse=True)[1]
    return registration.factory(labels, NUM_CLASSES, NUM_CLIENTS, config, rng, users=writers)


# --------------------------------------------------------------------- fedplug -> Flower


def test_every_builtin_partitioner_is_covered() -> None:
    builtin = collect_registry(_manager_with(partitions))
    assert sorted(partition["name"] for partition in BUILTIN_PARTITIONS) == builtin.names("partitioners")


@pytest.mark.parametrize("partition", BUILTIN_PARTITIONS, ids=lambda partition: partition["name"])
def test_fedplug_partitioner_gives_fedplug_clients(partition: dict[str, Any]) -> None:
    # Prepare
    dataset = hf_dataset()
    expected = fedplug_own(partition)
    partitioner = FedplugPartitioner(
        num_partitions=NUM_CLIENTS,
        partition=partition,
        seed=SEED,
        users_column="writer" if partition["name"] == "natural" else None,
        noise_column="x" if partition["name"] == "feature_noise" else None,
    )
    partitioner.dataset = dataset

    # Execute
    clients = [partitioner.load_partition(k) for k in range(partitioner.num_partitions)]

    # Assert: the same rows, in fedplug's order, and the rest of each row unchanged
    for k, client in enumerate(clients):
        assert np.array_equal(client["id"][:], expected.client_indices[k]), f"client {k}"
        assert client["label"][:] == dataset.select(expected.client_indices[k])["label"][:]
    assert np.array_equal(partitioner.partition.class_counts, expected.class_counts)


def test_feature_noise_is_applied_to_the_noise_column() -> None:
    # Prepare: sigma 0.2 over 8 clients gives client k the std 0.2 * (k + 1) / 8
    dataset = hf_dataset()
    partitioner = FedplugPartitioner(
        NUM_CLIENTS, {"name": "feature_noise", "sigma": 0.2}, seed=SEED, noise_column="x"
    )
    partitioner.dataset = dataset
    expected = fedplug_own({"name": "feature_noise", "sigma": 0.2})
    clean = np.asarray(dataset.with_format("numpy")["x"][:], dtype=np.float32)

    for k in (0, NUM_CLIENTS - 1):
        # Execute
        noisy = np.asarray(partitioner.load_partition(k).with_format("numpy")["x"][:])

        # Assert: clip(x + N(0, std_k^2), 0, 1) drawn from default_rng([seed, k, 0x7E57])
        std = 0.2 * (k + 1) / NUM_CLIENTS
        rng = np.random.default_rng([SEED, k, 0x7E57])
        by_hand = add_feature_noise(clean[expected.client_indices[k]], std, rng)
        np.testing.assert_allclose(noisy, by_hand, atol=1e-6)
        assert not np.allclose(noisy, clean[expected.client_indices[k]])


def test_feature_noise_on_images_keeps_the_image_column() -> None:
    # Prepare: 16 grey 4x4 images (value 128), 2 clients, sigma 0.5
    images = [PILImage.fromarray(np.full((4, 4), 128, np.uint8)) for _ in range(16)]
    dataset = Dataset.from_dict(
        {"img": images, "label": [i % 2 for i in range(16)]},
        features=Features({"img": Image(), "label": ClassLabel(num_classes=2)}),
    )
    partitioner = FedplugPartitioner(2, {"name": "feature_noise", "sigma": 0.5}, noise_column="img")
    partitioner.dataset = dataset

    # Execute
    client = partitioner.load_partition(1)

    # Assert: still an Image column of uint8 pixels, now noisy around 128
    assert isinstance(client.features["img"], Image)
    assert isinstance(client[0]["img"], PILImage.Image)
    pixels = np.stack([np.asarray(image) for image in client["img"]])
    assert pixels.dtype == np.uint8 and pixels.shape == (8, 4, 4)
    assert len(np.unique(pixels)) > 10
    assert abs(pixels.mean() - 128) < 20


def test_feature_noise_without_noise_column_is_refused() -> None:
    partitioner = FedplugPartitioner(NUM_CLIENTS, {"name": "feature_noise"})
    partitioner.dataset = hf_dataset()
    with pytest.raises(DataError, match="noise_column"):
        partitioner.load_partition(0)


class RoundRobinConfig(ComponentConfig):
    """Sample i goes to client i mod K."""

    name: Literal["round_robin"] = "round_robin"


def test_a_plugin_partitioner_works_as_a_flower_partitioner() -> None:
    # Prepare: a third-party "round_robin" partitioner (sample i to client i mod K)
    class RoundRobinPlugin:
        @hookspecs.hookimpl
        def fedplug_register_partitioners(self, register: Any) -> None:
            def round_robin(labels, num_classes, num_clients, config, rng, users=None) -> Partition:
                indices = [np.arange(k, len(labels), num_clients) for k in range(num_clients)]
                return Partition(indices, partitions.class_counts_of(labels, indices, num_classes))

            register("round_robin", RoundRobinConfig, round_robin)

    registry = collect_registry(_manager_with(partitions, RoundRobinPlugin()))
    partitioner = FedplugPartitioner(3, "round_robin", registry=registry)
    partitioner.dataset = hf_dataset()

    # Execute
    client = partitioner.load_partition(2)

    # Assert
    assert client["id"][:5] == [2, 5, 8, 11, 14]


def test_fedplug_partitioner_bad_input_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match=r"unknown partitioner 'dirichlet'; registered: .*dirichlet_class"):
        FedplugPartitioner(4, {"name": "dirichlet"})
    with pytest.raises(ConfigError, match="alpah: unknown key"):
        FedplugPartitioner(4, {"name": "dirichlet_class", "alpah": 0.5})
    impossible = FedplugPartitioner(6, {"name": "llt"})  # 6 clients, 4 classes
    impossible.dataset = hf_dataset()
    with pytest.raises(DataError, match="multiple of the number of classes") as error:
        impossible.load_partition(0)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="partition_id"):
        impossible.load_partition(6)


# --------------------------------------------------------------------- Flower -> fedplug


FLWR_PARTITIONERS: list[tuple[str, dict[str, Any]]] = [
    ("IidPartitioner", {}),
    ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 5, "seed": 11}),
    ("ShardPartitioner", {"num_shards_per_partition": 2, "seed": 11}),
    ("PathologicalPartitioner", {"num_classes_per_partition": 2, "seed": 11}),
]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize(("name", "params"), FLWR_PARTITIONERS, ids=[name for name, _ in FLWR_PARTITIONERS])
def test_flwr_plugin_gives_flwr_datasets_own_partitions(name: str, params: dict[str, Any]) -> None:
    # Prepare: flwr-datasets' own partitioner on the user's dataset
    labels, _ = labels_and_users()
    arguments = {"num_partitions": NUM_CLIENTS, **params}
    if name != "IidPartitioner":
        arguments["partition_by"] = "label"
    own = getattr(flwr_partitioners, name)(**arguments)
    own.dataset = Dataset.from_dict({"id": np.arange(labels.size), "label": labels})
    expected = [np.asarray(own.load_partition(k)["id"][:]) for k in range(NUM_CLIENTS)]
    config = FlwrPartitionConfig(partitioner=name, params=params)

    # Execute
    partition = flwr_partition(labels, NUM_CLASSES, NUM_CLIENTS, config, np.random.default_rng(0))

    # Assert: the same rows in the same order, and class counts that match them
    for k in range(NUM_CLIENTS):
        assert np.array_equal(partition.client_indices[k], expected[k]), f"client {k}"
        assert np.array_equal(
            partition.class_counts[k], np.bincount(labels[expected[k]], minlength=NUM_CLASSES)
        )


def test_flwr_plugin_natural_ids_use_the_writers() -> None:
    labels, users = labels_and_users()
    writers = np.unique(users, return_inverse=True)[1]
    config = FlwrPartitionConfig(partitioner="NaturalIdPartitioner", params={"partition_by": "user"})
    partition = flwr_partition(labels, NUM_CLASSES, 10, config, np.random.default_rng(0), users=writers)
    assert sorted(len(np.unique(writers[indices])) for indices in partition.client_indices) == [1] * 10
    assert sorted(np.concatenate(partition.client_indices).tolist()) == list(range(labels.size))


def test_flwr_seed_comes_from_fedplugs_generator_when_not_given() -> None:
    labels, _ = labels_and_users()
    config = FlwrPartitionConfig(partitioner="DirichletPartitioner", params={"alpha": 0.5, "min_partition_size": 0})

    def split(seed: int) -> list[list[int]]:
        made = flwr_partition(labels, NUM_CLASSES, 4, config, np.random.default_rng(seed))
        return [indices.tolist() for indices in made.client_indices]

    assert split(0) == split(0)
    assert split(0) != split(1)


def test_flwr_registers_only_when_flwr_datasets_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "flwr" in collect_registry(_manager_with(flwr_partitions)).names("partitioners")
    monkeypatch.setattr(flwr_partitions, "flwr_datasets_installed", lambda: False)
    assert collect_registry(_manager_with(flwr_partitions)).names("partitioners") == []


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        (
            {"name": "flwr", "partitioner": "DirichletPartitoner"},
            "data.partition.partitioner: unknown flwr-datasets partitioner 'DirichletPartitoner'; "
            "available: ContinuousPartitioner, DirichletPartitioner,",
        ),
        (
            {"name": "flwr", "partitioner": "DirichletPartitioner", "params": {"alpah": 0.5}},
            "data.partition: params.alpah: DirichletPartitioner has no such parameter; its parameters: "
            "partition_by, alpha,",
        ),
        (
            {"name": "flwr", "partitioner": "DirichletPartitioner"},
            "data.partition: DirichletPartitioner needs params.alpha",
        ),
        (
            {"name": "flwr", "partitioner": "IidPartitioner", "params": {"num_partitions": 4}},
            "data.partition: params.num_partitions: fedplug sets it from data.num_clients",
        ),
    ],
)
def test_flwr_config_errors_name_the_path(partition: dict[str, Any], message: str) -> None:
    data = {"dataset": {"name": "synthetic"}, "partition": partition, "num_clients": 4}
    with pytest.raises(ConfigError) as error:
        validate_section("data", data)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("ShardPartitioner", {"num_shards_per_partition": 100}, "flwr-datasets ShardPartitioner cannot make this split: "),
        ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 100}, "The max number of attempts (10) was reached"),
        ("SizePartitioner", {"partition_sizes": [10, 10]}, "makes 2 partitions but data.num_clients is 8"),
    ],
)
def test_flwr_impossible_split_is_one_data_error_line(name: str, params: dict[str, Any], message: str) -> None:
    labels, _ = labels_and_users()
    config = FlwrPartitionConfig(partitioner=name, params=params)
    with pytest.raises(DataError) as error:
        flwr_partition(labels, NUM_CLASSES, NUM_CLIENTS, config, np.random.default_rng(0))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_fedplug_run_with_a_flwr_partition(small_experiment: dict[str, Any], tmp_path, capsys) -> None:
    # Prepare: the small synthetic experiment (600 samples, 4 classes, 6 clients) split
    # by flwr-datasets' DirichletPartitioner
    small_experiment["data"]["partition"] = {
        "name": "flwr",
        "partitioner": "DirichletPartitioner",
        "params": {"alpha": 0.5, "min_partition_size": 10, "seed": 5},
    }
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(small_experiment))
    out = tmp_path / "run"

    # Execute
    code = main(["run", str(config_path), "--set", "train.rounds=2", "--out", str(out), "--quiet"])

    # Assert
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rounds"] == 2 and len(metrics["history"]) == 2
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["data"]["partition"]["params"]["alpha"] == 0.5

    # Bad input: an unknown partitioner and an impossible split, each one clear line
    for override, expected in [
        ("data.partition.partitioner=Dirichlet", "unknown flwr-datasets partitioner 'Dirichlet'; available:"),
        ("data.partition.params.min_partition_size=1000", "flwr-datasets DirichletPartitioner cannot make this split"),
    ]:
        code = main(["run", str(config_path), "--set", override, "--out", str(tmp_path / "bad"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2
        assert expected in err
        assert "Traceback" not in err


def _manager_with(*plugins: Any) -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for plugin in plugins:
        manager.register(plugin)
    return manager
