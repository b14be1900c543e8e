"""fedplug's server side next to a FedML user's own ``ClientTrainer``, model and data.

:class:`FedplugAggregator` is the ``ServerAggregator`` to pass to FedML's cross-silo server
instead of FedML's default one: fedplug's sampling, aggregators and groupers decide the
next global model, nothing changes on the clients. Silo ``k`` is fedplug client ``k``;
FedML's ``comm_round`` must be :attr:`FedplugAggregator.comm_round`. A component that
needs more than a model and a sample count is refused in one line naming what it needs.
Guide: docs/fedml.md, 'Your own FedML app: fedplug's server side only'.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from fedml.core import ServerAggregator
from torch import Tensor, nn

from fedplug.components import SLOTS, ClientNeeds, FederationSummary, RoundPlan
from fedplug.config import validate_section
from fedplug.errors import ConfigError, TrainingError
from fedplug.models.flops import training_flops_per_sample
from fedplug.registry import Registry
from fedplug.run.chains import ChainProgress, RoundChains
from fedplug.run.components import Components
from fedplug.run.evaluation import evaluate_batches
from fedplug.run.federated_round import AggregatedRound, Evaluation, RoundCore
from fedplug.run.results import RoundRecord, RunResult
from fedplug.run.round_plan import round_steps
from fedplug.run.vectors import model_to_vector, vector_to_model
from fedplug.screening import count_problem, dtype_problem

ENGINE_NAME = "fedml-drop-in"
"""The ``engine`` entry of the drop-in's derived params."""

ClientReply = tuple[float, Mapping[str, Tensor]]
"""What FedML's server hands ``aggregate`` per silo: ``(sample count, state dict)``."""


def unmet_needs(needs: ClientNeeds, class_counts_given: bool) -> list[str]:
    """What the components need that a plain FedML ClientTrainer does not give: everything
    :meth:`ClientNeeds.describe` names, except the class counts when the caller passed
    them, plus any pooled data."""
    unmet = dataclasses.replace(needs, class_counts=False).describe()
    if needs.class_counts and not class_counts_given:
        unmet.append("every client's class counts (pass class_counts=)")
    if needs.pooled_data is not None:
        unmet.append(needs.pooled_data)
    return unmet


def first_input_shape(batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[int, ...] | None:
    """The shape of one sample of the first batch of ``(x, y)`` (``None`` when empty)."""
    for inputs, _ in batches:
        return tuple(inputs.shape[1:])
    return None


def class_counts_of(
    train_data_local_dict: Mapping[int, Iterable[Any]], num_classes: int
) -> np.ndarray:
    """The K x C class counts of FedML's ``train_data_local_dict`` (silo -> batches of
    ``(x, y)``), for a grouper that needs them (FedGSP's ``fedgsp`` mode)."""
    counts = np.zeros((len(train_data_local_dict), num_classes), dtype=np.int64)
    for silo, batches in train_data_local_dict.items():
        for _, labels in batches:
            counts[silo] += np.bincount(np.asarray(labels).reshape(-1), minlength=num_classes)
    return counts


class FedplugAggregator(ServerAggregator):
    """A FedML ``ServerAggregator`` that runs fedplug's server side over plain replies.

    Args:
        model: the global model (FedML's server model); it holds the current global
            model throughout.
        args: FedML's arguments.
        train_config: fedplug's ``train`` section (validated or a dict): its
            ``aggregator``, ``grouper``, ``client_fraction``, ``rounds`` and ``seed`` are
            used; its sampler and loss transform must be client-free (uniform,
            cross_entropy).
        num_clients: K, the number of FedML silos.
        class_counts: K x C class counts (:func:`class_counts_of`), for a grouper that
            needs them and for the cost model, which reads the clients' training-set
            sizes as their row sums (default: none; the modelled compute time is 0).
        test_data: batches of ``(x, y)`` to evaluate the global model on after each
            round (default: no central evaluation, NaN accuracy).
        input_shape: one sample's shape without the batch dimension, for the model's
            training FLOPs (the cost model and ``train_flops_per_sample``; default: the
            first batch of ``test_data``'s, else unknown and 0).
        target_accuracy: for :attr:`RunResult.rounds_to_target` (default None).
        registry: the component registry (default: the installed plugins).

    Raises:
        ConfigError: a component needs more from the clients than model and sample
            count (one line naming what), or the config is invalid.
    """

    def __init__(
        self,
        model: nn.Module,
        args: Any,
        train_config: Mapping[str, Any] | Any,
        *,
        num_clients: int,
        class_counts: np.ndarray | None = None,
        test_data: Iterable[tuple[Tensor, Tensor]] | None = None,
        input_shape: tuple[int, ...] | None = None,
        target_accuracy: float | None = None,
        registry: Registry | None = None,
    ) -> None:
        super().__init__(model, args)
        if registry is None:
            from fedplug.plugins import default_registry

            registry = default_registry()
        if isinstance(train_config, Mapping):
            train_config = validate_section("train", dict(train_config), registry)
        if num_clients < 1:
            raise ConfigError(f"num_clients ({num_clients}) must be positive")
        self.config = train_config
        self.num_clients = num_clients
        self.components = Components.build(train_config, registry, num_clients)
        self.aggregator = self.components.aggregator
        self.grouper = self.components.grouper
        self.loss_transform = self.components.loss_transform
        unmet = unmet_needs(self.components.needs(), class_counts is not None)
        if unmet:
            names = ", ".join(f"{slot}={getattr(train_config, slot).name}" for slot in SLOTS)
            raise ConfigError(
                f"FedplugAggregator runs next to your own FedML ClientTrainer, whose replies are "
                f"a model and a sample count; {names} also needs: {'; '.join(unmet)}. Run it with "
                "fedplug's ClientTrainer instead: python -m fedplug.adapters.fedml run CONFIG"
            )
        counts = (
            np.asarray(class_counts, dtype=np.int64)
            if class_counts is not None
            else np.zeros((num_clients, 1), dtype=np.int64)
        )
        if counts.shape[0] != num_clients:
            raise ConfigError(
                f"class_counts has {counts.shape[0]} rows, one per client is {num_clients}"
            )
        self.components.prepare(FederationSummary(counts))
        phases = self.components.setup_phases()
        if phases:
            raise ConfigError(
                f"FedplugAggregator runs next to your own FedML ClientTrainer, which cannot answer the "
                f"steps of the setup phase of the {', '.join(slot for slot, _ in phases)} (FedML's drop-in "
                "messages carry a model and a sample count only); run the experiment with the FedML "
                "coordinator runtime, which runs setup phases: python -m fedplug.adapters.fedml run CONFIG"
            )
        self.vector = model_to_vector(model).detach().clone()
        self.aggregator.initialize(self.vector)
        if input_shape is None and test_data is not None:
            input_shape = first_input_shape(test_data)
        self.core = RoundCore(
            train_config,
            components=self.components,
            num_clients=num_clients,
            class_counts=counts if class_counts is not None else None,
            client_sizes=counts.sum(axis=1) if class_counts is not None else None,
            model_bytes=self.vector.numel() * 4,
            train_flops=training_flops_per_sample(model, input_shape) if input_shape else 0,
            can_replay=False,
            runtime="FedML",
        )
        self.plans: list[RoundPlan] = [self.core.plan(index) for index in range(train_config.rounds)]
        self.test_data = test_data
        self.history: list[RoundRecord] = []
        self.target_accuracy = target_accuracy
        self._round = 0
        self._position = 0
        self._chains: RoundChains | None = None
        self._started = time.perf_counter()
        self._bytes = 0
        self._start_round()

    @property
    def comm_round(self) -> int:
        """The FedML rounds the run takes (``args.comm_round``): one per chain position
        of every fedplug round."""
        return sum(round_steps(plan) for plan in self.plans)

    @property
    def result(self) -> RunResult:
        """The finished rounds and the run's derived params, as ``fedplug run``'s
        ``metrics.json`` holds them (no setup phase: the components are client-free)."""
        return self.core.run_result(
            list(self.history),
            self.components,
            target_accuracy=self.target_accuracy,
            engine=ENGINE_NAME,
            fedml_rounds=self.comm_round,
        )

    # ------------------------------------------------------------- FedML's calls

    def get_model_params(self) -> OrderedDict[str, Tensor]:
        return OrderedDict(self.model.state_dict())

    def set_model_params(self, model_parameters: Any) -> None:
        """FedML stores what :meth:`aggregate` returned; per-silo models (a plain dict)
        are not a global model, so only a state dict is loaded."""
        if isinstance(model_parameters, OrderedDict):
            self.model.load_state_dict(model_parameters)

    def aggregate(self, raw_client_model_or_grad_list: list[ClientReply]) -> Any:
        """Take the silos' replies for the current chain position. Between positions of
        a round, return ``{silo: state dict}`` (a plain dict, which FedML sends silo by
        silo: each chain's next member gets its chain's model); after a round's last
        position, the new global model (a state dict, which FedML sends to all).

        Raises:
            TrainingError: FedML sent more rounds than :attr:`comm_round`, a reply is
                missing, or too many chains failed (FedML cannot replay a round).
        """
        if self._round >= len(self.plans):
            raise TrainingError(
                f"FedML ran more rounds than fedplug planned; set args.comm_round = {self.comm_round}"
            )
        replies = list(raw_client_model_or_grad_list)
        if len(replies) != self.num_clients:
            raise TrainingError(
                f"FedML handed {len(replies)} replies, fedplug expects one per silo ({self.num_clients}); "
                f"set client_num_per_round = client_num_in_total = {self.num_clients}"
            )
        max_samples = self.core.screening_rules.config.max_num_examples
        for chain in self._round_chains().active():  # every one at this position (lockstep)
            take_reply(chain, replies[chain.current], self.model, max_samples)
        self._position += 1
        if self._position < round_steps(self.plans[self._round]):
            return self._per_silo_models()
        self._finish_round()
        self._round += 1
        if self._round < len(self.plans):
            self._start_round()
        return self.get_model_params()

    def test(self, test_data: Any, device: Any, args: Any) -> dict[str, float] | None:
        """The last finished round's metrics (evaluated on ``test_data`` given at
        construction)."""
        if not self.history:
            return None
        record = self.history[-1]
        return {"round": record.round, "accuracy": record.accuracy, "loss": record.loss}

    # ----------------------------------------------------------------- internals

    def _start_round(self) -> None:
        self._chains = RoundChains(self.plans[self._round], self.vector)
        self._position = 0
        self._started = time.perf_counter()

    def _round_chains(self) -> RoundChains:
        if self._chains is None:
            raise RuntimeError("no round in progress: _start_round must run first")
        return self._chains

    def _per_silo_models(self) -> dict[int, OrderedDict[str, Tensor]]:
        global_state = self.get_model_params()
        models: dict[int, OrderedDict[str, Tensor]] = {
            silo: global_state for silo in range(self.num_clients)
        }
        for chain in self._round_chains().chains:
            # A failed chain's next member trains too (FedML sends every silo a model),
            # from the chain's last model; its reply is ignored.
            if self._position < len(chain.chain):
                vector_to_model(chain.vector, self.model)
                models[chain.chain[self._position]] = copy.deepcopy(
                    OrderedDict(self.model.state_dict())
                )
        vector_to_model(self.vector, self.model)
        return models

    def _finish_round(self) -> None:
        plan = self.plans[self._round]
        chains = self._round_chains()
        attempt: AggregatedRound = self.core.run(
            self._round, self.vector, plan, lambda _attempt: chains.outcomes()
        )
        self.vector = attempt.vector
        vector_to_model(self.vector, self.model)
        evaluation = (
            evaluate_batches(self.model, self.test_data) if self.test_data is not None else Evaluation()
        )
        record = self.core.record(
            self._round,
            plan,
            attempt,
            evaluation,
            payload_bytes=0,
            bytes_so_far=self._bytes,
            started=self._started,
        )
        self._bytes = record.cumulative_bytes
        self.history.append(record)


def take_reply(chain: ChainProgress, reply: ClientReply, model: nn.Module, max_samples: int) -> None:
    """Advance ``chain`` with its current member's ``(sample count, state dict)``; a reply
    that is not one (a sample count that is not an integer in ``[0, max_samples]``, a state
    dict of other keys, shapes or dtypes) fails the chain with the reason, as the round
    core's screen would (which then screens the chain's model and total count)."""
    decoded = decode_reply(reply, model, max_samples)
    if isinstance(decoded, str):
        chain.fail(decoded)
        return
    vector, samples = decoded
    chain.advance(vector, samples, steps=0, seconds=0.0)


def decode_reply(reply: ClientReply, model: nn.Module, max_samples: int) -> tuple[Tensor, int] | str:
    """One silo's reply as ``(model vector, sample count)``, or why it is not FedML's
    ``(sample count, state dict)`` for ``model``."""
    try:
        samples, state = reply
    except (TypeError, ValueError):
        return f"its reply is not FedML's (sample count, state dict) but {type(reply).__name__}"
    if reason := count_problem("a sample count", samples, max_samples):
        return reason
    if not isinstance(state, Mapping):
        return f"its reply is not the model's state dict but {type(state).__name__}"
    for key, value in state.items():
        if not isinstance(value, Tensor):
            return f"its state dict holds {type(value).__name__} at {str(key)[:60]!r}, expected tensors"
        if reason := dtype_problem(f"state dict entry {str(key)[:60]!r}", value.dtype, "real"):
            return reason
    try:
        scratch = copy.deepcopy(model)
        scratch.load_state_dict(state)
    except Exception as error:  # noqa: BLE001 - a silo's reply must not stop the server
        return f"its reply is not the model's state dict ({type(error).__name__}: {str(error)[:200]})"
    return model_to_vector(scratch).detach().clone(), int(samples)
