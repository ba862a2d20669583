"""Follow-ups the main grid does not shape: shorter than the producer, and diverging
inside the producer's probe tail (B shares the context and part of A's tail).

The grid's B always adds 48 tokens after the shared prefix. Here B adds 1 or 5
(shorter than A's 40-token tail), or keeps j of A's tail tokens before its own
turn, which is the geometry S + j shared, U - j unique. The geometry model must
hold on the real scheduler for both, and on the patched tree speculation must
lose nothing of its own.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kit.geometry.geometry_cases import (
    CONTEXT_BASE,
    UNIT,
    all_cases,
    follow_up_turn,
    producer_tail,
)
from kit.geometry.geometry_model import Case, expected
from kit.rig.regress import eagle_specific_loss
from kit.rig.sched_harness import run_case, run_pair

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

LONG_TAIL = 2 * UNIT + 8


def _long_tail_cases() -> list[tuple[str, Case]]:
    return [(cid, case) for cid, case in all_cases() if case.tail == LONG_TAIL]


SHORT = [
    pytest.param(replace(case, follow_up=f), id=f"{cid}-F{f}")
    for cid, case in _long_tail_cases()
    for f in (1, 5)
]
# j tail tokens shared: the probe token alone, most of a unit, all but one.
INSIDE_TAIL = [
    pytest.param(case, j, id=f"{cid}-j{j}")
    for cid, case in _long_tail_cases()
    for j in (1, UNIT - 1, LONG_TAIL - 1)
]


def _assert_no_speculation_loss(case: Case, hit: int, fix: bool) -> None:
    # The k = 0 twin's hit from the model: each twin is a parameter of the same
    # test, where the real scheduler must reproduce that number.
    if fix and case.eagle:
        plain = expected(case.without_speculation(), patched=True).hit
        assert eagle_specific_loss(case, hit, plain) <= 0, (hit, plain)


@pytest.mark.parametrize("case", SHORT)
def test_follow_up_shorter_than_producer(tiny_model_dir, tree_is_patched: bool, case: Case) -> None:
    rig, a, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched)
    assert len(b.prompt) < len(a.prompt)
    assert b.hit == expected(case, patched=tree_is_patched).hit
    assert b.resumed_from_own_prefix()
    assert rig.chunk_ends[b.request_id][-1] == len(b.prompt)
    _assert_no_speculation_loss(case, b.hit, tree_is_patched)


@pytest.mark.parametrize(("case", "j"), INSIDE_TAIL)
def test_follow_up_diverging_inside_probe_tail(
    tiny_model_dir, tree_is_patched: bool, case: Case, j: int
) -> None:
    context = list(range(CONTEXT_BASE, CONTEXT_BASE + case.shared))
    a_tokens = context + producer_tail(case.tail)
    b_tokens = a_tokens[: case.shared + j] + follow_up_turn(case.follow_up)
    same = replace(case, shared=case.shared + j, tail=case.tail - j)
    _, _, b, _ = run_pair(tiny_model_dir, case, a_tokens, b_tokens, fix=tree_is_patched)
    assert b.hit == expected(same, patched=tree_is_patched).hit
    assert b.resumed_from_own_prefix()
    _assert_no_speculation_loss(same, b.hit, tree_is_patched)
