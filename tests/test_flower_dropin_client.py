"""Test (b) of issue 14: a quickstart-shaped Flower ClientApp (its own Net, its own loop
with ``torch.optim.SGD``, dict batches) gains each client-side algorithm in at most five
changed lines, and runs against :class:`FedplugStrategy`.

Each variant's source is the base app's source with the variant's lines edited in
(:func:`variant_source`), so the diff the test counts is the diff a user would write.
The apps run on the in-process :class:`LoopbackGrid`; one slow test runs them all in a
single ``run_simulation``. Where the loop is fedplug's own (plain SGD, fedplug's batches,
cross-entropy), two rounds end at the simulator's global model within 1e-5.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_EXPERIMENT
from fedplug.adapters.flower import (
    FedplugLoss,
    FedplugStrategy,
    LoopbackGrid,
    RoundSampler,
    answer_class_counts,
    with_sample_ids,
)
from fedplug.adapters.flower.loopback import ensure_task_identity
from fedplug.adapters.flower.records import (
    CLIENT_ID,
    CONFIG_KEY,
    EXTRAS_KEY,
    METRICS_KEY,
    NUM_CLASSES,
    NUM_STEPS,
    PAYLOAD_KEY,
    ROUND,
    model_record,
    tensors_to_record,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedplug.algorithms.uniform import UniformSampler
from fedplug.config import validate_experiment, validate_section
from fedplug.data.build import build_federation
from fedplug.errors import ConfigError, TrainingError
from fedplug.experiment import run_experiment
from fedplug.plugins import default_registry
from fedplug.run.local_training import (
    ClientAlgorithm,
    LocalSchedule,
    local_rng,
    train_locally,
)
from fedplug.run.model import build_model
from fedplug.run.vectors import model_to_vector, vector_to_model

NUM_CLIENTS = 4
ROUNDS = 2
MAX_CHANGED_LINES = 5

# ----------------------------------------------------------------- the user's app

BASE_APP = '''
import torch
from torch import nn
from torch.utils.data import DataLoader
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

BATCH_SIZE = 16
LEARNING_RATE = 0.5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id):
    """This node's (train, test) datasets of {"img": ..., "label": ...} samples."""
    return PARTITIONS[partition_id]


app = ClientApp()


@app.train()
def train(msg, context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainset, _ = load_data(context.node_config["partition-id"])
    trainloader = DataLoader(trainset, batch_size=BATCH_SIZE, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()
    model.train()
    running_loss = 0.0
    for batch in trainloader:
        optimizer.zero_grad()
        loss = criterion(model(batch["img"]), batch["label"])
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
    metrics = {"train_loss": running_loss / max(1, len(trainloader)), "num-examples": len(trainset)}
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg, context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testset = load_data(context.node_config["partition-id"])
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in DataLoader(testset, batch_size=64):
            correct += int((model(batch["img"]).argmax(1) == batch["label"]).sum())
    metrics = {"accuracy": correct / max(1, len(testset)), "num-examples": len(testset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
'''

DATA_OF = 'lambda context: load_data(context.node_config["partition-id"])[0]'
LOADER = "trainloader = DataLoader(trainset, batch_size=BATCH_SIZE, shuffle=True)"
CRITERION = "criterion = nn.CrossEntropyLoss()"
IMPORT = "from flwr.clientapp import ClientApp"
APP = "app = ClientApp()"

Edit = tuple[str, list[str]]
"""A line of the base app and the lines that replace it (the line itself kept, for an
insertion)."""

VARIANTS: dict[str, list[Edit]] = {
    "iwds": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import RoundSampler"]),
        (APP, [APP, 'iwds = RoundSampler({"name": "iwds"}, seed=0, app=app)']),
        (
            LOADER,
            [
                "trainloader = DataLoader(trainset, batch_size=BATCH_SIZE, "
                "sampler=iwds.for_round(msg, context, trainset))"
            ],
        ),
    ],
    # FedProx, with fedplug's own shuffling so that the batches are the simulator's.
    "fedprox": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss, RoundSampler"]),
        (
            APP,
            [
                APP,
                'fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": 0.1}, app=app)',
                'shuffle = RoundSampler({"name": "uniform"}, seed=0, app=app)',
            ],
        ),
        (
            LOADER,
            [
                "trainloader = DataLoader(trainset, batch_size=BATCH_SIZE, "
                "sampler=shuffle.for_round(msg, context, trainset))"
            ],
        ),
        (CRITERION, ["criterion = fedprox.begin_round(msg, context, model)"]),
    ],
    "fedshift": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss"]),
        (
            APP,
            [APP, f'fedshift = FedplugLoss(loss_transform={{"name": "fedshift"}}, app=app, data={DATA_OF})'],
        ),
        (CRITERION, ["criterion = fedshift.begin_round(msg, context, model, trainset)"]),
    ],
    "reweighting": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss"]),
        (
            APP,
            [
                APP,
                f'reweighting = FedplugLoss(loss_transform={{"name": "reweighting"}}, app=app, data={DATA_OF})',
            ],
        ),
        (CRITERION, ["criterion = reweighting.begin_round(msg, context, model, trainset)"]),
    ],
    "scaffold": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss"]),
        (APP, [APP, 'scaffold = FedplugLoss(aggregator={"name": "scaffold"}, app=app)']),
        (CRITERION, ["criterion = scaffold.begin_round(msg, context, model)"]),
        (
            'content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})',
            [
                'content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})',
                "scaffold.finish_round(content, optimizer)",
            ],
        ),
    ],
    # FedNova's client side reports a_k (its normalising factor) with the model.
    "fednova": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss"]),
        (APP, [APP, 'fednova = FedplugLoss(aggregator={"name": "fednova"}, app=app)']),
        (CRITERION, ["criterion = fednova.begin_round(msg, context, model)"]),
        (
            'content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})',
            [
                'content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})',
                "fednova.finish_round(content, optimizer)",
            ],
        ),
    ],
    # FedGSP's inter-cluster grouping needs every node's class counts: one query handler.
    "fedgsp_icg": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import answer_class_counts"]),
        (APP, [APP, f"answer_class_counts(app, {DATA_OF})"]),
    ],
    "feddisk": [
        (IMPORT, [IMPORT, "from fedplug.adapters.flower import FedplugLoss, with_sample_ids"]),
        (
            APP,
            [APP, f"feddisk = FedplugLoss(loss_transform=FEDDISK, app=app, data={DATA_OF})"],
        ),
        (
            LOADER,
            ["trainloader = DataLoader(with_sample_ids(trainset), batch_size=BATCH_SIZE, shuffle=True)"],
        ),
        (CRITERION, ["criterion = feddisk.begin_round(msg, context, model, trainset)"]),
        (
            'loss = criterion(model(batch["img"]), batch["label"])',
            ['loss = criterion(model(batch["img"]), batch["label"], batch["sample_id"])'],
        ),
    ],
}

FEDDISK = {
    "name": "feddisk",
    "made_hidden": 8,
    "made_max_epochs": 1,
    "global_rounds": 1,
    "classifier_hidden": 8,
    "classifier_epochs": 1,
}
# The server's train config of each variant (the same components as the client's).
SERVER_TRAIN: dict[str, dict[str, Any]] = {
    "iwds": {"sampler": {"name": "iwds"}},
    "fedprox": {"loss_transform": {"name": "fedprox", "mu": 0.1}},
    "fedshift": {"loss_transform": {"name": "fedshift"}},
    "reweighting": {"loss_transform": {"name": "reweighting"}},
    "scaffold": {"aggregator": {"name": "scaffold"}},
    "feddisk": {"loss_transform": FEDDISK},
    "fednova": {"aggregator": {"name": "fednova"}},
    "fedgsp_icg": {"grouper": {"name": "fedgsp", "mode": "naive_icg", "fixed_groups": 2, "group_fraction": 1.0}},
}


def variant_source(name: str) -> str:
    """The base app with the variant's edits; each anchor must be exactly one line."""
    lines = BASE_APP.splitlines()
    for anchor, replacement in VARIANTS[name]:
        matches = [i for i, line in enumerate(lines) if line.strip() == anchor]
        assert len(matches) == 1, f"{name}: anchor {anchor!r} found {len(matches)} times"
        index = matches[0]
        indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
        lines[index : index + 1] = [indent + line for line in replacement]
    return "\n".join(lines) + "\n"


def changed_lines(before: str, after: str) -> list[str]:
    """The lines of ``after`` that are new or edited (a diff's '+' lines)."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]


# -------------------------------------------------------------------- the federation


class DictDataset(Dataset):
    """flwr-datasets-style samples: ``{"img": tensor, "label": int}``."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"img": self.inputs[index], "label": int(self.labels[index])}


def experiment(name: str) -> Any:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_CLIENTS
    data["train"].update(rounds=ROUNDS, client_fraction=1.0, **copy.deepcopy(SERVER_TRAIN[name]))
    return validate_experiment(data)


def partitions(config: Any) -> dict[int, tuple[DictDataset, DictDataset]]:
    federation = build_federation(config.data, default_registry())
    return {
        k: (
            DictDataset(client.train_x, client.train_y),
            DictDataset(client.test_x, client.test_y),
        )
        for k, client in enumerate(federation.clients)
    }


def load_app(source: str, name: str, data: dict[int, Any]) -> dict[str, Any]:
    """Run an app's source as a module of its own; return its namespace (``app``,
    ``Net``, ...)."""
    namespace: dict[str, Any] = {
        "__name__": f"quickstart_{name}",
        "PARTITIONS": data,
        "FEDDISK": FEDDISK,
    }
    exec(compile(source, f"<quickstart_{name}>", "exec"), namespace)  # noqa: S102
    return namespace


def build_app(name: str, data: dict[int, Any]) -> ClientApp:
    return load_app(variant_source(name), name, data)["app"]


def initial_model(config: Any) -> nn.Module:
    """The user's ``Net`` holding the simulator's initial model (fedplug's ``mlp`` from
    ``train.seed``: the same layers in the same order)."""
    federation = build_federation(config.data, default_registry())
    simulated = build_model(config.train, default_registry(), federation, torch.device("cpu"))
    net = load_app(BASE_APP, "base", {})["Net"]()
    vector_to_model(model_to_vector(simulated), net)
    return net


def run_variant(
    name: str, grid: Any = None, num_clients: int | None = NUM_CLIENTS
) -> tuple[FedplugStrategy, Any, LoopbackGrid | Any]:
    """Two rounds of the variant against FedplugStrategy, Flower-style
    (``strategy.start(grid=..., initial_arrays=..., num_rounds=...)``)."""
    config = experiment(name)
    if grid is None:
        grid = LoopbackGrid(build_app(name, partitions(config)), NUM_CLIENTS)
    model = initial_model(config)
    strategy = FedplugStrategy(
        config.train,
        num_clients=num_clients,
        num_classes=4,
        model=copy.deepcopy(model),
        federated_evaluation=False,
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=ROUNDS)
    return strategy, result, grid


# ------------------------------------------------------------------------- test (b)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_algorithm_is_at_most_five_changed_lines(name: str) -> None:
    # Execute
    source = variant_source(name)
    changed = changed_lines(BASE_APP, source)
    # Assert: the diff a user writes, and it compiles.
    assert 0 < len(changed) <= MAX_CHANGED_LINES, "\n".join(changed)
    compile(source, name, "exec")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_variant_runs_against_fedplug_strategy(name: str) -> None:
    # Execute
    strategy, _, grid = run_variant(name)
    # Assert: both rounds accepted every client's reply.
    history = strategy.run_result.history
    assert [record.round for record in history] == [1, 2]
    assert [record.failures for record in history] == [0, 0]
    assert [record.participants for record in history] == [NUM_CLIENTS, NUM_CLIENTS]
    assert torch.isfinite(strategy.final_vector).all()
    types = {message.metadata.message_type for message in grid.delivered}
    if name == "feddisk":  # the setup phase ran on the nodes, through the app's handler
        assert "train.feddisk" in types
    if name in ("fedshift", "reweighting", "fedgsp_icg"):  # the counts were asked for and answered
        assert MessageType.QUERY in types
    if name == "fedgsp_icg":  # the groups were chains of two, handed on through the server
        assert all("cpd_median" in record.metrics for record in history)
    if name == "scaffold":  # the replies carried delta_c, and the server's c moved
        assert float(strategy.aggregator.control.abs().sum()) > 0


@pytest.mark.parametrize("name", ["fedprox", "iwds"])
def test_where_the_loop_is_fedplugs_the_run_equals_the_simulators(name: str) -> None:
    # Prepare
    config = experiment(name)
    simulated, simulator = run_experiment(config, None)
    # Execute
    strategy, _, _ = run_variant(name)
    # Assert
    torch.testing.assert_close(strategy.final_vector, simulator.final_vector, rtol=0, atol=1e-5)
    for ours, theirs in zip(strategy.run_result.history, simulated.history):
        assert ours.bytes_up == theirs.bytes_up


class ConnectingGrid(LoopbackGrid):
    """Nodes that connect one by one, as a Ray simulation's do: two at first, then one
    more each time the server looks."""

    def __init__(self, client_app: ClientApp, num_nodes: int) -> None:
        super().__init__(client_app, num_nodes)
        self.waiting = sorted(self.contexts)[2:]
        self.connected = set(sorted(self.contexts)[:2])

    def get_node_ids(self) -> list[int]:
        ids = sorted(self.connected)
        if self.waiting:
            self.connected.add(self.waiting.pop(0))
        return ids


def test_without_num_clients_the_run_waits_for_the_partitions_the_nodes_report() -> None:
    """Flower's ``FedAvg`` takes no client count: the run's K is the ``num-partitions``
    the nodes report, even when only two of the four have connected when it starts."""
    # Prepare
    config = experiment("fedshift")
    grid = ConnectingGrid(build_app("fedshift", partitions(config)), NUM_CLIENTS)
    # Execute
    torch.manual_seed(0)  # the app's own DataLoader shuffles with torch's global generator
    late, _, _ = run_variant("fedshift", grid, num_clients=None)
    torch.manual_seed(0)
    present, _, _ = run_variant("fedshift", num_clients=None)
    # Assert: every node was asked for its counts, and the run is the one where all four
    # were connected from the start.
    queried = {m.metadata.dst_node_id for m in grid.delivered if m.metadata.message_type == MessageType.QUERY}
    assert queried == set(grid.contexts)
    assert [record.participants for record in late.run_result.history] == [NUM_CLIENTS, NUM_CLIENTS]
    torch.testing.assert_close(late.final_vector, present.final_vector, rtol=0, atol=0)


def test_nodes_reporting_different_partition_counts_are_refused_by_name() -> None:
    config = experiment("fedshift")
    node_configs = [{"partition-id": k, "num-partitions": 3 + (k == 3)} for k in range(NUM_CLIENTS)]
    grid = LoopbackGrid(build_app("fedshift", partitions(config)), NUM_CLIENTS, node_configs=node_configs)
    with pytest.raises(TrainingError, match=r"different num-partitions \(\{3: \[1000, 1001, 1002\], 4: \[1003\]\}\)"):
        run_variant("fedshift", grid, num_clients=None)


# ------------------------------------------------------------------- the pieces alone


def message(model: nn.Module, server_round: int = 1, client: int = 0, **records: Any) -> Message:
    ensure_task_identity()
    content = RecordDict(
        {
            "arrays": model_record(model),
            CONFIG_KEY: ConfigRecord({ROUND: server_round, CLIENT_ID: client, NUM_CLASSES: 3}),
        }
    )
    for key, record in records.items():
        content[key] = record
    return Message(content, dst_node_id=1000, message_type=MessageType.TRAIN)


def node_context(partition: int = 0) -> Context:
    return Context(
        run_id=1,
        node_id=1000 + partition,
        node_config={"partition-id": partition, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )


def small_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def small_data(num_samples: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    labels = torch.tensor([0] * 20 + [1] * 7 + [2] * 3)[:num_samples]
    return torch.rand(num_samples, 4, generator=generator), labels


def test_round_sampler_draws_the_simulators_indices_epoch_after_epoch() -> None:
    # Prepare: client 2, round 3, seed 7; the simulator draws its epochs from one stream.
    inputs, labels = small_data()
    registry = default_registry()
    component = registry.build("samplers", validate_section("train", {"sampler": {"name": "iwds"}}).sampler)
    counts = np.bincount(labels.numpy(), minlength=3)
    rng = local_rng(7, 2, 2)
    expected = [component.epoch_indices(labels.numpy(), counts, 2, rng).tolist() for _ in range(2)]
    sampler = RoundSampler({"name": "iwds"}, seed=7)
    # Execute: two passes over a DataLoader of dict samples, after the round's message.
    dataset = DictDataset(inputs, labels)
    sampler.for_round(message(small_model(), server_round=3, client=2), node_context(), dataset)
    assert len(sampler) == 30
    epochs = [list(sampler) for _ in range(2)]
    # Then the same round again (a retry) restarts the stream.
    sampler.set_round(3, dataset, client_id=2, num_classes=3)
    again = list(sampler)
    # Assert
    assert epochs == expected
    assert again == expected[0]
    loader = DataLoader(dataset, batch_size=8, sampler=sampler.set_round(3, labels, client_id=2))
    assert [int(i) for batch in loader for i in batch["label"]] == labels[expected[0]].tolist()


def test_round_sampler_reads_the_partition_id_without_a_fedplug_server() -> None:
    # Prepare: a stock strategy's message has only server-round.
    ensure_task_identity()
    _, labels = small_data()
    stock = Message(
        RecordDict({CONFIG_KEY: ConfigRecord({ROUND: 2})}), dst_node_id=1000, message_type="train"
    )
    sampler = RoundSampler({"name": "uniform"}, seed=0)
    # Execute
    drawn = list(sampler.for_round(stock, node_context(partition=1), labels))
    # Assert: client 1 (its partition id), round index 1: a permutation from that stream.
    counts = np.bincount(labels.numpy(), minlength=3)
    expected = UniformSampler().epoch_indices(labels.numpy(), counts, 1, local_rng(0, 1, 1))
    assert drawn == expected.tolist()
    assert sorted(drawn) == list(range(30))


def fedplug_reference(
    train: dict[str, Any], model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: Any
) -> Any:
    """train_locally with the given components, batch 10, one epoch, SGD lr 0.1."""
    registry = default_registry()
    config = validate_section(
        "train", {**train, "batch_size": 10, "optimizer": {"name": "sgd", "lr": 0.1}}, registry
    )
    algorithm = ClientAlgorithm(
        sampler=registry.build("samplers", config.sampler),
        loss_transform=registry.build("loss_transforms", config.loss_transform),
        aggregator=registry.build("aggregators", config.aggregator, 1),
    )
    return train_locally(
        model,
        model_to_vector(model),
        inputs,
        labels,
        np.bincount(labels.numpy(), minlength=3),
        algorithm=algorithm,
        schedule=LocalSchedule(1, 10, config.optimizer),
        round_index=0,
        rng=local_rng(0, 0, 0),
        **kwargs,
    )


def own_loop(criterion: Any, model: nn.Module, loader: DataLoader, lr: float = 0.1) -> Any:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in loader:
        inputs, labels = (batch["img"], batch["label"]) if isinstance(batch, dict) else batch
        optimizer.zero_grad()
        criterion(model(inputs), labels).backward()
        optimizer.step()
    return optimizer


def test_fedplug_loss_with_fedprox_in_a_tuple_loop_equals_train_locally() -> None:
    # Prepare
    inputs, labels = small_data()
    start = small_model()
    reference = fedplug_reference(
        {"loss_transform": {"name": "fedprox", "mu": 0.5}},
        copy.deepcopy(start),
        inputs,
        labels,
        loss_context={},
        payload={},
        client_state={},
    )
    model = copy.deepcopy(start)
    fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": 0.5})
    sampler = RoundSampler({"name": "uniform"}, seed=0)
    # Execute: tuple batches, the user's torch.optim.SGD.
    loader = DataLoader(
        torch.utils.data.TensorDataset(inputs, labels),
        batch_size=10,
        sampler=sampler.for_round(message(start), node_context(), labels),
    )
    own_loop(fedprox.begin_round(message(start), node_context(), model), model, loader)
    # Assert
    assert fedprox.num_steps == 3
    torch.testing.assert_close(model_to_vector(model), reference.vector, rtol=0, atol=1e-6)


def test_fedplug_loss_runs_scaffolds_client_side_and_keeps_its_state() -> None:
    # Prepare: the server's c, sent as fedplug's payload.
    inputs, labels = small_data()
    start = small_model()
    size = model_to_vector(start).numel()
    server_variate = torch.linspace(-0.1, 0.1, size)
    payload = {"c": server_variate}
    reference_state: dict[str, torch.Tensor] = {}
    reference = fedplug_reference(
        {"aggregator": {"name": "scaffold"}},
        copy.deepcopy(start),
        inputs,
        labels,
        loss_context={},
        payload=payload,
        client_state=reference_state,
    )
    scaffold = FedplugLoss(aggregator={"name": "scaffold"})
    model, context = copy.deepcopy(start), node_context()
    incoming = message(start, **{PAYLOAD_KEY: tensors_to_record(payload)})
    sampler = RoundSampler({"name": "uniform"}).for_round(incoming, context, labels)
    # Execute
    optimizer = own_loop(
        scaffold.begin_round(incoming, context, model),
        model,
        DataLoader(DictDataset(inputs, labels), batch_size=10, sampler=sampler),
    )
    content = RecordDict({"arrays": ArrayRecord(model.state_dict())})
    extras = scaffold.finish_round(content, optimizer)
    # Assert: the simulator's model and delta_c, in the reply; c_k kept on the node.
    torch.testing.assert_close(model_to_vector(model), reference.vector, rtol=0, atol=1e-6)
    torch.testing.assert_close(extras["delta_c"], reference.extras["delta_c"], rtol=0, atol=1e-5)
    assert set(content.array_records[EXTRAS_KEY]) == {"delta_c"}
    assert content.metric_records[METRICS_KEY][NUM_STEPS] == 3
    kept = np.array(context.state.array_records["fedplug.client-state"]["c_k"].numpy())
    np.testing.assert_allclose(kept, reference_state["c_k"].numpy(), atol=1e-5)


def test_scaffold_with_adam_or_without_a_learning_rate_says_what_to_change() -> None:
    # Prepare
    start = small_model()
    payload = {"c": torch.zeros(model_to_vector(start).numel())}
    scaffold = FedplugLoss(aggregator={"name": "scaffold"})
    incoming = message(start, **{PAYLOAD_KEY: tensors_to_record(payload)})
    # Execute / Assert
    scaffold.begin_round(incoming, node_context(), start)
    with pytest.raises(ConfigError, match="learning rate"):
        scaffold.finish_round(RecordDict())
    scaffold.begin_round(incoming, node_context(), start)
    with pytest.raises(ConfigError, match="sgd"):
        scaffold.finish_round(RecordDict(), torch.optim.Adam(start.parameters()))


def test_a_sample_weighted_loss_without_sample_ids_asks_for_them() -> None:
    # Prepare: a loss transform whose per-sample loss gathers weights by sample id
    # (FedDisk's shape), with its context given directly.
    from fedplug.algorithms.feddisk import SampleWeightedLoss

    inputs, labels = small_data()
    model = small_model()
    loss = FedplugLoss(loss_transform=FEDDISK, app=None)
    weights = torch.linspace(0.5, 1.5, 30)
    assert isinstance(loss.trainer.algorithm.loss_transform, SampleWeightedLoss)
    loss.trainer._loss_context = lambda *args: {"sample_weight": weights}  # type: ignore[method-assign]
    criterion = loss.begin_round(message(model), node_context(), model, labels)
    logits = model(inputs[:5])
    # Execute / Assert: with ids, the weighted mean; without, a message saying what to add.
    expected = (weights[:5] * torch.nn.functional.cross_entropy(logits, labels[:5], reduction="none")).mean()
    torch.testing.assert_close(criterion(logits, labels[:5], torch.arange(5)), expected)
    with pytest.raises(ConfigError, match="with_sample_ids"):
        criterion(logits, labels[:5])


def test_fedplug_loss_needing_client_data_says_so() -> None:
    # Prepare
    model = small_model()
    fedshift = FedplugLoss(loss_transform={"name": "fedshift"})
    # Execute / Assert: the labels are missing at the round, the data at registration.
    with pytest.raises(ConfigError, match="pass it"):
        fedshift.begin_round(message(model), node_context(), model)
    with pytest.raises(ConfigError, match="data="):
        FedplugLoss(loss_transform={"name": "fedshift"}, app=ClientApp())


def test_with_sample_ids_adds_the_index_to_dict_and_tuple_samples() -> None:
    inputs, labels = small_data(4)
    assert with_sample_ids(DictDataset(inputs, labels))[3]["sample_id"] == 3
    assert with_sample_ids(torch.utils.data.TensorDataset(inputs, labels))[2][2] == 2
    batch = next(iter(DataLoader(with_sample_ids(DictDataset(inputs, labels)), batch_size=4)))
    assert batch["sample_id"].tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------- run_simulation


def dispatching_app(apps: dict[str, ClientApp], data: dict[int, Any]) -> ClientApp:
    """One ClientApp for one simulation: each message goes to the variant app its
    ``config["variant"]`` names (the strategy sends it with every message). The class
    count query is answered here for every variant, so that the strategies can map
    client k to the node of partition k (Ray's node ids are random) and compare with the
    simulator; the variants' own query handlers run on the loopback grid above."""
    from fedplug.adapters.flower.capabilities import ANY_COMPONENT, CLIENT_SLOTS, declare

    app = ClientApp()

    def dispatch(msg: Message, context: Context) -> Message:
        return apps[str(msg.content[CONFIG_KEY]["variant"])](msg, context)

    app.train()(dispatch)
    app.train("feddisk")(dispatch)
    app.evaluate()(dispatch)
    answer_class_counts(app, lambda context: data[int(context.node_config["partition-id"])][0])
    # it serves every variant's components (the capability query, issue 25)
    declare(app, dict.fromkeys(CLIENT_SLOTS, ANY_COMPONENT))
    return app


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
def test_every_variant_runs_under_run_simulation() -> None:
    """Every variant, one after another in one Flower simulation (Ray backend)."""
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    data = partitions(experiment("iwds"))
    apps = {name: build_app(name, data) for name in VARIANTS}
    outcome: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name in sorted(VARIANTS):
            config = experiment(name)
            model = initial_model(config)
            strategy = FedplugStrategy(
                config.train,
                num_clients=NUM_CLIENTS,
                num_classes=4,
                model=copy.deepcopy(model),
                message_config={"variant": name},
                node_wait_seconds=120,
                query_nodes=True,
            )
            strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=ROUNDS)
            outcome[name] = strategy

    run_simulation(
        server,
        dispatching_app(apps, data),
        num_supernodes=NUM_CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    assert sorted(outcome) == sorted(VARIANTS)
    for name, strategy in outcome.items():
        history = strategy.run_result.history
        assert [record.failures for record in history] == [0, 0], name
        assert all(record.client_accuracy_mean is not None for record in history), name
    # fedprox and iwds keep fedplug's loop: the simulator's model, as on the loopback grid.
    for name in ("fedprox", "iwds"):
        _, simulator = run_experiment(experiment(name), None)
        torch.testing.assert_close(outcome[name].final_vector, simulator.final_vector, rtol=0, atol=1e-5)


def test_base_app_source_is_the_quickstart_shape() -> None:
    """The base app trains with its own loop on dict batches and replies as the
    quickstart does (arrays + metrics with num-examples)."""
    config = experiment("iwds")
    data = partitions(config)
    app = load_app(BASE_APP, "base", data)["app"]
    model = initial_model(config)
    reply = app(message(model, client=1), node_context(partition=1))
    assert reply.content["metrics"]["num-examples"] == len(data[1][0])
    assert set(reply.content["arrays"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
