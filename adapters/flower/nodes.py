"""The ready ClientApp's work on a node: rebuild this node's client of a fedplug
experiment and answer the server's query, train, setup-phase and evaluate messages.

The server sends the experiment (its ``data`` and ``train`` sections, as JSON) with
every message, so nodes need no config file and always run the server's config. A node
builds the federation with :func:`fedplug.data.build.build_federation` and keeps only
its own shard, the client ``partition-id`` of its node config (``num-partitions`` must
equal ``data.num_clients``); this is how a fedplug experiment's non-IID split is
reproduced on Flower nodes (a real deployment would read the node's own data instead,
see :class:`~fedplug.adapters.flower.FedplugTrainer`).

The caches live in this imported module on purpose: Flower's Ray workers re-execute
an app script's globals for every message (measured: about 10x slower), but keep
imported modules. Under ``flower-supernode`` each message runs in a fresh
``flwr-clientapp`` process, so there the shard is rebuilt per message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Context, Message
from torch import nn

from fedplug.config import validate_experiment
from fedplug.data.build import build_federation
from fedplug.data.federation import ClientData, Federation
from fedplug.errors import ConfigError
from fedplug.run.model import build_model, resolve_device

from .records import CLIENT_ID, CONFIG_KEY, integer
from .trainer import FedplugTrainer

EXPERIMENT = "fedplug.experiment"
"""ConfigRecord key of the experiment JSON (``{"data": ..., "train": ...}``)."""
EXPERIMENT_ID = "fedplug.experiment-id"
"""ConfigRecord key of its digest: the cache key on nodes and the namespace of client
state in ``context.state``, so one Flower run can run several experiments."""


def experiment_message_config(experiment: Any) -> dict[str, str]:
    """The ConfigRecord entries that carry ``experiment`` (a validated experiment config)
    to the nodes."""
    text = json.dumps(
        {
            "data": experiment.data.model_dump(mode="json"),
            "train": experiment.train.model_dump(mode="json"),
        },
        sort_keys=True,
    )
    return {EXPERIMENT: text, EXPERIMENT_ID: hashlib.sha256(text.encode()).hexdigest()[:16]}


@dataclass
class NodeExperiment:
    """One experiment as this node runs it."""

    experiment_id: str
    config: Any
    client: ClientData
    model: nn.Module
    trainer: FedplugTrainer

    @property
    def state_namespace(self) -> str:
        return f"fedplug.{self.experiment_id}"


_experiments: dict[tuple[str, int], NodeExperiment] = {}
_federation: dict[str, Federation] = {}
"""At most one federation per process (the last data config seen)."""


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config.

    Raises:
        ConfigError: the node was started without them.
    """
    node_config = context.node_config
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ConfigError(
            "this node has no partition-id / num-partitions in its node config; start it with "
            "flower-supernode --node-config 'partition-id=<k> num-partitions=<K>'"
        )
    return integer(node_config, "partition-id"), integer(node_config, "num-partitions")


def node_experiment(message: Message, context: Context) -> NodeExperiment:
    """This node's client of the experiment the message carries (cached per process).

    Raises:
        ConfigError: the message carries no experiment, or the node's partition does not
            fit it.
    """
    config = message.content.config_records.get(CONFIG_KEY, ConfigRecord())
    if EXPERIMENT not in config or EXPERIMENT_ID not in config:
        raise ConfigError(
            "the message carries no fedplug experiment; run the ServerApp "
            "fedplug.adapters.flower.apps:server_app (or make_server_app) with this ClientApp"
        )
    partition, partitions = node_partition(context)
    experiment_id = str(config[EXPERIMENT_ID])
    cached = _experiments.get((experiment_id, partition))
    if cached is not None:
        return cached
    experiment = validate_experiment(json.loads(str(config[EXPERIMENT])))
    num_clients = experiment.data.num_clients
    if partitions != num_clients or not 0 <= partition < num_clients:
        raise ConfigError(
            f"this node has partition-id={partition} num-partitions={partitions}, but the experiment "
            f"has data.num_clients={num_clients}; start nodes with num-partitions={num_clients} and "
            f"partition-id 0..{num_clients - 1}"
        )
    from fedplug.plugins import default_registry
    from fedplug.threads import choose_run_threads

    # torch's threads as the server's (train.threads, else 1), set once per experiment in this
    # process; the ServerApp says what they are, so many nodes do not repeat it.
    choose_run_threads(experiment.train, announce=False)
    registry = default_registry()
    device = resolve_device(experiment.train.device)
    data_key = json.dumps([experiment.data.model_dump(mode="json"), str(device)], sort_keys=True)
    federation = _federation.get(data_key)
    if federation is None:
        _federation.clear()
        federation = _federation[data_key] = build_federation(experiment.data, registry, device)
    node = NodeExperiment(
        experiment_id=experiment_id,
        config=experiment,
        client=federation.clients[partition],
        model=build_model(experiment.train, registry, federation, device),
        trainer=FedplugTrainer(
            experiment.train, registry=registry, num_classes=federation.num_classes
        ),
    )
    _experiments[(experiment_id, partition)] = node
    return node


def _check_client(message: Message, context: Context) -> None:
    """Raise ConfigError when the message is for another client than this node's."""
    config = message.content.config_records[CONFIG_KEY]
    partition, _ = node_partition(context)
    requested = integer(config, CLIENT_ID, partition)
    if requested != partition:
        raise ConfigError(f"asked to train client {requested} on the node of client {partition}")


def handle_query(message: Message, context: Context) -> Message:
    """Reply with this client's class counts (:meth:`FedplugTrainer.describe`)."""
    node = node_experiment(message, context)
    return node.trainer.describe(node.client, message, context)


def handle_train(message: Message, context: Context) -> Message:
    """Train this client from the message's model (:meth:`FedplugTrainer.fit`).

    Raises:
        ConfigError: the server asked this node to train another client.
    """
    node = node_experiment(message, context)
    _check_client(message, context)
    return node.trainer.fit(
        node.model, node.client, message, context, state_namespace=node.state_namespace
    )


def handle_setup_phase(message: Message, context: Context) -> Message:
    """Do one step of the loss transform's setup phase on this client's training data
    (:meth:`FedplugTrainer.setup_phase`).

    Raises:
        ConfigError: the server asked this node about another client.
    """
    node = node_experiment(message, context)
    _check_client(message, context)
    return node.trainer.setup_phase(
        node.client,
        message,
        context,
        device=node.client.train_x.device,
        state_namespace=node.state_namespace,
    )


def handle_evaluate(message: Message, context: Context) -> Message:
    """Evaluate the message's model on this client's local test split."""
    node = node_experiment(message, context)
    return node.trainer.evaluate(node.model, (node.client.test_x, node.client.test_y), message)
