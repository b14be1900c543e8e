"""Stage ``partition``: split the training set over the clients, once for every run.

Reads the ``data`` section. Writes to ``data/partition/``:

- ``partition.npz``: every client's sample indices and the K x C class-count matrix
  (:func:`fedplug.data.partitions.save_partition`);
- ``class_counts.csv``: the same matrix, one row per client, for reading by eye;
- ``heatmap.png``: the matrix as a clients x classes heatmap (also logged to MLflow by every
  train run, and shown by ``dvc plots show``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PARTITION_DIR, read_params, run_main, section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument(
        "--out", default=str(PARTITION_DIR), help=f"output folder (default {PARTITION_DIR})"
    )
    args = parser.parse_args(argv)

    from fedplug.config import validate_section
    from fedplug.data.build import load_dataset, make_partition
    from fedplug.data.partitions import save_partition
    from fedplug.plugins import default_registry
    from fedplug.report import plot_partition_heatmap

    params = read_params(args.params)
    registry = default_registry()
    data_config = validate_section("data", section(params, "data"), registry)
    dataset = load_dataset(data_config, registry)
    partition = make_partition(dataset, data_config, registry)
    partition.validate(dataset.num_train)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_partition(out / "partition.npz", partition)
    counts = partition.class_counts
    with open(out / "class_counts.csv", "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(
            ["client", *(f"class_{label}" for label in range(counts.shape[1])), "total"]
        )
        for client, row in enumerate(counts):
            writer.writerow([client, *(int(value) for value in row), int(row.sum())])
    settings = ", ".join(
        f"{key}={value}"
        for key, value in data_config.partition.model_dump().items()
        if key != "name"
    )
    title = f"{dataset.name}: {data_config.partition.name} over {partition.num_clients} clients"
    if settings:
        title += f"\n({settings})"
    plot_partition_heatmap(counts, out / "heatmap.png", title)
    print(
        f"partition: {partition.num_clients} clients, sizes {int(partition.sizes.min())}..{int(partition.sizes.max())}"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
