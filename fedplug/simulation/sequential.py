"""The sequential engine: one client after another on one reusable model.

On a CPU this runs at the speed of centralised training of the same samples: the only
per-client work beyond the training steps is loading a vector into the model.

A chain that runs past ``train.failures.client_timeout_seconds`` is interrupted (a
``SIGALRM`` in the main thread, see :mod:`fedplug.deadline`) and dropped, and the round
goes on with the next chain (:func:`train_chain`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

from torch import Tensor, nn

from fedplug.components import ClientUpdate, RoundPlan
from fedplug.deadline import ClientTimeout, deadline
from fedplug.run.chains import ChainProgress
from fedplug.run.local_training import local_rng, train_locally
from fedplug.run.round_context import RoundContext
from fedplug.run.round_screen import ClientFailure


def train_chain(
    model: nn.Module,
    start_vector: Tensor,
    chain: list[int],
    plan: RoundPlan,
    round_index: int,
    context: RoundContext,
) -> ClientUpdate | ClientFailure:
    """Train one chain of clients on ``model``: the first member starts from
    ``start_vector``, each next one from its predecessor's model.

    Every engine that trains chains one at a time (sequential, parallel) calls this, so
    their results cannot drift apart. An exception while training (a failing client)
    becomes a :class:`ClientFailure` with the reason ``"<ExceptionType>: <message>"``.
    ``context.client_states`` of the chain's clients are updated in place; the chain
    reports its last member's ``context.reply_metrics``.

    Timeouts: the limit ``context.client_timeout`` (``train.failures.client_timeout_seconds``)
    applies **per chain**, to the whole chain's training, as the post-hoc check of
    :func:`fedplug.run.round_screen.unusable` reads the chain's ``seconds`` (a chain of
    one client, the default grouping, is one client). The chain runs inside
    :func:`fedplug.deadline.deadline`, so a client that hangs (``time.sleep``, a loop) is
    interrupted once the chain's time is up and the chain fails with the reason
    ``"ClientTimeout: client K ran past train.failures.client_timeout_seconds=T and was
    interrupted"`` (``"... (chain [..])"`` for a longer chain, naming the member that
    was training).
    """
    started = time.perf_counter()
    progress = ChainProgress(chain, start_vector)
    try:
        with deadline(context.client_timeout, _chain_name(chain)):
            while not progress.done:
                client_id = progress.current
                client = context.federation.clients[client_id]
                result = train_locally(
                    model,
                    progress.vector,
                    client.train_x,
                    client.train_y,
                    client.class_counts,
                    algorithm=context.algorithm,
                    loss_context=context.loss_context(client_id),
                    payload=context.payload,
                    client_state=context.client_state(client_id),
                    schedule=context.schedule,
                    round_index=round_index,
                    rng=local_rng(context.seed, round_index, client_id),
                    reply_metrics=context.reply_metrics,
                )
                progress.advance(
                    result.vector, result.num_samples, result.num_steps, 0.0, result.extras, result.metrics
                )
                progress.stop_if_unusable(plan, context.client_timeout)
    except ClientTimeout as error:
        return ClientFailure(list(chain), timeout_reason(_training(progress), chain, error))
    except Exception as error:  # a failing client must not stop the federation
        return ClientFailure(chain, f"{type(error).__name__}: {error}")
    if progress.failure is not None:
        return ClientFailure(list(chain), progress.failure)
    # The chain's time is its wall time, loading the vectors included, not its members' sum.
    return context.make_update(
        chain,
        progress.vector,
        progress.samples,
        progress.steps,
        progress.extras,
        plan,
        time.perf_counter() - started,
        progress.metrics,
    )


def _training(progress: ChainProgress) -> int:
    """The member that was training when the chain was interrupted (the last one when it
    was interrupted after its last member; -1 for an empty chain)."""
    if not progress.chain:
        return -1
    return progress.chain[min(progress.position, len(progress.chain) - 1)]


def _chain_name(chain: list[int]) -> str:
    return f"client {int(chain[0])}" if len(chain) == 1 else f"chain {[int(k) for k in chain]}"


def timeout_reason(client_id: int, chain: list[int], error: ClientTimeout) -> str:
    """A timed-out chain's reason: the client that was training, the limit, and the
    chain when it has more than one member."""
    seconds = error.seconds
    limit = f"={seconds:g}" if seconds is not None else ""
    where = f" (chain {[int(k) for k in chain]})" if len(chain) > 1 else ""
    return (
        f"ClientTimeout: client {int(client_id)} ran past train.failures.client_timeout_seconds{limit} "
        f"and was interrupted{where}"
    )


@dataclass
class SequentialEngine:
    model: nn.Module

    name = "sequential"

    def derived_params(self) -> dict[str, Any]:
        """The engine's entries in the run's derived params (none)."""
        return {}

    def close(self) -> None:
        """Nothing to stop: this engine trains in the calling process."""

    def run_round(
        self, start_vector: Tensor, plan: RoundPlan, round_index: int, context: RoundContext
    ) -> Iterator[ClientUpdate | ClientFailure]:
        """Train every chain of ``plan``; yield one update (or failure) per chain, as soon
        as it is ready, so the aggregator can keep a running sum."""
        for chain in plan.chains:
            yield train_chain(self.model, start_vector, chain, plan, round_index, context)
