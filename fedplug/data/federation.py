"""A federation: a dataset split into clients, each with a local train and test split
(and, when asked for, a validation split held out of its training samples).

A federation built from a dataset (:func:`fedplug.data.build.build_federation`) holds
arrays, not one object per client: :class:`ClientArrays` keeps the dataset's arrays, one
index array with K + 1 offsets, and builds a client's :class:`ClientData` when it is asked
for (a small LRU cache keeps a round's clients). A federation made in code from a list of
:class:`ClientData` behaves the same.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch
from torch import Tensor

from fedplug.data.partitions import add_feature_noise, counts_by_client

SPLIT_STREAM = 0x7E57
"""Tag of client k's local split (and feature noise) generator: ``[data seed, k, tag]``."""
DEFAULT_CACHE_CLIENTS = 1024
"""How many built clients :class:`ClientArrays` keeps (least recently used dropped first)."""


@dataclass
class ClientData:
    """One client's data, already on the training device."""

    client_id: int
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    class_counts: np.ndarray
    """Counts of each class in the client's local *training* split (length C)."""

    @property
    def num_samples(self) -> int:
        return int(self.train_y.shape[0])


def local_test_sizes(sizes: np.ndarray, fraction: float) -> np.ndarray:
    """How many of each client's ``sizes`` samples its local test split keeps:
    ``floor(fraction * n)``, leaving at least one sample for training."""
    sizes = np.asarray(sizes, dtype=np.int64)
    wanted = np.floor(fraction * sizes.astype(np.float64)).astype(np.int64)
    return np.minimum(wanted, np.maximum(sizes - 1, 0))


def shuffled_split(
    indices: np.ndarray, num_test: int, rng: np.random.Generator, num_validation: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle a client's indices with ``rng``; the first ``num_test`` form its local
    test split, the next ``num_validation`` its validation split, the rest its training
    split, all in the shuffled order: ``(train, test, validation)``. Without a validation
    split, the train and test splits are those of a federation that never had one."""
    shuffled = rng.permutation(indices)
    held_out = num_test + num_validation
    return shuffled[held_out:], shuffled[:num_test], shuffled[num_test:held_out]


class ClientArrays(Sequence[ClientData]):
    """The K clients of a federation as arrays; ``clients[k]`` builds client k.

    Client k holds the training samples ``indices[offsets[k]:offsets[k + 1]]``. When it
    is built, its generator ``[seed, k, SPLIT_STREAM]`` shuffles them; the first
    ``floor(local_test_fraction * n_k)`` (at most n_k - 1) form its local test split, the
    next ``floor(validation_fraction * m_k)`` of the m_k left (at most m_k - 1) its
    validation split, the rest its training split; with ``noise_std`` its training
    inputs, then its test inputs, then its validation inputs, get Gaussian noise from the
    same generator. Its tensors are gathered from
    ``train_x``/``train_y`` and moved to ``device``. The last ``cache_clients`` clients
    built are kept, so a round's clients are gathered once.

    Sizes (:attr:`train_sizes`, :attr:`test_sizes`) cost nothing per client. The K x C
    class counts and the concatenated local test splits need every client's split: one
    pass over the K clients, done once, when first asked for (with no local test split,
    the class counts come from the labels alone).
    """

    def __init__(
        self,
        train_x: np.ndarray,
        train_y: np.ndarray,
        indices: np.ndarray,
        offsets: np.ndarray,
        *,
        num_classes: int,
        seed: int,
        local_test_fraction: float,
        validation_fraction: float = 0.0,
        noise_std: np.ndarray | None = None,
        device: torch.device | str = "cpu",
        cache_clients: int = DEFAULT_CACHE_CLIENTS,
    ) -> None:
        if cache_clients < 1:
            raise ValueError(f"cache_clients must be at least 1, got {cache_clients}")
        self.train_x = train_x
        self.train_y = np.asarray(train_y, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.num_classes = int(num_classes)
        self.seed = seed
        self.noise_std = None if noise_std is None else np.asarray(noise_std, dtype=np.float64)
        self.device = torch.device(device)
        self.cache_clients = int(cache_clients)
        sizes = np.diff(self.offsets)
        self.test_sizes = local_test_sizes(sizes, local_test_fraction)
        """Each client's local test split size (length K)."""
        self.validation_sizes = local_test_sizes(sizes - self.test_sizes, validation_fraction)
        """Each client's validation split size (length K): held out of its training
        samples, never trained on; the global model is evaluated on their union."""
        self.train_sizes = sizes - self.test_sizes - self.validation_sizes
        """Each client's local training split size (length K)."""
        self._cache: OrderedDict[int, ClientData] = OrderedDict()
        self._class_counts: np.ndarray | None = None
        self._test_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> ClientData: ...

    @overload
    def __getitem__(self, index: slice) -> list[ClientData]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        try:
            client_id = operator.index(index)
        except TypeError:
            raise TypeError(f"client ids are integers, got {index!r}") from None
        if client_id < 0:
            client_id += len(self)
        if not 0 <= client_id < len(self):
            raise IndexError(f"client {index} is out of range; the federation has {len(self)} clients")
        client = self._cache.get(client_id)
        if client is None:
            client = self._build(client_id)
            self._cache[client_id] = client
            if len(self._cache) > self.cache_clients:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(client_id)
        return client

    def __iter__(self) -> Iterator[ClientData]:
        for client_id in range(len(self)):
            yield self[client_id]

    # ------------------------------------------------------------------ one client

    def _split(self, client_id: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray, np.ndarray]:
        """Client ``client_id``'s generator (after the shuffle) and its train, test and
        validation ids."""
        rng = np.random.default_rng([self.seed, client_id, SPLIT_STREAM])
        own = self.indices[self.offsets[client_id] : self.offsets[client_id + 1]]
        train_ids, test_ids, validation_ids = shuffled_split(
            own, int(self.test_sizes[client_id]), rng, int(self.validation_sizes[client_id])
        )
        return rng, train_ids, test_ids, validation_ids

    def _inputs(
        self, client_id: int, rng: np.random.Generator, train_ids: np.ndarray, test_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        x_train, x_test = self.train_x[train_ids], self.train_x[test_ids]
        if self.noise_std is not None:
            # Feature skew: the client's inputs, local test split included, carry its noise.
            std = float(self.noise_std[client_id])
            x_train = add_feature_noise(x_train, std, rng)
            x_test = add_feature_noise(x_test, std, rng)
        return x_train, x_test

    def _build(self, client_id: int) -> ClientData:
        rng, train_ids, test_ids, _ = self._split(client_id)
        x_train, x_test = self._inputs(client_id, rng, train_ids, test_ids)
        y_train = self.train_y[train_ids]
        return ClientData(
            client_id=client_id,
            train_x=torch.as_tensor(x_train, dtype=torch.float32).to(self.device),
            train_y=torch.from_numpy(y_train).to(self.device),
            test_x=torch.as_tensor(x_test, dtype=torch.float32).to(self.device),
            test_y=torch.from_numpy(self.train_y[test_ids]).to(self.device),
            class_counts=np.bincount(y_train, minlength=self.num_classes).astype(np.int64),
        )

    # ---------------------------------------------------------------- all clients

    def class_counts(self) -> np.ndarray:
        """The K x C matrix of local training class counts (computed once)."""
        if self._class_counts is None:
            if self.test_sizes.any() or self.validation_sizes.any():
                self._split_every_client()
            else:
                # No held-out split: a client trains on all its samples, in whatever order.
                self._class_counts = counts_by_client(self.train_y, self.indices, self.offsets, self.num_classes)
        assert self._class_counts is not None
        self._class_counts.flags.writeable = False  # shared by every caller
        return self._class_counts

    def local_test_set(self) -> tuple[Tensor, Tensor]:
        """Every client's local test split concatenated in client order (inputs, labels)."""
        if not self.test_sizes.any():
            test_ids = np.zeros(0, dtype=np.int64)
            x = self.train_x[test_ids]
        elif self.noise_std is not None:
            # The test inputs' noise follows the training inputs' in each client's stream.
            parts = [self._build_inputs(k) for k in range(len(self))]
            test_ids = np.concatenate([ids for ids, _ in parts])
            x = np.concatenate([inputs for _, inputs in parts])
        else:
            test_ids = self._split_every_client()
            x = self.train_x[test_ids]
        return (
            torch.as_tensor(x, dtype=torch.float32).to(self.device),
            torch.from_numpy(self.train_y[test_ids]).to(self.device),
        )

    def _build_inputs(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client_id``'s test ids and (noisy) test inputs."""
        rng, train_ids, test_ids, _ = self._split(client_id)
        return test_ids, self._inputs(client_id, rng, train_ids, test_ids)[1]

    def validation_ids(self) -> np.ndarray:
        """Every client's validation ids (rows of ``train_x``), concatenated in client order."""
        if not self.validation_sizes.any():
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self._split(client_id)[3] for client_id in range(len(self))])

    def validation_set(self) -> tuple[Tensor, Tensor]:
        """Every client's validation split concatenated in client order (inputs, labels);
        with ``noise_std``, each client's inputs carry its noise, drawn after its training
        and test inputs' from its generator."""
        ids = self.validation_ids()
        x = self.train_x[ids]
        if self.noise_std is not None and len(ids):
            parts = []
            for client_id in range(len(self)):
                rng, train_ids, test_ids, validation_ids = self._split(client_id)
                self._inputs(client_id, rng, train_ids, test_ids)  # advances rng past their noise
                parts.append(add_feature_noise(self.train_x[validation_ids], float(self.noise_std[client_id]), rng))
            x = np.concatenate(parts)
        return (
            torch.as_tensor(x, dtype=torch.float32).to(self.device),
            torch.from_numpy(self.train_y[ids]).to(self.device),
        )

    def _split_every_client(self) -> np.ndarray:
        """Every client's test ids concatenated in client order, and the class counts:
        one pass over the K clients' split generators, the first time either is asked for."""
        if self._test_ids is not None:
            return self._test_ids
        # The training splits' labels (narrowed), not their ids: a byte a sample for C <= 256.
        train_labels = np.empty(int(self.train_sizes.sum()), dtype=np.min_scalar_type(max(self.num_classes - 1, 0)))
        test_ids = np.empty(int(self.test_sizes.sum()), dtype=np.int64)
        train_at = test_at = 0
        for client_id in range(len(self)):
            _, train, test, _ = self._split(client_id)
            train_labels[train_at : train_at + len(train)] = self.train_y[train]
            test_ids[test_at : test_at + len(test)] = test
            train_at += len(train)
            test_at += len(test)
        train_offsets = np.concatenate([[0], np.cumsum(self.train_sizes)])
        self._class_counts = counts_by_client(train_labels, None, train_offsets, self.num_classes)
        self._test_ids = test_ids
        return test_ids


@dataclass
class Federation:
    """All clients plus the held-out global test set.

    ``clients`` is a list of :class:`ClientData` or a :class:`ClientArrays` (built from
    arrays, client by client on access); both index, iterate and measure the same.
    """

    clients: Sequence[ClientData]
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    dataset_name: str

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def class_counts(self) -> np.ndarray:
        """The K x C matrix of local training class counts."""
        if isinstance(self.clients, ClientArrays):
            return self.clients.class_counts()
        if not len(self.clients):
            return np.zeros((0, self.num_classes), dtype=np.int64)
        return np.stack([client.class_counts for client in self.clients])

    @property
    def client_sizes(self) -> np.ndarray:
        """Each client's local training-set size n_k (length K, int64), without
        building the clients."""
        if isinstance(self.clients, ClientArrays):
            return self.clients.train_sizes.copy()
        return np.array([client.num_samples for client in self.clients], dtype=np.int64)

    def local_test_set(self) -> tuple[Tensor, Tensor, np.ndarray]:
        """Every client's local test split concatenated in client order: inputs, labels
        and each client's test-split size (length K)."""
        if isinstance(self.clients, ClientArrays):
            x, y = self.clients.local_test_set()
            return x, y, self.clients.test_sizes.copy()
        sizes = np.array([client.test_y.shape[0] for client in self.clients], dtype=np.int64)
        if not len(self.clients):
            empty = torch.zeros((0, *self.input_shape), device=self.device)
            return empty, torch.zeros(0, dtype=torch.long, device=self.device), sizes
        x = torch.cat([client.test_x for client in self.clients])
        y = torch.cat([client.test_y for client in self.clients])
        return x, y, sizes

    def validation_set(self) -> tuple[Tensor, Tensor]:
        """The clients' validation splits concatenated in client order (inputs, labels):
        samples held out of their training data (``data.validation_fraction``) to choose
        hyperparameters on, never the test sets. Empty without them (and for a federation
        made in code from :class:`ClientData`, which has none)."""
        if isinstance(self.clients, ClientArrays):
            return self.clients.validation_set()
        empty = torch.zeros((0, *self.input_shape), device=self.device)
        return empty, torch.zeros(0, dtype=torch.long, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.test_x.device
