"""FEMNIST (LEAF): read from LEAF's json files, with each training sample's writer;
never downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np

from fedplug.components import ComponentConfig
from fedplug.data.datasets.dataset import Dataset
from fedplug.errors import DataError
from fedplug.safe_files import read_regular_bytes


class FemnistConfig(ComponentConfig):
    """FEMNIST (LEAF): grey 28x28 digits and letters by ~3,500 writers, 62 classes.

    Read from LEAF's json files in ``root/femnist/train/`` and ``root/femnist/test/``; they
    are never downloaded (see :func:`load_femnist`). Pixels are kept as LEAF stores them:
    ``byte / 255`` with **1.0 = white background** and dark strokes, the reverse of MNIST.
    ``train_users`` holds each training sample's writer.
    """

    name: Literal["femnist"] = "femnist"


FEMNIST_CLASSES = 62
FEMNIST_HOWTO = (
    "FEMNIST is not downloaded automatically. Produce it with LEAF "
    "(https://github.com/TalwalkarLab/leaf): `cd leaf/data/femnist && ./preprocess.sh -s niid "
    "--sf 1.0 -k 0 -t sample` (use e.g. --sf 0.05 for a 5% sample), then copy "
    "leaf/data/femnist/data/train/*.json to {train} and leaf/data/femnist/data/test/*.json "
    "to {test}"
)


def femnist_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The LEAF json files of the train and test splits, sorted by name; raises
    :class:`~fedplug.errors.DataError` with instructions when either split has none."""
    train_folder = Path(root) / "femnist" / "train"
    test_folder = Path(root) / "femnist" / "test"
    train_files = sorted(train_folder.glob("*.json"))
    test_files = sorted(test_folder.glob("*.json"))
    if not train_files or not test_files:
        missing = train_folder if not train_files else test_folder
        raise DataError(
            f"no FEMNIST json files in {missing}. "
            + FEMNIST_HOWTO.format(train=train_folder, test=test_folder)
        )
    return train_files, test_files


def read_leaf_json(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read LEAF json files into ``{writer id: (x float32 (n, 784), y int64 (n,))}``.

    Each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784
    floats], ...], "y": [ints]}}}``. A writer appearing in two files is an error (two copies
    of the data in one folder), as is a sample count that disagrees with ``num_samples``.
    """
    writers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    origin: dict[str, Path] = {}
    for path in files:
        hint = f"delete {path} and produce it again with LEAF's preprocess.sh"
        try:
            # Not a plain open(): a FIFO among the json files is refused, not waited on.
            content = json.loads(read_regular_bytes(path, what="FEMNIST file", advice=hint, error=DataError))
            users = [str(user) for user in content["users"]]
            counts = [int(count) for count in content["num_samples"]]
            user_data = content["user_data"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(f"{path} is not a LEAF json file ({error!r}); {hint}") from error
        if len(users) != len(counts):
            raise DataError(
                f"{path} lists {len(users)} users but {len(counts)} num_samples; {hint}"
            )
        for user, count in zip(users, counts, strict=True):
            if user in writers:
                raise DataError(
                    f"writer {user!r} appears in both {origin[user]} and {path}; keep only one "
                    "copy of LEAF's output in the folder"
                )
            try:
                x = np.asarray(user_data[user]["x"], dtype=np.float32)
                y = np.asarray(user_data[user]["y"], dtype=np.int64)
            except (KeyError, TypeError, ValueError) as error:
                raise DataError(
                    f"{path}: user_data of writer {user!r} is not x/y arrays ({error!r}); {hint}"
                ) from error
            if x.ndim != 2 or x.shape != (count, 784) or y.shape != (count,):
                raise DataError(
                    f"{path}: writer {user!r} has x of shape {x.shape} and y of shape "
                    f"{y.shape}, expected ({count}, 784) and ({count},) from num_samples; {hint}"
                )
            if count and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
                raise DataError(
                    f"{path}: writer {user!r} has labels outside 0..{FEMNIST_CLASSES - 1}; {hint}"
                )
            if count and not (x.min() >= 0.0 and x.max() <= 1.0):
                raise DataError(
                    f"{path}: writer {user!r} has pixel values outside [0, 1]; {hint}"
                )
            writers[user] = (x, y)
            origin[user] = path
    return writers


def load_femnist(config: FemnistConfig, root: Path) -> Dataset:
    """Load FEMNIST from LEAF's json files (never downloads; see :data:`FEMNIST_HOWTO`).

    Training samples are ordered by writer id (sorted as strings), each writer's samples in
    stored order; ``train_users[i]`` is the index of sample ``i``'s writer in that sorted
    list. The test split is LEAF's test files (held-out samples of the same writers when
    LEAF split by sample). Pixels are as LEAF stores them: 1.0 = white background.
    """
    train_files, test_files = femnist_files(root)
    splits = []
    for files in (train_files, test_files):
        writers = read_leaf_json(files)
        ordered = [writers[user] for user in sorted(writers) if writers[user][1].size]
        if not ordered:
            raise DataError(
                f"the FEMNIST json files in {files[0].parent} hold no samples. "
                + FEMNIST_HOWTO.format(train=files[0].parent, test=files[0].parent)
            )
        x = np.concatenate([samples for samples, _ in ordered]).reshape(-1, 1, 28, 28)
        y = np.concatenate([labels for _, labels in ordered])
        sizes = [len(labels) for _, labels in ordered]
        users = np.repeat(np.arange(len(ordered), dtype=np.int64), sizes)
        splits.append((x, y, users))
    (train_x, train_y, train_users), (test_x, test_y, _) = splits
    return Dataset(
        name="femnist",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=FEMNIST_CLASSES,
        input_shape=(1, 28, 28),
        train_users=train_users,
    ).validate(Path(root) / "femnist")


def prepare_femnist(config: FemnistConfig, root: Path) -> list[Path]:
    """Check that LEAF's files are there and load; leaves them as they are and returns
    them (train files, then test files)."""
    load_femnist(config, root)
    train_files, test_files = femnist_files(root)
    return [*train_files, *test_files]
