"""FedDisk's phase 1 over Flower messages: each node fits its own MADEs and classifier
on its own data; only MADE parameters, two input bounds and scalar NLLs travel.

The built-in simulator runs phase 1 with :func:`fedplug.algorithms.feddisk.compute_feddisk_weights`.
Here the server runs the server-side pieces of that function (combining input ranges,
FedAvg of the MADEs, the federated validation NLL and its stopping rule, the cost) and
every node the client-side pieces on its own client, with the client's own random stream
(:class:`~fedplug.algorithms.feddisk.PhaseOneSeeds`), so both compute the same weights.

Every exchange is one ``train.feddisk`` message to each node (a ClientApp answers it with
``@app.train("feddisk")``); ``fedplug.feddisk-step`` in its config names the step:

============ ================================ ==================================== ======================
step         down (server -> node)            on the node                          up (node -> server)
============ ================================ ==================================== ======================
``range``    -                                flatten the inputs                   n_k, D, min, max
``local``    FedDisk config, seeds, bounds,   split; local MADE (step 1); NLL of   M_1^k, NLL(M_0)
             M_0                              M_0; round 1 from M_0 (step 2)
``evaluate`` M_r (the average of round r)     keep M_r                             NLL(M_r)
``train``    -                                round r + 1 from M_r                 M_{r+1}^k
``weights``  which model to keep              classifier D, sample weights         n_k
                                              (steps 3-4), kept in context.state
============ ================================ ==================================== ======================

After ``local`` the server alternates ``evaluate`` and ``train`` until
:class:`~fedplug.algorithms.feddisk.GlobalMadeStopping` says stop: R global rounds take
2R + 2 exchanges in all (``range``, ``local``, R ``evaluate``, R - 1 ``train``, ``weights``). Every M travels as its float32 parameters (the masks
are rebuilt from the template seed), so the traffic is what the simulator reports:
(R + 1) K B down and R K B up (:func:`~fedplug.algorithms.feddisk.made_phase_cost`).

What a node keeps between messages lives in ``context.state`` under its namespace: the
phase's settings, its local MADE, the latest and the previous global MADE, its
global-round generator and, at the end, only its sample weights, which
:func:`feddisk_loss_context` hands to the loss in every later train message.

A node that fails (raises, sends no reply, replies malformed) stops the run with a
:class:`~fedplug.errors.TrainingError` naming it: FedAvg of the global MADE and the
federated validation NLL need every client, and a client without weights could not
train FedDisk's loss afterwards.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import Tensor

from fedplug.algorithms.feddisk import (
    ClientDensityData,
    FedDiskConfig,
    GlobalMadeStopping,
    PhaseOneSeeds,
    average_state_dicts,
    client_density_data,
    client_sample_weights,
    client_validation_nlls,
    federated_nll,
    flat_inputs,
    global_made_round,
    input_range,
    made_phase_cost,
    made_template,
    parameter_bytes,
    sample_weight_context,
    to_unit_interval,
    train_local_mades,
    unit_interval_bounds,
)
from fedplug.components import Context as LossContext
from fedplug.components import PhaseCost
from fedplug.errors import ConfigError, DataError, TrainingError
from fedplug.models.made import MADE

from .priors import NodeDirectory
from .records import (
    CLIENT_ID,
    CONFIG_KEY,
    METRICS_KEY,
    MODEL_KEY,
    NUM_EXAMPLES,
    number,
    record_to_tensors,
    tensors_to_record,
)

logger = logging.getLogger("fedplug.adapters.flower")

FEDDISK_ACTION = "feddisk"
"""The ClientApp action of phase 1's messages: ``@app.train("feddisk")``."""
FEDDISK_MESSAGE_TYPE = f"train.{FEDDISK_ACTION}"

STEP = "fedplug.feddisk-step"
FEDDISK_CONFIG = "fedplug.feddisk-config"
"""The server's FedDisk config as JSON: the node runs phase 1 with the server's settings."""
TEMPLATE_SEED = "fedplug.feddisk-template-seed"
CLIENT_SEED = "fedplug.feddisk-client-seed"
LOWER_BOUND = "fedplug.feddisk-low"
UPPER_BOUND = "fedplug.feddisk-high"
"""The global input bounds; both absent when the inputs already lie in [0, 1]."""
KEEP = "fedplug.feddisk-keep"
"""``"latest"`` or ``"previous"``: the global MADE the classifier uses."""
INPUT_DIM = "fedplug.input-dim"
INPUT_MIN = "fedplug.input-min"
INPUT_MAX = "fedplug.input-max"
VALIDATION_NLL = "fedplug.validation-nll"

RANGE, LOCAL, EVALUATE, TRAIN, WEIGHTS = "range", "local", "evaluate", "train", "weights"
"""The steps, in the order the server runs them (EVALUATE and TRAIN alternate)."""
LATEST, PREVIOUS = "latest", "previous"


# ----------------------------------------------------------------- MADE parameters


def made_parameters(model: MADE) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` by name (what travels; masks do not)."""
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


def load_made_parameters(model: MADE, parameters: Mapping[str, Tensor]) -> MADE:
    """Copy ``parameters`` into ``model`` and return it.

    Raises:
        ValueError: a name is missing or extra, or a shape differs (the message says
            which).
    """
    expected = dict(model.named_parameters())
    if set(parameters) != set(expected):
        raise ValueError(f"sent MADE parameters {sorted(parameters)}, expected {sorted(expected)}")
    with torch.no_grad():
        for name, parameter in expected.items():
            value = parameters[name]
            if tuple(value.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"sent MADE parameter {name!r} of shape {tuple(value.shape)}, expected "
                    f"{tuple(parameter.shape)}"
                )
            parameter.copy_(value)
    return model


# ------------------------------------------------------------------------- server


class _Exchanges:
    """Sends one phase-1 message to every node and returns every reply's content, or
    stops the run naming the first node that failed."""

    def __init__(
        self,
        grid: Grid,
        node_of: Mapping[int, int],
        message_config: Mapping[str, Any],
        timeout: float | None,
    ) -> None:
        self.grid = grid
        self.node_of = dict(sorted(node_of.items()))
        self.message_config = dict(message_config)
        self.timeout = timeout

    def __call__(
        self,
        step: str,
        *,
        parameters: Mapping[str, Tensor] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> dict[int, RecordDict]:
        """``step`` on every node; ``parameters`` (a MADE) go down with it when given."""
        model = tensors_to_record(parameters) if parameters is not None else None
        messages = []
        for client, node in self.node_of.items():
            content = RecordDict(
                {
                    CONFIG_KEY: ConfigRecord(
                        {**self.message_config, CLIENT_ID: client, STEP: step, **(config or {})}
                    )
                }
            )
            if model is not None:
                content[MODEL_KEY] = model
            messages.append(
                Message(
                    content,
                    dst_node_id=node,
                    message_type=FEDDISK_MESSAGE_TYPE,
                    group_id=f"feddisk-{step}",
                )
            )
        replies = {
            reply.metadata.src_node_id: reply
            for reply in self.grid.send_and_receive(messages, timeout=self.timeout)
        }
        contents = {}
        for client, node in self.node_of.items():
            reply = replies.get(node)
            if reply is None:
                raise self.failure(step, client, f"sent no reply within {self.timeout}s")
            if reply.has_error():
                raise self.failure(step, client, f"raised: {reply.error.reason}")
            if METRICS_KEY not in reply.content.metric_records:
                raise self.failure(step, client, f"replied without a {METRICS_KEY!r} record")
            contents[client] = reply.content
        return contents

    def failure(self, step: str, client: int, reason: str) -> TrainingError:
        return TrainingError(
            f"FedDisk phase 1, step {step!r}: client {client} (node {self.node_of[client]}) "
            f"{reason}. FedDisk's sample weights need the MADEs of every client, so the run "
            'stops. (A ClientApp answers these messages with @app.train("feddisk") '
            "returning trainer.feddisk(data, message, context); the ready client_app does.)"
        )

    def numbers(self, step: str, contents: Mapping[int, RecordDict], key: str) -> list[float]:
        """Every client's ``key`` metric, in client order."""
        values = []
        for client, content in contents.items():
            try:
                values.append(number(content.metric_records[METRICS_KEY], key))
            except ValueError as error:
                raise self.failure(step, client, str(error)) from None
        return values

    def parameters(
        self, step: str, contents: Mapping[int, RecordDict], template: MADE
    ) -> list[dict[str, Tensor]]:
        """Every client's MADE parameters, in client order, checked against ``template``."""
        states = []
        for client, content in contents.items():
            try:
                state = record_to_tensors(content.array_records.get(MODEL_KEY))
                load_made_parameters(copy.deepcopy(template), state)
            except ValueError as error:
                raise self.failure(step, client, str(error)) from None
            states.append(state)
        return states


def run_feddisk_phase(
    grid: Grid,
    directory: NodeDirectory,
    config: FedDiskConfig,
    *,
    message_config: Mapping[str, Any],
    timeout: float | None,
) -> PhaseCost:
    """Run FedDisk's phase 1 on every node of ``directory`` (see the module docstring);
    the weights stay on the nodes.

    Args:
        grid: the ServerApp's grid.
        directory: which node holds which client (from the class-count query).
        config: the ``train.loss_transform`` FedDisk config.
        message_config: entries for every message's ConfigRecord (the experiment).
        timeout: bound of each exchange, seconds (None: no bound).

    Returns:
        The traffic of the global MADE rounds, as the simulator reports it.

    Raises:
        TrainingError: a node failed or sent something malformed (the message names it).
        DataError: the clients' inputs are constant or not finite, or their dimensions
            differ.
    """
    if config.cache_dir is not None:
        logger.warning(
            "FedDisk's cache_dir %r is not used on Flower (it would be a disk shared with the "
            "nodes); phase 1 runs over messages",
            config.cache_dir,
        )
    exchange = _Exchanges(grid, directory.node_of, message_config, timeout)
    seeds = PhaseOneSeeds.draw(np.random.default_rng(config.seed))

    ranges = exchange(RANGE)
    sizes = [int(size) for size in exchange.numbers(RANGE, ranges, NUM_EXAMPLES)]
    dimensions = {int(dimension) for dimension in exchange.numbers(RANGE, ranges, INPUT_DIM)}
    if len(dimensions) != 1:
        raise DataError(f"the clients' inputs have different sizes {sorted(dimensions)}")
    bounds = unit_interval_bounds(
        list(
            zip(
                exchange.numbers(RANGE, ranges, INPUT_MIN),
                exchange.numbers(RANGE, ranges, INPUT_MAX),
            )
        ),
        "the clients' data",
    )
    template = made_template(dimensions.pop(), config, seeds)
    setup: dict[str, Any] = {
        FEDDISK_CONFIG: config.model_dump_json(),
        TEMPLATE_SEED: seeds.template,
        CLIENT_SEED: seeds.clients,
    }
    if bounds is not None:
        setup[LOWER_BOUND], setup[UPPER_BOUND] = bounds

    local = exchange(LOCAL, parameters=made_parameters(template), config=setup)
    stopping = GlobalMadeStopping(
        config.global_rounds, federated_nll(exchange.numbers(LOCAL, local, VALIDATION_NLL), sizes)
    )
    updates = exchange.parameters(LOCAL, local, template)
    while True:
        evaluated = exchange(EVALUATE, parameters=average_state_dicts(updates, sizes))
        stopping.record(federated_nll(exchange.numbers(EVALUATE, evaluated, VALIDATION_NLL), sizes))
        if stopping.finished:
            break
        updates = exchange.parameters(TRAIN, exchange(TRAIN), template)

    done = exchange(WEIGHTS, config={KEEP: PREVIOUS if stopping.rose else LATEST})
    for client, count, size in zip(done, exchange.numbers(WEIGHTS, done, NUM_EXAMPLES), sizes):
        if int(count) != size:
            raise exchange.failure(
                WEIGHTS, client, f"holds {int(count)} weights for {size} samples"
            )
    cost = made_phase_cost(stopping.rounds, len(sizes), parameter_bytes(template))
    logger.info(
        "FedDisk phase 1: %d global MADE rounds (federated validation NLL %s), %d bytes up, "
        "%d down; the sample weights are on the nodes",
        cost.rounds,
        ", ".join(f"{nll:.4f}" for nll in stopping.history),
        cost.bytes_up,
        cost.bytes_down,
    )
    return cost


# --------------------------------------------------------------------------- node


def state_key(namespace: str, name: str) -> str:
    """The ``context.state`` key of what phase 1 keeps under ``name`` on a node."""
    return f"{namespace}.feddisk-{name}"


def _seed(record: ConfigRecord, key: str) -> int:
    """An integer read exactly (:func:`.records.integer` goes through float, which would
    round a 62-bit seed)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"the FedDisk phase-1 settings hold no integer {key!r}")
    return value


@dataclass
class _Node:
    """One node's part of phase 1: its client's inputs and what ``context.state`` keeps."""

    train_x: Tensor
    client_id: int
    state: RecordDict
    namespace: str

    def key(self, name: str) -> str:
        return state_key(self.namespace, name)

    @property
    def device(self) -> torch.device:
        return self.train_x.device

    def settings(self) -> tuple[FedDiskConfig, PhaseOneSeeds, tuple[float, float] | None]:
        """The phase's settings the ``local`` step stored."""
        record = self.state.config_records.get(self.key("settings"))
        if record is None:
            raise ConfigError(
                "a FedDisk phase-1 message arrived before the 'local' step on this node; the "
                "server must run the whole phase (FedplugStrategy does)"
            )
        config = FedDiskConfig.model_validate_json(str(record[FEDDISK_CONFIG]))
        seeds = PhaseOneSeeds(_seed(record, TEMPLATE_SEED), _seed(record, CLIENT_SEED))
        bounds = (
            (number(record, LOWER_BOUND), number(record, UPPER_BOUND))
            if LOWER_BOUND in record
            else None
        )
        return config, seeds, bounds

    def data(
        self, config: FedDiskConfig, seeds: PhaseOneSeeds, bounds: tuple[float, float] | None
    ) -> ClientDensityData:
        """The client's share, rebuilt from its stream (the same every message)."""
        inputs = to_unit_interval(flat_inputs(self.client_id, self.train_x), bounds)
        return client_density_data(inputs, config, seeds.client_rng(self.client_id))

    def template(self, config: FedDiskConfig, seeds: PhaseOneSeeds) -> MADE:
        dimension = int(np.prod(self.train_x.shape[1:]))
        return made_template(dimension, config, seeds).to(self.device)

    def keep(self, name: str, parameters: Mapping[str, Tensor]) -> None:
        self.state[self.key(name)] = tensors_to_record(parameters)

    def made(self, name: str, template: MADE) -> MADE:
        """The MADE kept under ``name``."""
        parameters = record_to_tensors(self.state.array_records[self.key(name)], self.device)
        return load_made_parameters(copy.deepcopy(template), parameters)

    def train_round(
        self, model: MADE, data: ClientDensityData, config: FedDiskConfig
    ) -> dict[str, Tensor]:
        """One global round from ``model`` with the client's global-round generator,
        which continues where the previous round left it."""
        saved = self.state.array_records.get(self.key("generator"))
        if saved is not None:
            data.global_generator.set_state(record_to_tensors(saved)["state"])
        [state] = global_made_round(model, [data.train], config, [data.global_generator])
        self.state[self.key("generator")] = tensors_to_record(
            {"state": data.global_generator.get_state()}
        )
        return {name: state[name] for name, _ in model.named_parameters()}

    def forget(self, *names: str) -> None:
        """Drop the MADEs and the generator state (and ``names``) from ``context.state``."""
        for name in ("local", LATEST, PREVIOUS, "generator", *names):
            if self.key(name) in self.state:
                del self.state[self.key(name)]


NodeStep = Callable[[_Node, ConfigRecord, ArrayRecord | None], tuple[dict[str, Any], Any]]
"""A step on the node: ``(node, config, model record) -> (metrics, MADE parameters or None)``."""


def _received(node: _Node, template: MADE, record: ArrayRecord | None) -> MADE:
    if record is None:
        raise ConfigError("a FedDisk phase-1 message carries no MADE")
    return load_made_parameters(copy.deepcopy(template), record_to_tensors(record, node.device))


def _range_step(
    node: _Node, config: ConfigRecord, record: ArrayRecord | None
) -> tuple[dict[str, Any], None]:
    inputs = flat_inputs(node.client_id, node.train_x)
    low, high = input_range(inputs)
    metrics = {
        NUM_EXAMPLES: int(inputs.shape[0]),
        INPUT_DIM: int(inputs.shape[1]),
        INPUT_MIN: low,
        INPUT_MAX: high,
    }
    return metrics, None


def _local_step(
    node: _Node, config: ConfigRecord, record: ArrayRecord | None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    node.forget(WEIGHTS)  # what an earlier, interrupted or finished, phase left
    settings = {key: config[key] for key in (FEDDISK_CONFIG, TEMPLATE_SEED, CLIENT_SEED)}
    for key in (LOWER_BOUND, UPPER_BOUND):
        if key in config:
            settings[key] = config[key]
    node.state[node.key("settings")] = ConfigRecord(settings)
    feddisk, seeds, bounds = node.settings()
    data = node.data(feddisk, seeds, bounds)
    template = node.template(feddisk, seeds)
    [local] = train_local_mades(template, [data], feddisk)
    node.keep("local", made_parameters(local))
    initial = _received(node, template, record)
    node.keep(LATEST, made_parameters(initial))
    [nll] = client_validation_nlls(initial, [data.validation])
    trained = node.train_round(initial, data, feddisk)
    return {NUM_EXAMPLES: data.num_samples, VALIDATION_NLL: nll}, trained


def _evaluate_step(
    node: _Node, config: ConfigRecord, record: ArrayRecord | None
) -> tuple[dict[str, Any], None]:
    feddisk, seeds, bounds = node.settings()
    data = node.data(feddisk, seeds, bounds)
    received = _received(node, node.template(feddisk, seeds), record)
    node.state[node.key(PREVIOUS)] = node.state.array_records[node.key(LATEST)]
    node.keep(LATEST, made_parameters(received))
    [nll] = client_validation_nlls(received, [data.validation])
    return {VALIDATION_NLL: nll}, None


def _train_step(
    node: _Node, config: ConfigRecord, record: ArrayRecord | None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    feddisk, seeds, bounds = node.settings()
    data = node.data(feddisk, seeds, bounds)
    latest = node.made(LATEST, node.template(feddisk, seeds))
    return {NUM_EXAMPLES: data.num_samples}, node.train_round(latest, data, feddisk)


def _weights_step(
    node: _Node, config: ConfigRecord, record: ArrayRecord | None
) -> tuple[dict[str, Any], None]:
    feddisk, seeds, bounds = node.settings()
    keep = str(config.get(KEEP, LATEST))
    if keep not in (LATEST, PREVIOUS):
        raise ConfigError(f"{KEEP} must be {LATEST!r} or {PREVIOUS!r}, got {keep!r}")
    data = node.data(feddisk, seeds, bounds)
    template = node.template(feddisk, seeds)
    [weights] = client_sample_weights(
        [node.made("local", template)], node.made(keep, template), [data], feddisk
    )
    node.forget()
    node.state[node.key(WEIGHTS)] = tensors_to_record({"weights": torch.as_tensor(weights)})
    return {NUM_EXAMPLES: int(weights.shape[0])}, None


NODE_STEPS: dict[str, NodeStep] = {
    RANGE: _range_step,
    LOCAL: _local_step,
    EVALUATE: _evaluate_step,
    TRAIN: _train_step,
    WEIGHTS: _weights_step,
}


def answer_feddisk(
    train_x: Tensor, client_id: int, message: Message, context: Context, namespace: str
) -> Message:
    """Do the step a ``train.feddisk`` message asks for on this node's training inputs
    ``train_x`` (``[n_k, ...]``, in sample order) and reply.

    Raises:
        ConfigError: an unknown step, or a step out of order.
        DataError: the client has fewer than 2 training samples.
    """
    config = message.content.config_records.get(CONFIG_KEY, ConfigRecord())
    step = str(config.get(STEP, ""))
    run = NODE_STEPS.get(step)
    if run is None:
        raise ConfigError(
            f"unknown FedDisk phase-1 step {step!r}; expected one of {sorted(NODE_STEPS)}"
        )
    node = _Node(train_x, client_id, context.state, namespace)
    metrics, parameters = run(node, config, message.content.array_records.get(MODEL_KEY))
    reply = RecordDict({METRICS_KEY: MetricRecord({**metrics, CLIENT_ID: client_id})})
    if parameters is not None:
        reply[MODEL_KEY] = tensors_to_record(parameters)
    return Message(reply, reply_to=message)


def feddisk_loss_context(
    context: Context, namespace: str, num_samples: int, device: torch.device | str
) -> LossContext:
    """The FedDisk loss's client context from the weights phase 1 left on this node.

    Raises:
        ConfigError: phase 1 has not run on this node.
        DataError: the weights do not cover the training data (it changed since).
    """
    record = context.state.array_records.get(state_key(namespace, WEIGHTS))
    if record is None:
        raise ConfigError(
            "FedDisk's sample weights are not on this node: the server runs FedDisk's phase 1 "
            "before round 1 (FedplugStrategy does), and this node's ClientApp must answer its "
            "'train.feddisk' messages (@app.train(\"feddisk\") returning "
            "trainer.feddisk(data, message, context); the ready client_app does)"
        )
    weights = record_to_tensors(record, device)["weights"]
    if int(weights.shape[0]) != num_samples:
        raise DataError(
            f"FedDisk's sample weights on this node cover {int(weights.shape[0])} samples but its "
            f"training data has {num_samples}; the data changed after phase 1: start the run again"
        )
    return sample_weight_context(weights)


ServerPhase = Callable[..., PhaseCost]
NodeLossContext = Callable[[Context, str, int, torch.device | str], LossContext]

MESSAGE_PHASES: dict[str, ServerPhase] = {"feddisk": run_feddisk_phase}
"""Loss transforms whose ``prepare`` runs over Flower messages, by name: the server side,
``phase(grid, directory, config, message_config=..., timeout=...) -> PhaseCost``."""
NODE_LOSS_CONTEXTS: dict[str, NodeLossContext] = {"feddisk": feddisk_loss_context}
"""Their node side: the loss's client context from what the phase left on the node."""
