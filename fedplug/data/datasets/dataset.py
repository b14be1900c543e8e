"""The :class:`Dataset` every loader returns: train and test arrays, checked by
:meth:`Dataset.validate`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedplug.errors import DataError


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset: training and held-out test arrays.

    ``eq=False`` because comparing numpy arrays with ``==`` is element-wise, not a bool.
    """

    name: str
    train_x: np.ndarray
    """float32, shape ``(N, *input_shape)``, values in ``[0, 1]``."""
    train_y: np.ndarray
    """int64, shape ``(N,)``, values in ``0 .. num_classes - 1``."""
    test_x: np.ndarray
    """float32, shape ``(M, *input_shape)``, values in ``[0, 1]``."""
    test_y: np.ndarray
    """int64, shape ``(M,)``."""
    num_classes: int
    input_shape: tuple[int, ...]
    train_users: np.ndarray | None = None
    """int64, shape ``(N,)``: the writer of each training sample, as an index into the
    writers sorted by their id; ``None`` for datasets without natural users."""

    @property
    def num_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.test_y.shape[0])

    def validate(self, source: object = None) -> Dataset:
        """Check dtypes, shapes, label and value ranges; return ``self``.

        ``source`` (default ``None``): where the data came from (a path), named in the
        error so the user knows which file to replace. Raises
        :class:`~fedplug.errors.DataError` on the first problem found.
        """
        where = f"dataset {self.name!r}" + (f" read from {source}" if source is not None else "")
        problems: list[str] = []
        for split, inputs, labels in (
            ("train", self.train_x, self.train_y),
            ("test", self.test_x, self.test_y),
        ):
            if inputs.dtype != np.float32:
                problems.append(f"{split}_x has dtype {inputs.dtype}, expected float32")
            if labels.dtype != np.int64:
                problems.append(f"{split}_y has dtype {labels.dtype}, expected int64")
            if tuple(inputs.shape[1:]) != tuple(self.input_shape):
                problems.append(
                    f"{split}_x has samples of shape {tuple(inputs.shape[1:])}, "
                    f"expected {tuple(self.input_shape)}"
                )
            if labels.ndim != 1 or labels.shape[0] != inputs.shape[0]:
                problems.append(
                    f"{split} has {inputs.shape[0]} inputs but labels of shape {labels.shape}"
                )
            if inputs.shape[0] == 0:
                problems.append(f"{split} split is empty")
            if problems:
                break
            if labels.min() < 0 or labels.max() >= self.num_classes:
                problems.append(
                    f"{split}_y has labels in [{labels.min()}, {labels.max()}], expected "
                    f"0 .. {self.num_classes - 1}"
                )
            # min/max rather than isfinite: NaN fails both comparisons below.
            low, high = float(inputs.min()), float(inputs.max())
            if not (low >= 0.0 and high <= 1.0):
                problems.append(f"{split}_x has values in [{low}, {high}], expected [0, 1]")
        if not problems and self.train_users is not None:
            users = self.train_users
            if users.dtype != np.int64 or users.shape != self.train_y.shape:
                problems.append(
                    f"train_users has dtype {users.dtype} and shape {users.shape}, expected "
                    f"int64 of shape {self.train_y.shape}"
                )
            elif users.min() < 0:
                problems.append("train_users has negative writer indices")
        if problems:
            raise DataError(
                f"{where} is invalid: {problems[0]}; replace those files (delete them and load "
                "again to download a fresh copy, or re-create them)"
            )
        return self
