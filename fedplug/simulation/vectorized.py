"""The vectorised engine: many clients train in lockstep as one batched computation.

Every client of a block holds its own copy of the model: each parameter is one tensor with
a leading "client" dimension. One training step of all of them is a single call of
``torch.func.vmap(torch.func.grad(loss))`` over that dimension, with
``torch.func.functional_call`` running the shared module on each client's parameters. On
a GPU this turns hundreds of tiny per-client kernels into a few large ones.

It computes what :class:`fedplug.simulation.sequential.SequentialEngine` computes (same
samples, same order, same SGD arithmetic), up to floating-point rounding:

- **Data order.** Client k's epochs come from ``sampler.epoch_indices`` called epoch by
  epoch with ``local_rng(seed, round, k)``, exactly as :func:`train_locally` calls it;
  each epoch is cut into batches of ``batch_size``, the last one possibly short.
- **Unequal clients.** Batches are padded to a common width with index 0 and a 0/1 mask;
  a batch's loss is ``sum(mask * per_sample_loss) / sum(mask) + penalties``, which is
  the sequential engine's mean over the real samples. Clients are sorted by their number
  of steps, so at step s the clients that still train are a prefix of the block and the
  step runs on that prefix only: a client that has run out of batches stops updating and
  costs nothing.
- **SGD** is torch.optim.SGD written out: ``d = g + weight_decay * w``; with momentum the
  buffer starts as the first ``d`` and then ``buf = momentum * buf + d`` (no dampening,
  no Nesterov); ``w = w - lr * buf``. Each client starts with a fresh buffer, as it gets a
  fresh optimiser in :func:`train_locally`. Adam is refused by the config.
- **Algorithm contexts.** The loss transform's and the aggregator's per-client contexts
  (dicts of tensors) are stacked along the client dimension; tensors whose first
  dimension differs between clients (per-sample weights of length n_k) are zero-padded to
  the longest. Penalties receive one client's parameters, its anchor (the vector it
  started from) and its context, inside ``vmap``.
- **Chains** (FedGSP) are vectorised across chains and looped along positions: position
  p of every chain trains in lockstep, each starting from the final vector of position
  p - 1 of its own chain.

One batch gather per step: each block keeps its clients' training data concatenated on
the training device, plus a ``[clients, steps, width]`` matrix of indices into it.

Models of ``Flatten``, ``Linear`` and ``ReLU`` layers under plain cross-entropy with no
penalty skip ``vmap``: :mod:`fedplug.simulation.linear_stack` writes their step out as
batched matrix products and applies plain SGD in place.

Memory (what we chose). Chains are processed in blocks of at most
``max_clients_per_block`` (default 1024 on a GPU, 8 on a CPU) clients, further capped so that the block's
estimated footprint fits in ``memory_fraction`` (default 0.5) of the memory available
when the first round starts (free CUDA memory, or the host's available memory). The
estimate per client is a few copies of the model's state (parameters, gradients,
momentum, anchor, context) plus activations measured by one forward pass of a single
sample times the batch width. Chains are sorted by their total number of samples before
blocking, so a block holds clients of similar size and little padding. If a block still
runs out of memory, the clients' states are restored, the block size halves (for the rest
of the run) and the block is retried; any other error turns the block's chains into
:class:`ClientFailure` values, so one bad block does not stop the round.

Timeouts (``train.failures.client_timeout_seconds`` = T, per chain as in the sequential
engine; see :mod:`fedplug.deadline`). Two deadlines, both ``SIGALRM`` in the calling
thread:

- **Per client.** Every call into a client's own code (the sampler's epoch orders, the
  loss transform's and the aggregator's client contexts, ``client_finish``) runs under
  a deadline of T: one call of a client cannot take longer than its whole chain may. If
  it fires, that client is known: its chain fails with the sequential engine's reason
  (``"ClientTimeout: client K ran past ..."``), the block's client states are restored
  (as after an out-of-memory) and the block's other chains are trained again without it.
  This is how a client that hangs is found: within T, whatever the block's size.
- **Per block.** The batched steps run every chain of the block at once (a hang there is
  not one client's), so the whole block of n chains runs under a deadline of n x T, the
  most its chains may take together (each chain is charged its share of the block's
  time). If that fires, the states are restored and the block is retried in halves,
  each under its own deadline, until a chain that runs past T alone is dropped; the
  other chains keep their updates. The block size is not lowered for later rounds (a
  timeout is not a lack of memory).

A retried block trains its chains from the same start vectors and restored states, so
the chains kept have the updates they would have had without the dropped one.

Limits: the model must not contain BatchNorm (the simulator checks) nor draw random
numbers in its forward pass (dropout): vmap is run with ``randomness="error"``. A
parameter that the loss does not use gets a zero gradient here (so weight decay still
moves it), while torch.optim.SGD would skip it; the built-in models use every parameter.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, vmap

from fedplug.components import TRAIN_LOSS, ClientUpdate, Context, LocalTraining, RoundPlan
from fedplug.deadline import ClientTimeout, deadline
from fedplug.errors import ConfigError
from fedplug.run.chains import ChainProgress, start_chains
from fedplug.run.local_training import local_rng, mean_loss
from fedplug.run.round_context import ClientFailure, RoundContext
from fedplug.simulation.linear_stack import LinearStackStep, linear_stack
from fedplug.simulation.sequential import timeout_reason

DEFAULT_MAX_CLIENTS_PER_BLOCK = 1024
"""Most clients trained in lockstep at once on a GPU (the memory budget may allow fewer):
a block of 128 small clients is too little work per step to keep a large GPU busy."""

DEFAULT_CPU_CLIENTS_PER_BLOCK = 8
"""Most clients trained in lockstep at once on a CPU: the block's weights, gradients and
activations stay in the core's caches (a block of 100 ``mlp`` clients, 80 MB of weights,
streams from memory at every step and is slower than one client after another)."""

DEFAULT_MEMORY_FRACTION = 0.5
"""Share of the available memory a block may use (the rest is left for everything else)."""

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


def _slice_tree(tree: Any, count: int) -> Any:
    """The first ``count`` clients of a stacked context (dicts of tensors)."""
    if isinstance(tree, dict):
        return {key: _slice_tree(value, count) for key, value in tree.items()}
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
    """Rough peak memory of one client in a block (see the module docstring)."""
    state_bytes = sum(parameter.numel() * 4 for parameter in model.parameters())
    copies = STATE_COPIES + int(momentum) + 2 * int(penalty)  # penalty: anchor and a context vector
    activations = (
        ACTIVATION_COPIES * batch_width * activation_bytes_per_sample(model, input_shape, device)
    )
    inputs = batch_width * 4 * math.prod(input_shape)
    return copies * state_bytes + activations + inputs


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in message or "can't allocate memory" in message
    )


# ------------------------------------------------------------------------ timeouts


class _ClientHung(Exception):
    """One client's own code ran past the chain's limit (the per-client deadline)."""

    def __init__(self, client_id: int, timeout: ClientTimeout) -> None:
        super().__init__(str(timeout))
        self.client_id = client_id
        self.timeout = timeout


@contextmanager
def _client_code(client_id: int, seconds: float | None) -> Iterator[None]:
    """Run a call into client ``client_id``'s code under the per-client deadline; its
    firing becomes :class:`_ClientHung` (the block's own deadline passes through)."""
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
        raise _ClientHung(client_id, error) from None


# ------------------------------------------------------------------------ the engine


@dataclass
class _Member:
    """One client of a lockstep group: which chain it belongs to and where it starts."""

    chain_index: int
    client_id: int
    start: Tensor


@dataclass
class VectorizedEngine:
    """Trains a round's chains in lockstep with ``torch.func.vmap`` over clients.

    Args:
        model: the module whose structure every client shares (its own values are
            never changed). Must not contain BatchNorm.
        max_clients_per_block: most clients trained at once (default 1024 on a GPU,
            :data:`DEFAULT_CPU_CLIENTS_PER_BLOCK` on a CPU).
        memory_fraction: share of the available memory a block may use (default 0.5);
            the block size is the smaller of this bound and ``max_clients_per_block``.
    """

    model: nn.Module
    max_clients_per_block: int | None = None
    memory_fraction: float = DEFAULT_MEMORY_FRACTION

    name = "vectorized"

    def derived_params(self) -> dict[str, Any]:
        """The engine's entries in the run's derived params (none)."""
        return {}

    def close(self) -> None:
        """Nothing to stop: this engine trains in the calling process."""

    def __post_init__(self) -> None:
        from fedplug.models.zoo import has_batch_norm

        if has_batch_norm(self.model):
            raise ConfigError(
                "the vectorised engine cannot train a model with BatchNorm (its statistics "
                "are per batch, not per client); use train.engine 'sequential'"
            )
        if self.max_clients_per_block is not None and self.max_clients_per_block < 1:
            raise ConfigError(
                f"max_clients_per_block must be at least 1, got {self.max_clients_per_block}"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        self.block_size: int | None = None
        """Clients per block, fixed at the first round (halved after an out-of-memory)."""
        self._training: list[int] = []
        """The clients of the chain position being trained (names a timed-out chain's member)."""
        self._parameter_names = [name for name, _ in self.model.named_parameters()]
        self._parameter_shapes = [tuple(p.shape) for _, p in self.model.named_parameters()]
        buffers = [(name, b) for name, b in self.model.named_buffers() if b.is_floating_point()]
        self._buffer_names = [name for name, _ in buffers]
        self._buffer_shapes = [tuple(b.shape) for _, b in buffers]
        self._num_parameter_elements = sum(math.prod(shape) for shape in self._parameter_shapes)
        layers = linear_stack(self.model)
        self._analytic_step = LinearStackStep(layers) if layers is not None and not buffers else None
        """Steps of a Linear/ReLU model under plain cross-entropy (see linear_stack)."""
        self.analytic_groups = 0
        """Groups trained on the analytic path (the rest went through ``vmap``)."""

    # -------------------------------------------------------------------- the round

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> Iterator[ClientUpdate | ClientFailure]:
        """Train every chain of ``plan``; yield one update (or failure) per chain, block
        by block, so the aggregator can keep a running sum."""
        if not plan.chains:
            return
        block_size = self._block_size(context)
        client_sizes = context.federation.client_sizes
        sizes = [int(client_sizes[chain].sum()) for chain in plan.chains]
        # Largest chains first, so that a block holds chains of similar length.
        by_size = sorted(range(len(plan.chains)), key=lambda index: -sizes[index])
        pending: deque[list[int]] = deque(
            by_size[offset : offset + block_size] for offset in range(0, len(by_size), block_size)
        )
        timeout = context.client_timeout
        while pending:
            block = pending.popleft()
            chains = [plan.chains[index] for index in block]
            members = [client for chain in chains for client in chain]
            saved_states = context.save(members)
            started = time.perf_counter()
            self._training = []
            try:
                with deadline(
                    timeout * len(block) if timeout is not None else None,
                    f"a vectorised block of {len(block)} chains",
                ):
                    progress = self._train_block(start_vector, chains, plan, round_index, context)
            except _ClientHung as hung:  # that client's chain fails; the others train again
                context.restore(members, saved_states)
                culprit = next(n for n, chain in enumerate(chains) if hung.client_id in chain)
                rest = block[:culprit] + block[culprit + 1 :]
                if rest:
                    pending.appendleft(rest)
                chain = chains[culprit]
                yield ClientFailure(list(chain), timeout_reason(hung.client_id, chain, hung.timeout))
                continue
            except ClientTimeout as error:  # the block as a whole: halves, down to one chain
                context.restore(members, saved_states)
                if len(block) > 1:
                    half = (len(block) + 1) // 2
                    pending.appendleft(block[half:])
                    pending.appendleft(block[:half])
                    continue
                client_id = self._training[0] if self._training else chains[0][-1]
                yield ClientFailure(list(chains[0]), timeout_reason(client_id, chains[0], error))
                continue
            except Exception as error:  # noqa: BLE001 (a failing block must not stop the round)
                if _is_out_of_memory(error) and len(block) > 1:
                    context.restore(members, saved_states)
                    half = (len(block) + 1) // 2
                    self.block_size = min(self.block_size or half, half)
                    pending.appendleft(block[half:])
                    pending.appendleft(block[:half])
                    continue
                reason = (
                    f"{type(error).__name__} in a vectorised block of {len(block)} chains: {error}"
                )
                for chain in chains:
                    yield ClientFailure(list(chain), reason)
                continue
            seconds = time.perf_counter() - started
            total_steps = sum(item.steps for item in progress)
            for chain, item in zip(chains, progress):
                if item.failure is not None:
                    yield ClientFailure(list(chain), item.failure)
                    continue
                # Chains of a block run simultaneously; each is charged its share of the
                # block's time in proportion to its steps.
                share = item.steps / total_steps if total_steps else 1.0 / len(chains)
                yield context.make_update(
                    list(chain),
                    item.vector,
                    item.samples,
                    item.steps,
                    item.extras,
                    plan,
                    seconds * share,
                    item.metrics,
                )

    def _analytic(self, context: RoundContext) -> bool:
        """Whether this round's steps take the analytic path (:mod:`linear_stack`)."""
        algorithm = context.algorithm
        return self._analytic_step is not None and algorithm.plain_cross_entropy and not algorithm.has_penalty

    def _block_size(self, context: RoundContext) -> int:
        if self.block_size is None:
            device = context.federation.device
            optimizer = context.schedule.optimizer
            per_client = estimate_bytes_per_client(
                self.model,
                tuple(context.federation.input_shape),
                context.schedule.batch_size,
                device,
                momentum=optimizer.momentum != 0,
                penalty=context.algorithm.has_penalty,
            )
            fits = int(self.memory_fraction * available_bytes(device)) // max(per_client, 1)
            most = self.max_clients_per_block
            if most is None:
                most = DEFAULT_MAX_CLIENTS_PER_BLOCK if device.type == "cuda" else DEFAULT_CPU_CLIENTS_PER_BLOCK
            self.block_size = max(1, min(most, fits))
        return self.block_size

    def _train_block(
        self, start_vector: Tensor, chains: list[list[int]], plan: RoundPlan, round_index: int, context: RoundContext
    ) -> list[ChainProgress]:
        """Train ``chains`` position by position: the chains' members at one position
        train together, each from its own chain's model; a chain stops at a member whose
        model cannot be handed on (:meth:`ChainProgress.stop_if_unusable`)."""
        progress = start_chains(chains, start_vector)
        while active := [index for index, item in enumerate(progress) if not item.done]:
            members = [_Member(index, progress[index].current, progress[index].vector) for index in active]
            self._training = [member.client_id for member in members]
            end_vectors, steps, metrics = self._train_group(members, round_index, context)
            optimizer = context.schedule.optimizer
            for member, end_vector, num_steps, member_metrics in zip(
                members, end_vectors, steps, metrics
            ):
                client_id = member.client_id
                training = LocalTraining(
                    num_steps=num_steps, learning_rate=optimizer.lr, momentum=optimizer.momentum
                )
                with _client_code(client_id, context.client_timeout):
                    extras = context.algorithm.aggregator.client_finish(
                        member.start,
                        end_vector,
                        training,
                        context.payload,
                        context.client_state(client_id),
                    )
                chain = progress[member.chain_index]
                chain.advance(
                    end_vector,
                    context.federation.clients[client_id].num_samples,
                    num_steps,
                    0.0,
                    extras,
                    member_metrics,
                )
                chain.stop_if_unusable(plan, context.client_timeout)
        return progress

    # -------------------------------------------------------------------- one group

    def _train_group(
        self, members: Sequence[_Member], round_index: int, context: RoundContext
    ) -> tuple[list[Tensor], list[int], list[dict[str, float]]]:
        """Train each member from its own start vector on its own data, in lockstep.

        Returns every member's final vector, number of steps and reply metrics
        (``context.reply_metrics``: its own mean training loss, summed per client on the
        device and read once at the end), in ``members`` order.
        """
        federation, algorithm, schedule = context.federation, context.algorithm, context.schedule
        device = federation.device
        clients = [federation.clients[member.client_id] for member in members]
        timeout = context.client_timeout
        orders = []
        for member, client in zip(members, clients):
            rng = local_rng(context.seed, round_index, member.client_id)
            labels = client.train_y.cpu().numpy()
            with _client_code(member.client_id, timeout):
                orders.append(
                    [
                        algorithm.sampler.epoch_indices(labels, client.class_counts, round_index, rng)
                        for _ in range(schedule.local_epochs)
                    ]
                )
        plan = batch_plan(orders, schedule.batch_size)
        # Most steps first: the clients still training at step s are then a prefix.
        rank = np.argsort(-plan.steps, kind="stable")
        steps = plan.steps[rank]
        sorted_clients = [clients[n] for n in rank]
        sizes = np.array([client.num_samples for client in sorted_clients], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        data_x = torch.cat([client.train_x for client in sorted_clients])
        data_y = torch.cat([client.train_y for client in sorted_clients])
        local_ids = torch.from_numpy(plan.local_ids[rank]).to(device)
        global_ids = local_ids + torch.from_numpy(offsets).to(device).view(-1, 1, 1)
        mask = torch.from_numpy(plan.mask[rank]).to(device)
        # Real samples come first in every batch row: at each step, the columns past the
        # longest row still training are padding only and are not computed.
        real = plan.mask[rank].sum(axis=2)

        starts = [members[n].start for n in rank]
        if all(start is starts[0] for start in starts):  # a round's first position: one start
            vectors = starts[0].to(device, torch.float32).unsqueeze(0).expand(len(starts), -1)
        else:
            vectors = torch.stack([start.to(device, torch.float32) for start in starts])
        # One contiguous [clients, *shape] tensor per parameter: batched matmuls run on
        # contiguous weights, and the SGD update is a handful of foreach ops on them.
        params = self._unflatten(vectors, self._parameter_names, self._parameter_shapes, 0)
        buffers = self._unflatten(
            vectors, self._buffer_names, self._buffer_shapes, self._num_parameter_elements
        )
        del vectors, starts
        anchor = (
            {name: tensor.clone() for name, tensor in params.items()}
            if algorithm.has_penalty
            else {}
        )
        member_loss_contexts, member_aggregator_contexts = [], []
        for n in rank:
            client_id = members[n].client_id
            with _client_code(client_id, timeout):
                member_loss_contexts.append(context.loss_context(client_id))
                member_aggregator_contexts.append(
                    algorithm.aggregator.client_context(context.payload, context.client_state(client_id))
                )
        loss_contexts = stack_contexts(member_loss_contexts, "loss_transform.client_context")
        aggregator_contexts = stack_contexts(member_aggregator_contexts, "aggregator.client_context")
        optimizer = schedule.optimizer
        momentum_buffers = (
            [torch.zeros_like(tensor) for tensor in params.values()]
            if optimizer.momentum != 0
            else None
        )
        report_loss = TRAIN_LOSS in context.reply_metrics
        analytic = self._analytic_step if self._analytic(context) else None
        # Plain SGD steps in place on the analytic path (no gradient tensors).
        in_place_lr = optimizer.lr if optimizer.momentum == 0 and optimizer.weight_decay == 0 else None
        step_gradient = self._step_gradient(context, with_loss=report_loss) if analytic is None else None
        self.analytic_groups += analytic is not None
        loss_sums = (
            torch.zeros(len(members), dtype=torch.float64, device=device) if report_loss else None
        )
        if analytic is None:  # functional_call runs the modules (the analytic path does not)
            self.model.train()

        active = -1
        for step in range(int(steps[0]) if len(steps) else 0):
            count = int(np.count_nonzero(steps > step))
            if count != active:
                active = count
                params_now = _slice_tree(params, active)
                buffers_now = _slice_tree(buffers, active)
                anchor_now = _slice_tree(anchor, active)
                loss_now = _slice_tree(loss_contexts, active)
                aggregator_now = _slice_tree(aggregator_contexts, active)
                weights = list(params_now.values())
                buffers_list = (
                    [buffer[:active] for buffer in momentum_buffers]
                    if momentum_buffers is not None
                    else []
                )
            width = max(1, int(real[:active, step].max()))
            batch = global_ids[:active, step, :width]
            step_mask = mask[:active, step, :width]
            if analytic is not None:
                gradients, losses = analytic(params_now, data_x[batch], data_y[batch], step_mask, in_place_lr)
                if loss_sums is not None:
                    loss_sums[:active] += losses
                if gradients is None:  # stepped in place
                    continue
            else:
                step_result = step_gradient(
                    params_now,
                    buffers_now,
                    anchor_now,
                    data_x[batch],
                    data_y[batch],
                    local_ids[:active, step, :width],
                    step_mask,
                    loss_now,
                    aggregator_now,
                )
                if loss_sums is not None:
                    gradients, losses = step_result
                    loss_sums[:active] += losses.detach()
                else:
                    gradients = step_result
            # torch.optim.SGD's arithmetic (no dampening, no Nesterov), per client.
            updates = [gradients[name] for name in self._parameter_names]
            if optimizer.weight_decay != 0:
                updates = list(torch._foreach_add(updates, weights, alpha=optimizer.weight_decay))
            if momentum_buffers is not None:
                if step == 0:  # the buffer starts as the first gradient
                    torch._foreach_copy_(buffers_list, updates)
                else:
                    torch._foreach_mul_(buffers_list, optimizer.momentum)
                    torch._foreach_add_(buffers_list, updates)
                updates = buffers_list
            torch._foreach_add_(weights, updates, alpha=-optimizer.lr)

        num_members = len(members)
        flat = [tensor.reshape(num_members, -1) for tensor in (*params.values(), *buffers.values())]
        step_counts = [0] * num_members
        metrics: list[dict[str, float]] = [{} for _ in range(num_members)]
        sums = loss_sums.tolist() if loss_sums is not None else None  # the one sync
        end_vectors: list[Tensor] = [torch.zeros(0, device=device)] * num_members
        for position, n in enumerate(rank):
            if flat:  # one copy: the client's rows of every parameter, concatenated
                end_vectors[n] = torch.cat([tensor[position] for tensor in flat])
            step_counts[n] = int(steps[position])
            if sums is not None:
                metrics[n] = {TRAIN_LOSS: mean_loss(sums[position], step_counts[n])}
        return end_vectors, step_counts, metrics

    @staticmethod
    def _unflatten(
        flat: Tensor, names: list[str], shapes: list[tuple[int, ...]], offset: int
    ) -> dict[str, Tensor]:
        """Contiguous copies of ``flat[:, offset:]`` (``[clients, elements]``), one
        ``[clients, *shape]`` tensor per name."""
        out: dict[str, Tensor] = {}
        for name, shape in zip(names, shapes):
            count = math.prod(shape)
            out[name] = (
                flat[:, offset : offset + count]
                .reshape(flat.shape[0], *shape)
                .clone(memory_format=torch.contiguous_format)
            )
            offset += count
        return out

    def _step_gradient(self, context: RoundContext, with_loss: bool = False) -> Callable[..., Any]:
        """``vmap(grad(loss))``: every active client's gradient for its own batch; with
        ``with_loss``, ``vmap(grad_and_value(loss))``: the gradients and each client's
        batch loss."""
        model = self.model
        algorithm = context.algorithm
        loss_transform = algorithm.loss_transform
        aggregator = algorithm.aggregator
        has_penalty = algorithm.has_penalty

        def client_loss(
            params: dict[str, Tensor],
            buffers: dict[str, Tensor],
            anchor: dict[str, Tensor],
            inputs: Tensor,
            targets: Tensor,
            sample_ids: Tensor,
            mask: Tensor,
            loss_context: Context,
            aggregator_context: Context,
        ) -> Tensor:
            logits = functional_call(model, (params, buffers), (inputs,))
            per_sample = loss_transform.per_sample_loss(logits, targets, sample_ids, loss_context)
            loss = (per_sample * mask).sum() / mask.sum().clamp_min(1.0)
            if has_penalty:
                for term in (
                    loss_transform.penalty(params, anchor, loss_context),
                    aggregator.client_penalty(params, anchor, aggregator_context),
                ):
                    if term is not None:
                        loss = loss + term
            return loss

        if with_loss:
            return vmap(grad_and_value(client_loss), randomness="error")
        return vmap(grad(client_loss), randomness="error")
