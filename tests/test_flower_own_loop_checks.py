"""FedplugLoss's checks and loss reporting in the user's own loop (issue 25, items 3-4).

The optimiser a component constrains (SCAFFOLD: plain SGD without momentum) is checked
before any parameter moves, on every path: passed to ``begin_round``, seen at its first
``step()`` through torch's optimiser step pre-hook, or described by ``learning_rate=`` and
``momentum=`` for a hand-written update. The loss the loop sees has the task loss's value
and the penalty's gradient; the penalty's round mean is reported as ``train_penalty``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from fedplug.adapters.flower import FedplugLoss
from fedplug.adapters.flower.loopback import ensure_task_identity
from fedplug.adapters.flower.own_loop import TRAIN_PENALTY
from fedplug.adapters.flower.records import (
    CLIENT_ID,
    CONFIG_KEY,
    METRICS_KEY,
    NUM_CLASSES,
    PAYLOAD_KEY,
    REPLY_METRICS,
    ROUND,
    model_record,
    tensors_to_record,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

from fedplug.components import TRAIN_LOSS
from fedplug.errors import ConfigError
from fedplug.run.vectors import model_to_vector

LEARNING_RATE = 0.1
SCAFFOLD = {"name": "scaffold"}


def small_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def batches(num_batches: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.rand(10, 4, generator=generator), torch.randint(0, 3, (10,), generator=generator))
        for _ in range(num_batches)
    ]


def train_message(model: nn.Module, server_round: int = 1, **config: object) -> Message:
    """A FedplugStrategy train message for ``model``, with SCAFFOLD's server variate c."""
    ensure_task_identity()
    size = model_to_vector(model).numel()
    content = RecordDict(
        {
            "arrays": model_record(model),
            CONFIG_KEY: ConfigRecord({ROUND: server_round, CLIENT_ID: 0, NUM_CLASSES: 3, **config}),
            PAYLOAD_KEY: tensors_to_record({"c": torch.linspace(-0.1, 0.1, size)}),
        }
    )
    return Message(content, dst_node_id=1000, message_type=MessageType.TRAIN)


def node_context() -> Context:
    return Context(
        run_id=1, node_id=1000, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )


def optimizer_loop(criterion: FedplugLoss, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The quickstart's loop: zero_grad, loss, backward, step."""
    for inputs, labels in batches():
        optimizer.zero_grad()
        criterion(model(inputs), labels).backward()
        optimizer.step()


def hand_written_loop(criterion: FedplugLoss, model: nn.Module) -> None:
    """Plain SGD written out, no torch optimiser."""
    for inputs, labels in batches():
        model.zero_grad()
        criterion(model(inputs), labels).backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= LEARNING_RATE * parameter.grad


def reply() -> RecordDict:
    return RecordDict({"arrays": ArrayRecord()})


# ---------------------------------------------------------------- the optimiser checks


def test_momentum_seen_at_the_first_step_fails_before_any_parameter_moves() -> None:
    # Prepare: the quickstart's optimiser, built inside the user's train(), never passed.
    model = small_model()
    scaffold = FedplugLoss(aggregator=SCAFFOLD)
    criterion = scaffold.begin_round(train_message(model), node_context(), model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    before = model_to_vector(model).clone()
    inputs, labels = batches()[0]
    criterion(model(inputs), labels).backward()
    # Execute / Assert: the first step raises one line naming the momentum and the fix.
    with pytest.raises(ConfigError, match="momentum is 0.9; set it to 0") as raised:
        optimizer.step()
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith("your optimizer SGD(lr=0.1, momentum=0.9) does not fit aggregator 'scaffold'")
    assert torch.equal(model_to_vector(model), before)
    assert not optimizer.state  # no momentum buffer was created either


def test_an_optimizer_passed_to_begin_round_is_checked_before_any_forward_pass() -> None:
    # Prepare
    model = small_model()
    forwards: list[int] = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    scaffold = FedplugLoss(aggregator=SCAFFOLD)
    # Execute / Assert
    with pytest.raises(ConfigError, match="momentum is 0.9"):
        scaffold.begin_round(
            train_message(model),
            node_context(),
            model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9),
        )
    with pytest.raises(ConfigError, match="name is 'adam'; set it to 'sgd'"):
        scaffold.begin_round(
            train_message(model), node_context(), model, optimizer=torch.optim.Adam(model.parameters())
        )
    assert forwards == []


def test_learning_rate_alone_is_refused_and_with_its_momentum_is_checked() -> None:
    # Prepare: a hand-written update, so no optimiser is ever seen.
    start = small_model()
    model = copy.deepcopy(start)
    scaffold = FedplugLoss(aggregator=SCAFFOLD)
    hand_written_loop(scaffold.begin_round(train_message(start), node_context(), model), model)
    # Execute / Assert: without momentum, the fix is named; momentum 0.9 is refused.
    with pytest.raises(ConfigError, match=r"optimizer=optimizer\), or finish_round\(content, learning_rate=0.1, momentum=0.0\)"):
        scaffold.finish_round(reply(), learning_rate=LEARNING_RATE)
    with pytest.raises(ConfigError, match="momentum is 0.9; set it to 0"):
        scaffold.finish_round(reply(), learning_rate=LEARNING_RATE, momentum=0.9)
    extras = scaffold.finish_round(reply(), learning_rate=LEARNING_RATE, momentum=0.0)
    # Assert: the same delta_c as torch's SGD with that learning rate, optimiser passed.
    reference = FedplugLoss(aggregator=SCAFFOLD)
    other = copy.deepcopy(start)
    optimizer = torch.optim.SGD(other.parameters(), lr=LEARNING_RATE)
    criterion = reference.begin_round(train_message(start), node_context(), other, optimizer=optimizer)
    optimizer_loop(criterion, other, optimizer)
    torch.testing.assert_close(extras["delta_c"], reference.finish_round(reply())["delta_c"], rtol=0, atol=1e-6)


def test_the_seen_optimizer_and_the_passed_one_give_the_same_reply() -> None:
    # Prepare: plain SGD three ways: seen at its step, passed to begin_round, passed to
    # finish_round (the earlier API).
    start = small_model()
    replies, vectors = [], []
    for way in ("seen", "begin_round", "finish_round"):
        model = copy.deepcopy(start)
        scaffold = FedplugLoss(aggregator=SCAFFOLD)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        passed = {"optimizer": optimizer} if way == "begin_round" else {}
        criterion = scaffold.begin_round(train_message(start), node_context(), model, **passed)
        optimizer_loop(criterion, model, optimizer)
        content = reply()
        # Execute
        if way == "finish_round":
            scaffold.finish_round(content, optimizer)
        else:
            scaffold.finish_round(content)
        replies.append(content)
        vectors.append(model_to_vector(model))
    # Assert: same model, same delta_c, and delta_c is not zero (the variate moved).
    deltas = [content.array_records["fedplug.extras"]["delta_c"].numpy() for content in replies]
    for vector, delta in zip(vectors[1:], deltas[1:]):
        assert torch.equal(vector, vectors[0])
        assert (delta == deltas[0]).all()
    assert abs(deltas[0]).sum() > 0


def test_a_learning_rate_disagreeing_with_the_seen_optimizer_names_both() -> None:
    # Prepare
    model = small_model()
    scaffold = FedplugLoss(aggregator=SCAFFOLD)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    optimizer_loop(scaffold.begin_round(train_message(model), node_context(), model), model, optimizer)
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"learning_rate=0.05 but the round's optimizer SGD\(lr=0.1, momentum=0\) has 0.1"):
        scaffold.finish_round(reply(), learning_rate=0.05)
    scaffold.finish_round(reply(), learning_rate=LEARNING_RATE)  # agreeing: accepted


def test_the_step_hook_ignores_other_models_and_goes_at_finish_round() -> None:
    # Prepare
    model, unrelated = small_model(), small_model(seed=1)
    scaffold = FedplugLoss(aggregator=SCAFFOLD)
    hooks_before = len(_global_optimizer_pre_hooks)
    for server_round in range(1, 6):
        criterion = scaffold.begin_round(train_message(model, server_round), node_context(), model)
        assert len(_global_optimizer_pre_hooks) == hooks_before + 1
        # Execute: a momentum optimiser over another model steps freely during the round.
        other = torch.optim.SGD(unrelated.parameters(), lr=LEARNING_RATE, momentum=0.9)
        unrelated(batches()[0][0]).sum().backward()
        other.step()
        optimizer_loop(criterion, model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE))
        scaffold.finish_round(reply())
        # Assert: the hook went with the round.
        assert len(_global_optimizer_pre_hooks) == hooks_before
    # After the rounds, momentum on the round's model is no longer fedplug's business.
    after = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    model(batches()[0][0]).sum().backward()
    after.step()
    # A round abandoned before finish_round leaves one hook, replaced by the next round.
    scaffold.begin_round(train_message(model), node_context(), model)
    scaffold.begin_round(train_message(model), node_context(), model)
    assert len(_global_optimizer_pre_hooks) == hooks_before + 1
    del scaffold, criterion  # and one that goes takes its hook along
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == hooks_before


def test_components_that_do_not_read_the_optimizer_leave_it_alone() -> None:
    # Prepare: FedProx takes any optimiser and needs no learning rate.
    model = small_model()
    fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": 0.5})
    hooks_before = len(_global_optimizer_pre_hooks)
    # Execute
    criterion = fedprox.begin_round(train_message(model), node_context(), model)
    optimizer_loop(criterion, model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9))
    # Assert: no hook, and finish_round with only a learning rate is accepted.
    assert len(_global_optimizer_pre_hooks) == hooks_before
    assert fedprox.finish_round(reply(), learning_rate=LEARNING_RATE) == {}


# ---------------------------------------------------------------- the reported loss


def test_the_loss_has_the_task_value_and_the_penalized_gradient() -> None:
    # Prepare: the model has moved away from the round's start, so the proximal term
    # and its gradient mu (w - w0) are not zero.
    mu = 0.5
    start = small_model()
    model = copy.deepcopy(start)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter += 0.1
    inputs, labels = batches()[0]
    fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": mu})
    criterion = fedprox.begin_round(train_message(start), node_context(), model)
    # Execute
    loss = criterion(model(inputs), labels)
    loss.backward()
    gradients = [parameter.grad.clone() for parameter in model.parameters()]
    # Assert: the value is cross-entropy's, exactly; the gradient is that of
    # cross-entropy + mu/2 ||w - w0||^2.
    model.zero_grad()
    task = nn.functional.cross_entropy(model(inputs), labels)
    assert loss.item() == task.item()
    proximal = sum(
        ((parameter - anchor.detach()) ** 2).sum()
        for parameter, anchor in zip(model.parameters(), start.parameters())
    )
    (task + mu / 2 * proximal).backward()
    for ours, expected in zip(gradients, (parameter.grad for parameter in model.parameters())):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)
    assert float(proximal.detach()) > 0.1


def test_train_penalty_is_the_rounds_mean_penalty_and_train_loss_still_includes_it() -> None:
    # Prepare: FedProx mu = 0.5, two steps: the first at w0 (penalty 0), the second at
    # w1 = w0 - lr g1 (penalty mu/2 ||w1 - w0||^2).
    mu = 0.5
    start = small_model()
    model = copy.deepcopy(start)
    fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": mu})
    criterion = fedprox.begin_round(
        train_message(start, **{REPLY_METRICS: [TRAIN_LOSS]}), node_context(), model
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    reported, after_first_step = [], None
    for inputs, labels in batches(2):
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
        reported.append(loss.item())
        if after_first_step is None:
            after_first_step = model_to_vector(model).clone()
    content = reply()
    # Execute
    fedprox.finish_round(content)
    # Assert
    second_penalty = mu / 2 * float(((after_first_step - model_to_vector(start)) ** 2).sum())
    assert second_penalty > 0
    metrics = content.metric_records[METRICS_KEY]
    assert metrics[TRAIN_PENALTY] == pytest.approx((0.0 + second_penalty) / 2, rel=1e-5)
    # fedplug's own train_loss is the simulator's: task losses plus penalties.
    assert metrics[TRAIN_LOSS] == pytest.approx((sum(reported) + second_penalty) / 2, rel=1e-6)
