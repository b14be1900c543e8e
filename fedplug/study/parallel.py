"""Train a study's pending runs as Ray tasks, on this machine or on a Ray cluster.

``pipelines/studies/run_study.py --jobs N`` (N > 1) and ``--address`` call
:func:`train_on_ray`: each run is one Ray task (``num_cpus=1``, one torch thread) that calls
the runner's own training function, so a run trained here is the run the sequential runner
trains (the same run folder, per-round checkpoint and MLflow child run). What else it does:

- **Data once per node.** Each node has a :class:`FederationHolder` (a Ray actor,
  :func:`start_holders`): the first task on a node that asks for a data config has the
  holder build that federation there and put it into the node's object store; every later
  task on the node reads it from there (numpy arrays without a copy) instead of building.
  A worker process also keeps the last federation it used, for its next run on the same
  data. Runs on a GPU (``train.device`` cuda, or auto on a node with one) build their own,
  once per worker process.
- **Failures are per run.** A run that raises is reported as a :class:`RunOutcome` with one
  line saying why (its traceback too, unless it is a fedplug error, which already says
  what to fix); the other runs go on. A worker that dies mid-run (killed, out of memory) is
  retried once by Ray, and the retry resumes the run from its checkpoint.
- **One progress bar** over runs with an ETA on a terminal (:class:`RunProgress`), else one
  line per finished run.

Ray is imported only when a study trains in parallel; ``RAY_USAGE_STATS_ENABLED=0``,
no dashboard, worker output is not forwarded (Ray keeps it in its session logs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TextIO

from fedplug.errors import ConfigError, FedplugError
from fedplug.safe_files import read_regular_bytes

FAILED_NAME = "failed.json"
"""The study folder's record of runs that failed in parallel runs: run id -> why."""
RUN_CPUS = 1
"""CPUs one run's Ray task asks for: its torch threads stay within them
(:func:`fedplug.threads.limit_cores`; ``train.threads`` above it is capped)."""
RETRIES_AFTER_CRASH = 1
"""Ray retries a task whose worker process died (not one that raised) this many times; the
retry resumes the run from its checkpoint."""
CONNECT_TIMEOUT_S = 10.0
"""How long ``--address`` may take to accept a TCP connection (Ray itself waits minutes)."""
FEDERATIONS_PER_NODE = 2
"""How many federations a node's :class:`FederationHolder` keeps (the last ones asked for):
a study lists the runs of one data config together, so the runs in flight span few."""


class TrainRun(Protocol):
    """The runner's training of one run (``run_study.train_task``): check the run folder's
    checkpoint, train (resuming it), write ``provenance`` into ``provenance.json``, return
    the result summary."""

    def __call__(self, spec: Any, run: Any, folder: Path, registry: Any, federation: Any, parent: Any, *,
                 redo: bool, provenance: dict[str, Any]) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class RunTask:
    """What one Ray task needs to train one run. The run's config travels as its JSON
    document: the config classes are built at run time from the plugin registry and do not
    pickle, so the worker validates the document again."""

    spec: Any
    """The study (its name tags the MLflow run)."""
    run: Any
    """The :class:`~fedplug.study.StudyRun` without its config."""
    config: dict[str, Any]
    """``run.config.model_dump(mode="json")``."""
    folder: Path
    """The run folder."""
    parent: Any
    """The MLflow parent run (``run_study.StudyParent``), or None without MLflow."""
    redo: bool
    """``--redo-mismatched``: delete a checkpoint the run cannot resume instead of failing."""

    @classmethod
    def of(cls, spec: Any, run: Any, folder: Path, parent: Any, redo: bool) -> RunTask:
        return cls(spec, dataclasses.replace(run, config=None), run.config.model_dump(mode="json"), folder, parent,
                   redo)


class RunOutcome(NamedTuple):
    """How one run's task ended."""

    run_id: str
    summary: dict[str, Any] | None
    """The run's result summary (``final_accuracy``, ...); None when it failed."""
    error: str | None
    """One line: why it failed (None when it finished)."""
    details: str | None
    """The remote traceback of an unexpected error (None for fedplug errors and successes)."""
    node: str | None
    """The Ray node id that trained it (None when it failed)."""
    seconds: float
    """Wall time from submission to the result."""
    federation: str | None = None
    """Where its federation came from (None when it failed): ``built`` (its node's holder
    built it for this run), ``node`` (the holder had it), ``process`` (the worker process
    kept it from its previous run) or ``task`` (the task built it itself: a run on a GPU, or
    a node without a holder)."""


# ------------------------------------------------------------------------------ in the worker

def holder_name(node_id: str) -> str:
    """The name of node ``node_id``'s :class:`FederationHolder` (in the Ray job's namespace)."""
    return f"fedplug-federations-{node_id}"


class FederationHolder:
    """One node's federations on the CPU (a Ray actor pinned to the node,
    :func:`start_holders`): the first time a task of the node asks for a data config, the
    holder builds its federation (reading ``data.root`` on this node) and puts it into the
    node's object store; later tasks get the object there. Ray runs an actor's calls one at
    a time, so tasks asking at once wait for one build. Keeps the last ``keep`` federations."""

    def __init__(self, keep: int = FEDERATIONS_PER_NODE) -> None:
        from fedplug.plugins import default_registry

        self.registry = default_registry()  # the plugins load here as in the tasks
        self.keep = keep
        self.federations: OrderedDict[str, Any] = OrderedDict()
        """Data config (its JSON document, keys sorted) -> the federation's object ref."""

    def federation(self, data: str) -> tuple[list[Any], bool]:
        """The object ref of the federation of ``data`` (a data config's JSON document,
        keys sorted), in a list so that Ray hands over the ref, not the federation; and
        whether this call built it."""
        import ray

        from fedplug.config import validate_section
        from fedplug.data.build import build_federation

        built = data not in self.federations
        if built:
            while len(self.federations) >= self.keep:
                self.federations.popitem(last=False)  # the node's store frees it once no task uses it
            config = validate_section("data", json.loads(data), self.registry)
            self.federations[data] = ray.put(build_federation(config, self.registry, "cpu"))
        self.federations.move_to_end(data)
        return [self.federations[data]], built


def node_federation(data: str, node: str) -> tuple[Any, str]:
    """The federation of ``data`` (as :meth:`FederationHolder.federation` takes it) from
    node ``node``'s holder, and ``built`` or ``node`` (see :class:`RunOutcome`); ``(None,
    "task")`` when the node has no holder or it died. A build that fails fails the run with
    the build's own error (Ray passes it on), as a run without Ray does."""
    import ray

    try:
        holder = ray.get_actor(holder_name(node))
    except ValueError:  # a node that joined the cluster after the study started
        return None, "task"
    try:
        [ref], built = ray.get(holder.federation.remote(data))
    except ray.exceptions.RayActorError:
        return None, "task"
    return ray.get(ref), "built" if built else "node"


_FEDERATION: dict[str, Any] = {}
"""This worker process's last federation (``key``, ``federation``)."""


def worker_federation(config: Any, registry: Any, node: str) -> tuple[Any, str]:
    """The federation of ``config.data`` on ``config.train.device`` and where it came from
    (see :class:`RunOutcome`): this process's last one when it is the same, else its node's
    (:func:`node_federation`) on the CPU, else built here. The process keeps only the last."""
    from fedplug.data.build import build_federation
    from fedplug.run.model import resolve_device

    data = json.dumps(config.data.model_dump(mode="json"), sort_keys=True)
    device = resolve_device(config.train.device)
    key = json.dumps([data, str(device)])
    if _FEDERATION.get("key") == key:
        return _FEDERATION["federation"], "process"
    _FEDERATION.clear()  # free the previous one first
    federation, source = node_federation(data, node) if device.type == "cpu" else (None, "task")
    if federation is None:
        federation = build_federation(config.data, registry, device)
    _FEDERATION.update(key=key, federation=federation)
    return federation, source


def train_in_worker(train: TrainRun, task: RunTask) -> dict[str, Any]:
    """The body of a run's Ray task: torch's threads within the task's :data:`RUN_CPUS`
    (:func:`fedplug.threads.choose_run_threads`), the run's config validated again,
    its federation (:func:`worker_federation`), then ``train``; returns the summary, the
    node id, this process's id and where the federation came from."""
    import ray

    from fedplug.config import validate_experiment
    from fedplug.plugins import default_registry
    from fedplug.threads import choose_run_threads, choose_threads, limit_cores

    limit_cores(RUN_CPUS)  # the node shows all its cores; this task was given RUN_CPUS of them
    choose_threads(None, announce=False)  # before the config is validated (the plugins load)
    registry = default_registry()
    config = validate_experiment(task.config, registry)
    choose_run_threads(config.train, announce=False)  # train.threads, within RUN_CPUS
    if config.model_dump(mode="json") != task.config:
        raise ConfigError(f"run {task.run.run_id}: its config does not survive the trip to a Ray worker "
                          "(validating its JSON document gives another config); train it with --jobs 1")
    run = dataclasses.replace(task.run, config=config)
    node = ray.get_runtime_context().get_node_id()
    federation, source = worker_federation(config, registry, node)
    summary = train(task.spec, run, task.folder, registry, federation, task.parent, redo=task.redo,
                    provenance={"ray_node": node})
    return {"summary": summary, "node": node, "pid": os.getpid(), "federation": source}


# ------------------------------------------------------------------------------ in the driver


def unreachable(address: str, reason: object) -> ConfigError:
    return ConfigError(f"cannot reach the Ray cluster at {address}: {reason}; start one with `ray start --head` "
                       "or drop --address")


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse in one line an ``--address`` (``host:port`` or ``ray://host:port``) that does
    not accept a TCP connection within ``timeout`` seconds: ``ray.init`` would retry for
    minutes and then exit the process. ``auto`` is left to Ray (it fails at once)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise unreachable(address, error.strerror or error) from None


@contextmanager
def ray_session(address: str | None, jobs: int | None) -> Iterator[int]:
    """Ray for the study: connected to the cluster at ``address``, else a local Ray of
    ``jobs`` CPUs, shut down (disconnected) at the end. Yields how many runs to keep in
    flight: ``jobs``, else the cluster's CPUs."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray starts; workers inherit it
    # Ray's coming default (and no FutureWarning): tasks see the node's GPUs, so runs with
    # train.device cuda share them.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    import ray

    if address is not None:
        check_reachable(address)
    try:
        if address is None:
            # "local": a new Ray of our own, never the cluster RAY_ADDRESS or `ray start` left
            # on this machine (ray.init's default joins those).
            ray.init(address="local", num_cpus=jobs, include_dashboard=False, logging_level=logging.ERROR,
                     log_to_driver=False)
        else:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, TimeoutError) as error:
        raise unreachable(address or "local", error) from None
    try:
        yield jobs if jobs is not None else max(1, int(ray.cluster_resources().get("CPU", 1)))
    finally:
        ray.shutdown()


def describe_failure(error: BaseException) -> tuple[str, str | None]:
    """One line saying why a run's task failed, and the remote traceback when the error is
    not a fedplug error (whose message already says what to fix)."""
    import ray.exceptions

    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        if isinstance(cause, FedplugError):
            return str(cause).splitlines()[0], None
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {message}".rstrip(": "), str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": "), None


def start_holders() -> list[Any]:
    """A :class:`FederationHolder` (no CPU of its own) pinned to each alive node with CPUs,
    named :func:`holder_name` in this Ray job's namespace (another study on the cluster
    has its own), or the one already there; their handles."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    holder = ray.remote(num_cpus=0)(FederationHolder)
    return [holder.options(name=holder_name(node["NodeID"]), get_if_exists=True,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]


def train_on_ray(tasks: list[RunTask], train: TrainRun, *, in_flight: int,
                 on_outcome: Callable[[RunOutcome], None]) -> list[RunOutcome]:
    """Train ``tasks`` in this order, at most ``in_flight`` at a time, on the connected Ray
    (:func:`ray_session`); ``on_outcome`` hears of each run as it ends. Interrupted, the
    runs still in flight are cancelled (their checkpoints stay, so they resume). Each node's
    :class:`FederationHolder` lives as long as this call, its federations with it."""
    import ray

    module = sys.modules.get(getattr(train, "__module__", "") or "")
    if module is not None and module.__name__ != "__main__" and not module.__name__.startswith("fedplug."):
        # A script's module (the study runner, loaded from its file) is not importable on the
        # workers: its functions travel by value, as ``__main__``'s do.
        ray.cloudpickle.register_pickle_by_value(module)
    remote = ray.remote(num_cpus=RUN_CPUS, max_retries=RETRIES_AFTER_CRASH)(train_in_worker)
    train_ref = ray.put(train)
    holders = start_holders()
    queue = list(tasks)
    pending: dict[Any, tuple[RunTask, float]] = {}
    outcomes = []
    try:
        while queue or pending:
            while queue and len(pending) < in_flight:
                task = queue.pop(0)
                pending[remote.options(name=task.run.run_id).remote(train_ref, task)] = (task, time.perf_counter())
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                task, started = pending.pop(ref)
                outcome = collect(ref, task.run.run_id, started)
                outcomes.append(outcome)
                on_outcome(outcome)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        for holder in holders:
            ray.kill(holder)
    return outcomes


def collect(ref: Any, run_id: str, started: float) -> RunOutcome:
    """The :class:`RunOutcome` of a finished task."""
    import ray

    try:
        done = ray.get(ref)
    except ray.exceptions.RayError as error:
        line, details = describe_failure(error)
        return RunOutcome(run_id, None, line, details, None, time.perf_counter() - started)
    return RunOutcome(run_id, done["summary"], None, None, done["node"], time.perf_counter() - started,
                      done["federation"])


# ------------------------------------------------------------------------------ the record of failures


def read_failures(out: Path) -> dict[str, dict[str, Any]]:
    """The study folder's :data:`FAILED_NAME`: run id -> ``{"error": ..., ...}`` (empty
    when absent).

    Raises:
        ConfigError: the file is unreadable, or not a regular file (a FIFO is refused in
            one line, not waited on).
    """
    path = out / FAILED_NAME
    advice = "delete it (it only lists failed runs) and run again"
    try:
        data = json.loads(read_regular_bytes(path, what="list of failed runs", advice=advice))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # as is_file() said: absent
        return {}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable ({error}); {advice}") from None
    return data if isinstance(data, dict) else {}


def updated_failures(failures: dict[str, dict[str, Any]], outcomes: list[RunOutcome],
                     when: str) -> dict[str, dict[str, Any]]:
    """``failures`` with each failed outcome added (or replaced) and each finished one
    dropped, in run-id order."""
    updated = dict(failures)
    for outcome in outcomes:
        if outcome.error is None:
            updated.pop(outcome.run_id, None)
        else:
            entry: dict[str, Any] = {"error": outcome.error, "when": when}
            if outcome.details:
                entry["traceback"] = outcome.details
            updated[outcome.run_id] = entry
    return dict(sorted(updated.items()))


# ------------------------------------------------------------------------------ progress


class RunProgress:
    """Progress over a study's runs: on a terminal one tqdm bar with an ETA (the last
    finished run and its accuracy as postfix), else one line per finished run, as the
    sequential runner prints."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.finished = 0
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    def update(self, outcome: RunOutcome) -> None:
        self.finished += 1
        if outcome.error is None:
            accuracy = float((outcome.summary or {}).get("final_accuracy", float("nan")))
            line = (f"[{self.finished}/{self.total}] {outcome.run_id}: final accuracy {accuracy:.4f}, "
                    f"{outcome.seconds:.0f} s")
        else:
            line = f"[{self.finished}/{self.total}] {outcome.run_id}: FAILED: {outcome.error}"
        if self.bar is None:
            print(line, file=self.stream, flush=True)
            return
        if outcome.error is None:
            self.bar.set_postfix_str(f"{outcome.run_id} {accuracy:.4f}", refresh=False)
        else:
            self.bar.write(line, file=sys.stderr)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
