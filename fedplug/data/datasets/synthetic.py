"""A generated classification task (Gaussian classes scaled to [0, 1]), deterministic in
its seed, for tests and quick runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from fedplug.components import ComponentConfig
from fedplug.data.datasets.dataset import Dataset
from fedplug.memory import check_fits


class SyntheticConfig(ComponentConfig):
    """A generated task: Gaussian classes in ``num_features`` dimensions, scaled to [0, 1].

    Class ``c`` has mean ``mu_c`` whose coordinates are drawn from
    ``N(0, class_separation^2)``; a sample is ``mu_c + N(0, I)``. All samples (train and
    test) are then mapped by one affine map onto ``[0, 1]`` (which keeps the classes'
    geometry, noise included, isotropic). Both splits are class-balanced. Deterministic in
    ``seed``. Test accuracy of a nearest-class-mean classifier at the other defaults
    (measured, seed 0): class_separation 2.0 -> 100%, 1.0 -> 98%, 0.5 -> 69%, 0.3 -> 43%.
    """

    name: Literal["synthetic"] = "synthetic"
    num_train: int = Field(default=2000, ge=1, le=10_000_000)
    """(default 2000) Number of training samples."""
    num_test: int = Field(default=500, ge=1, le=10_000_000)
    """(default 500) Number of test samples."""
    num_features: int = Field(default=20, ge=1, le=100_000)
    """(default 20) Dimension of each sample; the input shape is ``(num_features,)``."""
    num_classes: int = Field(default=10, ge=2, le=10_000)
    """(default 10) Number of classes."""
    class_separation: float = Field(default=2.0, ge=0.0, le=1000.0)
    """(default 2.0) Standard deviation of the class means' coordinates, in units of the
    per-feature noise; 0.0 makes the labels unlearnable."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """(default 0) Seed of the generator; the same seed gives the same dataset."""

    @model_validator(mode="after")
    def _every_class_present(self) -> SyntheticConfig:
        if self.num_train < self.num_classes or self.num_test < self.num_classes:
            raise ValueError(
                f"num_train ({self.num_train}) and num_test ({self.num_test}) must each be at "
                f"least num_classes ({self.num_classes}) so that every class appears"
            )
        return self


def make_synthetic(
    num_train: int,
    num_test: int,
    num_features: int,
    num_classes: int,
    class_separation: float,
    rng: np.random.Generator,
) -> Dataset:
    """Generate the Gaussian classification task described in :class:`SyntheticConfig`.

    Draw order (fixed, so a seed always gives the same data): class means, train labels,
    test labels, train noise, test noise. The noise is generated block by block, twice
    (for the range, then for the scaled values), so the peak memory is the float32
    result plus a few blocks, not three float64 copies of the data. Labels are ``arange(n) % num_classes`` shuffled,
    so each class has ``n // num_classes`` or one more samples in each split.
    """
    means = rng.normal(0.0, class_separation, size=(num_classes, num_features))
    train_y = rng.permutation(np.arange(num_train, dtype=np.int64) % num_classes)
    test_y = rng.permutation(np.arange(num_test, dtype=np.int64) % num_classes)
    # The noise is drawn twice, block by block, from the same generator state: once for
    # the range of all samples, once to scale them. A block of standard normals is the
    # next stretch of the same stream, so the values equal those of one large draw,
    # while only a block of float64 temporaries is held at a time.
    noise_state = rng.bit_generator.state
    low, high = np.inf, -np.inf
    for labels in (train_y, test_y):
        for block in _noisy_blocks(means, labels, rng):
            low, high = min(low, block.min()), max(high, block.max())
    span = high - low
    rng.bit_generator.state = noise_state
    scaled = []
    for labels in (train_y, test_y):
        inputs = np.empty((len(labels), num_features), dtype=np.float32)
        start = 0
        for block in _noisy_blocks(means, labels, rng):
            inputs[start : start + len(block)] = (block - low) / span
            start += len(block)
        scaled.append(inputs)
    return Dataset(
        name="synthetic",
        train_x=scaled[0],
        train_y=train_y,
        test_x=scaled[1],
        test_y=test_y,
        num_classes=num_classes,
        input_shape=(num_features,),
    ).validate("the synthetic generator")


SYNTHETIC_BLOCK_VALUES = 1 << 22
"""Values per block of :func:`make_synthetic`'s float64 temporaries (32 MiB each)."""
SYNTHETIC_BYTES_PER_VALUE = 4
"""Bytes :func:`make_synthetic` keeps per generated value (the float32 result); the
labels add 24 bytes per sample while they are shuffled, and the float64 temporaries at
most four blocks of :data:`SYNTHETIC_BLOCK_VALUES` values."""


def _noisy_blocks(means: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``means[labels] + N(0, I)`` in consecutive blocks of rows (float64), the noise
    drawn from ``rng`` in row order."""
    rows = max(1, SYNTHETIC_BLOCK_VALUES // max(means.shape[1], 1))
    for start in range(0, len(labels), rows):
        chosen = labels[start : start + rows]
        yield means[chosen] + rng.standard_normal((len(chosen), means.shape[1]))


def load_synthetic(config: SyntheticConfig, root: Path) -> Dataset:
    """Generate the synthetic task from ``config.seed``; ``root`` is not used. A size
    this machine cannot hold is refused before anything is allocated
    (:func:`fedplug.memory.check_fits`)."""
    samples = config.num_train + config.num_test
    values = samples * config.num_features
    check_fits(
        values * SYNTHETIC_BYTES_PER_VALUE + 24 * samples + 4 * 8 * SYNTHETIC_BLOCK_VALUES,
        f"data.dataset (synthetic) num_train + num_test = {config.num_train + config.num_test} samples x "
        f"num_features = {config.num_features}",
        "use fewer samples or features",
    )
    return make_synthetic(
        num_train=config.num_train,
        num_test=config.num_test,
        num_features=config.num_features,
        num_classes=config.num_classes,
        class_separation=config.class_separation,
        rng=np.random.default_rng(config.seed),
    )


def prepare_synthetic(config: SyntheticConfig, root: Path) -> list[Path]:
    """Nothing to fetch: the data is generated when loaded. Leaves no files."""
    load_synthetic(config, root)
    return []
