"""Test-only plugins for the conformance suite: one of each self-description a component
can make, defined only here and registered through the ordinary plugin mechanism.

- aggregator ``conformance_momentum``: server momentum with its own ``state_dict``; it
  sends a payload down with every model (``server_payload``), reads an extra in every
  reply (``reply_extras``), reports the damping as a round metric (a study column), and
  its config reports a derived value;
- loss transform ``conformance_mean_weighted``: a two-step setup phase (every client
  reports the sum of its inputs; the server sends the global mean back and each client
  keeps one weight per sample) and a cross-entropy weighted by those weights; with a
  ``cache_dir`` it keeps the phase's result in a file (``setup_file``), which the
  pipeline's setup stage computes;
- grouper ``conformance_pairs``: chains of two clients that train one after the other,
  with its own per-round metrics ``chain_count`` and ``largest_chain``, and an analysis
  that makes ``chain_count`` a study column and a box plot;
- loss transform ``conformance_faulty``: cross-entropy, except that chosen clients raise
  (always, or only the first time: :func:`reset_faults`) or train to NaN; failure
  injection that every runtime meets in the same component.

None of them exists in ``fedplug``: if a runtime runs them and agrees with the simulator,
it serves components by what they declare, not by their names.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor
from torch.nn import functional as F

from fedplug.analysis import Analysis, BoxFigure, RoundMetricColumn
from fedplug.components import (
    Aggregator,
    ClientNeeds,
    ClientUpdate,
    ComponentConfig,
    Context,
    Grouper,
    LocalTraining,
    LossTransform,
    PhaseCost,
    RoundPlan,
    WeightedMean,
)
from fedplug.hookspecs import RegisterAggregator, RegisterGrouper, RegisterLossTransform, hookimpl
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.vectors import tensors_num_bytes
from fedplug.setup_phase import ClientInputs, SetupPhase, SetupReply, SetupStep

AGGREGATOR = "conformance_momentum"
LOSS_TRANSFORM = "conformance_mean_weighted"
GROUPER = "conformance_pairs"
FAULTY_LOSS_TRANSFORM = "conformance_faulty"
PLUGIN_NAME = "conformance_plugins"

# Keys of the aggregator's messages.
DAMPING_KEY = "damping"
"""Server payload: a 1-element tensor, ``1 + the last round's mean update norm``."""
UPDATE_NORM_KEY = "update_norm"
"""Reply extra: a 1-element tensor, ``||end - start|| / damping``."""

# Keys of the setup phase.
SAMPLE_WEIGHT_KEY = "sample_weight"


# --------------------------------------------------------------------- the aggregator


class ConformanceMomentumConfig(ComponentConfig):
    """Server momentum damped by the clients' reported update norms (test only)."""

    name: Literal["conformance_momentum"] = "conformance_momentum"
    analysis = Analysis(columns=(RoundMetricColumn("conformance_damping", "final server damping", reduce="last"),))
    momentum: float = Field(default=0.5, ge=0.0, lt=1.0)
    """Server momentum beta (default 0.5)."""
    server_lr: float = Field(default=1.0, gt=0.0, le=10.0)
    """Server learning rate (default 1.0)."""

    def derived_values(self, train: Any) -> dict[str, Any]:
        """``conformance_effective_lr``: client lr x server lr / (1 - momentum)."""
        rate = train.optimizer.lr * self.server_lr / (1.0 - self.momentum)
        return {"conformance_effective_lr": rate}


class ConformanceMomentum(Aggregator):
    """Heavy-ball server momentum whose step is divided by ``1 + mean update norm``.

    Server state: the velocity and the damping sent as the next round's payload. Client
    side: each client reports ``||end - start|| / damping`` (a reply extra that depends on
    the payload), so a runtime that drops either message changes the model.
    """

    def __init__(self, config: ConformanceMomentumConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.config = config
        self.velocity: Tensor | None = None
        self.damping = torch.ones(1)

    def client_needs(self) -> ClientNeeds:
        return ClientNeeds(
            client_side=True, server_payload=(DAMPING_KEY,), reply_extras=(UPDATE_NORM_KEY,)
        )

    def initialize(self, global_vector: Tensor) -> None:
        self.velocity = torch.zeros_like(global_vector, dtype=torch.float32)
        self.damping = torch.ones(1)

    def server_payload(self) -> dict[str, Tensor]:
        return {DAMPING_KEY: self.damping.clone()}

    def client_finish(
        self,
        start_vector: Tensor,
        end_vector: Tensor,
        training: LocalTraining,
        payload: dict[str, Tensor],
        client_state: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        norm = (end_vector.detach().double() - start_vector.detach().double()).norm()
        return {UPDATE_NORM_KEY: (norm / payload[DAMPING_KEY].double()).float().reshape(1)}

    def aggregate(self, global_vector: Tensor, updates: Iterable[ClientUpdate]) -> Tensor:
        models, norms = WeightedMean(), WeightedMean()
        for update in updates:
            if UPDATE_NORM_KEY not in update.extras:
                raise ValueError(
                    f"client {update.client_id}'s update has no extras[{UPDATE_NORM_KEY!r}]"
                )
            models.add(update.vector, update.weight)
            norms.add(update.extras[UPDATE_NORM_KEY].reshape(1), update.weight)
        mean = models.mean().double()  # raises ValueError when no update arrived
        mean_norm = norms.mean().double()
        current = global_vector.detach().double()
        previous = torch.zeros_like(current) if self.velocity is None else self.velocity.double()
        velocity = self.config.momentum * previous + (current - mean)
        step = self.config.server_lr / (1.0 + float(mean_norm[0]))
        self.velocity = velocity.float()
        self.damping = (1.0 + mean_norm).float()
        return (current - step * velocity).float()

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        """``conformance_damping``: the damping the next round's clients receive."""
        return {"conformance_damping": float(self.damping[0])}

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity, "damping": self.damping}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = state["velocity"]
        self.damping = state["damping"]


# ---------------------------------------------------------------- the loss transform


class MeanWeightedConfig(ComponentConfig):
    """Cross-entropy weighted by each sample's closeness to the global input mean, which
    a two-step setup phase computes (test only)."""

    name: Literal["conformance_mean_weighted"] = "conformance_mean_weighted"
    scale: float = Field(default=1.0, gt=0.0, le=100.0)
    """Width of the weight: ``w_i = 1 / (1 + ||x_i - mean||^2 / (scale * d))``."""
    cache_dir: str | None = None
    """Folder that keeps the phase's weights (default None: computed in memory)."""

    def setup_file(self, federation: Any) -> str | None:
        """``conformance_mean-<hash>.npz``, the hash of ``scale`` and every client's inputs."""
        digest = hashlib.sha256(repr(self.scale).encode())
        for client in federation.clients:
            digest.update(np.ascontiguousarray(client.train_x.cpu().numpy()).tobytes())
        return f"conformance_mean-{digest.hexdigest()[:16]}.npz"

    def setup_file_cost(self, path: Any) -> PhaseCost:
        with np.load(path) as stored:
            return PhaseCost(*(int(value) for value in stored["cost"]))


class MeanPhase(SetupPhase):
    """Step ``report``: every client sends the sum of its inputs and its sample count.
    Step ``weigh``: the server sends the global mean; each client keeps a weight per
    sample."""

    name = "conformance_mean"

    def __init__(self, loss: MeanWeighted) -> None:
        self.loss = loss
        self.cost: PhaseCost | None = None

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        report = SetupStep("report")
        replies = yield report
        bytes_up = sum(tensors_num_bytes(reply.tensors) for reply in replies.values())
        # In client-id order, in float64, so that every runtime adds up the same.
        total = sum(replies[client].tensors["sum"].double() for client in sorted(replies))
        count = sum(int(replies[client].values["count"]) for client in sorted(replies))
        weigh = SetupStep("weigh", tensors={"mean": (total / count).float()}, final=True)
        replies = yield weigh
        self.loss.client_reports = {client: dict(replies[client].report) for client in sorted(replies)}
        bytes_up += sum(tensors_num_bytes(reply.tensors) for reply in replies.values())
        bytes_down = num_clients * tensors_num_bytes(weigh.tensors)
        self.cost = PhaseCost(rounds=2, bytes_up=bytes_up, bytes_down=bytes_down)
        return self.cost

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        inputs = data.train_x.reshape(data.train_x.shape[0], -1).double()
        if step.name == "report":
            return SetupReply(
                tensors={"sum": inputs.sum(dim=0).float()}, values={"count": int(inputs.shape[0])}
            )
        if step.name == "weigh":
            mean = step.tensors["mean"].double().to(inputs.device)
            width = self.loss.config.scale * inputs.shape[1]
            distance = ((inputs - mean) ** 2).sum(dim=1) / width
            state[SAMPLE_WEIGHT_KEY] = (1.0 / (1.0 + distance)).float().cpu()
            return SetupReply(values={"kept": int(inputs.shape[0])})
        raise ValueError(f"unknown step {step.name!r}")

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        self.loss.weights = {client: state[SAMPLE_WEIGHT_KEY] for client, state in states.items()}
        if self.loss.save_to is not None and self.cost is not None:
            arrays = {f"client_{client}": weights.numpy() for client, weights in self.loss.weights.items()}
            cost = np.array([self.cost.rounds, self.cost.bytes_up, self.cost.bytes_down])
            np.savez(self.loss.save_to, cost=cost, **arrays)

    def client_context(self, state: dict[str, Any]) -> Context:
        return {SAMPLE_WEIGHT_KEY: state[SAMPLE_WEIGHT_KEY]}

    def client_report(self, state: dict[str, Any]) -> dict[str, Any]:
        return weights_report(state[SAMPLE_WEIGHT_KEY])


def weights_report(weights: Tensor) -> dict[str, Any]:
    """One client's report: the sum of its weights (float64) and their count."""
    return {"weight_sum": float(weights.double().sum()), "count": int(weights.numel())}


class MeanWeighted(LossTransform):
    """``w_k[sample_ids] * CE``, the weights from :class:`MeanPhase`."""

    def __init__(self, config: MeanWeightedConfig) -> None:
        self.config = config
        self.weights: dict[int, Tensor] | None = None
        self.client_reports: dict[int, dict[str, Any]] | None = None
        self.save_to: Path | None = None
        self.loaded_from_file = False

    def prepare(self, federation: Any) -> PhaseCost | None:
        """With a ``cache_dir`` and a federation of clients' data: load the weights kept
        there (then no phase runs), or note where the phase should keep them."""
        if self.config.cache_dir is None or not hasattr(federation, "clients"):
            return None
        path = Path(self.config.cache_dir) / self.config.setup_file(federation)
        if not path.is_file():
            self.save_to = path
            return None
        with np.load(path) as stored:
            self.weights = {client: torch.from_numpy(stored[f"client_{client}"])
                            for client in range(len(federation.clients))}
        self.loaded_from_file = True
        return self.config.setup_file_cost(path)

    def setup_phase(self) -> SetupPhase | None:
        return None if self.loaded_from_file else MeanPhase(self)

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        if self.weights is None:
            raise RuntimeError("the conformance_mean setup phase must run before round 1")
        return {SAMPLE_WEIGHT_KEY: self.weights[client_id]}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        weights = context[SAMPLE_WEIGHT_KEY].to(logits.device)
        return weights.gather(0, sample_ids) * F.cross_entropy(logits, targets, reduction="none")

    def setup_report(self) -> dict[str, Any]:
        """How many clients the phase weighted and their samples' mean weight, from the
        clients' reports (or, loaded from a file, the same reports of the weights at hand);
        empty before the phase."""
        reports = self.client_reports
        if reports is None and self.weights:
            reports = {client: weights_report(weights) for client, weights in self.weights.items()}
        if not reports:
            return {}
        total = sum(reports[client]["weight_sum"] for client in sorted(reports))
        count = sum(reports[client]["count"] for client in sorted(reports))
        return {"weighted_clients": len(reports), "mean_weight": total / count}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.weights is None else {"weights": dict(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.weights = dict(state["weights"])


# ------------------------------------------------------------------------ the grouper


class PairsConfig(ComponentConfig):
    """Random chains of two clients that train one after the other (test only)."""

    name: Literal["conformance_pairs"] = "conformance_pairs"
    analysis = Analysis(
        columns=(RoundMetricColumn("chain_count", "chains per round", reduce="mean", series="chain_counts"),),
        figures=(BoxFigure("chain_count_box", series="chain_counts", title="chains per round",
                           axis_label="chains in a round"),),
    )
    chain_length: int = Field(default=2, ge=1, le=100)
    """Clients per chain (default 2); the last chain may be shorter."""

    def incompatibilities(self, train: Any) -> list[str]:
        # As for FedGSP: per-client control variates and step normalisation mean nothing
        # along a chain.
        if train.aggregator.name in {"scaffold", "fednova"}:
            name = train.aggregator.name
            return [f"grouper 'conformance_pairs' cannot run with aggregator {name!r}"]
        return []


class Pairs(Grouper):
    """Shuffles the sampled clients with the round's generator and cuts them into chains."""

    def __init__(self, config: PairsConfig) -> None:
        self.config = config

    def plan(self, round_number: int, clients: np.ndarray, rng: np.random.Generator) -> RoundPlan:
        order = [int(client) for client in rng.permutation(np.asarray(clients, dtype=np.int64))]
        length = self.config.chain_length
        chains = [order[start : start + length] for start in range(0, len(order), length)]
        groups = [list(chain) for chain in chains]
        return RoundPlan(chains=chains, weighting="samples", groups=groups)

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        return {
            "chain_count": float(len(plan.chains)),
            "largest_chain": float(max(len(chain) for chain in plan.chains)),
        }


# ------------------------------------------------------------------- failure injection


class FaultyConfig(ComponentConfig):
    """Cross-entropy, except that chosen clients raise or train to NaN (test only)."""

    name: Literal["conformance_faulty"] = "conformance_faulty"
    raise_on: tuple[int, ...] = ()
    """Clients whose training raises."""
    raise_once: bool = False
    """Raise only the first time each client of ``raise_on`` trains in this process (since
    the last :func:`reset_faults`), so that a retried round succeeds."""
    nan_on: tuple[int, ...] = ()
    """Clients whose loss, and so whose model, turns NaN."""


_RAISED: set[int] = set()
"""Clients of ``raise_on`` that already raised, for ``raise_once``."""


def reset_faults() -> None:
    """Forget which clients raised (call before each run that uses ``raise_once``)."""
    _RAISED.clear()


class Faulty(LossTransform):
    """Raises in :meth:`client_context` (where every runtime asks for a client's loss
    constants before it trains), or poisons the loss with a NaN factor."""

    def __init__(self, config: FaultyConfig) -> None:
        self.config = config

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        raised_before = self.config.raise_once and client_id in _RAISED
        if client_id in self.config.raise_on and not raised_before:
            _RAISED.add(client_id)
            raise RuntimeError(f"injected failure on client {client_id}")
        return {"poison": torch.tensor(float("nan") if client_id in self.config.nan_on else 0.0)}

    def per_sample_loss(
        self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context
    ) -> Tensor:
        # Multiplying (not adding) makes the NaN reach the gradients and so the model.
        poison = context["poison"].to(logits.device)
        return F.cross_entropy(logits, targets, reduction="none") * (1 + poison)


# ------------------------------------------------------------------------- the plugin


def make_plugin() -> types.ModuleType:
    """The plugin object: a module with one ``fedplug_register_*`` hookimpl per kind."""
    module = types.ModuleType(PLUGIN_NAME)

    @hookimpl
    def fedplug_register_aggregators(register: RegisterAggregator) -> None:
        register(AGGREGATOR, ConformanceMomentumConfig, ConformanceMomentum)

    @hookimpl
    def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
        register(LOSS_TRANSFORM, MeanWeightedConfig, MeanWeighted)
        register(FAULTY_LOSS_TRANSFORM, FaultyConfig, Faulty)

    @hookimpl
    def fedplug_register_groupers(register: RegisterGrouper) -> None:
        register(GROUPER, PairsConfig, Pairs)

    hooks = (
        fedplug_register_aggregators,
        fedplug_register_loss_transforms,
        fedplug_register_groupers,
    )
    for hook in hooks:
        setattr(module, hook.__name__, hook)
    return module


_REGISTRY: Registry | None = None


def conformance_registry() -> Registry:
    """The built-in components plus this module's plugins (built once per process)."""
    global _REGISTRY
    if _REGISTRY is None:
        manager = new_plugin_manager(autoload=False)
        manager.register(make_plugin(), name=PLUGIN_NAME)
        _REGISTRY = collect_registry(manager)
    return _REGISTRY
