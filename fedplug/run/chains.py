"""The chains of one round in progress, for every runtime: how far each got, and what it
ends the round with.

A runtime only decodes each member's reply; :class:`ChainProgress` adds it up, stops a
chain whose member failed, and turns what the chain ended with into the
:data:`~fedplug.run.round_screen.Outcome` the round core screens and aggregates.
Nothing here knows a runtime's message types.
Design: docs/round.md, 'Design notes: chains'.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.run.client_text import client_text
from fedplug.run.round_plan import chain_update, round_steps
from fedplug.run.round_screen import ClientFailure, Outcome, unusable


@dataclass
class ChainProgress:
    """One chain of a round: the model to hand to its next member, and what its members
    have done so far.

    ``vector`` is the model the next member starts from (the round's global model before
    the first); ``samples``, ``steps`` and ``seconds`` add up over the members that
    trained; ``extras`` and ``metrics`` are the last trained member's (a chain reports
    its last member's); ``failure`` is why the chain stopped, or ``None``.
    """

    chain: list[int]
    vector: Tensor
    position: int = 0
    samples: int = 0
    steps: int = 0
    seconds: float = 0.0
    extras: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    chain_start_shape: tuple[int, ...] = ()
    """The shape of the model the chain started from, which every member must hand on."""

    def __post_init__(self) -> None:
        if not self.chain_start_shape:
            self.chain_start_shape = tuple(self.vector.shape)

    @property
    def finished(self) -> bool:
        """Whether every member has trained."""
        return self.position == len(self.chain)

    @property
    def done(self) -> bool:
        """Whether no member is left to train: the chain finished or failed."""
        return self.failure is not None or self.finished

    @property
    def current(self) -> int:
        """The client that trains next (the chain must not be finished)."""
        return self.chain[self.position]

    @property
    def next_client(self) -> int:
        """:attr:`current`, under the name the Flower strategy reads."""
        return self.current

    @property
    def trained(self) -> list[int]:
        """The members that have trained so far, in order."""
        return self.chain[: self.position]

    def advance(
        self,
        vector: Tensor,
        samples: int,
        steps: int,
        seconds: float,
        extras: dict[str, Tensor] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Take the current member's result: its model becomes the next member's start,
        its counts add to the chain's, its extras and metrics replace the previous
        member's."""
        if self.done:
            raise ValueError(
                f"chain {self.chain} has no member left to train "
                f"({self.failure or 'every member trained'}); advance only an active chain"
            )
        self.vector = vector
        self.samples += samples
        self.steps += steps
        self.seconds += seconds
        self.extras = dict(extras) if extras else {}
        self.metrics = dict(metrics) if metrics else {}
        self.position += 1

    def handed_on_problem(self, plan: RoundPlan, timeout: float | None) -> str | None:
        """Why the model a member just handed on cannot go to the next member, or None:
        the round screen's rule (:func:`~fedplug.run.round_screen.unusable`) applied inside
        the chain, so that no runtime trains a member from a NaN or misshapen model. None
        once the chain is done: its last model is the round core's to screen."""
        if self.done:
            return None
        return unusable(self.update(plan), tuple(self.chain_start_shape), timeout)

    def stop_if_unusable(self, plan: RoundPlan, timeout: float | None) -> None:
        """Fail the chain at the member that just trained when :meth:`handed_on_problem`
        finds a reason, naming that member (``"client K <reason>"``)."""
        problem = self.handed_on_problem(plan, timeout)
        if problem is not None:
            self.fail(f"client {self.chain[self.position - 1]} {problem}")

    def fail(self, reason: str) -> None:
        """Stop the chain: no further member trains, and it ends the round as a
        :class:`ClientFailure` with ``reason`` (bounded and escaped,
        :func:`~fedplug.run.client_text.client_text`: runtimes put a client's own text in
        it)."""
        self.failure = client_text(reason)

    def update(self, plan: RoundPlan, seconds: float | None = None) -> ClientUpdate:
        """The update of the members trained so far under ``plan``'s weight rule
        (:func:`chain_update`); ``seconds`` replaces the summed time where a runtime
        measures the whole chain instead of its members (default: the sum)."""
        return chain_update(
            self.trained,
            self.vector,
            samples=self.samples,
            steps=self.steps,
            extras=self.extras,
            plan=plan,
            seconds=self.seconds if seconds is None else seconds,
            metrics=self.metrics,
        )

    def outcome(self, plan: RoundPlan, seconds: float | None = None) -> Outcome:
        """What the chain ends the round with: a :class:`ClientFailure` with its reason
        when it failed or did not finish, else its :meth:`update`."""
        if self.failure is not None:
            return ClientFailure(list(self.chain), self.failure)
        if not self.finished:
            return ClientFailure(
                list(self.chain),
                f"stopped after {self.position} of its {len(self.chain)} members",
            )
        return self.update(plan, seconds)


def start_chains(chains: Iterable[Iterable[int]], start: Tensor) -> list[ChainProgress]:
    """One :class:`ChainProgress` per chain, each starting from ``start``."""
    return [ChainProgress(list(chain), start) for chain in chains]


@dataclass
class RoundChains:
    """Every chain of one round's ``plan``, each starting from ``start`` (the round's
    global model), stepped one exchange at a time."""

    plan: RoundPlan
    start: Tensor
    chains: list[ChainProgress] = field(init=False)

    def __post_init__(self) -> None:
        self.chains = start_chains(self.plan.chains, self.start)

    @property
    def exchanges(self) -> int:
        """The exchanges the round takes when every chain trains one member per
        exchange: its longest chain (:func:`round_steps`; one for an empty round)."""
        return round_steps(self.plan)

    def active(self) -> list[ChainProgress]:
        """The chains with a member still to train, in plan order."""
        return [chain for chain in self.chains if not chain.done]

    def training(self) -> list[int]:
        """The clients that train in the next exchange, in plan order."""
        return [chain.current for chain in self.active()]

    @property
    def complete(self) -> bool:
        """Whether no chain has a member left to train."""
        return not self.active()

    def outcomes(self) -> list[Outcome]:
        """One outcome per chain, in plan order (the simulator's order, so a running sum
        adds the same numbers in the same order)."""
        return [chain.outcome(self.plan) for chain in self.chains]
