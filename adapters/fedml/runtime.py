"""FedML's inputs built from a fedplug experiment: its arguments and its dataset tuple.

No FedML import here (the launcher, which runs outside the FedML processes, uses it too).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, TensorDataset

from fedplug.data.federation import Federation
from fedplug.errors import ConfigError

from .protocol import owner_of

TESTED_FEDML_VERSION = "0.9.6"


def check_supported(config: Any) -> None:
    """Refuse, before any process starts, what the FedML adapter cannot run.

    Raises:
        ConfigError: ``train.engine`` is ``vectorized`` (FedML workers train client by
            client with the sequential loop).
    """
    if config.train.engine == "vectorized":
        raise ConfigError(
            "train.engine 'vectorized' cannot run under FedML: each FedML worker trains its clients one "
            "after another with fedplug's sequential loop; use train.engine: sequential (or auto)"
        )


def fedml_config(config: Any, workers: int) -> dict[str, Any]:
    """FedML's YAML config (its section layout) for a run of ``config`` on ``workers``
    worker ranks.

    FedML's client sampling is made the identity: ``client_num_in_total`` and
    ``client_num_per_round`` both equal the number of worker ranks, so FedML's
    ``client_selection`` and ``data_silo_selection``
    (``fedml/cross_silo/server/fedml_aggregator.py``) return every worker with its own
    index every round, and fedplug's sampler decides which clients each worker trains.
    ``comm_round`` is set by each rank from the schedule (:func:`.protocol.plan_rounds`).
    ``epochs``, ``batch_size`` and ``learning_rate`` are informational: FedML's trainer
    is replaced by fedplug's, which reads ``train``. ``using_gpu`` is False because FedML
    picks no device here: every rank puts its model where ``train.device`` says.
    """
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    train = config.train
    return {
        "common_args": {
            "training_type": "cross_silo",
            "scenario": "horizontal",
            "using_mlops": False,
            "random_seed": train.seed,
            "config_version": "local",
        },
        "data_args": {
            "dataset": f"fedplug-{config.data.dataset.name}",
            "data_cache_dir": str(config.data.root_path()),
        },
        "model_args": {"model": f"fedplug-{train.model.name}"},
        "train_args": {
            "federated_optimizer": "FedAvg",
            "client_num_in_total": workers,
            "client_num_per_round": workers,
            "epochs": train.local_epochs,
            "batch_size": train.batch_size,
            "client_optimizer": train.optimizer.name,
            "learning_rate": train.optimizer.lr,
        },
        "validation_args": {"frequency_of_the_test": 1},
        "device_args": {"worker_num": workers, "using_gpu": False},
        "comm_args": {"backend": "MPI", "is_mobile": 0},
        "tracking_args": {
            "enable_wandb": False,
            "skip_log_model_net": True,
            "sys_perf_profiling": False,
        },
    }


def fedml_arguments(config_path: str | Path) -> Any:
    """FedML's ``Arguments`` for a config file, without reading ``sys.argv`` (what
    ``fedml.load_arguments`` would do from ``--cf``)."""
    from fedml.arguments import Arguments

    command_line = argparse.Namespace(
        yaml_config_file=str(config_path),
        run_id="0",
        rank=0,
        local_rank=0,
        node_rank=0,
        role="client",
        run_device_id="0",
        using_mlops=False,
    )
    return Arguments(command_line)


def fedml_dataset(federation: Federation, workers: int, eval_batch_size: int) -> list[Any]:
    """FedML's eight-entry dataset list, from fedplug's federation.

    The "local" dictionaries are keyed by worker slot (FedML's silo index): worker ``w``'s
    entry is the list of client ids it owns, and its sample count is theirs summed. The
    global test set is a ``DataLoader`` over the federation's test tensors.
    """
    owned = {
        slot: [k for k in range(federation.num_clients) if owner_of(k, workers) == slot]
        for slot in range(workers)
    }
    samples = {
        slot: sum(federation.clients[k].num_samples for k in clients)
        for slot, clients in owned.items()
    }
    test_loader = DataLoader(
        TensorDataset(federation.test_x, federation.test_y), batch_size=eval_batch_size
    )
    return [
        sum(samples.values()),
        int(federation.test_y.shape[0]),
        None,
        test_loader,
        samples,
        owned,
        {slot: list(clients) for slot, clients in owned.items()},
        federation.num_classes,
    ]
