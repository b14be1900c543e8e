"""What the vectorised engine needs to form a block of clients trained in lockstep.

Each client's batches padded to common sizes (:func:`batch_plan`), the clients' contexts
stacked along a client dimension (:func:`stack_contexts`), the memory one client of a
block takes (:func:`estimate_bytes_per_client`), and the per-client deadline that finds a
client whose own code hangs (:func:`client_code`). docs/engines.md says how the engine
uses them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedplug.components import Context
from fedplug.deadline import ClientTimeout, deadline

FALLBACK_HOST_MEMORY = 4 * 2**30
"""Host memory assumed available when the operating system does not say (bytes)."""

STATE_COPIES = 4
"""Copies of the model state every client holds during a group: its parameters, their
gradients, the weight-decayed gradient, and the stacked start / final vectors."""

ACTIVATION_COPIES = 3
"""Activation memory per sample relative to the forward outputs: saved for backward,
their gradients, and temporaries."""


# ------------------------------------------------------------------------ batch plans


@dataclass(frozen=True)
class BatchPlan:
    """Every step of a group of clients, padded to common sizes.

    ``local_ids[n, s, j]`` is the j-th sample (an index into client n's own training set)
    of client n's s-th batch, 0 where ``mask[n, s, j]`` is 0 (padding); ``steps[n]`` is
    the number of batches of client n.
    """

    local_ids: np.ndarray
    mask: np.ndarray
    steps: np.ndarray


def epoch_batches(order: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut one epoch's ``order`` into batches of ``batch_size`` (the last may be short),
    as ``torch.split`` does: returns ``(ids, mask)`` of shape ``[ceil(L / B), B]``."""
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    num_batches = math.ceil(order.size / batch_size)
    ids = np.zeros(num_batches * batch_size, dtype=np.int64)
    mask = np.zeros(num_batches * batch_size, dtype=np.float32)
    ids[: order.size] = order
    mask[: order.size] = 1.0
    return ids.reshape(num_batches, batch_size), mask.reshape(num_batches, batch_size)


def batch_plan(orders: Sequence[Sequence[np.ndarray]], batch_size: int) -> BatchPlan:
    """Stack the batches of several clients; ``orders[n]`` holds client n's epoch orders.

    The width is ``batch_size``, or the longest epoch when every epoch is shorter (no
    column is all padding).
    """
    per_client = [[epoch_batches(order, batch_size) for order in epochs] for epochs in orders]
    steps = np.array(
        [sum(ids.shape[0] for ids, _ in batches) for batches in per_client], dtype=np.int64
    )
    longest = max((np.asarray(order).size for epochs in orders for order in epochs), default=0)
    width = max(1, min(batch_size, longest))
    num_steps = int(steps.max(initial=0))
    local_ids = np.zeros((len(orders), num_steps, width), dtype=np.int64)
    mask = np.zeros((len(orders), num_steps, width), dtype=np.float32)
    for n, batches in enumerate(per_client):
        if steps[n] == 0:
            continue
        local_ids[n, : steps[n]] = np.concatenate([ids for ids, _ in batches])[:, :width]
        mask[n, : steps[n]] = np.concatenate([masks for _, masks in batches])[:, :width]
    return BatchPlan(local_ids, mask, steps)


# ------------------------------------------------------------------------ contexts


def stack_contexts(contexts: Sequence[Context], path: str = "context") -> Context:
    """Stack per-client contexts along a new leading client dimension.

    Every context must have the same keys; values are tensors or nested dicts of them.
    Tensors of equal shape are stacked; tensors whose first dimension differs (per-sample
    weights of length n_k) are zero-padded to the longest first. ``path`` names the
    context in error messages.

    Raises:
        TypeError: keys differ, a value is not a tensor or dict, or shapes differ in
            more than the first dimension.
    """
    if not contexts:
        return {}
    keys = list(contexts[0])
    for other in contexts[1:]:
        if list(other) != keys:
            raise TypeError(f"{path}: clients returned different keys ({keys} vs {list(other)})")
    stacked: Context = {}
    for key in keys:
        values = [context[key] for context in contexts]
        where = f"{path}[{key!r}]"
        if all(isinstance(value, dict) for value in values):
            stacked[key] = stack_contexts(values, where)
        elif all(isinstance(value, Tensor) for value in values):
            stacked[key] = _stack_padded(values, where)
        else:
            kinds = sorted({type(value).__name__ for value in values})
            raise TypeError(
                f"{where} holds {', '.join(kinds)}; the vectorised engine stacks contexts "
                "across clients, so every value must be a tensor (or a dict of tensors)"
            )
    return stacked


def _stack_padded(values: list[Tensor], where: str) -> Tensor:
    shapes = {tuple(value.shape) for value in values}
    if len(shapes) == 1:
        return torch.stack(values)
    if (
        any(value.dim() == 0 for value in values)
        or len({tuple(value.shape[1:]) for value in values}) > 1
    ):
        raise TypeError(
            f"{where} has shapes {sorted(shapes)} across clients; only the first dimension "
            "may differ (it is zero-padded to the longest)"
        )
    longest = max(int(value.shape[0]) for value in values)
    padded = values[0].new_zeros((len(values), longest, *values[0].shape[1:]))
    for n, value in enumerate(values):
        padded[n, : value.shape[0]] = value
    return padded


def slice_clients(tree: Any, count: int) -> Any:
    """The first ``count`` clients of a stacked context (dicts of tensors)."""
    if isinstance(tree, dict):
        return {key: slice_clients(value, count) for key, value in tree.items()}
    return tree[:count]


# ------------------------------------------------------------------------ memory


def host_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, or :data:`FALLBACK_HOST_MEMORY`."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return FALLBACK_HOST_MEMORY


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (CUDA: ``torch.cuda.mem_get_info``; else the host's)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


@torch.no_grad()
def activation_bytes_per_sample(
    model: nn.Module, input_shape: tuple[int, ...], device: torch.device
) -> int:
    """Bytes of every module's forward output for one sample (a proxy for activations)."""
    total = 0

    def count(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal total
        if isinstance(output, Tensor):
            total += output.numel() * output.element_size()

    handles = [
        module.register_forward_hook(count) for module in model.modules() if module is not model
    ]
    try:
        model(torch.zeros((1, *input_shape), device=device))
    finally:
        for handle in handles:
            handle.remove()
    return total


def estimate_bytes_per_client(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch_width: int,
    device: torch.device,
    *,
    momentum: bool,
    penalty: bool,
) -> int:
    """Rough peak memory of one client in a block: a few copies of the model's state
    (parameters, gradients, momentum, anchor, context) plus the activations of one sample
    times the batch width."""
    state_bytes = sum(parameter.numel() * 4 for parameter in model.parameters())
    copies = STATE_COPIES + int(momentum) + 2 * int(penalty)  # penalty: anchor and a context vector
    activations = (
        ACTIVATION_COPIES * batch_width * activation_bytes_per_sample(model, input_shape, device)
    )
    inputs = batch_width * 4 * math.prod(input_shape)
    return copies * state_bytes + activations + inputs


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is CUDA's or the host allocator's out-of-memory error."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in message or "can't allocate memory" in message
    )


# ------------------------------------------------------------------------ timeouts


class ClientHung(Exception):
    """One client's own code ran past the chain's limit (the per-client deadline)."""

    def __init__(self, client_id: int, timeout: ClientTimeout) -> None:
        super().__init__(str(timeout))
        self.client_id = client_id
        self.timeout = timeout


@contextmanager
def client_code(client_id: int, seconds: float | None) -> Iterator[None]:
    """Run a call into client ``client_id``'s code under the per-client deadline; its
    firing becomes :class:`ClientHung` (the block's own deadline passes through)."""
    if seconds is None:
        yield
        return
    what = f"client {client_id}"
    try:
        with deadline(seconds, what):
            yield
    except ClientTimeout as error:
        if error.what != what:  # the block's deadline, which had less time left
            raise
        raise ClientHung(client_id, error) from None
