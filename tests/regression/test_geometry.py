"""Exact-geometry regression suite: producer A, then follow-up B, on vLLM's real scheduler.

For each case the expected numbers come from ``geometry_model`` (the geometry
alone). Cases where unpatched 0.32.0 and the fix differ carry ``fixed_by_mod``:
strict expected failures on the unpatched tree.
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import Case, Geometry, expected
from kit.rig.regress import eagle_specific_loss
from kit.rig.sched_harness import run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]


def _regressed(case: Case) -> bool:
    return expected(case, patched=False).hit < case.ideal


def _eagle_specific_loss_unpatched(case: Case) -> bool:
    plain = expected(case.without_speculation(), patched=False).hit
    return (eagle_specific_loss(case, expected(case, patched=False).hit, plain) or 0) > 0


ALL = [pytest.param(case, id=case_id) for case_id, case in all_cases()]
SPECULATIVE = [
    pytest.param(
        case,
        id=case_id,
        marks=[pytest.mark.fixed_by_mod] if _eagle_specific_loss_unpatched(case) else [],
    )
    for case_id, case in all_cases()
    if case.eagle
]
COVERED = [
    pytest.param(case, id=case_id, marks=[pytest.mark.fixed_by_mod] if _regressed(case) else [])
    for case_id, case in all_cases()
    if case.heuristic_covers
]


@pytest.mark.parametrize("case", ALL)
def test_boundaries_match_geometry(tiny_model_dir, tree_is_patched: bool, case: Case) -> None:
    """FA match, EAGLE rewind, Mamba replay point and B's resume, as the geometry predicts."""
    want = expected(case, patched=tree_is_patched)
    rig, a, b, bounds = run_case(tiny_model_dir, case, fix=tree_is_patched)
    # 1. the full-attention match boundary for B
    assert bounds.fa_match == want.fa_match
    # 2. the EAGLE rewind: exactly one unit below that match
    if case.eagle and bounds.fa_match:
        assert bounds.fa_eagle == bounds.fa_match - case.unit
    else:
        assert bounds.fa_eagle == bounds.fa_match
    # 3. where A materialised Mamba state, where B resumes, how far B computed
    assert rig.chunk_ends[a.request_id] == list(want.chunk_ends)
    assert b.hit == bounds.hit == want.hit
    assert rig.chunk_ends[b.request_id][-1] == len(b.prompt)
    assert b.final_computed >= len(b.prompt)
    # 4. no stale state: B resumes from a state made by exactly its first `hit` tokens
    assert b.resumed_from_own_prefix(), (b.hit, b.state_prefix and len(b.state_prefix))
    # 5. per prompt, partial entries are the ones the geometry names and no more
    assert sorted(rig.partial_entries_of(a.request_id, 0)) == sorted(want.fa_partials)
    assert sorted(rig.partial_entries_of(a.request_id, 1)) == sorted(want.mamba_partials)


@pytest.mark.parametrize("case", COVERED)
def test_follow_up_reaches_ideal(tiny_model_dir, tree_is_patched: bool, case: Case) -> None:
    """Where U < 2H - (S mod H) (EAGLE), B resumes at floor(S/H)*H - H."""
    _, _, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched)
    assert b.hit == case.ideal
    assert b.resumed_from_own_prefix()


@pytest.mark.parametrize("case", SPECULATIVE)
def test_speculation_costs_at_most_its_unit(
    tiny_model_dir, tree_is_patched: bool, case: Case
) -> None:
    """B under EAGLE resumes no lower than the same A and B without speculation, less H:
    the block-boundary predecessor state covers producer tails of any length."""
    _, _, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched)
    _, _, plain, _ = run_case(tiny_model_dir, case.without_speculation(), fix=tree_is_patched)
    assert b.resumed_from_own_prefix()
    assert eagle_specific_loss(case, b.hit, plain.hit) <= 0, (b.hit, plain.hit)


@pytest.mark.parametrize("case", ALL)
def test_patched_tree_with_switch_off_is_unpatched(
    tiny_model_dir, tree_is_patched: bool, case: Case
) -> None:
    """The mod is inert unless its switch is on: same chunks, entries and hits as 0.32.0."""
    if not tree_is_patched:
        pytest.skip("the unpatched tree is this baseline; test_boundaries_match_geometry covers it")
    want = expected(case, patched=False)
    rig, a, b, bounds = run_case(tiny_model_dir, case, fix=False)
    assert rig.chunk_ends[a.request_id] == list(want.chunk_ends)
    assert (bounds.fa_match, b.hit) == (want.fa_match, want.hit)
    assert rig.partial_entries_of(a.request_id, 0) == sorted(want.fa_partials)
    assert rig.partial_entries_of(a.request_id, 1) == sorted(want.mamba_partials)


# A step budget smaller than the prompt: align mode ends the chunk on the last
# block boundary the budget reaches. The bench's CPU geometry is among them
# (B_phys 2048, max_num_batched_tokens 2048, MTP k = 1, the "." probe).
BUDGET_CASES = [
    pytest.param(
        Case(Geometry(block, 16, k, budget=budget), shared, tail),
        id=f"B{block}-budget{budget}-S{shared}-k{k}-U{tail}",
    )
    for block, budget, shared_list in (
        (64, 64, (199, 335)),
        (64, 128, (199, 335)),
        (1024, 2048, (1007, 2159, 3103)),
        (2048, 2048, (900, 1007, 2048, 2159, 4111)),
    )
    for shared in shared_list
    for k in (0, 1)
    for tail in (1, 40)
]


@pytest.mark.parametrize("case", BUDGET_CASES)
def test_chunk_budget_shapes_the_boundaries(
    tiny_model_dir, tree_is_patched: bool, case: Case
) -> None:
    want = expected(case, patched=tree_is_patched)
    rig, a, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched)
    assert rig.chunk_ends[a.request_id] == list(want.chunk_ends)
    assert b.hit == want.hit
    assert b.resumed_from_own_prefix()
