"""What every MPI rank runs: ``python -m fedplug.adapters.fedml.rank`` under ``mpirun``.

Rank 0 is FedML's server (a :class:`~.fedml_components.FedplugServerAggregator`), ranks
1..W are workers (a :class:`~.fedml_components.FedplugClientTrainer` each). The launcher
(:mod:`.launcher`) starts them; run it, not this module.

Files written to ``--out``: ``metrics.json`` after every round and ``model.pt`` at the
end (rank 0); ``network-rank<r>.json`` (every rank: the attempts the loopback guard
refused, normally none); ``error-rank<r>.json`` when a rank fails, after which it aborts
the whole MPI job so that no rank waits forever; ``abandoned-ranks.json`` (rank 0) when
the run finished but a worker that missed a deadline (``train.failures.
client_timeout_seconds``, :mod:`.deadlines`) did not: rank 0 has saved the result and
ends the MPI job itself instead of waiting for that rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import guard

logger = logging.getLogger("fedplug.adapters.fedml")


def main(argv: Sequence[str] | None = None) -> int:
    guard.install()  # before FedML is imported
    parser = argparse.ArgumentParser(description="One MPI rank of a fedplug run on FedML.")
    parser.add_argument("--experiment", required=True, help="resolved experiment config (JSON)")
    parser.add_argument("--fedml-config", required=True, help="FedML's YAML config")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--workers", type=int, required=True, help="number of worker ranks W")
    options = parser.parse_args(argv)
    out = Path(options.out)

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        abandoned = run_rank(rank, MPI.COMM_WORLD.Get_size(), options, out)
    except BaseException as error:  # noqa: BLE001 - any failure must end every rank
        _write_json(
            out / f"error-rank{rank}.json",
            {
                "rank": rank,
                "type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(),
            },
        )
        traceback.print_exc()
        _write_json(out / f"network-rank{rank}.json", guard.blocked())
        if not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(1)
        return 1
    _write_json(out / f"network-rank{rank}.json", guard.blocked())
    if abandoned:
        # The result is saved; the ranks given up on would keep MPI.Finalize (and mpirun)
        # waiting, so the job ends here. The launcher reads abandoned-ranks.json.
        _write_json(out / ABANDONED_FILE, {"ranks": [slot + 1 for slot in abandoned]})
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(0)
    return 0


ABANDONED_FILE = "abandoned-ranks.json"
"""Rank 0's note that the run finished without the worker ranks it names."""


def run_rank(rank: int, size: int, options: argparse.Namespace, out: Path) -> list[int]:
    """Run this rank's part; return the worker slots rank 0 gave up on after the last
    round (always empty on the workers)."""
    import torch

    from fedplug.config import validate_experiment
    from fedplug.data.build import build_federation
    from fedplug.errors import ConfigError
    from fedplug.plugins import default_registry
    from fedplug.run.model import build_model, resolve_device
    from fedplug.safe_files import read_regular_bytes

    from .coordinator import Coordinator
    from .protocol import plan_rounds
    from .runtime import TESTED_FEDML_VERSION, check_supported, fedml_arguments, fedml_dataset
    from .worker import Worker

    workers = options.workers
    if size != workers + 1:
        raise ConfigError(
            f"started with {size} MPI ranks; a run on {workers} workers needs {workers + 1}"
        )
    # Not read_text(): a FIFO planted in the run folder is refused, not waited on.
    experiment = read_regular_bytes(options.experiment, what="FedML experiment file", advice="remove it and run again")
    config = validate_experiment(json.loads(experiment))
    check_supported(config)
    choose_rank_threads(config.train, rank, size)
    registry = default_registry()
    device = resolve_device(config.train.device)
    federation = build_federation(config.data, registry, device)
    schedule = plan_rounds(config.train, registry, federation.class_counts)

    # FedML last: its import takes most of a rank's start-up, so config and data errors
    # surface first.
    import fedml
    from fedml import FedMLRunner

    from .fedml_components import FedplugClientTrainer, FedplugServerAggregator
    from .server import run_server

    if fedml.__version__ != TESTED_FEDML_VERSION:
        logger.warning(
            "fedplug's FedML adapter was tested with FedML %s, this is %s",
            TESTED_FEDML_VERSION,
            fedml.__version__,
        )
    args = fedml_arguments(options.fedml_config)
    args.comm_round = schedule.fedml_rounds
    args = fedml.init(args, check_env=False)
    dataset = fedml_dataset(federation, workers, config.train.eval_batch_size)
    if rank == 0:
        from fedplug.output_folder import write_atomically
        from fedplug.run_folder import write_json

        def save(_record: Any) -> None:
            write_json(out / "metrics.json", coordinator.result.summary())
            write_json(out / "run_result.json", asdict(coordinator.result))

        coordinator = Coordinator(
            config.train,
            federation,
            registry,
            schedule,
            workers,
            target_accuracy=config.study.target_accuracy,
            on_round=save,
        )
        aggregator = FedplugServerAggregator(coordinator.model, args, coordinator)
        # FedML's cross-silo server, with a deadline on its wait for the workers.
        abandoned = run_server(args, device, dataset, aggregator, coordinator)
        if not coordinator.finished:
            raise RuntimeError(
                f"FedML stopped after {len(coordinator.result.history)} of {config.train.rounds} rounds"
            )
        state = coordinator.model.state_dict()
        write_atomically(out / "model.pt", lambda handle: torch.save(state, handle), what="model")
        return abandoned
    else:
        model = build_model(config.train, registry, federation, device)
        worker = Worker(config.train, federation, registry, model, rank - 1, workers)
        trainer = FedplugClientTrainer(model, args, worker)
        FedMLRunner(args, device, dataset, model, client_trainer=trainer).run()
    return []


def choose_rank_threads(train: Any, rank: int, size: int) -> int:
    """torch's threads in this rank (:func:`fedplug.threads.choose_threads`):
    ``train.threads``, else the launcher's ``--threads-per-rank`` (every rank's
    ``OMP_NUM_THREADS``, :func:`.guard.fedml_environment`); the ``size`` ranks share this
    machine's cores. Rank 0 says what it chose."""
    import os

    from fedplug.threads import choose_threads, parse_threads

    setting, source = train.threads, "train.threads"
    if setting is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        setting, source = parse_threads(os.environ["OMP_NUM_THREADS"], "--threads-per-rank"), "--threads-per-rank"
    return choose_threads(setting, workers=size, source=source, announce=rank == 0)


def _write_json(path: Path, data: Any) -> None:
    """Atomically through a unique temporary name: every rank writes into ``out``."""
    from fedplug.output_folder import write_text

    write_text(path, json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
