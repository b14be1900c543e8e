"""Checkpointing a component whose state is a few of its attributes (a momentum buffer, a
control variate, a class prior): name them, and ``state_dict`` / ``load_state_dict`` save
and restore them under their own names."""

from __future__ import annotations

from typing import Any, ClassVar


class AttributeState:
    """``state_dict`` and ``load_state_dict`` over the attributes named in
    :attr:`state_attributes`. List it before the component's interface among the bases
    (``class FedAvgM(AttributeState, Aggregator)``) so that it replaces the stateless default."""

    state_attributes: ClassVar[tuple[str, ...]] = ()
    """The attributes a checkpoint keeps; each is a key of :meth:`state_dict`."""

    def state_dict(self) -> dict[str, Any]:
        """The named attributes, by name (None before they are first set, if so initialised)."""
        return {name: getattr(self, name) for name in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the named attributes from :meth:`state_dict`'s output."""
        for name in self.state_attributes:
            setattr(self, name, state[name])
