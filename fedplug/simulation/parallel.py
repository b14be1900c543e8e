"""The parallel engine: the chains of a round trained in W forked CPU processes.

On a CPU the sequential engine trains one client after another on one torch thread, and
more intra-op threads do not help small models (an ``mlp`` step at batch 10 is a few
tiny matrix products). Like Flower's simulation, which runs one client actor per CPU,
this engine trains W chains at once, one per worker process with one torch thread each,
and gives the same results as :class:`fedplug.simulation.sequential.SequentialEngine`,
bit for bit:

- **The same arithmetic.** A worker trains a chain with
  :func:`fedplug.simulation.sequential.train_chain`, the sequential engine's own loop, on
  the same start vector, and a client's randomness depends only on (seed, round, client)
  (:func:`fedplug.simulation.local_training.local_rng`), not on which process trains it.
- **The same order.** Results are yielded in plan order, whatever order they finish in,
  so the aggregator's running sums add the same numbers in the same order.
- **The same state.** A chain's updated client states (SCAFFOLD's c_k, changed in place
  by the aggregator's client side) travel back with its update and are written into
  ``context.client_states`` just before the update is yielded, so the next round, a
  retried round and the checkpoint see what the sequential engine would leave. Loss
  contexts a worker computes travel back too and are cached, as the sequential engine
  caches them, so later rounds do not compute them again.

How (what we chose). Every round forks W fresh workers
(``multiprocessing.get_context("fork")``): a forked worker sees the current global
vector, payload, client states and loss-transform state as they are, with nothing to
send, and the federation's tensors are shared copy-on-write. The forked copy of the
engine's model is the worker's model. The main process hands out chain indices, keeping
each worker :data:`QUEUED_CHAINS_PER_WORKER` ahead (one training, one waiting), so a
worker never idles while the main process aggregates, and uneven chains balance
themselves: whichever worker is free takes the next chain. Results come back through one
pipe per worker, tensors pickled as numpy arrays (a copy of only their own elements).
Results that arrive ahead of plan order wait in the main process until their turn; with
similar chains that is a few models, at worst one per chain of the round.

Failures. An exception while training a chain is a :class:`ClientFailure` with the
sequential engine's reason. A worker that dies (killed, segfault, ``os._exit``) fails
only the chain it was training, with a reason giving its exit code; the chains queued
behind it go to the other workers, and if none is left, every chain not yet trained
fails.

Timeouts (``train.failures.client_timeout_seconds``, per chain as in the sequential
engine). A worker enforces the limit itself: :func:`train_chain` runs the chain under a
``SIGALRM`` deadline (:mod:`fedplug.deadline`; a forked worker runs in its own main
thread), so a hanging client is interrupted and its chain comes back as the sequential
engine's ``ClientTimeout`` failure. The main process is the backstop for a chain the
alarm cannot stop (client code that blocks or replaces ``SIGALRM``, or swallows the
exception): it knows when each worker started its current chain (when the chain was
handed to an idle worker, or when the worker's previous result arrived, never earlier
than the truth), and a worker whose chain has run :func:`kill_after` seconds (the limit
plus a margin of :data:`~fedplug.deadline.KILL_MARGIN_SECONDS`, or 10% of the limit when that is more) is
killed (``SIGKILL``). That chain fails with a reason naming the limit; the chains queued
behind it go back to the queue, and a replacement worker is forked (from the main
process as it is then: the same start vector and payload, and the states of the clients
not yet trained are untouched) when chains are left to train, so the round goes on at
full width. At the end of a complete round the workers' pipes close and they exit on their
own while the main process goes on (evaluation): tearing down a forked copy of a large
process takes about as long as forking it; they are joined when the next round starts,
or by :meth:`ParallelEngine.close`. When the consumer stops early (closes the generator)
or an error interrupts the round, the workers are terminated and joined at once. A
worker ignores Ctrl-C, which the main process handles.

Limits: CPU only (the model must be on the CPU), and a platform with the ``fork`` start
method (Linux, macOS; not Windows). Without ``client_timeout_seconds`` nothing bounds a
chain: one that never finishes (an infinite loop) blocks the round, as it does in the
sequential engine.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
from torch import Tensor, nn

from fedplug.components import ClientUpdate, Context, RoundPlan
from fedplug.deadline import KILL_MARGIN_SECONDS, grace_period
from fedplug.errors import ConfigError
from fedplug.simulation.round_context import ClientFailure, RoundContext
from fedplug.simulation.sequential import train_chain

QUEUED_CHAINS_PER_WORKER = 2
"""Chains handed to a worker ahead of its results: one it trains, one waiting."""

STOP_SECONDS = 5.0
"""How long a worker may take to exit once told to before it is killed."""

_NUMPY_DTYPES = frozenset(
    {
        torch.float16, torch.float32, torch.float64,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    }
)


def kill_after(timeout: float) -> float:
    """Seconds a worker's chain may run before the main process kills the worker:
    ``timeout`` plus its :func:`~fedplug.deadline.grace_period` (at least
    :data:`~fedplug.deadline.KILL_MARGIN_SECONDS`)."""
    return timeout + grace_period(timeout, KILL_MARGIN_SECONDS)


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ------------------------------------------------------------------------ messages


class _TensorPickler(pickle.Pickler):
    """Pickles plain CPU tensors as numpy arrays: about 3x faster than torch's own
    pickling (which writes a zip archive per tensor), and a view carries only its own
    elements, not its whole storage."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is Tensor
            and obj.layout is torch.strided
            and obj.device.type == "cpu"
            and obj.dtype in _NUMPY_DTYPES
        ):
            return torch.from_numpy, (obj.detach().numpy(),)
        return NotImplemented


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


@dataclass
class _ChainResult:
    """What a worker sends back for one chain."""

    index: int
    """The chain's position in ``plan.chains``."""
    outcome: ClientUpdate | ClientFailure
    client_states: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    """The chain's clients' states after training (those that have one)."""
    loss_contexts: dict[int, Context] = field(default_factory=dict)
    """Loss contexts the worker computed (not cached when it was forked)."""


# ------------------------------------------------------------------------ worker side


def _serve(
    connection: Connection,
    foreign: list[Connection],
    model: nn.Module,
    start_vector: Tensor,
    plan: RoundPlan,
    round_index: int,
    context: RoundContext,
) -> None:
    """A worker: train the chains whose indices arrive on ``connection`` until it closes."""
    for other in foreign:  # other pipes' main-process ends, inherited through fork
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops the workers
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held across fork (_fork)
    torch.set_num_threads(1)
    cached = set(context.loss_contexts)
    while True:
        try:
            index = connection.recv()
        except EOFError:  # the round is over
            return
        chain = plan.chains[index]
        outcome = train_chain(model, start_vector, chain, plan, round_index, context)
        states = {k: context.client_states[k] for k in chain if k in context.client_states}
        computed = {k: context.loss_contexts[k] for k in chain if k in context.loss_contexts and k not in cached}
        cached.update(computed)
        try:
            message = _dumps(_ChainResult(index, outcome, states, computed))
        except Exception as error:  # an extra that cannot be pickled fails its chain only
            failure = ClientFailure(chain, f"{type(error).__name__}: cannot send the result back: {error}")
            message = _dumps(_ChainResult(index, failure))
        connection.send_bytes(message)


# ------------------------------------------------------------------------ main side


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection
    assigned: deque[int] = field(default_factory=deque)
    """Chain indices sent and not yet answered, in the order the worker trains them."""
    alive: bool = True
    head_started: float | None = None
    """``time.monotonic()`` when the worker started ``assigned[0]`` (an upper bound: when
    it was handed to the idle worker, or when the result before it arrived)."""


def _exit_description(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        try:
            return f"exit code {exit_code} (signal {signal.Signals(-exit_code).name})"
        except ValueError:
            pass
    return f"exit code {exit_code}"


class ParallelEngine:
    """Trains a round's chains in ``workers`` forked CPU processes (see the module).

    Args:
        model: the simulator's model (on the CPU); each worker trains its forked copy.
        workers: worker processes per round (default None: one per usable CPU, see
            :func:`default_workers`); a round with fewer chains forks fewer.

    Raises:
        ConfigError: the model is not on the CPU, or the platform cannot fork.
    """

    name = "parallel"

    def derived_params(self) -> dict[str, Any]:
        """The number of worker processes, beside the engine's name."""
        return {"engine_workers": self.workers}

    def __init__(self, model: nn.Module, workers: int | None = None) -> None:
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ConfigError(
                f"train.engine 'parallel' forks worker processes, which this platform ({sys.platform}) "
                "cannot do; use engine 'sequential'"
            )
        device = next((tensor.device for tensor in model.parameters()), torch.device("cpu"))
        if device.type != "cpu":
            raise ConfigError(
                f"train.engine 'parallel' trains in CPU worker processes, but the model is on {device}; "
                "use engine 'vectorized' or 'sequential' there, or train.device: cpu"
            )
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.model = model
        self.workers = workers if workers is not None else default_workers()
        self.fork_seconds: list[float] = []
        """Per round: wall time of forking its workers."""
        self.stop_seconds: list[float] = []
        """Per round: wall time the main process spent stopping its workers."""
        self._exiting: list[BaseProcess] = []

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> Iterator[ClientUpdate | ClientFailure]:
        """Train every chain of ``plan`` in the workers; yield one update (or failure) per
        chain in plan order, each as soon as it and all before it are in."""
        self.close()
        if not plan.chains:
            return
        workers: list[_Worker] = []
        finished = False
        try:
            started = time.perf_counter()
            for _ in range(min(self.workers, len(plan.chains))):
                workers.append(self._fork(workers, start_vector, plan, round_index, context))
            self.fork_seconds.append(time.perf_counter() - started)

            def replacement() -> _Worker:  # for a worker killed past its chain's deadline
                return self._fork(workers, start_vector, plan, round_index, context)

            yield from self._collect(workers, plan, context, replacement)
            finished = True
        finally:
            started = time.perf_counter()
            for worker in workers:
                worker.connection.close()  # a waiting worker reads end-of-file and exits
                if finished:
                    self._exiting.append(worker.process)
                elif worker.process.is_alive():
                    worker.process.terminate()
            if not finished:
                _join([worker.process for worker in workers])
            self.stop_seconds.append(time.perf_counter() - started)

    def close(self) -> None:
        """Join the workers of the last complete round (they exit on their own)."""
        _join(self._exiting)
        self._exiting = []

    def _fork(
        self, earlier: list[_Worker], start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> _Worker:
        here, there = multiprocessing.get_context("fork").Pipe(duplex=True)
        foreign = [worker.connection for worker in earlier] + [here]
        process = multiprocessing.get_context("fork").Process(
            target=_serve,
            args=(there, foreign, self.model, start_vector, plan, round_index, context),
            name=f"fedplug-parallel-{len(earlier)}",
            daemon=True,
        )
        # Ctrl-C during fork() would be handled in an at-fork callback in this process
        # (logging's lock release), where Python prints the KeyboardInterrupt as "Exception
        # ignored" and drops it: the run went on. Hold SIGINT until fork() has returned; the
        # worker inherits the mask and ignores SIGINT before it unblocks it (_serve).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            # Only the worker may hold its end, or its death would not show as end-of-file here.
            there.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return _Worker(process, here)

    def _collect(
        self,
        workers: list[_Worker],
        plan: RoundPlan,
        context: RoundContext,
        replacement: Callable[[], _Worker],
    ) -> Iterator[ClientUpdate | ClientFailure]:
        pending = deque(range(len(plan.chains)))
        arrived: dict[int, _ChainResult] = {}
        timeout = context.client_timeout
        _hand_out(workers, pending)
        for index in range(len(plan.chains)):
            while index not in arrived:
                self._receive(workers, pending, arrived, plan, timeout)
                if timeout is not None and _stop_overdue(workers, pending, arrived, plan, timeout) and pending:
                    workers.append(replacement())
                _hand_out(workers, pending)
            result = arrived.pop(index)
            context.client_states.update(result.client_states)
            context.loss_contexts.update(result.loss_contexts)
            yield result.outcome

    def _receive(
        self,
        workers: list[_Worker],
        pending: deque[int],
        arrived: dict[int, _ChainResult],
        plan: RoundPlan,
        timeout: float | None = None,
    ) -> None:
        """Wait for at least one worker to answer or die, or (with a ``timeout``) until
        the first worker's chain is due to be killed; file what came."""
        live = {worker.connection: worker for worker in workers if worker.alive}
        if not live:
            reason = "not trained: every worker process died (" + ", ".join(
                _exit_description(worker.process.exitcode) for worker in workers
            ) + ")"
            while pending:
                index = pending.popleft()
                arrived[index] = _ChainResult(index, ClientFailure(plan.chains[index], reason))
            return
        wait_seconds = None
        if timeout is not None:
            starts = [worker.head_started for worker in live.values() if worker.head_started is not None]
            if starts:
                wait_seconds = max(0.0, min(starts) + kill_after(timeout) - time.monotonic())
        for connection in wait(list(live), wait_seconds):
            worker = live[connection]  # type: ignore[index]
            try:
                result: _ChainResult = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError):
                _bury(worker, pending, arrived, plan)
                continue
            worker.assigned.remove(result.index)
            # it trains its chains in order: the next one started about now
            worker.head_started = time.monotonic() if worker.assigned else None
            arrived[result.index] = result


def _hand_out(workers: list[_Worker], pending: deque[int]) -> None:
    """Top every live worker up to :data:`QUEUED_CHAINS_PER_WORKER` chains, in plan order."""
    for _ in range(QUEUED_CHAINS_PER_WORKER):
        for worker in workers:
            if not pending:
                return
            if worker.alive and len(worker.assigned) < QUEUED_CHAINS_PER_WORKER:
                try:
                    worker.connection.send(pending[0])
                except OSError:  # it died; the next wait() reports it
                    continue
                if not worker.assigned:  # an idle worker starts it now
                    worker.head_started = time.monotonic()
                worker.assigned.append(pending.popleft())


def _stop_overdue(
    workers: list[_Worker], pending: deque[int], arrived: dict[int, _ChainResult], plan: RoundPlan, timeout: float
) -> bool:
    """Kill every worker whose chain has run :func:`kill_after` ``timeout`` seconds (its
    own deadline did not stop it); fail that chain and queue the worker's others again.
    Returns whether one was killed."""
    killed = False
    now = time.monotonic()
    for worker in workers:
        if not worker.alive or worker.head_started is None or now - worker.head_started < kill_after(timeout):
            continue
        if worker.connection.poll():  # it answered (or died) just now: the next wait() files it
            continue
        worker.process.kill()
        worker.process.join()
        worker.alive = False
        worker.connection.close()
        index = worker.assigned.popleft()
        chain = plan.chains[index]
        who = f"client {int(chain[0])}" if len(chain) == 1 else f"chain {[int(k) for k in chain]}"
        reason = (
            f"ClientTimeout: {who} ran past train.failures.client_timeout_seconds={timeout:g}; its deadline "
            f"did not stop it within {kill_after(timeout) - timeout:g}s more, so its worker process was killed"
        )
        arrived[index] = _ChainResult(index, ClientFailure(list(chain), reason))
        queued = sorted([*pending, *worker.assigned])
        pending.clear()
        pending.extend(queued)
        worker.assigned.clear()
        worker.head_started = None
        killed = True
    return killed


def _bury(worker: _Worker, pending: deque[int], arrived: dict[int, _ChainResult], plan: RoundPlan) -> None:
    """A worker's pipe closed: it died. Fail the chain it was training; queue the rest again."""
    worker.alive = False
    _wait_for_exit(worker.process)
    if worker.assigned:
        index = worker.assigned.popleft()
        reason = f"the worker process training it died with {_exit_description(worker.process.exitcode)}"
        arrived[index] = _ChainResult(index, ClientFailure(plan.chains[index], reason))
    queued = sorted([*pending, *worker.assigned])
    pending.clear()
    pending.extend(queued)
    worker.assigned.clear()


def _wait_for_exit(process: BaseProcess) -> None:
    """Join a process that was told to exit (or closed its pipe); kill it if it has not
    exited within :data:`STOP_SECONDS`."""
    process.join(STOP_SECONDS)
    if process.is_alive():
        process.kill()
        process.join()


def _join(processes: list[BaseProcess]) -> None:
    for process in processes:
        _wait_for_exit(process)
        process.close()
