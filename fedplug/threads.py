"""How many threads torch computes with: chosen by fedplug, never inherited.

torch starts with one intra-op thread per core. fedplug's CPU models (logistic regression,
the MLP, the small CNNs) do too little work per step to split: on a 2-core machine shared
with other jobs, ``fedplug run`` at torch's default took 2.1-3.2 s a round for a
100,000-client synthetic logreg run, and 0.07 s with one thread (30-40x, issue 41); the
threads mostly wait on each other and on the other jobs. So every runtime (``fedplug
run``, the pipeline, the simulator's parallel workers, the study's Ray workers, Flower's
ServerApp and ClientApps, FedML's ranks) calls :func:`choose_threads`, which uses, in
this order:

1. ``fedplug run --threads N`` (the caller passes it with ``source="--threads"``);
2. ``train.threads`` in the config;
3. ``$FEDPLUG_TORCH_THREADS`` (the pipeline's older switch, kept);
4. else :data:`DEFAULT_THREADS` (1),

never more than the cores this process may run on (``os.sched_getaffinity``) divided by
the processes that share them (the parallel engine's or Ray's workers). ``0`` leaves
torch's own default (one thread per core, or ``OMP_NUM_THREADS``). On CUDA the setting
concerns only the work left on the CPU (data handling, the optimiser of small tensors).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_state: dict[str, Any] = {
    "granted_cores": None,
    "torch_default": None,
    "interop_tried": False,
    "chosen": None,
    "announced": None,
}
"""Per process: the cores :func:`limit_cores` granted, torch's thread count before fedplug
first changed it, whether the inter-op threads were set, the line describing the last
choice and the last line printed (a forked worker inherits it: the parent already said it)."""

THREADS_VARIABLE = "FEDPLUG_TORCH_THREADS"
"""Environment variable naming the thread count when neither ``--threads`` nor
``train.threads`` does (the pipeline's switch before ``train.threads`` existed)."""
DEFAULT_THREADS = 1
"""Threads when nothing is set: fedplug's CPU models are too small to split (see above)."""
TORCH_DEFAULT = 0
"""A setting that leaves torch's own thread count (one per core, or ``OMP_NUM_THREADS``)."""
MAX_THREADS = 1024
"""The largest setting ``train.threads`` accepts."""


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`decide_threads` chose: ``threads`` (None: torch's own default), the
    setting that decided it (``source``) and, when the cores capped it, the setting asked."""

    threads: int | None
    source: str
    asked: int | None = None

    def describe(self, torch_default: int) -> str:
        """The line printed once per process, e.g. ``fedplug: torch uses 1 thread
        (default; set --threads N to change)``; ``torch_default`` is what torch itself
        would use (said when the setting is 0)."""
        threads = self.threads if self.threads is not None else torch_default
        plural = "thread" if threads == 1 else "threads"
        if self.threads is None:
            setting = f"{self.source} 0: torch's default"
        elif self.asked is not None:
            setting = f"{self.source} {self.asked}, capped to the cores this process may use"
        else:
            setting = self.source
        return f"fedplug: torch uses {threads} {plural} ({setting}; set --threads N to change)"


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask (``os.cpu_count()`` where the
    platform has none), at most what :func:`limit_cores` granted it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    granted = _state["granted_cores"]
    return max(1, min(cores, granted) if granted is not None else cores)


def limit_cores(cores: int) -> None:
    """This process may use ``cores`` of the machine's cores from now on (a Ray task's
    ``num_cpus``: its affinity mask still shows every core of the node), so that every later
    :func:`choose_threads` in it, a run's included, stays within them."""
    _state["granted_cores"] = max(1, int(cores))


def parse_threads(raw: Any, where: str) -> int:
    """``raw`` as a thread setting (a whole number, 0 = torch's default).

    Raises:
        ConfigError: ``raw`` is not a whole number from 0 to :data:`MAX_THREADS`.
    """
    from fedplug.errors import ConfigError

    try:
        threads = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{where}={raw!r}: expected a whole number of threads, e.g. 1 (0 = torch's default)") from None
    if not 0 <= threads <= MAX_THREADS:
        raise ConfigError(f"{where}={raw!r}: use 0 (torch's default) to {MAX_THREADS} threads")
    return threads


def decide_threads(
    setting: int | None,
    *,
    workers: int = 1,
    source: str = "train.threads",
    environ: Mapping[str, str] | None = None,
    cores: int | None = None,
) -> ThreadChoice:
    """The thread count for this process, without applying it (see the module docstring
    for the order of the settings).

    Args:
        setting: the explicit setting (``--threads`` or ``train.threads``); None = not set.
        workers: processes sharing this process's cores (the parallel engine's or Ray's
            workers; default 1): each gets at most ``cores // workers`` threads.
        source: what ``setting`` is called in the printed line.
        environ: where ``$FEDPLUG_TORCH_THREADS`` is read (default ``os.environ``).
        cores: the usable cores (default :func:`usable_cores`).
    """
    environ = os.environ if environ is None else environ
    if setting is None and environ.get(THREADS_VARIABLE, "").strip():
        setting, source = parse_threads(environ[THREADS_VARIABLE], THREADS_VARIABLE), THREADS_VARIABLE
    if setting is None:
        setting, source = DEFAULT_THREADS, "default"
    if setting == TORCH_DEFAULT:
        return ThreadChoice(None, source)
    share = max(1, (cores if cores is not None else usable_cores()) // max(1, workers))
    if setting > share:
        return ThreadChoice(share, source, asked=setting)
    return ThreadChoice(setting, source)


def choose_threads(
    setting: int | None = None,
    *,
    workers: int = 1,
    source: str = "train.threads",
    announce: bool = True,
) -> int:
    """Decide (:func:`decide_threads`) and apply torch's intra-op threads for this
    process; print the choice to stderr once per process (again only if it changes).
    Returns torch's thread count afterwards.

    The inter-op pool is sized once, the first time, to the same count: torch allows
    that only before any inter-op work started, so a later call leaves it as it is.
    """
    import torch

    choice = decide_threads(setting, workers=workers, source=source)
    if _state["torch_default"] is None:
        _state["torch_default"] = torch.get_num_threads()
    threads = choice.threads if choice.threads is not None else _state["torch_default"]
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if not _state["interop_tried"]:
        _state["interop_tried"] = True
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # inter-op work already ran in this process: too late, harmless
            pass
    _state["chosen"] = choice.describe(_state["torch_default"])
    if announce:
        announce_threads()
    return torch.get_num_threads()


def announce_threads() -> None:
    """Print the last choice of :func:`choose_threads` to stderr, unless this process
    already printed that line (``fedplug run`` chooses before loading the data and says
    so once the run can no longer be refused)."""
    line = _state.get("chosen")
    if line is not None and _state["announced"] != line:
        _state["announced"] = line
        print(line, file=sys.stderr, flush=True)


def sharing_processes(train: Any) -> int:
    """How many processes of one run share this process's cores: the parallel engine's
    workers (``train.workers``, default one per usable core), else 1."""
    if getattr(train, "engine", None) != "parallel":
        return 1
    return getattr(train, "workers", None) or usable_cores()


def choose_run_threads(
    train: Any, override: int | None = None, *, workers: int | None = None, announce: bool = True
) -> int:
    """:func:`choose_threads` for a run of ``train`` (a validated ``train`` section):
    ``override`` (``fedplug run --threads``) first, else ``train.threads``. ``workers``:
    the processes sharing the cores (default :func:`sharing_processes`: the parallel
    engine's workers, else 1; FedML passes its ranks)."""
    if override is not None:
        setting, source = override, "--threads"
    else:
        setting, source = getattr(train, "threads", None), "train.threads"
    workers = workers if workers is not None else sharing_processes(train)
    return choose_threads(setting, workers=workers, source=source, announce=announce)
