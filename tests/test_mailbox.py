"""Mailbox integrity: counts and plans cross whole and for their own micro-batch; a stale or torn
entry is never used."""
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspeed_feplb.plan.hottest import NONE
from deepspeed_feplb.plan.policy import Plan, PlanConstraints
from deepspeed_feplb.plan.timeline import TimeModel
from deepspeed_feplb.scheduler.mailbox import RING, Mailbox

RANKS, EXPERTS = 3, 5
CONSTRAINTS = PlanConstraints(dynamic_experts=2, max_helpers=2, chunk_align=4, ce_budget_bytes=3e6, expert_bytes=10**6,
                              model=TimeModel(128, 0.5, 6.0, 203.1, 203.1, 0.033, 310.0), keep_copies=True,
                              max_rows_over_mean=1.05, mean_rows=1234.5)


@pytest.fixture
def mailbox():
    box = Mailbox(f"feplb-test-{secrets.token_hex(4)}-mbox", RANKS, create=True)
    yield box
    box.close()


def counts_for(rank: int, seq: int) -> np.ndarray:
    return np.arange(EXPERTS, dtype=np.int64) * 100 + rank * 10 + seq % 10 + seq * 1000


def dynamic_for(rank: int, seq: int) -> np.ndarray:
    """The dynamic experts a rank chose: not its hottest (the mailbox carries a choice, it makes
    none), and fewer than D on every third step."""
    return np.array([(rank + seq) % EXPERTS, (rank + seq + 2) % EXPERTS][:1 + bool(seq % 3)], np.int64)


def masks_for(rank: int, seq: int) -> np.ndarray:
    """A rank's row of the residency masks, int64 [EXPERTS, 1] (helpers of each of its experts)."""
    return ((np.arange(EXPERTS, dtype=np.int64) + rank + seq) % (1 << RANKS)).reshape(EXPERTS, 1)


# Each step: a rank that may publish its next step (ranks stay within RING - 1 steps of each other,
# as phase 1's collective guarantees), then a step to read.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, RANKS - 1), st.integers(0, 12)), min_size=1, max_size=60))
def test_counts_are_complete_and_of_the_asked_step_or_absent(mailbox, operations):
    mailbox.slots["begin"], mailbox.slots["end"] = -1, -1
    published = [-1] * RANKS  # newest step each rank published
    for rank, wanted in operations:
        if published[rank] + 1 - min(published) < RING - 1:
            published[rank] += 1
            mailbox.publish(rank, published[rank], counts_for(rank, published[rank]), CONSTRAINTS,
                            masks_for(rank, published[rank]), dynamic_for(rank, published[rank]))
        got = mailbox.read_counts(wanted)
        every_rank_has_it = all(p >= wanted for p in published)
        not_overwritten = all(p - wanted < RING for p in published)
        if got is None:
            assert not (every_rank_has_it and not_overwritten)
            continue
        assert every_rank_has_it and not_overwritten
        assert np.array_equal(got.counts, np.stack([counts_for(r, wanted) for r in range(RANKS)]))
        assert np.array_equal(got.resident, np.stack([masks_for(r, wanted) for r in range(RANKS)]))
        chosen = [list(dynamic_for(r, wanted)) + [NONE] * (2 - len(dynamic_for(r, wanted))) for r in range(RANKS)]
        assert got.dynamic.tolist() == chosen
        assert got.constraints == CONSTRAINTS  # the time model, the residency flag and the row bound cross too
        assert set(mailbox.missing_ranks(wanted)) == set()


def test_a_torn_counts_write_is_never_read(mailbox):
    for rank in range(RANKS):
        mailbox.publish(rank, 0, counts_for(rank, 0), CONSTRAINTS)
    assert mailbox.read_counts(0) is not None
    slot = mailbox.slots[1, 0:1]
    slot["begin"] = -1  # the writer of rank 1 was interrupted after it started rewriting this slot
    slot["counts"][0, :EXPERTS] = 7
    assert mailbox.read_counts(0) is None
    assert mailbox.missing_ranks(0) == [1]


def test_a_plan_crosses_as_a_plan_only_for_its_own_step_and_never_torn(mailbox):
    moves = np.array([[0, 1, 2, 16], [0, 1, 1, 8]], dtype=np.int64)
    rank_rows = np.arange(10, 10 + RANKS, dtype=np.int64)
    mailbox.write_plan(5, Plan(moves, rank_rows), plan_ns=1234)
    got, plan_ns = mailbox.read_plan(5)
    assert isinstance(got, Plan) and plan_ns == 1234
    assert np.array_equal(got.moves, moves) and np.array_equal(got.rank_rows, rank_rows)
    assert mailbox.read_plan(5 + RING) is None  # same ring entry, other step: stale
    assert mailbox.read_plan(4) is None
    mailbox.plans["end"][5 % RING] = 4  # torn: end marker of another micro-batch
    assert mailbox.read_plan(5) is None


def test_a_plan_too_large_for_the_mailbox_is_published_as_none(mailbox):
    from deepspeed_feplb.scheduler.mailbox import max_moves
    moves = np.tile(np.array([[0, 1, 2, 1]], dtype=np.int64), (max_moves(RANKS) + 1, 1))
    mailbox.write_plan(3, Plan(moves, np.zeros(RANKS, np.int64)), plan_ns=99)
    assert mailbox.read_plan(3) == (None, 99)  # readers plan themselves at once instead of waiting
