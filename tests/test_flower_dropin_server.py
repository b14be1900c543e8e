"""Tests (a) and (c) of issue 14: FedplugStrategy with an UNCHANGED quickstart-shaped
ClientApp (its own Net, its own SGD loop over dict batches, replies ``arrays`` and
``metrics`` with ``num-examples``, no query handler, no fedplug keys), inside Flower's DP
fixed-clipping wrappers, the one line an algorithm that needs more prints, and a
ServerApp run resumed from its checkpoint.

Most runs use the in-process :class:`LoopbackGrid`; one slow test runs several
strategies, the DP wrappers included, in a single ``run_simulation``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import numpy as np
import pytest
import torch
from fedplug.adapters.flower import FedplugStrategy, LoopbackGrid
from fedplug.adapters.flower.capabilities import CAPABILITY_QUERY
from fedplug.adapters.flower.records import (
    CHAIN_POSITION,
    CONFIG_KEY,
    record_to_vector,
    vector_layout,
)
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Result,
)
from torch import nn

from fedplug.errors import TrainingError

NUM_NODES = 4
NUM_FEATURES = 6
NUM_CLASSES = 3
LEARNING_RATE = 0.1
SERVER_SIDE: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedavgm": {"aggregator": {"name": "fedavgm", "momentum": 0.9, "server_lr": 1.0}},
    "fedadam": {"aggregator": {"name": "fedadam"}},
    "fedyogi": {"aggregator": {"name": "fedyogi"}},
    "fedadagrad": {"aggregator": {"name": "fedadagrad"}},
    "fedgsp_naive": {"grouper": {"name": "fedgsp", "mode": "naive", "fixed_groups": 2}},
}

# ------------------------------------------------------------ the user's own app


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, 8)
        self.fc2 = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int) -> list[dict[str, torch.Tensor]]:
    """A small in-memory dataset, as dict batches (flwr-datasets' shape); partition k
    has 8 + 4k samples, so weighting by num-examples matters."""
    generator = torch.Generator().manual_seed(100 + partition_id)
    size = 8 + 4 * partition_id
    images = torch.randn(size, NUM_FEATURES, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
    return [
        {"img": images[start : start + 4], "label": labels[start : start + 4]}
        for start in range(0, size, 4)
    ]


def train_fn(net: nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()
    total = 0.0
    for batch in batches:
        optimizer.zero_grad()
        loss = criterion(net(batch["img"]), batch["label"])
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(batches)


def quickstart_app(mods: list[Any] | None = None) -> ClientApp:
    """Flower's PyTorch quickstart ClientApp, unchanged in shape."""
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        batches = load_data(int(context.node_config["partition-id"]))
        train_loss = train_fn(model, batches)
        metrics = {"train_loss": train_loss, "num-examples": sum(len(b["label"]) for b in batches)}
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        batches = load_data(int(context.node_config["partition-id"]))
        images = torch.cat([b["img"] for b in batches])
        labels = torch.cat([b["label"] for b in batches])
        with torch.no_grad():
            logits = model(images)
        metrics = {
            "eval_loss": float(nn.functional.cross_entropy(logits, labels)),
            "eval_acc": float((logits.argmax(1) == labels).float().mean()),
            "num-examples": len(labels),
        }
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    batches = load_data(NUM_NODES)  # a partition no node holds: the server's test set
    images = torch.cat([b["img"] for b in batches])
    labels = torch.cat([b["label"] for b in batches])
    with torch.no_grad():
        logits = model(images)
    return MetricRecord(
        {
            "accuracy": float((logits.argmax(1) == labels).float().mean()),
            "loss": float(nn.functional.cross_entropy(logits, labels)),
        }
    )


def initial_net() -> Net:
    torch.manual_seed(0)
    return Net()


def strategy_for(train: dict[str, Any], **options: Any) -> FedplugStrategy:
    return FedplugStrategy({"rounds": 2, **train}, model=initial_net(), **options)


def run(strategy: Any, grid: Any, num_rounds: int = 2, **options: Any) -> Result:
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_net().state_dict()),
        num_rounds=num_rounds,
        evaluate_fn=central_evaluate,
        **options,
    )


def vector(arrays: ArrayRecord) -> torch.Tensor:
    return record_to_vector(arrays, vector_layout(Net()))


# ------------------------------------------------------------- (a) unchanged app


@pytest.mark.parametrize("name", sorted(SERVER_SIDE))
def test_an_unchanged_client_app_runs_every_server_side_algorithm(name: str) -> None:
    # Prepare
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    strategy = strategy_for(SERVER_SIDE[name])
    # Execute
    result = run(strategy, grid)
    # Assert: no query, two rounds recorded, nothing failed, the model moved; Flower's
    # Result holds the central evaluation of rounds 0, 1 and 2.
    types = {message.metadata.message_type for message in grid.delivered}
    assert types == {"train", "evaluate"}
    assert strategy.client_requirements is None
    assert [record.round for record in strategy.history] == [1, 2]
    assert all(record.failures == 0 for record in strategy.history)
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    assert strategy.history[-1].accuracy == result.evaluate_metrics_serverapp[2]["accuracy"]
    assert not torch.equal(vector(result.arrays), vector(ArrayRecord(initial_net().state_dict())))
    assert "eval_acc" in result.evaluate_metrics_clientapp[2]


def test_fedavg_round_is_the_num_examples_weighted_mean() -> None:
    # Prepare: every node trains (fraction 1); node k holds 8 + 4k samples.
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    strategy = strategy_for({"client_fraction": 1.0})
    # Execute
    result = run(strategy, grid, num_rounds=1)
    # Assert: the model and the train loss are averaged weighted by num-examples, by hand.
    models, losses, sizes = [], [], []
    for partition in range(NUM_NODES):
        net = initial_net()
        losses.append(train_fn(net, load_data(partition)))
        models.append(vector(ArrayRecord(net.state_dict())))
        sizes.append(8 + 4 * partition)
    total = sum(sizes)
    expected = sum(model * size for model, size in zip(models, sizes)) / total
    torch.testing.assert_close(vector(result.arrays), expected, rtol=0, atol=1e-6)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["train_loss"] == pytest.approx(
        sum(loss * size for loss, size in zip(losses, sizes)) / total
    )
    counters = strategy.train_metrics_serverapp[1]
    assert (counters["accepted"], counters["failures"]) == (NUM_NODES, 0)


def test_fedgsp_naive_hands_chains_between_stock_nodes() -> None:
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    # Two random groups of two, both trained: two chains of two members.
    groups = {"fixed_groups": 2, "group_fraction": 1.0}
    grouper = {**SERVER_SIDE["fedgsp_naive"]["grouper"], **groups}
    strategy = strategy_for({"grouper": grouper, "client_fraction": 1.0})
    run(strategy, grid, num_rounds=1)
    positions = [
        int(message.content[CONFIG_KEY][CHAIN_POSITION])
        for message in grid.delivered
        if message.metadata.message_type == "train"
    ]
    assert positions == [0, 0, 1, 1]  # each chain's model went from one stock node to the next
    assert strategy.history[0].failures == 0


# -------------------------------------------------------------- Flower's sampling


def sampled_nodes(grid: LoopbackGrid) -> list[list[int]]:
    by_round: dict[str, list[int]] = {}
    for message in grid.delivered:
        if message.metadata.message_type == "train":
            by_round.setdefault(message.metadata.group_id, []).append(message.metadata.dst_node_id)
    return [sorted(nodes) for _, nodes in sorted(by_round.items())]


@pytest.mark.parametrize(
    ("fraction", "min_train", "expected"), [(0.5, 2, 3), (0.3, 2, 2), (1.0, 2, 7), (0.1, 4, 4)]
)
def test_nodes_are_sampled_with_flowers_meaning(
    fraction: float, min_train: int, expected: int
) -> None:
    # Prepare: 7 connected nodes; Flower samples max(int(fraction * 7), min_train_nodes).
    options = {
        "fraction_train": fraction,
        "min_train_nodes": min_train,
        "federated_evaluation": False,
    }
    grids = [LoopbackGrid(quickstart_app(), 7) for _ in range(2)]
    # Execute: the same run twice.
    for grid in grids:
        run(strategy_for({}, **options), grid)
    # Assert: the sample size is Flower's, and the seeded choice repeats.
    first, second = (sampled_nodes(grid) for grid in grids)
    assert [len(nodes) for nodes in first] == [expected, expected]
    assert first == second


def test_too_few_nodes_for_min_available_nodes_stop_with_one_line() -> None:
    strategy = strategy_for({}, min_available_nodes=5, node_wait_seconds=0.2)
    with pytest.raises(TrainingError, match=r"only 4 of the 5 nodes needed"):
        run(strategy, LoopbackGrid(quickstart_app(), NUM_NODES))


def test_fixed_num_clients_keeps_the_simulators_sampling() -> None:
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    strategy = strategy_for({"client_fraction": 0.5}, num_clients=NUM_NODES)
    run(strategy, grid)
    assert [len(nodes) for nodes in sampled_nodes(grid)] == [2, 2]
    assert {message.metadata.message_type for message in grid.delivered} == {"train", "evaluate"}


def test_flowers_own_start_gives_the_same_result() -> None:
    ours = run(strategy_for(SERVER_SIDE["fedavgm"]), LoopbackGrid(quickstart_app(), NUM_NODES))
    strategy = strategy_for(SERVER_SIDE["fedavgm"])
    from flwr.serverapp.strategy import Strategy

    theirs = Strategy.start(
        strategy,
        LoopbackGrid(quickstart_app(), NUM_NODES),
        ArrayRecord(initial_net().state_dict()),
        num_rounds=2,
        evaluate_fn=central_evaluate,
    )
    torch.testing.assert_close(vector(theirs.arrays), vector(ours.arrays), rtol=0, atol=0)
    assert sorted(theirs.evaluate_metrics_serverapp) == [0, 1, 2]
    assert [record.round for record in strategy.history] == [1, 2]


# ------------------------------------------------------------- (c) DP wrappers


def clip_when_asked(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's fixedclipping_mod on train messages that carry a clipping norm (the
    client-side wrapper sends one); other messages pass."""
    if msg.metadata.message_type == "train" and "clipping_norm" in msg.content["config"]:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


@pytest.mark.parametrize("side", ["server", "client"])
def test_fedplug_strategy_inside_flowers_dp_fixed_clipping(side: str) -> None:
    # Prepare: no noise, a clipping norm far below the updates' norm.
    norm = 1e-3
    strategy = strategy_for({"client_fraction": 1.0}, evaluate_fn=central_evaluate)
    if side == "server":
        wrapper: Any = DifferentialPrivacyServerSideFixedClipping(strategy, 0.0, norm, NUM_NODES)
        app = quickstart_app()
    else:
        wrapper = DifferentialPrivacyClientSideFixedClipping(strategy, 0.0, norm, NUM_NODES)
        app = quickstart_app(mods=[fixedclipping_mod])
    # Execute: Flower's own start on the wrapper, which drives FedplugStrategy's hooks.
    start = ArrayRecord(initial_net().state_dict())
    result = wrapper.start(
        LoopbackGrid(app, NUM_NODES), start, num_rounds=1, evaluate_fn=central_evaluate
    )
    # Assert: every update was clipped to the norm, so the FedAvg step is within it.
    step = vector(result.arrays) - vector(start)
    assert 0 < float(step.norm()) <= norm + 1e-6
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1]
    assert [record.round for record in strategy.history] == [1]
    # fedplug's own record has the central accuracy too (the strategy's evaluate_fn).
    assert strategy.history[0].accuracy == result.evaluate_metrics_serverapp[1]["accuracy"]


# ------------------------------------------------- the one line, when more is needed


def stock_app_line(piece: str) -> str:
    """The whole line (a regex) that stops a run on a stock ClientApp: the probe went
    unanswered, no client trained, and ``piece`` is what to add to the app's own loop."""
    return (
        r"^the ClientApp runs no fedplug client piece \(node \d+ does not answer "
        r"'query\.fedplug'\), so no client trained: add "
        + re.escape(piece)
        + r" to its @app\.train\(\) loop, or train with "
        r"FedplugTrainer\.from_config\(train_config, app=app\)\.fit "
        r"\(docs/flower\.md, 'Client-side algorithms'\)$"
    )


@pytest.mark.parametrize(
    ("train", "piece"),
    [
        (
            {"loss_transform": {"name": "fedshift"}},
            "FedplugLoss(loss_transform={'name': 'fedshift'}, app=app, data=<context -> trainset>)",
        ),
        (
            {"loss_transform": {"name": "feddisk"}},
            "FedplugLoss(loss_transform={'name': 'feddisk'}, app=app, data=<context -> trainset>)",
        ),
        (
            {"aggregator": {"name": "scaffold"}},
            (
                "FedplugLoss(aggregator={'name': 'scaffold'}, app=app) with finish_round(content) "
                "on its reply"
            ),
        ),
    ],
    ids=["fedshift", "feddisk", "scaffold"],
)
def test_an_algorithm_that_needs_more_says_what_in_one_line(
    train: dict[str, Any], piece: str
) -> None:
    strategy = strategy_for(train, num_classes=NUM_CLASSES, input_shape=(NUM_FEATURES,))
    assert strategy.client_requirements is not None
    assert "\n" not in strategy.client_requirements
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    with pytest.raises(TrainingError, match=stock_app_line(piece)) as raised:
        run(strategy, grid)
    assert "\n" not in str(raised.value)
    assert strategy.history == []  # said before any round was recorded
    # Only the capability query went out: no class-count query, setup phase or train.
    assert [message.metadata.message_type for message in grid.delivered] == [CAPABILITY_QUERY]


# ------------------------------------------------------------------ resume


def test_a_run_resumes_from_its_checkpoint(tmp_path: Any) -> None:
    # Prepare: FedAvgM (server state: momentum) with Flower's sampling, half the nodes.
    train = {**SERVER_SIDE["fedavgm"], "client_fraction": 0.5}
    whole = strategy_for(train)
    uninterrupted = run(whole, LoopbackGrid(quickstart_app(), NUM_NODES), num_rounds=4)
    checkpoint = tmp_path / "server.pt"
    # Execute: 2 of 4 rounds, then a new strategy (a restarted ServerApp) on a new grid.
    run(strategy_for(train, checkpoint_path=checkpoint), LoopbackGrid(quickstart_app(), NUM_NODES))
    resumed = strategy_for(train, checkpoint_path=checkpoint)
    grid = LoopbackGrid(quickstart_app(), NUM_NODES)
    result = run(resumed, grid, num_rounds=4)
    # Assert: only rounds 3 and 4 trained; the same model and records as the whole run.
    assert sorted({int(m.metadata.group_id) for m in grid.delivered}) == [3, 4]
    torch.testing.assert_close(vector(result.arrays), vector(uninterrupted.arrays), rtol=0, atol=0)
    mine = [record.as_dict() for record in resumed.history]
    theirs = [record.as_dict() for record in whole.history]
    for ours, reference in zip(mine, theirs, strict=True):
        ours.pop("seconds"), reference.pop("seconds")
        assert ours == reference
    assert sorted(result.evaluate_metrics_serverapp) == [2, 3, 4]
    assert sorted(result.train_metrics_clientapp) == [3, 4]


def test_a_checkpoint_of_another_config_is_refused(tmp_path: Any) -> None:
    checkpoint = tmp_path / "server.pt"
    run(strategy_for({}, checkpoint_path=checkpoint), LoopbackGrid(quickstart_app(), NUM_NODES), 1)
    other = strategy_for(SERVER_SIDE["fedavgm"], checkpoint_path=checkpoint)
    with pytest.raises(TrainingError, match=r"belongs to a different config"):
        run(other, LoopbackGrid(quickstart_app(), NUM_NODES))


# ------------------------------------------------------------- run_simulation


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
def test_under_run_simulation_with_the_dp_wrappers() -> None:
    """fedavgm, fedgsp naive and both DP wrappers, one after another in one simulation."""
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    norm = 1e-3
    outcome: dict[str, Any] = {}
    server = ServerApp()

    def build(name: str) -> tuple[Any, FedplugStrategy]:
        if name in SERVER_SIDE:
            strategy = strategy_for(SERVER_SIDE[name], node_wait_seconds=120)
            return strategy, strategy
        strategy = strategy_for({"client_fraction": 1.0}, node_wait_seconds=120)
        wrapper_type = (
            DifferentialPrivacyServerSideFixedClipping
            if name == "dp-server"
            else DifferentialPrivacyClientSideFixedClipping
        )
        return wrapper_type(strategy, 0.0, norm, NUM_NODES), strategy

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for name in ("fedavgm", "fedgsp_naive", "dp-server", "dp-client"):
            driver, strategy = build(name)
            result = driver.start(
                grid=grid,
                initial_arrays=ArrayRecord(initial_net().state_dict()),
                num_rounds=2,
                evaluate_fn=central_evaluate,
            )
            outcome[name] = (result, copy.deepcopy(strategy.history))

    run_simulation(
        server,
        quickstart_app(mods=[clip_when_asked]),
        num_supernodes=NUM_NODES,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    assert sorted(outcome) == ["dp-client", "dp-server", "fedavgm", "fedgsp_naive"]
    start = vector(ArrayRecord(initial_net().state_dict()))
    for name, (result, history) in outcome.items():
        assert [record.round for record in history] == [1, 2], name
        assert all(record.failures == 0 for record in history), name
        assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2], name
        # fedplug's record has the central accuracy where FedplugStrategy.start ran
        # evaluate_fn; a wrapper's start calls it without telling the wrapped strategy.
        assert np.isfinite(history[-1].accuracy) == (not name.startswith("dp-")), name
    for name in ("dp-server", "dp-client"):
        step = vector(outcome[name][0].arrays) - start
        assert float(step.norm()) <= 2 * norm + 1e-6, name  # two rounds, each within the norm
