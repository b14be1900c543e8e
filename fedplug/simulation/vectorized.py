"""The vectorised engine: many clients train in lockstep as one batched computation.

Every client of a block holds its own copy of the model (each parameter gets a leading
"client" dimension), and one training step of all of them is one
``torch.func.vmap(torch.func.grad(loss))`` call. It computes what
:class:`fedplug.simulation.sequential.SequentialEngine` computes, up to floating-point
rounding; how (data order, padding, SGD, chains, memory, timeouts, limits) is in
docs/engines.md. The pieces a block is built from are in
:mod:`fedplug.simulation.vectorized_blocks`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
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
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure
from fedplug.simulation.linear_stack import LinearStackStep, linear_stack
from fedplug.simulation.sequential import timeout_reason
from fedplug.simulation.vectorized_blocks import (
    ClientHung,
    available_bytes,
    batch_plan,
    client_code,
    estimate_bytes_per_client,
    is_out_of_memory,
    slice_clients,
    stack_contexts,
)

DEFAULT_MAX_CLIENTS_PER_BLOCK = 1024
"""Most clients trained in lockstep at once on a GPU (the memory budget may allow fewer):
a block of 128 small clients is too little work per step to keep a large GPU busy."""

DEFAULT_CPU_CLIENTS_PER_BLOCK = 8
"""Most clients trained in lockstep at once on a CPU: the block's weights, gradients and
activations stay in the core's caches (a block of 100 ``mlp`` clients, 80 MB of weights,
streams from memory at every step and is slower than one client after another)."""

DEFAULT_MEMORY_FRACTION = 0.5
"""Share of the available memory a block may use (the rest is left for everything else)."""

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
            except ClientHung as hung:  # that client's chain fails; the others train again
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
                if is_out_of_memory(error) and len(block) > 1:
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
                with client_code(client_id, context.client_timeout):
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
            with client_code(member.client_id, timeout):
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
            with client_code(client_id, timeout):
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
                params_now = slice_clients(params, active)
                buffers_now = slice_clients(buffers, active)
                anchor_now = slice_clients(anchor, active)
                loss_now = slice_clients(loss_contexts, active)
                aggregator_now = slice_clients(aggregator_contexts, active)
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
