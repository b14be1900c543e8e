"""What a ClientApp must add to the quickstart shape for a given ``train`` config, in one
line.

A stock Flower ClientApp trains with its own loop and replies ``arrays`` plus
``metrics`` with ``num-examples``; that is all :class:`~.strategy.FedplugStrategy` needs
for a config whose components ask nothing of the clients. Every component says what it
needs (:meth:`client_needs`, a :class:`fedplug.components.ClientNeeds`; a loss
transform's :meth:`setup_phase`); :func:`client_requirements` turns those into the one
line a user reads before round 1 and in the error that replaces Flower's failure when a
node lacks what is needed. Nothing here names an algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedplug.components import ClientNeeds

from .records import EXTRAS_KEY, METRICS_KEY, PAYLOAD_KEY

DESCRIBE = "a @app.query() handler returning FedplugTrainer.describe(data, message, context)"
CLIENT_SIDE = "FedplugTrainer.fit, or fedplug's client pieces in its own @app.train() loop"
DATA = "data=<context -> trainset>"
MUST_ADD = ": the ClientApp must add "
OWN_LOOP_PIECE = {
    "sampler": "RoundSampler({{'name': {name!r}}}, app=app)",
    "loss_transform": "FedplugLoss(loss_transform={{'name': {name!r}}}, app=app{data})",
    "aggregator": "FedplugLoss(aggregator={{'name': {name!r}}}, app=app) with "
    "finish_round(content) on its reply",
}
"""The own-loop piece that runs a slot's client side (docs/flower.md, 'Client-side
algorithms')."""


@dataclass(frozen=True)
class Component:
    """One slot of a ``train`` config as built: ``train.<slot>`` named ``name``."""

    slot: str
    name: str
    component: Any


def client_requirements(
    components: Sequence[Component], setup_phase: str | None = None
) -> str | None:
    """The one line naming what each component needs from the clients and what the
    ClientApp must add for it, or ``None`` when arrays and ``num-examples`` suffice.

    Args:
        components: the config's built components, in slot order.
        setup_phase: the name of the loss transform's setup phase, if it declares one.
    """
    needs_total = ClientNeeds()
    phrases = []
    for entry in components:
        needs = entry.component.client_needs()
        items = needs.describe()
        if setup_phase is not None and entry.slot == "loss_transform":
            items.append(f"its setup phase {setup_phase!r} before round 1")
        if items:
            needed = ", ".join(items)
            phrases.append(f"train.{entry.slot} {entry.name!r} needs from every client {needed}")
        needs_total = needs_total | needs
    if not phrases:
        return None
    line = "; ".join(phrases) + MUST_ADD + " and ".join(
        additions(needs_total, setup_phase)
    )
    pieces = own_loop_pieces(components, setup_phase)
    if pieces:
        line += " (in its own loop: " + " and ".join(pieces) + ")"
    return line


def needs_only(requirement: str) -> str:
    """The part of a :func:`client_requirements` line that says what the components need
    (without what to add: logged before the ClientApp is asked what it provides)."""
    return requirement.split(MUST_ADD, 1)[0]


def own_loop_pieces(components: Sequence[Component], setup_phase: str | None = None) -> list[str]:
    """The own-loop pieces that serve the components' client sides, one per slot that
    has one (``FedplugLoss(...)`` with ``app=app``, which also registers the handlers)."""
    pieces = []
    for entry in components:
        needs = entry.component.client_needs()
        if not (needs.client_side or needs.client_state or needs.reply_extras):
            continue
        template = OWN_LOOP_PIECE.get(entry.slot)
        if template is None:
            continue
        wants_data = needs.class_counts or (setup_phase is not None and entry.slot == "loss_transform")
        pieces.append(template.format(name=entry.name, data=f", {DATA}" if wants_data else ""))
    counted = any(entry.component.client_needs().class_counts for entry in components)
    if counted and not any(DATA in piece for piece in pieces):
        pieces.append("answer_class_counts(app, <context -> trainset>)")
    return pieces


def additions(needs: ClientNeeds, setup_phase: str | None = None) -> list[str]:
    """What a quickstart-shaped ClientApp must add to serve ``needs``."""
    added = []
    if needs.class_counts:
        added.append(DESCRIBE)
    if setup_phase is not None:
        added.append(
            f"a @app.train({setup_phase!r}) handler returning "
            "FedplugTrainer.setup_phase(data, message, context)"
        )
    carried = []
    if needs.server_payload:
        carried.append(f"read {PAYLOAD_KEY!r} {list(needs.server_payload)} from each train message")
    if needs.client_state:
        carried.append("keep its state in context.state across rounds")
    if needs.reply_extras:
        carried.append(f"reply {EXTRAS_KEY!r} {list(needs.reply_extras)} with the model")
    if needs.reply_metrics:
        added.append(
            f"{list(needs.reply_metrics)} in its {METRICS_KEY!r} reply, as Flower's quickstart "
            "reports 'train_loss' (FedplugTrainer.fit and FedplugLoss.finish_round add them when "
            "the server asks)"
        )
    if needs.client_side or carried:
        client_side = CLIENT_SIDE
        if carried:
            client_side += " (which must " + ", ".join(carried) + ", as FedplugTrainer.fit does)"
        added.append(client_side)
    return added
