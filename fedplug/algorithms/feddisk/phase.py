"""FedDisk's phase 1 as a :class:`~fedplug.setup_phase.SetupPhase`: the server's side and
the clients' side, exchanged in steps that carry only MADE parameters and scalars. The
steps and what each carries: docs/algorithms.md, "FedDisk: the exchange".
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from fedplug.components import Context, PhaseCost
from fedplug.data.federation import Federation
from fedplug.errors import ConfigError, DataError, TrainingError
from fedplug.schema import MAX_COUNT, Count, MessageSchema, Real, TensorField
from fedplug.setup_phase import (
    ClientInputs,
    PhaseInputs,
    ReplySchema,
    SetupPhase,
    SetupReplies,
    SetupReply,
    SetupStep,
    Value,
    run_in_process,
)

from .config import FedDiskConfig
from .density import (
    ClientDensityData,
    GlobalMadeStopping,
    PhaseOneSeeds,
    average_state_dicts,
    client_density_data,
    client_validation_nlls,
    federated_nll,
    flat_inputs,
    input_range,
    load_made_parameters,
    made_parameters,
    made_phase_cost,
    made_template,
    parameter_bytes,
    to_unit_interval,
    train_local_mades,
    unit_interval_bounds,
)
from .made import MADE
from .made_training import train_epochs_stacked
from .weights import (
    SAMPLE_WEIGHT_KEY,
    ClassifierHistory,
    FedDiskWeights,
    client_density_ratios,
    client_weight_summary,
    histogram_top,
    log_classifier_training,
    normalise_weights,
    report_counts,
    sample_weight_context,
    weight_report_schema,
)

logger = logging.getLogger("fedplug.algorithms.feddisk")

RANGE, LOCAL, EVALUATE, TRAIN, WEIGHTS = "range", "local", "evaluate", "train", "weights"
"""The steps, in the order the server runs them (EVALUATE and TRAIN alternate)."""
LATEST, PREVIOUS, LOCAL_MADE = "latest", "previous", "local"
"""The MADEs a client keeps: the latest and the previous global one, and its own."""

# Values of steps and replies.
NUM_SAMPLES = "num-samples"
INPUT_DIM = "input-dim"
INPUT_MIN = "input-min"
INPUT_MAX = "input-max"
VALIDATION_NLL = "validation-nll"
CLASSIFIER_EPOCHS = "classifier-epochs"
CLASSIFIER_BEST_EPOCH = "classifier-best-epoch"
"""How many epochs a client's classifier D trained, and which one it kept."""
CONFIG = "config"
"""The server's FedDisk config as JSON: every client runs phase 1 with the server's settings."""
TEMPLATE_SEED = "template-seed"
CLIENT_SEED = "client-seed"
LOWER_BOUND = "low"
UPPER_BOUND = "high"
"""The global input bounds; both absent when the inputs already lie in [0, 1]."""
KEEP = "keep"
"""``"latest"`` or ``"previous"``: the global MADE the classifier uses."""

# What a client keeps in its state besides the settings and the MADEs.
GENERATOR = "global-generator"
SAMPLE_WEIGHTS = "sample-weights"
DENSITY_RATIOS = "density-ratios"
"""The raw ratios the weights were normalised from (float64; the cache stores them)."""
HISTOGRAM_TOP = "histogram-top"
"""The upper edge of the weight histogram the client reports over (:func:`~.weights.histogram_top`
of the server's config)."""

MAX_INPUT_DIM = 10**7
"""The most input dimensions a client may report (a 3 x 1000 x 1000 image has 3 x 10^6)."""
VALUE_BYTES = 4096
"""The most bytes of plain values in one client's reply to a step (they hold a few numbers)."""
NO_TENSORS = MessageSchema("setup tensor", max_bytes=0)
"""The replies that carry no MADE: any tensor is refused."""
NLL = Real(0.0, math.inf, allow_nonfinite=True)
"""A validation NLL: never negative; NaN or infinite from a diverged MADE, which the
server's stopping rule handles (:class:`~.density.GlobalMadeStopping`)."""


def _values(step: str, fields: dict[str, Any]) -> MessageSchema:
    return MessageSchema(f"{step!r} reply value", fields, max_bytes=VALUE_BYTES)


def _made_tensors(step: str, made: dict[str, Tensor]) -> MessageSchema:
    """A MADE's parameters, each of the shape of ``made``'s, nothing else."""
    fields = {name: TensorField(shape=tuple(value.shape)) for name, value in made.items()}
    return MessageSchema(f"{step!r} reply tensor", fields, max_bytes=1 << 40)


def _sample_counts(step: str, **more: Any) -> MessageSchema:
    return _values(step, {NUM_SAMPLES: Count(0, MAX_COUNT), **more})


ClientStep = Callable[
    [SetupStep, Sequence[ClientInputs], Sequence[dict[str, Any]]], list[SetupReply]
]
FinishCallback = Callable[[FedDiskWeights, list[Tensor]], None]
ReportsCallback = Callable[[list[dict[str, Any]]], None]


@dataclass(eq=False)
class FedDiskPhase(SetupPhase):
    """FedDisk's phase 1 (see the module docstring)."""

    name: ClassVar[str] = "feddisk"
    tolerates_dropped_clients: ClassVar[bool] = True

    config: FedDiskConfig
    """The validated :class:`~.config.FedDiskConfig`."""
    _: KW_ONLY
    rng: np.random.Generator | None = None
    """Draws the :class:`~.density.PhaseOneSeeds` (default
    ``numpy.random.default_rng(config.seed)``)."""
    on_finish: FinishCallback | None = None
    """Called by :meth:`finish` with the result and every client's weights (tensors on the
    clients' device, in client order)."""
    on_reports: ReportsCallback | None = None
    """Called by the server's side, on every runtime, with every client's
    :meth:`client_report` (in client order) from the replies to the last step."""
    cost: PhaseCost | None = field(default=None, init=False)
    result: FedDiskWeights | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._steps: dict[str, ClientStep] = {
            RANGE: self._range,
            LOCAL: self._local,
            EVALUATE: self._evaluate,
            TRAIN: self._train,
            WEIGHTS: self._weights,
        }

    # ---------------------------------------------------------------------- server

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        """The server's side (see the module docstring). A client whose reply it cannot
        use is dropped (:meth:`~fedplug.setup_phase.SetupReplies.drop`) and the phase goes
        on with the others: every step reads the clients of its own replies."""
        config = self.config
        rng = self.rng if self.rng is not None else np.random.default_rng(config.seed)
        seeds = PhaseOneSeeds.draw(rng)

        range_reply = ReplySchema(
            _sample_counts(RANGE, **{INPUT_DIM: Count(1, MAX_INPUT_DIM), INPUT_MIN: Real(), INPUT_MAX: Real()}),
            NO_TENSORS,
            sample_count=NUM_SAMPLES,
        )
        ranges = yield SetupStep(RANGE, expects=range_reply)
        sizes = {client: int(_value(ranges, client, RANGE, NUM_SAMPLES)) for client in sorted(ranges)}
        dimension = _common_dimension(ranges)
        bounds = unit_interval_bounds(
            [
                (
                    float(_value(ranges, client, RANGE, INPUT_MIN)),
                    float(_value(ranges, client, RANGE, INPUT_MAX)),
                )
                for client in sorted(ranges)
            ],
            "the clients' data",
        )
        template = made_template(dimension, config, seeds)
        settings: dict[str, Value] = {
            CONFIG: config.model_dump_json(),
            TEMPLATE_SEED: seeds.template,
            CLIENT_SEED: seeds.clients,
        }
        if bounds is not None:
            settings[LOWER_BOUND], settings[UPPER_BOUND] = bounds

        sent = made_parameters(template)
        local = yield SetupStep(LOCAL, tensors=sent, values=settings, expects=self._update_reply(LOCAL, sent))
        initial_nll = federated_nll(_nlls(local, LOCAL), _sizes_of(local, sizes))
        stopping = GlobalMadeStopping(config.global_rounds, initial_nll)
        updates = _made_updates(local, LOCAL, template)
        while True:
            sent = average_state_dicts(list(updates.values()), _sizes_of(updates, sizes))
            evaluated = yield SetupStep(
                EVALUATE, tensors=sent, expects=ReplySchema(_values(EVALUATE, {VALIDATION_NLL: NLL}), NO_TENSORS)
            )
            stopping.record(federated_nll(_nlls(evaluated, EVALUATE), _sizes_of(evaluated, sizes)))
            if stopping.finished:
                break
            trained = yield SetupStep(TRAIN, expects=self._update_reply(TRAIN, sent))
            updates = _made_updates(trained, TRAIN, template)

        epochs = Count(0, config.classifier_epochs)
        weights_reply = ReplySchema(
            _sample_counts(WEIGHTS, **{CLASSIFIER_EPOCHS: epochs, CLASSIFIER_BEST_EPOCH: epochs}),
            NO_TENSORS,
            sample_count=NUM_SAMPLES,
        )
        done = yield SetupStep(
            WEIGHTS,
            values={KEEP: PREVIOUS if stopping.rose else LATEST},
            final=True,
            expects=weights_reply,
        )
        _drop_miscounted(done, sizes)
        log_classifier_training(
            [int(_value(done, client, WEIGHTS, CLASSIFIER_EPOCHS)) for client in sorted(done)],
            [int(_value(done, client, WEIGHTS, CLASSIFIER_BEST_EPOCH)) for client in sorted(done)],
        )
        if self.on_reports is not None:
            # Every client that began the phase, in client order; one dropped since
            # reports nothing (its entries are null, its weights not counted).
            self.on_reports([dict(done[client].report) if client in done else {} for client in _every_client(num_clients, sizes)])
        self.cost = made_phase_cost(stopping.rounds, len(sizes), parameter_bytes(template))
        logger.info(
            "FedDisk phase 1: %d global MADE rounds (federated validation NLL %s), %d bytes up, "
            "%d down",
            self.cost.rounds,
            ", ".join(f"{nll:.4f}" for nll in stopping.history),
            self.cost.bytes_up,
            self.cost.bytes_down,
        )
        return self.cost

    def _update_reply(self, step: str, sent: dict[str, Tensor]) -> ReplySchema:
        """A reply that carries a client's MADE trained from ``sent``: the MADE's
        parameters of their shapes, screened by their change from ``sent``."""
        values = {NUM_SAMPLES: Count(0, MAX_COUNT)}
        if step == LOCAL:
            values[VALIDATION_NLL] = NLL
        return ReplySchema(_values(step, values), _made_tensors(step, sent), sample_count=NUM_SAMPLES, reference=sent)

    def report_schema(self) -> MessageSchema:
        """A client's :meth:`client_report`: ``histogram_counts``, exactly
        :data:`~.weights.HISTOGRAM_BINS` counts, and each of :data:`~.weights.WEIGHT_STATS`
        a finite weight in ``[0, histogram_top]`` (absent for a client without samples);
        nothing else (:func:`~.weights.weight_report_schema`)."""
        return weight_report_schema(histogram_top(self.config))

    # ---------------------------------------------------------------------- clients

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        [reply] = self.clients(step, [data], [state])
        return reply

    def clients(
        self,
        step: SetupStep,
        data: Sequence[ClientInputs],
        states: Sequence[dict[str, Any]],
    ) -> list[SetupReply]:
        """``step`` for every client of ``data`` at once (vectorised over clients; one
        client gives what it gives among many).

        Raises:
            ConfigError: an unknown step, or a step out of order.
            DataError: a client has fewer than 2 training samples.
        """
        run = self._steps.get(step.name)
        if run is None:
            raise ConfigError(
                f"unknown FedDisk phase-1 step {step.name!r}; expected one of {sorted(self._steps)}"
            )
        return run(step, data, states)

    def _range(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        replies = []
        for client, state in zip(data, states):
            state.clear()  # what an earlier, interrupted or finished, phase left
            inputs = flat_inputs(client.client_id, client.train_x)
            low, high = input_range(inputs)
            values: dict[str, Value] = {
                NUM_SAMPLES: int(inputs.shape[0]),
                INPUT_DIM: int(inputs.shape[1]),
                INPUT_MIN: low,
                INPUT_MAX: high,
            }
            replies.append(SetupReply(values=values))
        return replies

    def _local(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        for state in states:
            for key in (CONFIG, TEMPLATE_SEED, CLIENT_SEED, LOWER_BOUND, UPPER_BOUND):
                if key in step.values:
                    state[key] = step.values[key]
        shares, template = self._shares(data, states)
        local_models = train_local_mades(template, shares, self._settings(states[0])[0])
        initial = _received(template, step)
        nlls = client_validation_nlls(initial, [share.validation for share in shares])
        for state, local_model in zip(states, local_models):
            _keep(state, LOCAL_MADE, made_parameters(local_model))
            _keep(state, LATEST, made_parameters(initial))
        updates = self._global_round([copy.deepcopy(initial) for _ in shares], shares, states)
        return [
            SetupReply(tensors=update, values={NUM_SAMPLES: share.num_samples, VALIDATION_NLL: nll})
            for update, share, nll in zip(updates, shares, nlls)
        ]

    def _evaluate(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        shares, template = self._shares(data, states)
        received = _received(template, step)
        for state in states:
            _keep(state, PREVIOUS, _kept(state, LATEST))
            _keep(state, LATEST, made_parameters(received))
        nlls = client_validation_nlls(received, [share.validation for share in shares])
        return [SetupReply(values={VALIDATION_NLL: nll}) for nll in nlls]

    def _train(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        shares, template = self._shares(data, states)
        models = [_made(template, state, LATEST) for state in states]
        updates = self._global_round(models, shares, states)
        return [
            SetupReply(tensors=update, values={NUM_SAMPLES: share.num_samples})
            for update, share in zip(updates, shares)
        ]

    def _weights(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        keep = str(step.values.get(KEEP, LATEST))
        if keep not in (LATEST, PREVIOUS):
            raise ConfigError(f"{KEEP} must be {LATEST!r} or {PREVIOUS!r}, got {keep!r}")
        shares, template = self._shares(data, states)
        histories: list[ClassifierHistory] = []
        config = self._settings(states[0])[0]
        ratios = client_density_ratios(
            [_made(template, state, LOCAL_MADE) for state in states],
            [_made(template, state, keep) for state in states],
            shares,
            config,
            histories,
        )
        replies = []
        for state, share, client_ratios, history in zip(states, shares, ratios, histories):
            state.clear()
            weights = normalise_weights(
                client_ratios, config.normalisation, config.clip_min, config.clip_max, config.keep_mean
            )
            state[SAMPLE_WEIGHTS] = torch.as_tensor(weights, device=share.inputs.device)
            state[DENSITY_RATIOS] = torch.as_tensor(client_ratios, dtype=torch.float64)
            state[HISTOGRAM_TOP] = histogram_top(config)
            values: dict[str, Value] = {
                NUM_SAMPLES: int(weights.shape[0]),
                CLASSIFIER_EPOCHS: history.epochs,
                CLASSIFIER_BEST_EPOCH: history.best_epoch,
            }
            replies.append(SetupReply(values=values))
        return replies

    def _settings(
        self, state: dict[str, Any]
    ) -> tuple[FedDiskConfig, PhaseOneSeeds, tuple[float, float] | None]:
        """The phase's settings the ``local`` step stored."""
        if CONFIG not in state:
            raise ConfigError(
                "a FedDisk phase-1 step arrived before the 'local' step on this client; the "
                "server must run the whole phase"
            )
        config = FedDiskConfig.model_validate_json(str(state[CONFIG]))
        seeds = PhaseOneSeeds(int(state[TEMPLATE_SEED]), int(state[CLIENT_SEED]))
        bounds = (
            (float(state[LOWER_BOUND]), float(state[UPPER_BOUND]))
            if LOWER_BOUND in state
            else None
        )
        return config, seeds, bounds

    def _shares(
        self, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> tuple[list[ClientDensityData], MADE]:
        """Every client's share of the data, rebuilt from its own stream (the same at every
        step), and the MADE every party starts from."""
        shares = []
        for client, state in zip(data, states):
            config, seeds, bounds = self._settings(state)
            inputs = to_unit_interval(flat_inputs(client.client_id, client.train_x), bounds)
            shares.append(client_density_data(inputs, config, seeds.client_rng(client.client_id)))
        config, seeds, _ = self._settings(states[0])
        template = made_template(int(shares[0].inputs.shape[1]), config, seeds)
        return shares, template.to(shares[0].inputs.device)

    def _global_round(
        self,
        models: list[MADE],
        shares: Sequence[ClientDensityData],
        states: Sequence[dict[str, Any]],
    ) -> list[dict[str, Tensor]]:
        """Client k trains ``models[k]`` for one global round with its global-round
        generator, which continues where the previous round left it; returns the trained
        parameters."""
        config = self._settings(states[0])[0]
        for share, state in zip(shares, states):
            if GENERATOR in state:
                share.global_generator.set_state(state[GENERATOR].cpu())
        train_epochs_stacked(
            models,
            [share.train for share in shares],
            lr=config.made_lr,
            batch_size=config.made_batch_size,
            epochs=config.global_local_epochs,
            generators=[share.global_generator for share in shares],
        )
        for share, state in zip(shares, states):
            state[GENERATOR] = share.global_generator.get_state()
        return [made_parameters(model) for model in models]

    # ---------------------------------------------------------------------- the end

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        weights = [
            self.client_context(states[client])[SAMPLE_WEIGHT_KEY] for client in sorted(states)
        ]
        if self.cost is None:
            raise RuntimeError("FedDiskPhase.finish ran before the server's side ended")
        self.result = FedDiskWeights(
            weights=[w.detach().cpu().numpy() for w in weights],
            cost=self.cost,
            ratios=[states[client][DENSITY_RATIOS].numpy() for client in sorted(states)],
        )
        if self.on_finish is not None:
            self.on_finish(self.result, weights)

    def client_report(self, state: dict[str, Any]) -> dict[str, Any]:
        """This client's share of the setup report: its weights' statistics and their
        counts over the histogram's fixed bins (:func:`~.weights.client_weight_summary`);
        about 400 bytes, never the weights themselves."""
        weights = self.client_context(state)[SAMPLE_WEIGHT_KEY]
        return client_weight_summary(weights.detach().cpu().numpy(), float(state[HISTOGRAM_TOP]))

    def check_data(self, state: dict[str, Any], num_samples: int) -> None:
        """The weights must cover the node's training data (it may have changed since)."""
        weights = state.get(SAMPLE_WEIGHTS)
        if weights is not None and int(weights.shape[0]) != num_samples:
            raise DataError(
                f"FedDisk's sample weights on this node cover {int(weights.shape[0])} samples but its "
                f"training data has {num_samples}; the data changed after the setup phase: start the "
                "run again"
            )

    def client_context(self, state: dict[str, Any]) -> Context:
        """``{"sample_weight": w_k}`` from the weights the phase left in ``state``.

        Raises:
            ConfigError: the phase has not run (to its end) on this client.
        """
        weights = state.get(SAMPLE_WEIGHTS)
        if weights is None:
            raise ConfigError(
                "FedDisk's sample weights are not on this node: the server runs FedDisk's setup "
                "phase before round 1, and this node must answer its 'train.feddisk' messages"
            )
        return sample_weight_context(weights)


# ------------------------------------------------------------------------ helpers


def _failure(step: str, client: int, reason: str) -> TrainingError:
    return TrainingError(
        f"FedDisk phase 1, step {step!r}: client {client} {reason}. FedDisk's sample weights "
        "need the MADEs of every client, so the run stops"
    )


def _value(replies: dict[int, SetupReply], client: int, step: str, key: str) -> Value:
    value = replies[client].values.get(key)
    if value is None or isinstance(value, (str, bool)):
        raise _failure(step, client, f"replied without a number {key!r}")
    return value


def _drop(replies: dict[int, SetupReply], step: str, client: int, reason: str) -> None:
    """Drop ``client`` where the runtime can (:class:`~fedplug.setup_phase.SetupReplies`;
    the runtime logs it), else stop the run naming it."""
    if not isinstance(replies, SetupReplies):
        raise _failure(step, client, reason)
    replies.drop(client, reason)


def _common_dimension(ranges: dict[int, SetupReply]) -> int:
    """The input size of most clients; a client reporting another one is dropped.

    Raises:
        DataError: no size is reported by more clients than every other one.
    """
    dimensions = {client: int(_value(ranges, client, RANGE, INPUT_DIM)) for client in sorted(ranges)}
    tally = Counter(dimensions.values()).most_common()
    if len(tally) > 1 and tally[0][1] == tally[1][1]:
        raise DataError(f"the clients' inputs have different sizes {sorted(set(dimensions.values()))}")
    common = tally[0][0]
    for client, size in dimensions.items():
        if size != common:
            _drop(ranges, RANGE, client, f"reported inputs of {size} dimensions, most clients' have {common}")
    return common


def _drop_miscounted(done: dict[int, SetupReply], sizes: dict[int, int]) -> None:
    """Drop a client whose weights, or whose report's histogram, do not count the samples
    it reported in the first step."""
    for client in sorted(done):
        count = int(_value(done, client, WEIGHTS, NUM_SAMPLES))
        counted = report_counts(done[client].report)
        if count != sizes[client]:
            _drop(done, WEIGHTS, client, f"holds {count} weights for {sizes[client]} samples")
        elif counted is not None and counted != sizes[client]:
            _drop(done, WEIGHTS, client, f"reported a weight histogram of {counted} samples, not its {sizes[client]}")


def _every_client(num_clients: int, sizes: dict[int, int]) -> list[int]:
    """Every client that could have replied: ids 0..K-1 (every runtime numbers them so),
    or those of the first step's replies when they are numbered otherwise."""
    return list(range(num_clients)) if set(sizes) <= set(range(num_clients)) else sorted(sizes)


def _sizes_of(replies: Mapping[int, Any], sizes: dict[int, int]) -> list[int]:
    """The first step's sample counts of the clients of ``replies``, in client order."""
    return [sizes[client] for client in sorted(replies)]


def _nlls(replies: dict[int, SetupReply], step: str) -> list[float]:
    """Every client's validation NLL, in client order."""
    return [float(_value(replies, client, step, VALIDATION_NLL)) for client in sorted(replies)]


def _made_updates(
    replies: dict[int, SetupReply], step: str, template: MADE
) -> dict[int, dict[str, Tensor]]:
    """Every client's MADE parameters, by client id, checked against ``template``; a client
    whose parameters do not fit it is dropped."""
    updates = {}
    for client in sorted(replies):
        parameters = replies[client].tensors
        try:
            load_made_parameters(copy.deepcopy(template), parameters)
        except ValueError as error:
            _drop(replies, step, client, str(error))
            continue
        updates[client] = dict(parameters)
    if not updates:
        raise TrainingError(f"FedDisk phase 1, step {step!r}: no client sent a usable MADE, so the run stops")
    return updates


def _received(template: MADE, step: SetupStep) -> MADE:
    if not step.tensors:
        raise ConfigError(f"FedDisk phase-1 step {step.name!r} carries no MADE")
    return load_made_parameters(copy.deepcopy(template), step.tensors)


def _keep(state: dict[str, Any], name: str, parameters: dict[str, Tensor]) -> None:
    """Keep a MADE's parameters in ``state`` under ``name.<parameter>``."""
    for key in [key for key in state if key.startswith(f"{name}.")]:
        del state[key]
    for key, value in parameters.items():
        state[f"{name}.{key}"] = value


def _kept(state: dict[str, Any], name: str) -> dict[str, Tensor]:
    prefix = f"{name}."
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def _made(template: MADE, state: dict[str, Any], name: str) -> MADE:
    """The MADE ``state`` keeps under ``name``."""
    parameters = _kept(state, name)
    if not parameters:
        raise ConfigError(
            f"this client keeps no {name!r} MADE: the server must run the whole phase"
        )
    return load_made_parameters(copy.deepcopy(template), parameters)


# ---------------------------------------------------------------------- phase 1


def compute_feddisk_weights(
    federation: Federation, config: FedDiskConfig, rng: np.random.Generator
) -> FedDiskWeights:
    """FedDisk's phase 1 (steps 1-4) for every client, in this process.

    Args:
        federation: the clients; their ``train_x`` are flattened to D dimensions.
        config: the validated :class:`~.config.FedDiskConfig`.
        rng: the only source of randomness (:class:`~.density.PhaseOneSeeds` are drawn
            from it; client k's splits, mini-batch orders and classifier initialisation
            come from its own stream, keyed by its ``client_id``).

    Returns:
        The normalised weights of every client's training samples and the traffic of
        the global MADE rounds.
    """
    phase = FedDiskPhase(config, rng=rng)
    clients = [
        PhaseInputs(client.client_id, client.train_x, client.train_y)
        for client in federation.clients
    ]
    run_in_process(phase, clients)
    if phase.result is None:
        raise RuntimeError("FedDisk's phase 1 ended without a result")
    return phase.result
