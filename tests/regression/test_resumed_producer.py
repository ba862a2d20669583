"""A context load that itself resumed from a cache hit, and its follow-up.

The grid's producer A starts cold. Here an earlier request R shares A's first
``pre`` context tokens (a conversation's earlier turn, an agent's earlier
file), so A resumes from R's state and prefills only the rest. A's chunk ends
and the fix's states it exports from inside a step must be where the geometry
model cuts a prefill that resumed there, and its follow-up B, over the whole
context, must resume where the model puts it: at a state of A's, a higher
state of R's, or the junction vLLM stops A at. The fix covers a resumed
context load as it covers a cold one, less the states it leaves out less than
``FIX_MIN_GAIN`` above A's hit (B then resumes at that hit, 16-32 tokens lower,
in a few cases). Where A resumed does not otherwise bound what the fix saves
B: without the fix A's own resume point is often a block lower or zero (R met
the same loss), so the gain here is as large as for a cold load
(docs/fix-cost.md, the resumed-prompt rule).
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import CONTEXT_BASE, all_cases, follow_up_turn, producer_tail
from kit.geometry.geometry_model import (
    UNIT,
    Case,
    Expected,
    expected,
    producer_prefill,
    producer_states,
)
from kit.rig.sched_harness import SchedulerRig

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

# R's own tokens after the context it shares with A: a reply and a message.
R_TAIL = list(range(7001, 7001 + 24))


def _fix_matters(case: Case) -> bool:
    return expected(case, patched=True).hit > expected(case, patched=False).hit


# EAGLE cases in which the fix changes B's hit (cold producer), each with R
# sharing all but about three hash units of A's context (A adds a short turn),
# or all but a block and a bit (A adds a long document).
CASES = [
    pytest.param(case, pre, id=f"{checkpoints}-{cid}-pre{pre}")
    for checkpoints in ("split", "internal-1", "internal-grid")
    for cid, case in all_cases(checkpoints)
    if case.eagle and _fix_matters(case)
    for pre in sorted({case.shared - 3 * UNIT - 5, case.shared - case.block - 7})
    if pre > 0
]


@pytest.mark.parametrize(("case", "pre"), CASES)
def test_follow_up_of_a_resumed_producer(
    tiny_model_dir, tree_is_patched: bool, case: Case, pre: int
) -> None:
    context = list(range(CONTEXT_BASE, CONTEXT_BASE + case.shared))
    rig = SchedulerRig(tiny_model_dir, case.geometry, fix=tree_is_patched)
    rig.run(context[:pre] + R_TAIL)
    a = rig.run(context + producer_tail(case.tail))
    # A is R's follow-up over ``pre`` tokens: the model's hit, from R's state.
    earlier = Case(case.geometry, pre, len(R_TAIL))
    before = expected(earlier, patched=tree_is_patched)
    assert a.hit == before.hit and a.resumed_from_own_prefix()
    # A's chunks from its hit, as the model cuts them.
    resumed = producer_prefill(
        case, tree_is_patched, resume=before.hit, junction=junction(case, before)
    )
    assert tuple(rig.chunk_ends[a.request_id]) == resumed.ends
    # And the fix's states it exports from inside a step (internal paths): none
    # less than FIX_MIN_GAIN above its hit.
    assert tuple(rig.fix_exports.get(a.request_id, ())) == resumed.fix_exports
    b = rig.run(context + follow_up_turn(case.follow_up))
    assert b.hit == resumed_follow_up_hit(case, earlier, tree_is_patched), b.hit
    assert b.resumed_from_own_prefix()


def resumed_follow_up_hit(case: Case, earlier: Case, patched: bool) -> int:
    """B's hit after R (``earlier``: R's context share and tail) and a resumed A.

    A's prefill from its own hit as the model cuts it (``producer_prefill`` with
    the resume point), with the state at the junction with R (vLLM ends a chunk
    at the block-floored end of the longest single-group hit, for siblings) and
    without the fix's states just above the hit; R leaves its states on the
    shared context. B's full-attention match is the
    longer of the two producers' matches, less one unit under EAGLE; B resumes
    at the highest state below it.
    """
    before = expected(earlier, patched)
    cold = expected(case, patched)
    at = junction(case, before)
    states = {
        p for p in producer_states(case, patched, resume=before.hit, junction=at) if p > before.hit
    }
    states |= {p for p in producer_states(earlier, patched) if p <= earlier.shared}
    limit = max(cold.fa_eagle, before.fa_eagle)
    return max((p for p in states if p <= limit), default=0)


def junction(case: Case, before: Expected) -> int:
    """Where vLLM ends a chunk of A for its sibling R: the block-floored end of the
    longest single-group hit (A's full-attention match on R, less EAGLE's unit)."""
    return before.fa_eagle // case.block * case.block
