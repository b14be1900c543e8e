"""The parallel engine: the chains of a round trained in W forked CPU processes.

:class:`ParallelEngine` is the pool side: it forks the workers
(:mod:`fedplug.simulation.parallel_worker`), hands out chains, yields their outcomes in
plan order, and kills a worker whose chain runs past the time limit. It gives the
sequential engine's results bit for bit; docs/engines.md says how.
"""

from __future__ import annotations

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

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.deadline import KILL_MARGIN_SECONDS, grace_period
from fedplug.errors import ConfigError
from fedplug.run.evaluation import Batch, BatchResult, Evaluator
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure
from fedplug.run.vectors import model_to_vector
from fedplug.simulation.parallel_worker import (
    BatchDone,
    ChainResult,
    EvaluateBatch,
    LoadModel,
    NextRound,
    RoundState,
    dumps,
    serve,
)

QUEUED_CHAINS_PER_WORKER = 2
"""Chains handed to a worker ahead of its results: one it trains, one waiting."""

STOP_SECONDS = 5.0
"""How long a worker may take to exit once told to before it is killed."""

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
    loss_contexts: set[int] = field(default_factory=set)
    """The clients whose loss contexts the worker has (so they are not sent again)."""


def _exit_description(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        try:
            return f"exit code {exit_code} (signal {signal.Signals(-exit_code).name})"
        except ValueError:
            pass
    return f"exit code {exit_code}"


class ParallelEngine:
    """Trains a round's chains in ``workers`` forked CPU processes (docs/engines.md).

    Args:
        model: the simulator's model (on the CPU); each worker trains its forked copy.
        workers: worker processes per round (default None: one per usable CPU, see
            :func:`default_workers`); a round with fewer chains forks fewer.
        evaluator: the simulator's evaluator (default None: the workers do not evaluate);
            with it the round's workers stand by after the round and compute the
            evaluation's batches (:meth:`spread_evaluation`).

    Raises:
        ConfigError: the model is not on the CPU, or the platform cannot fork.
    """

    name = "parallel"

    def derived_params(self) -> dict[str, Any]:
        """The number of worker processes, beside the engine's name."""
        return {"engine_workers": self.workers}

    def __init__(self, model: nn.Module, workers: int | None = None, evaluator: Evaluator | None = None) -> None:
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
        self.evaluator = evaluator
        self.fork_seconds: list[float] = []
        """Per round: wall time of forking its workers."""
        self.stop_seconds: list[float] = []
        """Per round: wall time the main process spent stopping its workers."""
        self._exiting: list[BaseProcess] = []
        self._standby: list[_Worker] = []
        """The last complete round's live workers, waiting for its evaluation and the
        next round."""
        self._standby_context: RoundContext | None = None
        """The round context (one per run) the standing-by workers were forked with."""

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> Iterator[ClientUpdate | ClientFailure]:
        """Train every chain of ``plan`` in the workers; yield one update (or failure) per
        chain in plan order, each as soon as it and all before it are in."""
        if not plan.chains:
            return
        workers: list[_Worker] = []
        finished = False
        try:
            self._reuse(workers, start_vector, plan, round_index, context)
            started = time.perf_counter()
            while len(workers) < min(self.workers, len(plan.chains)):
                workers.append(self._fork(workers, start_vector, plan, round_index, context))
            self.fork_seconds.append(time.perf_counter() - started)

            def replacement() -> _Worker:  # for a worker killed past its chain's deadline
                return self._fork(workers, start_vector, plan, round_index, context)

            yield from self._collect(workers, plan, context, replacement)
            finished = True
        finally:
            started = time.perf_counter()
            if finished:  # the live ones stand by for the evaluation and the next round
                self._standby = [worker for worker in workers if worker.alive]
                self._standby_context = context
                workers = [worker for worker in workers if not worker.alive]
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
        """Dismiss the workers of the last complete round and join them."""
        self._dismiss()
        _join(self._exiting)
        self._exiting = []

    def _reuse(
        self, workers: list[_Worker], start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> None:
        """Put into ``workers`` the standing-by workers of the last round (of the same
        run) that are still alive, each sent the new round's state; dismiss the others,
        and all of them when the state cannot be pickled (the round's workers are then
        forked as they are). Every standing-by worker is in ``workers`` until it is
        dismissed, so an interruption terminates it with the round's."""
        workers.extend(self._standby)
        self._standby = []
        message = None
        if workers and self._standby_context is context:
            message = self._round_state(start_vector, plan, round_index, context)
        wanted = min(self.workers, len(plan.chains))
        clients = [k for chain in plan.chains for k in chain]
        reused = 0
        for worker in list(workers):
            if message is not None and reused < wanted and worker.alive and worker.process.is_alive():
                missing = {
                    k: context.loss_contexts[k]
                    for k in clients
                    if k in context.loss_contexts and k not in worker.loss_contexts
                }
                try:
                    worker.connection.send_bytes(dumps(NextRound(message, missing)))
                except OSError:  # it died: dismissed below, replaced by a fork
                    pass
                else:
                    worker.loss_contexts.update(missing)
                    reused += 1
                    continue
            workers.remove(worker)
            worker.connection.close()  # it reads end-of-file and exits
            self._exiting.append(worker.process)
        _join(self._exiting)  # the dismissed ones, and those of an earlier run
        self._exiting = []

    @staticmethod
    def _round_state(start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext) -> bytes | None:
        """The pickled :class:`RoundState` of a round, or ``None`` when some of it cannot
        be pickled (a component holding a lambda, a lock, an open file)."""
        clients = [k for chain in plan.chains for k in chain]
        state = RoundState(
            start_vector,
            plan,
            round_index,
            context.algorithm,
            context.payload,
            {k: context.client_states.get(k) for k in clients},
            {
                "seed": context.seed,
                "schedule": context.schedule,
                "reply_metrics": context.reply_metrics,
                "client_timeout": context.client_timeout,
            },
        )
        try:
            return dumps(state)
        except Exception:  # noqa: BLE001 - whatever pickling raises, forking needs no pickling
            return None

    def _dismiss(self) -> None:
        """Close the standing-by workers' pipes: they read end-of-file and exit."""
        for worker in self._standby:
            worker.connection.close()
            self._exiting.append(worker.process)
        self._standby = []

    def spread_evaluation(
        self, evaluator: Evaluator, model: nn.Module, batches: list[Batch]
    ) -> list[BatchResult] | None:
        """Compute ``evaluator``'s ``batches`` for ``model`` (the aggregated global model)
        in the last round's workers, which stand by for it (and then for the next round).

        Returns ``None`` (the caller evaluates in this process) when no worker stands by,
        when ``evaluator`` is not the one the workers were forked with, or when this
        process evaluates with more than the workers' one torch thread, so that every
        batch is computed exactly as this process would. A batch whose worker died or
        raised is computed here.
        """
        standby = [worker for worker in self._standby if worker.alive]
        if not standby or not batches or evaluator is not self.evaluator or torch.get_num_threads() != 1:
            return None
        results: list[BatchResult | None] = [None] * len(batches)
        finished = False
        try:
            load = dumps(LoadModel(model_to_vector(model)))
            for worker in standby:
                try:
                    worker.connection.send_bytes(load)
                except OSError:  # it died; the next wait() reports it
                    pass
            pending = deque(range(len(batches)))
            while pending or any(worker.alive and worker.assigned for worker in standby):
                _hand_out(standby, pending, lambda index: EvaluateBatch(index, batches[index]))
                live = {worker.connection: worker for worker in standby if worker.alive}
                if not live:
                    break
                for connection in wait(list(live)):
                    worker = live[connection]  # type: ignore[index]
                    try:
                        done: BatchDone = pickle.loads(connection.recv_bytes())
                    except (EOFError, OSError):  # it died: its batches go to the others
                        worker.alive = False
                        pending.extendleft(reversed(worker.assigned))
                        worker.assigned.clear()
                        continue
                    worker.assigned.remove(done.index)
                    results[done.index] = done.result
            finished = True
        finally:
            if not finished:  # interrupted (Ctrl-C): stop them at once
                for worker in self._standby:
                    worker.connection.close()
                    if worker.process.is_alive():
                        worker.process.terminate()
                _join([worker.process for worker in self._standby])
                self._standby = []
        missing = [index for index, result in enumerate(results) if result is None]
        if missing:
            model.eval()
            for index in missing:
                results[index] = evaluator.predict(model, batches[index])
            model.train()
        return results  # type: ignore[return-value]

    def _fork(
        self, earlier: list[_Worker], start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> _Worker:
        here, there = multiprocessing.get_context("fork").Pipe(duplex=True)
        foreign = [worker.connection for worker in earlier] + [here]
        loss_contexts = set(context.loss_contexts)
        process = multiprocessing.get_context("fork").Process(
            target=serve,
            args=(there, foreign, self.model, start_vector, plan, round_index, context, self.evaluator),
            name=f"fedplug-parallel-{len(earlier)}",
            daemon=True,
        )
        # Ctrl-C during fork() would be handled in an at-fork callback in this process
        # (logging's lock release), where Python prints the KeyboardInterrupt as "Exception
        # ignored" and drops it: the run went on. Hold SIGINT until fork() has returned; the
        # worker inherits the mask and ignores SIGINT before it unblocks it (serve).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            # Only the worker may hold its end, or its death would not show as end-of-file here.
            there.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return _Worker(process, here, loss_contexts=loss_contexts)

    def _collect(
        self,
        workers: list[_Worker],
        plan: RoundPlan,
        context: RoundContext,
        replacement: Callable[[], _Worker],
    ) -> Iterator[ClientUpdate | ClientFailure]:
        pending = deque(range(len(plan.chains)))
        arrived: dict[int, ChainResult] = {}
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
        arrived: dict[int, ChainResult],
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
                arrived[index] = ChainResult(index, ClientFailure(plan.chains[index], reason))
            return
        wait_seconds = None
        if timeout is not None:
            starts = [worker.head_started for worker in live.values() if worker.head_started is not None]
            if starts:
                wait_seconds = max(0.0, min(starts) + kill_after(timeout) - time.monotonic())
        for connection in wait(list(live), wait_seconds):
            worker = live[connection]  # type: ignore[index]
            try:
                result: ChainResult = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError):
                _bury(worker, pending, arrived, plan)
                continue
            worker.assigned.remove(result.index)
            worker.loss_contexts.update(result.loss_contexts)
            # it trains its chains in order: the next one started about now
            worker.head_started = time.monotonic() if worker.assigned else None
            arrived[result.index] = result


def _hand_out(
    workers: list[_Worker], pending: deque[int], message: Callable[[int], Any] = lambda index: index
) -> None:
    """Top every live worker up to :data:`QUEUED_CHAINS_PER_WORKER` items (chain indices, or
    evaluation batches through ``message``), in ``pending`` order."""
    for _ in range(QUEUED_CHAINS_PER_WORKER):
        for worker in workers:
            if not pending:
                return
            if worker.alive and len(worker.assigned) < QUEUED_CHAINS_PER_WORKER:
                try:
                    worker.connection.send(message(pending[0]))
                except OSError:  # it died; the next wait() reports it
                    continue
                if not worker.assigned:  # an idle worker starts it now
                    worker.head_started = time.monotonic()
                worker.assigned.append(pending.popleft())


def _stop_overdue(
    workers: list[_Worker], pending: deque[int], arrived: dict[int, ChainResult], plan: RoundPlan, timeout: float
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
        arrived[index] = ChainResult(index, ClientFailure(list(chain), reason))
        queued = sorted([*pending, *worker.assigned])
        pending.clear()
        pending.extend(queued)
        worker.assigned.clear()
        worker.head_started = None
        killed = True
    return killed


def _bury(worker: _Worker, pending: deque[int], arrived: dict[int, ChainResult], plan: RoundPlan) -> None:
    """A worker's pipe closed: it died. Fail the chain it was training; queue the rest again."""
    worker.alive = False
    _wait_for_exit(worker.process)
    if worker.assigned:
        index = worker.assigned.popleft()
        reason = f"the worker process training it died with {_exit_description(worker.process.exitcode)}"
        arrived[index] = ChainResult(index, ClientFailure(plan.chains[index], reason))
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
