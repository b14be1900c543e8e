"""Time the class-count query of a 10-node Flower setup, labels read with and without images.

Issue 25 measured 34 s for 10 nodes to answer :class:`~fedplug.adapters.flower.FedplugStrategy`'s
class-count query, each node loading its images. This script builds the quickstart's data
shape offline: a synthetic MNIST-sized image dataset (``--nodes`` x ``--samples-per-node``
PNG-encoded 28x28 uint8 images with a ClassLabel, ``datasets.Dataset.from_dict``), cut into
contiguous node partitions (flwr-datasets' ``IidPartitioner``), each split
``train_test_split(test_size=0.2, seed=42)``, given the quickstart's ``apply_transforms``
(PIL image -> normalised tensor) and wrapped in a shuffling DataLoader. Every node then
answers the query (``FedplugTrainer.describe``, what ``answer_class_counts`` registers)
with its labels read four ways, timed for all nodes together (median of ``--repeats``):

- ``dataloader_batches``: the labels of every batch of the node's DataLoader (every image
  decoded and transformed: what a handler reading ``batch["label"]`` costs);
- ``sample_by_sample``: :func:`~fedplug.adapters.flower.local_data.labels_by_iteration`,
  the reader's fallback (every sample loaded and transformed);
- ``column_as_list``: the label column turned into a Python list (fedplug's reader before
  this script, no transform run);
- ``label_column``: :func:`~fedplug.adapters.flower.local_data.labels_of` today (the column
  read as Arrow, no transform run).

Every way must give the same counts on every node; the script fails otherwise.

Run: ``.venv/bin/python benchmarks/bench_flower_class_counts.py [--threads 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

NUM_CLASSES = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10, help="node partitions (default 10)")
    parser.add_argument(
        "--samples-per-node", type=int, default=5000, help="images per node (default 5000)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="DataLoader batch (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per way (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    return parser.parse_args(argv)


def image_dataset(num_samples: int, seed: int = 0) -> Any:
    """MNIST's shape in flwr-datasets: PNG-encoded 28x28 grey images and a ClassLabel."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(num_samples, 28, 28), dtype=np.uint8)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=NUM_CLASSES)}
    )
    return datasets.Dataset.from_dict(
        {
            "image": [Image.fromarray(image) for image in pixels],
            "label": rng.integers(0, NUM_CLASSES, size=num_samples).tolist(),
        },
        features=features,
    )


def quickstart_loaders(dataset: Any, num_nodes: int, batch_size: int) -> list[Any]:
    """Each node's training DataLoader, built as Flower's quickstart ``load_data`` does."""
    from flwr_datasets.partitioner import IidPartitioner
    from torch.utils.data import DataLoader
    from torchvision.transforms import Compose, Normalize, ToTensor

    to_tensor = Compose([ToTensor(), Normalize((0.5,), (0.5,))])

    def apply_transforms(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        batch["image"] = [to_tensor(image) for image in batch["image"]]
        return batch

    partitioner = IidPartitioner(num_partitions=num_nodes)
    partitioner.dataset = dataset
    loaders = []
    for node in range(num_nodes):
        split = partitioner.load_partition(node).train_test_split(test_size=0.2, seed=42)
        train = split.with_transform(apply_transforms)["train"]
        loaders.append(DataLoader(train, batch_size=batch_size, shuffle=True))
    return loaders


def dataloader_batches(loader: Any) -> Any:
    import torch

    return torch.cat([batch["label"] for batch in loader])


def sample_by_sample(loader: Any) -> Any:
    from fedplug.adapters.flower.local_data import labels_by_iteration

    return labels_by_iteration(loader.dataset)


def column_as_list(loader: Any) -> Any:
    import numpy as np

    return np.asarray(list(loader.dataset.with_format(None)["label"]), dtype=np.int64)


def label_column(loader: Any) -> Any:
    return loader  # the answer reads the DataLoader itself, through labels_of


LABEL_READERS: dict[str, Callable[[Any], Any]] = {
    "dataloader_batches": dataloader_batches,
    "sample_by_sample": sample_by_sample,
    "column_as_list": column_as_list,
    "label_column": label_column,
}
"""Each way of reading a node's labels: it gives what the query answer is computed from
(labels, or for ``label_column`` the DataLoader, read by ``labels_of`` inside the answer)."""


def answer_all_nodes(loaders: list[Any], reader: Callable[[Any], Any]) -> list[list[int]]:
    """Every node's class-count answer, as a fresh node process would give it."""
    from fedplug.adapters.flower import FedplugTrainer
    from fedplug.adapters.flower.loopback import ensure_task_identity
    from fedplug.adapters.flower.records import CLASS_COUNTS, CONFIG_KEY, METRICS_KEY
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

    ensure_task_identity()
    answers = []
    for node, loader in enumerate(loaders):
        trainer = FedplugTrainer.from_config({}, num_classes=NUM_CLASSES)  # no cached labels
        query = Message(
            RecordDict({CONFIG_KEY: ConfigRecord({})}),
            dst_node_id=node + 1,
            message_type=MessageType.QUERY,
        )
        context = Context(
            1, node + 1, {"partition-id": node, "num-partitions": len(loaders)}, RecordDict(), {}
        )
        reply = trainer.describe(reader(loader), query, context)
        answers.append(
            [int(count) for count in reply.content.metric_records[METRICS_KEY][CLASS_COUNTS]]
        )
    return answers


def time_reader(loaders: list[Any], reader: Callable[[Any], Any], repeats: int) -> dict[str, Any]:
    seconds, answers = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        answers = answer_all_nodes(loaders, reader)
        seconds.append(time.perf_counter() - started)
    return {
        "seconds": [round(value, 4) for value in seconds],
        "median_seconds": round(benchlib.median(seconds), 4),
        "counts": answers,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = benchlib.set_threads(args.threads)
    machine = benchlib.machine_description()
    benchlib.print_machine(
        "flower_class_counts: the class-count query of a 10-node quickstart setup", machine
    )
    print(f"torch threads: {threads}")
    started = time.perf_counter()
    dataset = image_dataset(args.nodes * args.samples_per_node)
    loaders = quickstart_loaders(dataset, args.nodes, args.batch_size)
    build_seconds = time.perf_counter() - started
    train_rows = [len(loader.dataset) for loader in loaders]
    print(
        f"{args.nodes} nodes x {args.samples_per_node} PNG images (28x28), {sum(train_rows)} training rows "
        f"after train_test_split, built in {build_seconds:.1f} s"
    )
    ways = {}
    for name, reader in LABEL_READERS.items():
        ways[name] = time_reader(loaders, reader, args.repeats)
        print(
            f"{name:>20}: {args.nodes} nodes answered in {ways[name]['median_seconds']:.3f} s (median of {args.repeats}: {ways[name]['seconds']})"
        )
        sys.stdout.flush()
    reference = ways["sample_by_sample"]["counts"]
    agree = all(way["counts"] == reference for way in ways.values())
    print(f"every way gives the same counts on every node: {agree}")
    before, after = (
        ways["dataloader_batches"]["median_seconds"],
        ways["label_column"]["median_seconds"],
    )
    print(
        f"reading the labels without the images: {before:.3f} s -> {after:.3f} s ({before / after:.0f}x)"
    )
    result = {
        "benchmark": "flower_class_counts",
        "machine": machine,
        "threads": threads,
        "nodes": args.nodes,
        "samples_per_node": args.samples_per_node,
        "train_rows_per_node": train_rows,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "build_seconds": round(build_seconds, 2),
        "ways": {
            name: {key: value for key, value in way.items() if key != "counts"}
            for name, way in ways.items()
        },
        "counts": reference,
        "counts_agree": agree,
        "load_average_end": benchlib.load_average(),
    }
    benchlib.write_result(args.json, result)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
