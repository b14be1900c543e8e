"""The parallel engine's worker process, and the messages it exchanges with the pool.

A worker (:func:`serve`) is forked by :class:`fedplug.simulation.parallel.ParallelEngine`;
it trains the chains whose indices arrive on its pipe with the sequential engine's
:func:`~fedplug.simulation.sequential.train_chain`, then evaluates batches while it stands
by. Messages are pickled with tensors as numpy arrays (:func:`dumps`). docs/engines.md
says how the pool and its workers share a round.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import Tensor, nn

from fedplug.components import ClientUpdate, Context, RoundPlan
from fedplug.run.evaluation import Batch, BatchResult, Evaluator
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure
from fedplug.run.vectors import vector_to_model
from fedplug.simulation.sequential import train_chain

KEEP_FREED_BYTES = 1 << 30
"""A worker's C allocator keeps freed blocks up to this size for reuse (see
:func:`keep_freed_memory`)."""

NUMPY_DTYPES = frozenset(
    {
        torch.float16, torch.float32, torch.float64,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    }
)


# ------------------------------------------------------------------------ messages


class TensorPickler(pickle.Pickler):
    """Pickles plain CPU tensors as numpy arrays: about 3x faster than torch's own
    pickling (which writes a zip archive per tensor), and a view carries only its own
    elements, not its whole storage."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is Tensor
            and obj.layout is torch.strided
            and obj.device.type == "cpu"
            and obj.dtype in NUMPY_DTYPES
            and not obj.requires_grad  # torch's own pickling keeps the flag
        ):
            return torch.from_numpy, (obj.detach().numpy(),)
        return NotImplemented


def dumps(value: Any) -> bytes:
    """``value`` pickled for a pipe, plain CPU tensors as numpy arrays (:class:`TensorPickler`)."""
    buffer = io.BytesIO()
    TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


@dataclass
class ChainResult:
    """What a worker sends back for one chain."""

    index: int
    """The chain's position in ``plan.chains``."""
    outcome: ClientUpdate | ClientFailure
    client_states: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    """The chain's clients' states after training (those that have one)."""
    loss_contexts: dict[int, Context] = field(default_factory=dict)
    """Loss contexts the worker computed (not cached when it was forked)."""


@dataclass
class RoundState:
    """What a standing-by worker needs to train the next round as a worker forked for it
    would: everything of the main process that training reads and that may have changed."""

    start_vector: Tensor
    plan: RoundPlan
    round_index: int
    algorithm: Any
    """``context.algorithm`` (sampler, loss transform, aggregator, with their state)."""
    payload: dict[str, Tensor]
    client_states: dict[int, dict[str, Tensor] | None]
    """The round's clients' states (``None``: the client has none)."""
    fields: dict[str, Any]
    """The round context's other settings (seed, schedule, reply metrics, timeout)."""


@dataclass
class NextRound:
    state: bytes
    """A pickled :class:`RoundState`, the same for every worker."""
    loss_contexts: dict[int, Context]
    """Cached loss contexts of the round's clients that this worker lacks."""


@dataclass
class LoadModel:
    """To a worker standing by after its round: evaluate this global model next."""

    vector: Tensor


@dataclass
class EvaluateBatch:
    index: int
    """The batch's position in the evaluation's list."""
    batch: Batch


@dataclass
class BatchDone:
    """What a worker sends back for one evaluation batch (``None``: it raised; the main
    process computes that batch itself, and raises the same error there)."""

    index: int
    result: BatchResult | None


# ------------------------------------------------------------------------ worker side


def keep_freed_memory() -> None:
    """Let this process's C allocator (glibc) reuse freed blocks of up to
    :data:`KEEP_FREED_BYTES` instead of returning them to the system.

    By default a block over 32 MiB (an evaluation batch's activations: 1000 images
    through ``cnn_mnist``'s first convolution take 100 MiB) is mapped fresh for every
    batch and unmapped after it, so each batch page-faults its memory in again: about half
    of a CNN evaluation's CPU time, spent in the kernel. The numbers computed do not
    change (torch aligns every tensor to 64 bytes either way); the worker's memory stays
    at its peak until it exits. Nothing happens on a C library without ``mallopt``.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS)
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, KEEP_FREED_BYTES)
    mallopt(m_trim_threshold, KEEP_FREED_BYTES)


def serve(
    connection: Connection,
    foreign: list[Connection],
    model: nn.Module,
    start_vector: Tensor,
    plan: RoundPlan,
    round_index: int,
    context: RoundContext,
    evaluator: Evaluator | None,
) -> None:
    """A worker: train the chains whose indices arrive on ``connection``, then (standing by
    after the round) evaluate the batches that arrive, until the connection closes."""
    for other in foreign:  # other pipes' main-process ends, inherited through fork
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops the workers
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held across fork (_fork)
    torch.set_num_threads(1)
    keep_freed_memory()
    cached = set(context.loss_contexts)
    while True:
        try:
            message = connection.recv()
        except EOFError:  # dismissed
            return
        if isinstance(message, NextRound):  # a standing-by worker is reused
            state: RoundState = pickle.loads(message.state)
            start_vector, plan, round_index = state.start_vector, state.plan, state.round_index
            context.algorithm, context.payload = state.algorithm, state.payload
            for name, value in state.fields.items():
                setattr(context, name, value)
            for client, client_state in state.client_states.items():
                if client_state is None:
                    context.client_states.pop(client, None)
                else:
                    context.client_states[client] = client_state
            context.loss_contexts.update(message.loss_contexts)
            cached.update(message.loss_contexts)
            continue
        if isinstance(message, LoadModel):  # the round is over: evaluation follows
            vector_to_model(message.vector, model)
            model.eval()
            continue
        if isinstance(message, EvaluateBatch):
            assert evaluator is not None
            try:
                result = evaluator.predict(model, message.batch)
            except Exception:  # noqa: BLE001 - the main process computes it again and raises
                result = None
            connection.send_bytes(dumps(BatchDone(message.index, result)))
            continue
        index = message
        chain = plan.chains[index]
        outcome = train_chain(model, start_vector, chain, plan, round_index, context)
        states = {k: context.client_states[k] for k in chain if k in context.client_states}
        computed = {k: context.loss_contexts[k] for k in chain if k in context.loss_contexts and k not in cached}
        cached.update(computed)
        try:
            message = dumps(ChainResult(index, outcome, states, computed))
        except Exception as error:  # noqa: BLE001 - an extra that cannot be pickled fails its chain only
            failure = ClientFailure(chain, f"{type(error).__name__}: cannot send the result back: {error}")
            message = dumps(ChainResult(index, failure))
        connection.send_bytes(message)
