"""The bench's control for cached B (issue 49, ``ttft.control_requests``): a fresh
context whose cold load leaves the state at the first block boundary, then a
follow-up that resumes there on both trees and prefills cached B's uncached tail.
Pure geometry-model checks; ``tests/regression/test_control_steps.py`` runs the
same prompts on the real scheduler."""

from __future__ import annotations

import pytest

from kit.bench import serve_args, ttft
from kit.geometry.geometry_model import (
    Case,
    Geometry,
    boundary_control,
    expected,
    resumed_chunk_ends,
)

pytestmark = pytest.mark.cpu

# The CPU default's internal path as the bench's servers report it (retention 0).
CPU = Geometry(serve_args.CPU_BLOCK, 16, 1, 8192, checkpoints="internal-1", retention=0)
SPLIT = Geometry(serve_args.CPU_BLOCK, 16, 1, 2048, checkpoints="split", retention=0)
LOOKAHEAD = Geometry(
    serve_args.CPU_BLOCK, 16, 1, 8192, checkpoints="internal-1", retention=0, hash_lookahead=1
)
SHARED = (900, 1007, 2048, 2159)


@pytest.mark.parametrize("geo", [CPU, SPLIT])
def test_the_control_resumes_on_the_first_block_boundary(geo: Geometry) -> None:
    """0.32.0 hashing under EAGLE: the load is 2064 tokens and a probe, so its prompt
    checkpoint floor(2065/16)*16 - 16 is the boundary, and the follow-up's attention
    match 2064 drops a unit to it; one token less and it falls below."""
    control = boundary_control(geo)
    assert control == (2064, 2048)
    for patched in (False, True):
        assert expected(Case(geo, 2064, 1), patched, retention=0).hit == 2048
    # Sharing only the boundary's 2048 tokens, the match drops to 2032: mid-block.
    assert expected(Case(geo, 2048, 1), False, retention=0).hit == 2032


def test_lookahead_hashes_need_one_token_past_the_boundary() -> None:
    assert boundary_control(LOOKAHEAD) == (2049, 2048)
    for patched in (False, True):
        assert expected(Case(LOOKAHEAD, 2049, 1), patched, 1, 0).hit == 2048


def test_the_tail_must_reach_past_the_shared_unit() -> None:
    control = boundary_control(CPU)
    assert control.prompt_len(79) == 2048 + 79
    with pytest.raises(ValueError, match="recomputes more"):
        control.prompt_len(16)


def test_the_controls_tail_is_the_fixs_cached_b_tail() -> None:
    """79 uncached tokens at S 1007 and 2159, 68 at 900, 64 at 2048: B (S + 48) less
    the fix's hit (976, 2128, 880, 2032)."""
    tails = {s: s + ttft.TURN_LEN - ttft.fix_hit(CPU, s) for s in SHARED}
    assert tails == {900: 68, 1007: 79, 2048: 64, 2159: 79}


@pytest.mark.parametrize("patched", [False, True])
def test_the_control_takes_cached_bs_steps_less_the_mid_block_stop(patched: bool) -> None:
    """The control's chunks from 2048: the prompt checkpoint floor(N/16)*16 - 16 is
    inside and the layer cannot export it into the block table (its column is the
    initial state's). Unpatched: two steps, 48 tokens then the rest. Patched: the
    fix exports it into a block of its own, one step. The fix's cached B at S 900,
    1007 and 2159 has the same shape; at S 2048 it resumes at 2032 and runs past
    the block boundary, which the fix exports too (case A): one step, where the
    unpatched tree's mid-block stop adds one."""
    control = boundary_control(CPU)
    for shared in SHARED:
        b_len = shared + ttft.TURN_LEN
        hit = ttft.fix_hit(CPU, shared)
        tail = b_len - hit
        ends = resumed_chunk_ends(CPU, control.prompt_len(tail), control.resume, patched)
        assert ends == ((2048 + tail,) if patched else (2048 + 48, 2048 + tail)), shared
        cached = resumed_chunk_ends(CPU, b_len, hit, patched)
        steps = [e - s for s, e in zip((hit, *cached), cached, strict=False)]
        control_steps = [e - s for s, e in zip((2048, *ends), ends, strict=False)]
        if shared == 2048 and not patched:
            assert steps == [16, 32, 16]
        else:
            assert steps == control_steps, shared


def test_the_split_path_control_stays_two_steps() -> None:
    """Without internal checkpoints the prompt checkpoint is a chunk end on both trees."""
    control = boundary_control(SPLIT)
    for patched in (False, True):
        assert resumed_chunk_ends(SPLIT, control.prompt_len(79), control.resume, patched) == (
            2096,
            2127,
        )
