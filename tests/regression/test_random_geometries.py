"""Seeded random geometries beyond the grid: producer tails longer than a block,
contexts several blocks long, step budgets that cut the prefill.

The geometry model must hold on the real scheduler for each, with no stale
state. On the patched tree speculation may lose something of its own in one
place only, measured (`make loss-sweep`) and documented in mods/fix-eagle-fine-prefix/README.md:
the server without speculation resumes on a block boundary below the last one
inside A, where a step budget that cut A's prefill left a state, and EAGLE's
rewind needs the state one unit below it. Keeping that state below every cut
is one more state and chunk end per cut, growing with the prompt, not a
constant per prompt, so the fix does not; a prefill that fits in one step
never loses.
"""

from __future__ import annotations

import random

import pytest

from kit.geometry.geometry_model import Case, Geometry, expected
from kit.rig.loss_sweep import earlier_block_state
from kit.rig.regress import eagle_specific_loss
from kit.rig.sched_harness import run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

SEED = 20261203


def _cases(count: int = 80) -> list:
    rng = random.Random(SEED)
    out = []
    while len(out) < count:
        block = rng.choice((64, 128, 384))
        unit = rng.choice((16, 32))
        case = Case(
            Geometry(block, unit, 1, budget=rng.choice((8192, block, 2 * block))),
            shared=rng.randrange(1, 4 * block),
            tail=rng.randrange(1, 3 * block),
        )
        case_id = f"B{block}-H{unit}-S{case.shared}-U{case.tail}-budget{case.budget}"
        out.append(pytest.param(case, id=case_id))
    return out


@pytest.mark.parametrize("case", _cases())
def test_random_geometry(tiny_model_dir, tree_is_patched: bool, case: Case) -> None:
    want = expected(case, patched=tree_is_patched)
    rig, a, b, bounds = run_case(tiny_model_dir, case, fix=tree_is_patched)
    assert rig.chunk_ends[a.request_id] == list(want.chunk_ends)
    assert (bounds.fa_match, b.hit) == (want.fa_match, want.hit)
    assert b.resumed_from_own_prefix()
    _, _, plain, _ = run_case(tiny_model_dir, case.without_speculation(), fix=tree_is_patched)
    assert plain.hit == expected(case.without_speculation(), patched=tree_is_patched).hit
    if tree_is_patched and eagle_specific_loss(case, b.hit, plain.hit) > 0:
        assert case.budget < case.producer_len, "a one-step prefill lost to speculation"
        assert earlier_block_state(case, plain.hit, want.chunk_ends), (b.hit, plain.hit)
