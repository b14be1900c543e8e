"""Class counts from the labels alone (issue 25, item 5): the label reader finds the labels
where the data keep them apart (a Hugging Face column, a Subset's parent, a label tensor,
torchvision's ``targets``) and gives what reading every sample gives, without loading an
input or running a transform; other datasets are still read sample by sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from fedplug.adapters.flower import answer_class_counts
from fedplug.adapters.flower.local_data import (
    labels_by_iteration,
    labels_of,
    stored_labels,
    with_sample_ids,
)
from fedplug.adapters.flower.loopback import ensure_task_identity
from fedplug.adapters.flower.records import CLASS_COUNTS, CONFIG_KEY, METRICS_KEY, NUM_EXAMPLES
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from fedplug.errors import DataError

datasets = pytest.importorskip(
    "datasets", reason="Hugging Face datasets comes with fedplug[flower]"
)

NUM_CLASSES = 4
LABELS = [2, 0, 3, 3, 1, 0, 2, 2, 3, 0, 1, 3, 3, 2, 0]
"""15 labels: 4 of class 0, 2 of class 1, 4 of class 2, 5 of class 3."""
COUNTS = [4, 2, 4, 5]


def image_dataset(labels: list[int] = LABELS) -> Any:
    """A flwr-datasets-style Dataset: a PNG-encoded 4x4 image and a ClassLabel per row."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8)) for _ in labels]
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=NUM_CLASSES)}
    )
    return datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)


class CountingTransform:
    """The quickstart's ``apply_transforms`` (PIL image -> tensor), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.calls += 1
        batch["img"] = [
            torch.tensor(np.array(image), dtype=torch.float32) for image in batch["img"]
        ]
        return batch


def refuse_to_run(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    raise AssertionError("the transform ran: the labels were read by loading the images")


class TargetsDataset(Dataset):
    """torchvision's shape: ``targets``, ``target_transform``, optionally a joint
    ``transforms``; counts the inputs it loads."""

    def __init__(
        self,
        labels: list[int],
        target_transform: Callable[[int], int] | None = None,
        transforms: Callable[[Any, int], tuple[Any, int]] | None = None,
    ) -> None:
        self.targets = list(labels)
        self.target_transform = target_transform
        self.transforms = transforms
        self.loads = 0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.loads += 1
        image, target = torch.zeros(1, 4, 4), self.targets[index]
        if self.transforms is not None:
            return self.transforms(image, target)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def tensor_dataset(labels: list[int] = LABELS, *extra: torch.Tensor) -> TensorDataset:
    inputs = torch.arange(len(labels) * 2, dtype=torch.float32).reshape(len(labels), 2)
    return TensorDataset(inputs, torch.tensor(labels), *extra)


def hugging_face_shapes() -> dict[str, Any]:
    """Every shape a Flower app gives a Hugging Face dataset in, transforms that run."""
    dataset = image_dataset()
    split = dataset.train_test_split(test_size=0.4, seed=42)
    return {
        "plain": dataset,
        "torch format": dataset.with_format("torch"),
        "with_transform": dataset.with_transform(CountingTransform()),
        "train_test_split train, transformed": split.with_transform(CountingTransform())["train"],
        "train_test_split test, torch": split.with_format("torch")["test"],
        "shuffled select": dataset.shuffle(seed=3).select(range(9)),
        "with sample ids": with_sample_ids(dataset.with_transform(CountingTransform())),
    }


def torch_shapes() -> dict[str, Any]:
    """Every torch-side shape whose labels are kept apart from the inputs."""
    return {
        "TensorDataset": tensor_dataset(),
        "TensorDataset with a third tensor": tensor_dataset(LABELS, torch.arange(len(LABELS))),
        "Subset of a TensorDataset": Subset(tensor_dataset(), [14, 0, 3, 3, 7]),
        "Subset of a Subset": Subset(Subset(tensor_dataset(), torch.arange(2, 12)), [0, 5, 9]),
        "Subset of a Hugging Face dataset": Subset(
            image_dataset().with_transform(CountingTransform()), [1, 4, 2, 2]
        ),
        "ConcatDataset": ConcatDataset([tensor_dataset(), Subset(tensor_dataset(), [1, 2])]),
        "targets": TargetsDataset(LABELS),
        "targets with target_transform": TargetsDataset(LABELS, lambda target: 3 - target),
        "Subset of targets": Subset(TargetsDataset(LABELS), range(3, 10)),
    }


ALL_SHAPES = {**hugging_face_shapes(), **torch_shapes()}


# ------------------------------------------------------------- two paths, one answer


@pytest.mark.parametrize("name", sorted(ALL_SHAPES))
def test_stored_labels_equal_the_labels_of_every_sample(name: str) -> None:
    # Prepare
    dataset = ALL_SHAPES[name]
    # Execute: the labels where the data keep them, and sample by sample
    stored = stored_labels(dataset)
    read = labels_by_iteration(dataset)
    # Assert: the fast path was taken and agrees, in order
    assert stored is not None, f"{name}: the labels were not found apart from the inputs"
    assert stored.dtype == np.int64
    np.testing.assert_array_equal(stored, read)
    np.testing.assert_array_equal(labels_of(dataset), read)
    np.testing.assert_array_equal(labels_of(DataLoader(dataset, batch_size=4)), read)


def test_the_full_dataset_has_the_hand_counted_classes() -> None:
    for name in ("plain", "with_transform", "with sample ids"):
        counts = np.bincount(labels_of(ALL_SHAPES[name]), minlength=NUM_CLASSES)
        assert counts.tolist() == COUNTS, name
    target_counts = np.bincount(labels_of(ALL_SHAPES["targets with target_transform"]))
    assert target_counts.tolist() == COUNTS[::-1]  # 3 - label reverses the classes


def test_a_subset_gives_its_parents_labels_at_its_indices() -> None:
    assert labels_of(Subset(tensor_dataset(), [14, 0, 3, 3, 7])).tolist() == [0, 2, 3, 3, 2]


# ---------------------------------------------------------- nothing loaded, no transform


def test_a_transform_that_refuses_to_run_is_never_called() -> None:
    # Prepare: the quickstart's shape, a transform that fails if it runs
    split = image_dataset().train_test_split(test_size=0.4, seed=42)
    expected = np.asarray(list(split["train"]["label"]), dtype=np.int64)
    train = split.with_transform(refuse_to_run)["train"]
    loader = DataLoader(train, batch_size=4, shuffle=True)
    # Execute / Assert: the dataset, the DataLoader over it, a Subset of it
    np.testing.assert_array_equal(labels_of(train), expected)
    np.testing.assert_array_equal(labels_of(loader), expected)
    np.testing.assert_array_equal(labels_of(Subset(train, [2, 0])), expected[[2, 0]])
    with pytest.raises(AssertionError, match="the transform ran"):
        labels_by_iteration(train)  # the transform is live: only the column read avoids it
    assert train.format["type"] == "custom"  # the user's dataset keeps its transform


def test_no_input_is_loaded_for_targets_or_a_subset_of_them() -> None:
    dataset = TargetsDataset(LABELS, lambda target: target + 1)
    assert labels_of(DataLoader(Subset(dataset, [0, 4]), batch_size=2)).tolist() == [3, 2]
    assert dataset.loads == 0


def test_the_class_count_query_runs_no_transform() -> None:
    # Prepare: a ClientApp answering the query over a DataLoader of a transformed split
    ensure_task_identity()
    transform = CountingTransform()
    train = image_dataset().with_transform(transform)
    app = ClientApp()
    answer_class_counts(
        app, lambda context: DataLoader(train, batch_size=4), num_classes=NUM_CLASSES
    )
    query = Message(
        RecordDict({CONFIG_KEY: ConfigRecord({})}), dst_node_id=7, message_type=MessageType.QUERY
    )
    context = Context(1, 7, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
    # Execute
    reply = app(query, context)
    # Assert: the hand-counted classes, and the images were never converted
    metrics = reply.content.metric_records[METRICS_KEY]
    assert list(metrics[CLASS_COUNTS]) == COUNTS
    assert metrics[NUM_EXAMPLES] == len(LABELS)
    assert transform.calls == 0


# ------------------------------------------------------------- where the labels are not kept apart


class DictSamples(Dataset):
    def __init__(self, labels: list[int]) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"img": torch.zeros(2), "target": self.labels[index]}


@pytest.mark.parametrize(
    "dataset",
    [
        DictSamples(LABELS),
        Subset(DictSamples(LABELS), [3, 1]),
        TargetsDataset(LABELS, transforms=lambda image, target: (image, 3 - target)),
    ],
    ids=["dict samples", "subset of dict samples", "joint transforms"],
)
def test_other_datasets_are_read_sample_by_sample(dataset: Any) -> None:
    assert stored_labels(dataset, "target") is None
    np.testing.assert_array_equal(
        labels_of(dataset, "target"), labels_by_iteration(dataset, "target")
    )


def test_a_label_tensor_of_one_hot_rows_is_not_taken_for_labels() -> None:
    one_hot = torch.nn.functional.one_hot(torch.tensor(LABELS))
    dataset = TensorDataset(torch.zeros(len(LABELS), 2), one_hot)
    assert stored_labels(dataset) is None
    with pytest.raises((ValueError, RuntimeError)):  # reading a sample: not one number
        labels_of(dataset)


def test_a_joint_transform_is_run_as_it_may_change_the_target() -> None:
    dataset = TargetsDataset(LABELS, transforms=lambda image, target: (image, 3 - target))
    assert np.bincount(labels_of(dataset)).tolist() == COUNTS[::-1]
    assert dataset.loads == len(LABELS)


def test_a_hugging_face_dataset_without_the_label_key_says_which_key_to_pass() -> None:
    dataset = image_dataset().rename_column("label", "fine_label")
    assert stored_labels(dataset) is None
    assert labels_of(dataset, "fine_label").tolist() == LABELS
    with pytest.raises(DataError, match="pass label_key= for another key"):
        labels_of(dataset)
