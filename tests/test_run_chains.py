"""The runtime-neutral chain stepper (fedplug/run/chains.py), against numbers computed by
hand and against the round core's weight rule (chain_update)."""

from __future__ import annotations

import pytest
import torch

from fedplug.components import RoundPlan
from fedplug.run.chains import ChainProgress, RoundChains
from fedplug.run.round_plan import chain_update, round_steps
from fedplug.run.round_screen import ClientFailure


def vector(value: float) -> torch.Tensor:
    return torch.full((3,), value)


def test_a_chain_whose_second_member_fails_names_that_client_and_keeps_its_counts():
    # Prepare: a chain of 3; member 1 (client 4) trains 10 samples in 2 steps.
    chain = ChainProgress([4, 7, 9], vector(0.0))
    chain.advance(vector(1.0), samples=10, steps=2, seconds=0.5)
    # Execute: member 2 (client 7) fails.
    assert chain.current == 7
    chain.fail("client 7 raised RuntimeError: boom")
    outcome = chain.outcome(RoundPlan(chains=[[4, 7, 9]]))
    # Assert: the whole chain fails with the reason naming client 7; client 9 never trains.
    assert outcome == ClientFailure([4, 7, 9], "client 7 raised RuntimeError: boom")
    assert chain.done and not chain.finished
    assert (chain.position, chain.samples, chain.steps, chain.seconds) == (1, 10, 2, 0.5)
    assert chain.trained == [4]
    with pytest.raises(ValueError, match="no member left to train"):
        chain.advance(vector(2.0), samples=1, steps=1, seconds=0.0)


def test_chains_of_lengths_1_3_2_take_3_exchanges_one_member_per_chain_each():
    # Prepare
    plan = RoundPlan(chains=[[0], [1, 2, 3], [4, 5]])
    rounds = RoundChains(plan, vector(0.0))
    # Execute: every exchange trains the current member of every active chain.
    trained_per_exchange = []
    while not rounds.complete:
        clients = rounds.training()
        trained_per_exchange.append(clients)
        for chain in rounds.active():
            chain.advance(vector(float(chain.current)), samples=1, steps=1, seconds=0.0)
    # Assert
    assert rounds.exchanges == 3 == round_steps(plan)
    assert trained_per_exchange == [[0, 1, 4], [2, 5], [3]]
    assert [outcome.chain for outcome in rounds.outcomes()] == [[0], [1, 2, 3], [4, 5]]


def test_an_empty_round_takes_one_exchange_and_has_no_outcomes():
    rounds = RoundChains(RoundPlan(chains=[]), vector(0.0))
    assert rounds.exchanges == 1
    assert rounds.complete and rounds.training() == [] and rounds.outcomes() == []


@pytest.mark.parametrize(("weighting", "weight"), [("samples", 60.0), ("uniform", 1.0)])
def test_a_finished_chain_is_chain_updates_update(weighting, weight):
    # Prepare: members 2, 5, 8 train 10, 20 and 30 samples in 1, 2 and 3 steps.
    plan = RoundPlan(chains=[[2, 5, 8]], weighting=weighting)
    rounds = RoundChains(plan, vector(0.0))
    chain = rounds.chains[0]
    for member, samples in enumerate((10, 20, 30), start=1):
        chain.advance(
            vector(float(member)),
            samples=samples,
            steps=member,
            seconds=0.25 * member,
            extras={"delta": vector(-float(member))},
            metrics={"train_loss": 1.0 / member},
        )
    # Execute
    [update] = rounds.outcomes()
    expected = chain_update(
        [2, 5, 8],
        vector(3.0),
        samples=60,
        steps=6,
        extras={"delta": vector(-3.0)},
        plan=plan,
        seconds=1.5,
        metrics={"train_loss": 1.0 / 3},
    )
    # Assert: 10 + 20 + 30 samples, 1 + 2 + 3 steps, the last member's model, extras, metrics.
    assert update.weight == weight == expected.weight
    assert (update.num_examples, update.num_steps, update.seconds) == (60, 6, 1.5)
    assert (update.client_id, update.chain) == (8, [2, 5, 8]) == (expected.client_id, expected.chain)
    torch.testing.assert_close(update.vector, expected.vector)
    torch.testing.assert_close(update.extras["delta"], expected.extras["delta"])
    assert update.metrics == expected.metrics == {"train_loss": pytest.approx(1 / 3)}


def test_the_whole_chains_time_replaces_the_members_sum_when_given():
    chain = ChainProgress([1], vector(0.0))
    chain.advance(vector(1.0), samples=4, steps=1, seconds=0.5)
    plan = RoundPlan(chains=[[1]])
    assert chain.outcome(plan).seconds == 0.5
    assert chain.outcome(plan, seconds=2.0).seconds == 2.0


def test_an_unfinished_chain_ends_the_round_as_a_failure_saying_how_far_it_got():
    chain = ChainProgress([3, 6], vector(0.0))
    chain.advance(vector(1.0), samples=4, steps=1, seconds=0.0)
    outcome = chain.outcome(RoundPlan(chains=[[3, 6]]))
    assert outcome == ClientFailure([3, 6], "stopped after 1 of its 2 members")


def test_an_intermediate_update_covers_only_the_members_trained_so_far():
    chain = ChainProgress([3, 6, 9], vector(0.0))
    chain.advance(vector(1.0), samples=4, steps=1, seconds=0.0)
    chain.advance(vector(2.0), samples=5, steps=2, seconds=0.0)
    update = chain.update(RoundPlan(chains=[[3, 6, 9]]))
    assert (update.client_id, update.chain, update.weight) == (6, [3, 6], 9.0)
