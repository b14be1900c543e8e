"""The Flower adapter's client side (FedplugTrainer) and message codecs, without a runtime:
messages are built by hand, or delivered in-process by LoopbackGrid."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from fedplug.adapters.flower import FedplugStrategy, FedplugTrainer, LoopbackGrid
from fedplug.adapters.flower.loopback import ensure_task_identity
from fedplug.adapters.flower.records import (
    CLASS_COUNTS,
    CONFIG_KEY,
    EXTRAS_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_EXAMPLES,
    NUM_STEPS,
    PAYLOAD_KEY,
    ROUND,
    decode_loss_state,
    encode_loss_state,
    model_record,
    record_to_vector,
    tensors_to_record,
    vector_layout,
)
from fedplug.adapters.flower.trainer import load_client_state, save_client_state
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedplug.algorithms.fedshift import class_shift, global_prior
from fedplug.errors import ConfigError, DataError
from fedplug.plugins import default_registry
from fedplug.run.local_training import (
    ClientAlgorithm,
    LocalSchedule,
    local_rng,
    train_locally,
)
from fedplug.run.vectors import model_to_vector

NUM_CLASSES = 3


def make_model(seed: int = 0) -> nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, NUM_CLASSES))
    torch.random.set_rng_state(generator_state)
    return model


def make_data(num_samples: int = 30, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(num_samples, 4, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    return inputs, labels


class PairDataset(Dataset):
    """A map-style dataset without a ``targets`` attribute: labels come from items."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.inputs[index], int(self.labels[index])


def context(partition: int = 0) -> Context:
    return Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": partition, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )


def train_message(
    model: nn.Module, server_round: int = 1, client_id: int = 0, payload: ArrayRecord | None = None
) -> Message:
    ensure_task_identity()
    content = RecordDict(
        {
            MODEL_KEY: model_record(model),
            CONFIG_KEY: ConfigRecord({ROUND: server_round, "fedplug.client-id": client_id}),
        }
    )
    if payload is not None:
        content[PAYLOAD_KEY] = payload
    return Message(content, dst_node_id=7, message_type=MessageType.TRAIN)


TRAIN = {
    "sampler": {"name": "iwds"},
    "optimizer": {"lr": 0.1},
    "batch_size": 8,
    "local_epochs": 2,
    "seed": 3,
}


def test_fit_on_dataset_and_loader_matches_tensors_and_train_locally() -> None:
    # Prepare: one model and data set, four ways to hand the data over.
    inputs, labels = make_data()
    trainer = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    start = make_model()
    forms = {
        "tensors": (inputs, labels),
        "dataset": PairDataset(inputs, labels),
        "loader": DataLoader(PairDataset(inputs, labels), batch_size=8),
    }
    # Execute
    vectors = {}
    for name, data in forms.items():
        model = copy.deepcopy(start)
        reply = trainer.fit(
            model, data, train_message(start, server_round=2, client_id=5), context()
        )
        vectors[name] = record_to_vector(
            reply.content.array_records[MODEL_KEY], vector_layout(model)
        )
        assert reply.content.metric_records[METRICS_KEY][NUM_EXAMPLES] == 30
        # 2 epochs of 30 draws in batches of 8: 4 steps each.
        assert reply.content.metric_records[METRICS_KEY][NUM_STEPS] == 8
    reference = copy.deepcopy(start)
    algorithm = ClientAlgorithm(
        trainer.algorithm.sampler, trainer.algorithm.loss_transform, trainer.algorithm.aggregator
    )
    direct = train_locally(
        reference,
        model_to_vector(start),
        inputs,
        labels,
        np.bincount(labels.numpy(), minlength=NUM_CLASSES),
        algorithm=algorithm,
        loss_context={},
        payload={},
        client_state={},
        schedule=LocalSchedule(2, 8, trainer.config.optimizer),
        round_index=1,
        rng=local_rng(3, 1, 5),
    )
    # Assert: the same samples in the same order give the same model every way.
    for name, vector in vectors.items():
        torch.testing.assert_close(vector, direct.vector, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(direct.vector, model_to_vector(start))


def test_describe_reports_class_counts_and_partition() -> None:
    ensure_task_identity()
    labels = torch.tensor([0, 0, 2, 1, 2, 2])
    trainer = FedplugTrainer.from_config({}, num_classes=4)
    query = Message(
        RecordDict({CONFIG_KEY: ConfigRecord({})}), dst_node_id=7, message_type=MessageType.QUERY
    )
    reply = trainer.describe((torch.zeros(6, 4), labels), query, context(partition=1))
    metrics = reply.content.metric_records[METRICS_KEY]
    assert list(metrics[CLASS_COUNTS]) == [2, 1, 3, 0]
    assert metrics[NUM_EXAMPLES] == 6
    assert metrics["fedplug.partition-id"] == 1 and metrics["fedplug.num-partitions"] == 2


def test_fedshift_needs_the_prior_then_uses_the_gathered_one() -> None:
    inputs, labels = make_data()
    trainer = FedplugTrainer.from_config(
        {"loss_transform": {"name": "fedshift"}}, num_classes=NUM_CLASSES
    )
    model = make_model()
    with pytest.raises(ConfigError, match="prepare_from_class_counts"):
        trainer.fit(model, (inputs, labels), train_message(model), context())
    all_counts = np.array([[10, 0, 5], [1, 9, 5]])
    trainer.prepare_from_class_counts(all_counts)
    local_counts = np.bincount(labels.numpy(), minlength=NUM_CLASSES)
    shift = trainer.algorithm.loss_transform.client_context(0, local_counts)["shift"]
    expected = class_shift(local_counts, global_prior(all_counts))
    torch.testing.assert_close(shift, torch.as_tensor(expected, dtype=torch.float32))
    reply = trainer.fit(model, (inputs, labels), train_message(model), context())
    assert not reply.has_error()


def test_scaffold_client_refuses_a_message_without_the_server_variate() -> None:
    inputs, labels = make_data()
    trainer = FedplugTrainer.from_config(
        {"aggregator": {"name": "scaffold"}}, num_classes=NUM_CLASSES
    )
    model = make_model()
    with pytest.raises(ConfigError, match=r"needs \['c'\]"):
        trainer.fit(model, (inputs, labels), train_message(model), context())


def test_the_trainer_learns_the_payload_keys_from_the_aggregators_needs() -> None:
    # The keys come from ClientNeeds.server_payload: the trainer builds its own aggregator
    # once and never a second one to see what the server would send.
    registry = default_registry()
    built: list[str] = []
    real_build = registry.build

    def counting_build(kind: str, config: Any, *args: Any) -> Any:
        built.append(kind)
        return real_build(kind, config, *args)

    counting = copy.copy(registry)
    counting.build = counting_build  # type: ignore[method-assign]
    inputs, labels = make_data()
    trainer = FedplugTrainer.from_config(
        {"aggregator": {"name": "scaffold"}}, num_classes=NUM_CLASSES, registry=counting
    )
    model = make_model()
    payload = tensors_to_record({"c": torch.zeros_like(model_to_vector(model))})

    reply = trainer.fit(model, (inputs, labels), train_message(model, payload=payload), context())

    assert not reply.has_error()
    assert trainer._payload_keys == {"c"}
    assert built.count("aggregators") == 1


def test_scaffold_client_keeps_its_variate_in_context_state() -> None:
    # Prepare: SCAFFOLD's server variate c = 0 sent with the model.
    inputs, labels = make_data()
    trainer = FedplugTrainer.from_config(
        {"aggregator": {"name": "scaffold"}, "optimizer": {"lr": 0.1}}, num_classes=NUM_CLASSES
    )
    model = make_model()
    start = model_to_vector(model)
    node = context()
    payload = tensors_to_record({"c": torch.zeros_like(start)})
    # Execute
    reply = trainer.fit(model, (inputs, labels), train_message(model, payload=payload), node)
    # Assert: c_k+ = (x - y) / (tau eta) when c = c_k = 0, kept in context.state and sent as delta_c.
    end = record_to_vector(reply.content.array_records[MODEL_KEY], vector_layout(model))
    steps = reply.content.metric_records[METRICS_KEY][NUM_STEPS]
    expected = (start - end) / (steps * 0.1)
    kept = node.state.array_records["fedplug.client-state"]["c_k"].numpy()
    torch.testing.assert_close(torch.from_numpy(kept), expected)
    sent = reply.content.array_records[EXTRAS_KEY]["delta_c"].numpy()
    torch.testing.assert_close(torch.from_numpy(sent), expected)


def test_client_state_of_a_retried_round_restarts_from_the_round_start() -> None:
    node = context()
    save_client_state(node, "ns", {"c_k": torch.tensor([1.0])})
    first = load_client_state(node, "ns", round_index=4)
    save_client_state(node, "ns", {"c_k": first["c_k"] + 10})  # trained in a failed attempt
    retried = load_client_state(node, "ns", round_index=4)
    save_client_state(node, "ns", {"c_k": retried["c_k"] + 10})
    next_round = load_client_state(node, "ns", round_index=5)
    assert float(retried["c_k"]) == 1.0
    assert float(next_round["c_k"]) == 11.0


def test_misshapen_record_names_the_entry() -> None:
    model = make_model()
    record = model_record(model)
    record["0.weight"] = Array(np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"'0.weight' of shape \(3,\), expected \(8, 4\)"):
        record_to_vector(record, vector_layout(model))
    del record["2.bias"]
    record["0.weight"] = model_record(model)["0.weight"]
    with pytest.raises(ValueError, match="returned no array '2.bias'"):
        record_to_vector(record, vector_layout(model))


def test_loss_state_round_trip_keeps_types_and_rejects_lists() -> None:
    state = {
        "prior": np.array([0.25, 0.75]),
        "weights": torch.tensor([1.0, 2.0]),
        "cost": None,
        "seed": 3,
    }
    decoded = decode_loss_state(*encode_loss_state(state, "x"))
    assert decoded is not None
    np.testing.assert_array_equal(decoded["prior"], state["prior"])
    assert isinstance(decoded["weights"], torch.Tensor) and decoded["weights"].tolist() == [
        1.0,
        2.0,
    ]
    assert decoded["cost"] is None and decoded["seed"] == 3
    with pytest.raises(ConfigError, match="cannot send"):
        encode_loss_state({"per_client": [torch.zeros(1)]}, "feddisk")


def test_stock_flower_fedavg_aggregates_trainer_replies() -> None:
    # Prepare: a user's ClientApp (own model, own data) gains IWDS through the trainer;
    # the server is Flower's own FedAvg, which knows nothing of fedplug.
    shards = [make_data(20, seed=10), make_data(30, seed=11)]
    trainer = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    app = ClientApp()

    @app.train()
    def train(message: Message, node_context: Context) -> Message:
        model = make_model()
        return trainer.fit(
            model, shards[int(node_context.node_config["partition-id"])], message, node_context
        )

    grid = LoopbackGrid(app, num_nodes=2)
    start = make_model()
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    # Execute
    result = strategy.start(grid, ArrayRecord(start.state_dict()), num_rounds=1)
    # Assert: Flower accepted the replies and averaged them by num-examples.
    fits = [
        trainer.fit(copy.deepcopy(start), shard, train_message(start, client_id=k), context(k))
        for k, shard in enumerate(shards)
    ]
    layout = vector_layout(start)
    vectors = [record_to_vector(fit.content.array_records[MODEL_KEY], layout) for fit in fits]
    expected = (20 * vectors[0] + 30 * vectors[1]) / 50
    torch.testing.assert_close(record_to_vector(result.arrays, layout), expected, rtol=0, atol=1e-6)


def test_user_client_app_with_fedplug_strategy_gathers_counts_and_runs_scaffold() -> None:
    # Prepare: the user's ClientApp (own model and data, a query handler) and a
    # FedplugStrategy with the user's model on the server.
    shards = [make_data(20, seed=10), make_data(30, seed=11)]
    train = {
        "aggregator": {"name": "scaffold"},
        "optimizer": {"lr": 0.1},
        "batch_size": 8,
        "rounds": 1,
    }
    app = ClientApp()
    trainer = FedplugTrainer.from_config(train, num_classes=NUM_CLASSES, app=app)

    @app.query()
    def query(message: Message, node_context: Context) -> Message:
        partition = int(node_context.node_config["partition-id"])
        return trainer.describe(shards[partition], message, node_context)

    @app.train()
    def fit(message: Message, node_context: Context) -> Message:
        partition = int(node_context.node_config["partition-id"])
        return trainer.fit(make_model(), shards[partition], message, node_context)

    start = make_model()
    strategy = FedplugStrategy(
        train,
        num_clients=2,
        num_classes=NUM_CLASSES,
        model=copy.deepcopy(start),
        federated_evaluation=False,
        query_nodes=True,  # SCAFFOLD needs no counts; ask for them anyway, to test the query
    )
    # Execute
    strategy.start(LoopbackGrid(app, num_nodes=2))
    # Assert: the counts came by query; SCAFFOLD's first round (c = c_k = 0) is the
    # unweighted mean of the two clients' models.
    assert strategy.directory is not None
    expected_counts = [np.bincount(labels.numpy(), minlength=NUM_CLASSES) for _, labels in shards]
    np.testing.assert_array_equal(strategy.directory.class_counts, np.stack(expected_counts))
    payload = tensors_to_record({"c": torch.zeros_like(model_to_vector(start))})
    layout = vector_layout(start)
    fits = [
        trainer.fit(
            copy.deepcopy(start),
            shard,
            train_message(start, client_id=k, payload=payload),
            context(k),
        )
        for k, shard in enumerate(shards)
    ]
    vectors = [record_to_vector(reply.content.array_records[MODEL_KEY], layout) for reply in fits]
    torch.testing.assert_close(
        strategy.final_vector, (vectors[0] + vectors[1]) / 2, rtol=0, atol=1e-6
    )


class CountingDataset(PairDataset):
    """Counts sample loads."""

    loads = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.loads += 1
        return super().__getitem__(index)


def test_labels_of_a_dataset_are_read_once_per_object() -> None:
    # Prepare: 30 samples, 2 epochs of 30 draws each.
    dataset = CountingDataset(*make_data())
    trainer = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    model = make_model()
    # Execute / Assert: the first fit reads 30 labels and loads 60 samples; the next
    # fits only load their 60.
    trainer.fit(model, dataset, train_message(model), context())
    assert dataset.loads == 30 + 60
    trainer.fit(model, dataset, train_message(model, server_round=2), context())
    assert dataset.loads == 30 + 60 + 60


# ------------------------------------------------------------------- dict batches


class DictDataset(Dataset):
    """flwr-datasets-style samples under configurable keys."""

    def __init__(
        self, inputs: torch.Tensor, labels: torch.Tensor, keys: tuple[str, str] = ("img", "label")
    ) -> None:
        self.inputs, self.labels, self.keys = inputs, labels, keys

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {self.keys[0]: self.inputs[index], self.keys[1]: int(self.labels[index])}


def fit_vector(trainer: FedplugTrainer, start: nn.Module, data: Any) -> torch.Tensor:
    model = copy.deepcopy(start)
    reply = trainer.fit(model, data, train_message(start, server_round=2, client_id=5), context())
    assert reply.content.metric_records[METRICS_KEY][NUM_EXAMPLES] == 30
    return record_to_vector(reply.content.array_records[MODEL_KEY], vector_layout(model))


def test_fit_on_dict_batches_matches_tuple_batches() -> None:
    # Prepare: the same samples as (input, label) pairs and as dicts, keys by default
    # ("label", the one other key) and named (FEMNIST's "character").
    inputs, labels = make_data()
    start = make_model()
    reference = fit_vector(FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES), start, (inputs, labels))
    default_keys = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    named_keys = FedplugTrainer.from_config(
        TRAIN, num_classes=NUM_CLASSES, input_key="image", label_key="character"
    )
    # Execute
    vectors = {
        "dataset": fit_vector(default_keys, start, DictDataset(inputs, labels)),
        "loader": fit_vector(default_keys, start, DataLoader(DictDataset(inputs, labels), batch_size=8)),
        "named keys": fit_vector(
            named_keys, start, DictDataset(inputs, labels, keys=("image", "character"))
        ),
    }
    # Assert
    for name, vector in vectors.items():
        torch.testing.assert_close(vector, reference, rtol=0, atol=1e-6, msg=name)


def test_fit_on_a_hugging_face_dataset_with_a_transform() -> None:
    # Prepare: a datasets.Dataset with a per-batch transform, as flwr-datasets hands out;
    # its labels are read from the column, without running the transform.
    datasets = pytest.importorskip("datasets")
    inputs, labels = make_data()
    start = make_model()
    reference = fit_vector(FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES), start, (inputs, labels))
    calls = []

    def to_tensors(batch: dict[str, Any]) -> dict[str, Any]:
        calls.append(len(batch["img"]))
        return {"img": [torch.tensor(row) for row in batch["img"]], "label": batch["label"]}

    hugging_face = datasets.Dataset.from_dict(
        {"img": inputs.tolist(), "label": labels.tolist()}
    ).with_transform(to_tensors)
    trainer = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    # Execute
    vector = fit_vector(trainer, start, DataLoader(hugging_face, batch_size=8))
    # Assert: the transform ran only for the samples trained on (2 epochs x 30 draws).
    torch.testing.assert_close(vector, reference, rtol=0, atol=1e-6)
    assert sum(calls) == 60


def test_an_ambiguous_dict_sample_asks_for_input_key() -> None:
    inputs, labels = make_data()

    class TwoInputs(DictDataset):
        def __getitem__(self, index: int) -> dict[str, Any]:
            return {**super().__getitem__(index), "other": 0}

    trainer = FedplugTrainer.from_config(TRAIN, num_classes=NUM_CLASSES)
    with pytest.raises(DataError, match="input_key="):
        trainer.fit(make_model(), TwoInputs(inputs, labels), train_message(make_model()), context())
