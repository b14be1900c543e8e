"""Composite loss transform: several loss transforms in the one ``loss_transform`` slot.

``loss_transform: [fedshift, {name: fedprox, mu: 0.01}]`` is short for
``loss_transform: {name: composite, parts: [fedshift, {name: fedprox, mu: 0.01}]}``; both
validate to the same config, and the resolved config (``config.yaml``) shows the long form.
Each part is validated exactly as it would be alone in the slot, an error naming its path
(``train.loss_transform.parts.1.mu``). A single loss transform keeps its own config (and
config hash): the composite exists only where a list, or ``name: composite``, is written.

How the parts combine (every hook of :class:`~fedplug.components.LossTransform` and
:class:`~fedplug.components.ComponentHooks`):

- **Per-sample loss:** at most one part may change it (FedShift's shifted logits,
  Reweighting's class weights, FedDisk's and FedDiskAb's sample weights); the composite's
  per-sample loss is that part's, or plain cross-entropy when no part changes it. Two such
  parts are refused when the config is validated: each one's ``per_sample_loss`` returns a
  whole loss (a weighted cross-entropy, a shifted cross-entropy), and the interface says
  nothing that would combine two of them exactly (weights times a shifted cross-entropy
  would need a part's weights apart from its loss).
- **Penalty:** the parts' penalties add, in part order (FedProx's proximal term).
- **Client context:** each part's own, under its key ``"<position>.<name>"`` (``"0.fedshift"``),
  so two parts never see, or overwrite, each other's entries.
- **prepare:** every part's, in order; their phase costs add up.
- **Setup phase:** at most one part may declare one (FedDisk's); the composite declares it,
  with its client context put under that part's key. Such a part cannot be combined with
  another part that has a client context of its own: on Flower only the phase's context
  reaches the clients' training.
- **Client needs:** the union of the parts'. **Setup report** and **round metrics:** the
  parts' merged; a key two parts report is an error.
- **state_dict / load_state_dict:** every part's entries, under ``"<key>/<entry>"``.

A runtime sees a composite as one loss transform, so it runs unchanged on the simulator
(every engine), Flower and FedML. The composite's class overrides exactly the hooks its
parts override (the runtimes detect FedProx's missing per-sample loss, or FedShift's
``prepare``, by the class), so FedProx + plain cross-entropy trains as FedProx alone, bit
for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import (
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from torch import Tensor

from fedplug.components import ClientNeeds, ComponentConfig, Context, LossTransform, PhaseCost, RoundPlan
from fedplug.config import COMPOSITE_LOSS, REGISTRY_CONTEXT
from fedplug.errors import ConfigError
from fedplug.hookspecs import RegisterLossTransform, hookimpl
from fedplug.setup_phase import SetupPhase

if TYPE_CHECKING:
    from fedplug.registry import Registry
    from fedplug.schema import MessageSchema
    from fedplug.setup_phase import ClientInputs, ReplySchema, ReportValue, SetupReply, SetupStep

__all__ = [
    "COMPOSITE",
    "REGISTRY_CONTEXT",
    "CompositeLoss",
    "CompositeLossConfig",
    "build_composite_loss",
    "part_key",
]

COMPOSITE = COMPOSITE_LOSS
"""The composite's registered name."""
KIND = "loss_transforms"
STATE_SEPARATOR = "/"


def part_key(position: int, name: str) -> str:
    """The key of the part at ``position`` (0-based) named ``name``: ``"0.fedshift"``; its
    client context and state entries live under it."""
    return f"{position}.{name}"


# ------------------------------------------------------------------ what a part changes


def changes_per_sample_loss(transform_class: type) -> bool:
    """Whether a loss transform of this class changes the per-sample loss."""
    return transform_class.per_sample_loss is not LossTransform.per_sample_loss


def declares_setup_phase(transform_class: type) -> bool:
    return transform_class.setup_phase is not LossTransform.setup_phase


def has_client_context(transform_class: type) -> bool:
    return transform_class.client_context is not LossTransform.client_context


def composition_problems(names: Sequence[str], classes: Sequence[type | None]) -> list[str]:
    """Why the parts named ``names``, of the loss-transform ``classes`` (None: not known
    before the part is built), cannot be composed (one reason); empty when they can."""
    known = [(name, cls) for name, cls in zip(names, classes) if cls is not None]
    problems: list[str] = []
    per_sample = [name for name, cls in known if changes_per_sample_loss(cls)]
    if len(per_sample) > 1:
        return [
            f"the parts {', '.join(map(repr, per_sample))} each change the per-sample loss, and at most "
            "one may (each returns a whole loss, which cannot be combined exactly); keep one of them, "
            "with any penalty parts (fedprox)"
        ]
    phased = [name for name, cls in known if declares_setup_phase(cls)]
    if len(phased) > 1:
        problems.append(
            f"the parts {', '.join(map(repr, phased))} each declare a setup phase, and at most one may; "
            "keep one of them"
        )
    elif phased:
        with_context = [
            name for name, cls in known if has_client_context(cls) and not declares_setup_phase(cls)
        ]
        if with_context:
            problems.append(
                f"the part {phased[0]!r} declares a setup phase, so on Flower only its client context reaches "
                f"the clients, and {', '.join(map(repr, with_context))} needs a client context of its own; "
                "compose it with parts that need none (fedprox)"
            )
    return problems


def _known_class(factory: Callable[..., Any]) -> type | None:
    """The loss-transform class a factory builds, when the factory is that class (a
    factory function builds a class the composite checks once it is built)."""
    return factory if isinstance(factory, type) and issubclass(factory, LossTransform) else None


# ----------------------------------------------------------------------------- config


def _default_registry() -> Registry:
    from fedplug.plugins import default_registry

    return default_registry()


def _registry_in(info: ValidationInfo) -> Registry | None:
    """The registry :func:`fedplug.config.composed_loss_entry` validates the parts against."""
    context = info.context if isinstance(info.context, Mapping) else {}
    return context.get(REGISTRY_CONTEXT)


def _error(kind: str, message: str, location: tuple[Any, ...], value: Any) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=location, input=value)


def validated_parts(value: Any, registry: Registry) -> tuple[ComponentConfig, ...]:
    """``value`` (a list of loss transforms: names, ``{name: ..., ...}`` entries or configs)
    as the parts' validated configs, each validated by its registered config class.

    Raises:
        ValidationError: one problem per line, at the path of the part (``1.mu``), or at
            the list when the parts cannot be composed.
    """
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        message = "expected a list of loss transforms (names, or {name: ..., ...} entries)"
        raise ValidationError.from_exception_data("parts", [_error("composite_parts", message, (), value)])
    entries = list(value)
    if len(entries) < 2:
        message = (
            "a composite needs at least two parts; write a single loss transform on its own "
            "(loss_transform: fedprox)"
        )
        raise ValidationError.from_exception_data("parts", [_error("composite_parts", message, (), value)])
    names = registry.names(KIND)
    choices = ", ".join(name for name in names if name != COMPOSITE)
    configs: list[ComponentConfig] = []
    errors: list[InitErrorDetails] = []
    for position, entry in enumerate(entries):
        if isinstance(entry, ComponentConfig):
            configs.append(entry)
            continue
        entry = {"name": entry} if isinstance(entry, str) else entry
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(entry, Mapping):
            message = "expected a loss transform: a name, or {name: ..., ...}"
            errors.append(_error("composite_part", message, (position,), entry))
        elif name is None:
            message = f"missing 'name:'; choose one of: {choices}"
            errors.append(_error("composite_part", message, (position,), entry))
        elif name == COMPOSITE:
            message = "a part cannot itself be a composite; list all the parts in one list"
            errors.append(_error("composite_part", message, (position, "name"), name))
        elif name not in names:
            message = f"unknown loss transform {name!r}; registered: {choices}"
            errors.append(_error("composite_part", message, (position,), entry))
        else:
            try:
                configs.append(registry.get(KIND, name).config_class.model_validate(dict(entry)))
            except ValidationError as error:
                errors += [
                    _error(item["type"], item["msg"], (position, *item["loc"]), item["input"])
                    for item in error.errors()
                ]
    if not errors:
        classes = [_known_class(registry.get(KIND, config.name).factory) for config in configs]
        problems = composition_problems([config.name for config in configs], classes)
        errors += [_error("composite_parts", problem, (), value) for problem in problems]
    if errors:
        raise ValidationError.from_exception_data("parts", errors)
    return tuple(configs)


class CompositeLossConfig(ComponentConfig):
    """Several loss transforms in one slot: penalties add, at most one part changes the
    per-sample loss (``loss_transform: [fedshift, fedprox]``)."""

    name: Literal["composite"] = "composite"
    parts: tuple[SerializeAsAny[ComponentConfig], ...] = Field(min_length=2)
    """The loss transforms composed, in order (at least two), each written as it would be
    alone in the slot: a name, or ``{name: ..., parameters}``. At most one may change the
    per-sample loss (fedshift, reweighting, feddisk, feddisk_ab); penalties (fedprox) add.
    No default."""

    _factories: tuple[Callable[..., Any], ...] | None = PrivateAttr(default=None)
    """The registered factory of every part, from the registry that validated them (None:
    validated without one; the installed plugins' are used)."""

    @field_validator("parts", mode="before")
    @classmethod
    def _parts_by_their_own_configs(cls, value: Any, info: ValidationInfo) -> tuple[ComponentConfig, ...]:
        return validated_parts(value, _registry_in(info) or _default_registry())

    @model_validator(mode="after")
    def _remember_factories(self, info: ValidationInfo) -> CompositeLossConfig:
        registry = _registry_in(info)
        if registry is not None:
            self._factories = tuple(registry.get(KIND, part.name).factory for part in self.parts)
        return self

    def part_factories(self) -> tuple[Callable[..., Any], ...]:
        """Every part's factory: from the registry that validated the parts, else the
        installed plugins'."""
        if self._factories is not None:
            return self._factories
        registry = _default_registry()
        return tuple(registry.get(KIND, part.name).factory for part in self.parts)

    def incompatibilities(self, train: Any) -> list[str]:
        """Every part's reasons, each naming the part."""
        return [
            f"part {part_key(position, part.name)!r}: {why}"
            for position, part in enumerate(self.parts)
            for why in part.incompatibilities(train)
        ]

    def derived_values(self, train: Any) -> dict[str, Any]:
        """Every part's derived values; a name two parts derive is kept under each part's key."""
        values: dict[str, Any] = {}
        per_part = [part.derived_values(train) for part in self.parts]
        counts: dict[str, int] = {}
        for derived in per_part:
            for name in derived:
                counts[name] = counts.get(name, 0) + 1
        for position, (part, derived) in enumerate(zip(self.parts, per_part)):
            for name, value in derived.items():
                values[name if counts[name] == 1 else f"{part_key(position, part.name)}/{name}"] = value
        return values


# ------------------------------------------------------------------------ the transform


def merged_reports(reports: Sequence[tuple[str, Mapping[str, Any]]], what: str) -> dict[str, Any]:
    """The parts' reports (``(part key, entries)`` each) merged.

    Raises:
        ConfigError: two parts report an entry of the same name.
    """
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for key, entries in reports:
        for name, value in entries.items():
            if name in owner:
                raise ConfigError(
                    f"the loss transform parts {owner[name]!r} and {key!r} both report the {what} "
                    f"{name!r}; compose parts whose {what}s differ"
                )
            owner[name] = key
            merged[name] = value
    return merged


class CompositeLoss(LossTransform):
    """The parts of a :class:`CompositeLossConfig`, asked as one loss transform (see the
    module docstring). Built by :func:`build_composite_loss`, which picks the subclass that
    overrides exactly the hooks the parts override.

    Args:
        config: the validated :class:`CompositeLossConfig`.
        parts: the parts, built, in the config's order.
    """

    def __init__(self, config: CompositeLossConfig, parts: Sequence[LossTransform]) -> None:
        self.config = config
        self.parts = list(parts)
        self.keys = [part_key(position, part.name) for position, part in enumerate(config.parts)]
        problems = composition_problems([part.name for part in config.parts], [type(part) for part in self.parts])
        if problems:
            raise ConfigError(f"train.loss_transform.parts: {'; '.join(problems)}")
        self.sample_loss_part: int | None = next(
            (index for index, part in enumerate(self.parts) if changes_per_sample_loss(type(part))), None
        )
        """The position of the part whose per-sample loss the composite's is (None: plain CE)."""

    def _keyed(self) -> Iterable[tuple[str, LossTransform]]:
        return zip(self.keys, self.parts)

    def client_needs(self) -> ClientNeeds:
        """The union of the parts' needs."""
        needs = ClientNeeds()
        for part in self.parts:
            needs = needs | part.client_needs()
        return needs

    def setup_phase(self) -> SetupPhase | None:
        """The one part's setup phase, its client context under that part's key; None
        when no part declares one (now)."""
        for key, part in self._keyed():
            phase = part.setup_phase()
            if phase is not None:
                return PartPhase(phase, key)
        return None

    def setup_report(self) -> dict[str, Any]:
        return merged_reports([(key, part.setup_report()) for key, part in self._keyed()], "setup entry")

    def round_metrics(self, plan: RoundPlan, class_counts: np.ndarray | None) -> dict[str, float]:
        reports = [(key, part.round_metrics(plan, class_counts)) for key, part in self._keyed()]
        return merged_reports(reports, "round metric")

    def state_dict(self) -> dict[str, Any]:
        """Every part's entries under ``"<part key>/<entry>"`` (empty when no part keeps any)."""
        return {
            f"{key}{STATE_SEPARATOR}{name}": value
            for key, part in self._keyed()
            for name, value in part.state_dict().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand every part its own entries of :meth:`state_dict`'s output."""
        for key, part in self._keyed():
            prefix = key + STATE_SEPARATOR
            own = {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}
            part.load_state_dict(own)


class _PartsPrepare:
    """``prepare``: every part's, in order; their costs added (None when none has one)."""

    parts: list[LossTransform]

    def prepare(self, federation: Any) -> PhaseCost | None:
        costs = [cost for cost in (part.prepare(federation) for part in self.parts) if cost is not None]
        if not costs:
            return None
        total = costs[0]
        for cost in costs[1:]:
            total = total + cost
        return total


class _PartsContext:
    """``client_context``: every part's non-empty context under its key."""

    parts: list[LossTransform]
    keys: list[str]

    def client_context(self, client_id: int, class_counts: np.ndarray) -> Context:
        contexts = ((key, part.client_context(client_id, class_counts)) for key, part in zip(self.keys, self.parts))
        return {key: context for key, context in contexts if context}


class _OnePartSampleLoss:
    """``per_sample_loss``: the one part's that changes it, with its own context."""

    parts: list[LossTransform]
    keys: list[str]
    sample_loss_part: int | None

    def per_sample_loss(self, logits: Tensor, targets: Tensor, sample_ids: Tensor, context: Context) -> Tensor:
        index = self.sample_loss_part  # set: this hook is on the class only when a part changes the loss
        assert index is not None
        own_context = context.get(self.keys[index], {})
        return self.parts[index].per_sample_loss(logits, targets, sample_ids, own_context)


class _SummedPenalties:
    """``penalty``: the parts' penalties added, in part order (None when none gives one)."""

    parts: list[LossTransform]
    keys: list[str]

    def penalty(self, params: dict[str, Tensor], anchor: dict[str, Tensor], context: Context) -> Tensor | None:
        total: Tensor | None = None
        for key, part in zip(self.keys, self.parts):
            term = part.penalty(params, anchor, context.get(key, {}))
            if term is not None:
                total = term if total is None else total + term
        return total


HOOK_MIXINS: dict[str, type] = {
    "prepare": _PartsPrepare,
    "client_context": _PartsContext,
    "per_sample_loss": _OnePartSampleLoss,
    "penalty": _SummedPenalties,
}
"""The hooks a runtime tells apart by the loss transform's class (``type(t).penalty is
LossTransform.penalty``), each with the mixin that delegates it to the parts."""


def _variant_name(hooks: Iterable[str]) -> str:
    return "CompositeLoss" + "".join("_" + hook for hook in hooks)


def _make_variants() -> dict[frozenset[str], type[CompositeLoss]]:
    """One subclass of :class:`CompositeLoss` per set of delegated hooks, made once at
    import and kept as this module's attributes, so that a composite pickles (the
    parallel engine sends its loss transform to its workers)."""
    variants: dict[frozenset[str], type[CompositeLoss]] = {frozenset(): CompositeLoss}
    for size in range(1, len(HOOK_MIXINS) + 1):
        for hooks in itertools.combinations(HOOK_MIXINS, size):
            name = _variant_name(hooks)
            variant = type(name, (*(HOOK_MIXINS[hook] for hook in hooks), CompositeLoss), {"__module__": __name__})
            variant.__qualname__ = name
            globals()[name] = variant
            variants[frozenset(hooks)] = variant
    return variants


VARIANTS = _make_variants()


def build_composite_loss(config: CompositeLossConfig) -> CompositeLoss:
    """The composite of ``config``'s parts, each built by its registered factory, as the
    subclass of :class:`CompositeLoss` that overrides exactly the hooks the parts override.

    Raises:
        ConfigError: the built parts cannot be composed (a part built by a factory
            function, whose class the config's validation could not see).
    """
    parts = [factory(part) for factory, part in zip(config.part_factories(), config.parts)]
    hooks = frozenset(
        hook
        for hook in HOOK_MIXINS
        if any(getattr(type(part), hook) is not getattr(LossTransform, hook) for part in parts)
    )
    return VARIANTS[hooks](config, parts)


class PartPhase(SetupPhase):
    """A part's setup phase as the composite declares it: the same phase, whose client
    context (what a Flower node trains with) is put under the part's key.

    Args:
        phase: the part's phase.
        key: the part's key (:func:`part_key`).
    """

    def __init__(self, phase: SetupPhase, key: str) -> None:
        self.phase = phase
        self.key = key
        self.name = phase.name
        self.tolerates_dropped_clients = phase.tolerates_dropped_clients

    def server(self, num_clients: int) -> Generator[SetupStep, dict[int, SetupReply], PhaseCost]:
        return self.phase.server(num_clients)

    def client(self, step: SetupStep, data: ClientInputs, state: dict[str, Any]) -> SetupReply:
        return self.phase.client(step, data, state)

    def clients(
        self, step: SetupStep, data: Sequence[ClientInputs], states: Sequence[dict[str, Any]]
    ) -> list[SetupReply]:
        return self.phase.clients(step, data, states)

    def finish(self, states: dict[int, dict[str, Any]]) -> None:
        self.phase.finish(states)

    def client_context(self, state: dict[str, Any]) -> Context:
        """The part's context of ``state``, under the part's key."""
        context = self.phase.client_context(state)
        return {self.key: context} if context else {}

    def client_report(self, state: dict[str, Any]) -> dict[str, ReportValue]:
        return self.phase.client_report(state)

    def report_schema(self) -> MessageSchema:
        return self.phase.report_schema()

    def reply_schema(self, step: SetupStep) -> ReplySchema:
        return self.phase.reply_schema(step)

    def check_data(self, state: dict[str, Any], num_samples: int) -> None:
        self.phase.check_data(state, num_samples)


@hookimpl
def fedplug_register_loss_transforms(register: RegisterLossTransform) -> None:
    register(CompositeLossConfig, build_composite_loss)
