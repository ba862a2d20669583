"""The geometry model on a handful of cases, every number written out.

As vLLM's tests/v1/core spell geometry out (``block_size = 16``, ``3 * 16 + 1``
tokens), each expected number here is a literal with the line of vLLM's rule
that gives it, so a change to the model that moves one shows which rule moved.
The rules (docs/defects.md):

* B tokens per block, H tokens per hash unit (``prefix_match_unit``); B is a
  multiple of H. A prompt of N tokens is A's context of S tokens and a tail of U.
* 0.32.0 hashing: a follow-up matches at most floor(S/H)*H, and EAGLE/MTP drops
  one unit of that match; A's prompt checkpoint is floor(N/H)*H - H. Without
  speculation the last token is recomputed: floor((N-1)/H)*H, no drop.
* 0.33.0 on (lookahead hashes, L = 1 for EAGLE and MTP): a unit's key also covers
  the next token, so a follow-up proves floor((S-1)/H)*H, nothing is dropped, and
  A's checkpoint is floor((N-1)/H)*H.
* Align mode: state is written at chunk ends, so a chunk that starts inside a
  block stops at the next block boundary (the scheduler's
  ``_mamba_block_aligned_split``); a budget too small for the prompt cuts chunks
  at block boundaries.
* The fix keeps one more state one unit below A's checkpoint, and one unit below
  the last block boundary A crosses.

The README's example is the first case: 2048-token blocks, one draft token, a
2159-token context and a one-token probe. When these were written, vLLM's real
scheduler (``kit.rig.sched_harness.run_case`` on the 0.32.0 trees, and on
0.33.0's for the lookahead cases) gave the same chunk ends and hits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kit.geometry.geometry_model import (
    Case,
    Geometry,
    checkpoints_of,
    expected,
    lookahead_ideal,
    next_turn_resume,
    producer_prefill,
    producer_states,
    prompt_checkpoint,
    resumed_fix_skips,
)

pytestmark = [pytest.mark.cpu]

H = 16
B = 2048
EAGLE = Geometry(B, H, num_spec=1)  # split path, budget 8192: one chunk unless stopped
NO_SPEC = Geometry(B, H)


def test_prompt_checkpoint() -> None:
    # EAGLE: floor(2160/16)*16 = 2160 = 135 units held, one dropped.
    assert prompt_checkpoint(2160, H, eagle=True) == 2144
    # EAGLE: floor(2159/16)*16 = 2144 held (the 135th unit is incomplete), one dropped.
    assert prompt_checkpoint(2159, H, eagle=True) == 2128
    # No speculation: the last token is recomputed, floor(2159/16)*16.
    assert prompt_checkpoint(2160, H, eagle=False) == 2144
    # No speculation, one token past a unit: floor(2160/16)*16.
    assert prompt_checkpoint(2161, H, eagle=False) == 2160
    # EAGLE under one unit: floor(15/16)*16 = 0 held, nothing to drop.
    assert prompt_checkpoint(15, H, eagle=True) == 0


def test_prompt_checkpoint_with_lookahead_hashes() -> None:
    """Each block's hash also covers L tokens past it: the last boundary L tokens
    below the end is held, and nothing is dropped."""
    # floor((2160 - 1)/16)*16 = 2144; floor((2159 - 1)/16)*16 = 2144.
    assert prompt_checkpoint(2160, H, eagle=True, lookahead=1) == 2144
    assert prompt_checkpoint(2159, H, eagle=True, lookahead=1) == 2144
    # One token past a unit: floor(2160/16)*16 = 2160 (the legacy hashing drops it).
    assert prompt_checkpoint(2161, H, eagle=True, lookahead=1) == 2160
    assert prompt_checkpoint(2161, H, eagle=True) == 2144
    # Three tokens of lookahead: floor((2162 - 3)/16)*16 = 2144.
    assert prompt_checkpoint(2162, H, eagle=True, lookahead=3) == 2144
    # A geometry hashes past its blocks only under speculative decoding.
    with pytest.raises(ValueError, match="only under speculative decoding"):
        Geometry(B, H, hash_lookahead=1)


def test_next_turn_resume() -> None:
    """A turn whose 8-token reply crosses the 1056 boundary (prompt 1055, 1062 tokens
    known, 1061 computed): the next turn resumes at 1056 with lookahead hashes and
    without speculation, at the checkpoint under 0.32.0's EAGLE hashing."""
    block = 1056
    mtp_lookahead = Geometry(block, H, num_spec=1, hash_lookahead=1)
    # floor((1055 + 8 - 1)/1056)*1056 = 1056 above floor((1055 - 1)/16)*16 = 1040.
    assert next_turn_resume(1055, 8, mtp_lookahead) == 1056
    # The boundary hashes only with its lookahead token known: 1048 + 8 - 1 < 1056.
    assert next_turn_resume(1048, 8, mtp_lookahead) == 1040
    # 0.32.0's hashing: the match at 1056 drops a unit; floor(1055/16)*16 - 16.
    assert next_turn_resume(1055, 8, Geometry(block, H, num_spec=1)) == 1024
    # No speculation: 1056 <= 1055 + 8 - 1.
    assert next_turn_resume(1055, 8, Geometry(block, H)) == 1056
    # A reply that crosses no boundary: the prompt's checkpoint, as for a resend.
    assert next_turn_resume(1111, 8, mtp_lookahead) == prompt_checkpoint(1111, H, True, 1)


@pytest.mark.parametrize(
    ("shared", "num_spec", "legacy", "lookahead"),
    [
        # S mod H = 15. 0.32.0: floor(2159/16)*16 - 16 = 2144 - 16; 0.33.0: floor(2158/16)*16.
        (2159, 1, 2128, 2144),
        # S mod H = 0. 0.32.0: 2160 - 16; 0.33.0: floor(2159/16)*16, the boundary unproven.
        (2160, 1, 2144, 2144),
        # The README's other S. 0.32.0: floor(1007/16)*16 - 16; 0.33.0: floor(1006/16)*16.
        (1007, 1, 976, 992),
        # No speculation: no drop and no lookahead hash, floor(1007/16)*16 on either.
        (1007, 0, 992, 992),
    ],
)
def test_ideal_resume(shared: int, num_spec: int, legacy: int, lookahead: int) -> None:
    case = Case(Geometry(B, H, num_spec=num_spec), shared, 1)
    assert (lookahead_ideal(case, 0), lookahead_ideal(case, 1)) == (legacy, lookahead)
    assert case.ideal == legacy


def test_producer_chunk_ends_on_0_32_0() -> None:
    readme = Case(EAGLE, 2159, 1)  # N = 2160
    # The last block A keeps is floor(2160/2048)*2048 - 2048 = 0 (EAGLE drops a block);
    # the prompt checkpoint floor(2160/16)*16 - 16 = 2144; then the end, 2160.
    assert producer_prefill(readme, patched=False).ends == (2144, 2160)
    # The fix adds 2144 - 16 = 2128 and one unit below the block boundary A crosses,
    # floor(2159/2048)*2048 - 16 = 2032; the chunk from 2032 starts inside a block, so
    # it stops at the boundary 2048.
    assert producer_prefill(readme, patched=True).ends == (2032, 2048, 2128, 2144, 2160)

    budget = Case(Geometry(B, H, num_spec=1, budget=B), 5000, 40)  # N = 5040
    # A 2048-token budget cuts at the blocks 2048 and 4096 (the last one EAGLE keeps is
    # floor(5040/2048)*2048 - 2048 = 2048); the checkpoint floor(5040/16)*16 - 16 = 5024.
    assert producer_prefill(budget, patched=False).ends == (2048, 4096, 5024, 5040)
    # The fix stops at 4096 - 16 = 4080 (below the boundary 5039 crosses), then at the
    # block boundary 4096 (its chunk starts inside a block), and at 5024 - 16 = 5008.
    assert producer_prefill(budget, patched=True).ends == (2048, 4080, 4096, 5008, 5024, 5040)


@pytest.mark.parametrize(
    ("shared", "tail", "geometry", "patched", "fa_match", "fa_eagle", "hit"),
    [
        # README, unpatched: A's one attention entry past a block is its last unit 2160,
        # beyond S, so B matches the block 2048, less one unit 2032; A's only state is
        # 2144: B resumes at 0 and recomputes everything.
        (2159, 1, EAGLE, False, 2048, 2032, 0),
        # README, patched: A also keeps 2144's attention entry; B matches
        # floor(2159/16)*16 = 2144, less one unit, 2128, where the fix kept a state.
        (2159, 1, EAGLE, True, 2144, 2128, 2128),
        # S = 1007, N = 1008, inside the first block: unpatched, A's entry 1008 is past S
        # and no block is full: 0.
        (1007, 1, EAGLE, False, 0, 0, 0),
        # Patched: 992 = floor(1007/16)*16 matched, less one unit: the fix's 976.
        (1007, 1, EAGLE, True, 992, 976, 976),
        # No speculation: A's checkpoint floor(1007/16)*16 = 992 is B's match, no drop.
        (1007, 1, NO_SPEC, False, 992, 992, 992),
        # A 2048-token budget (chunk ends 2048, 4096, 5024): B matches the block 4096
        # (A's entry 5040 is past S = 5000), less one unit 4080; A's states at or below
        # are the chunk end 2048.
        (5000, 40, Geometry(B, H, num_spec=1, budget=B), False, 4096, 4080, 2048),
        # Patched: the fix's state 4096 - 16 = 4080 is there.
        (5000, 40, Geometry(B, H, num_spec=1, budget=B), True, 4096, 4080, 4080),
    ],
)
def test_follow_up_on_0_32_0(
    shared: int,
    tail: int,
    geometry: Geometry,
    patched: bool,
    fa_match: int,
    fa_eagle: int,
    hit: int,
) -> None:
    want = expected(Case(geometry, shared, tail), patched)
    assert (want.fa_match, want.fa_eagle, want.hit) == (fa_match, fa_eagle, hit)


@pytest.mark.parametrize(
    ("shared", "patched", "chunk_ends", "hit"),
    [
        # S mod H = 15, N = 2160: A's checkpoint floor(2159/16)*16 = 2144 after the block
        # 2048 below floor(2159/2048)*2048; B proves floor(2158/16)*16 = 2144, no drop.
        (2159, False, (2048, 2144, 2160), 2144),
        # S mod H = 0, N = 2161: A's checkpoint floor(2160/16)*16 = 2160 is past what B
        # proves, floor(2159/16)*16 = 2144: B falls to the block, 2048.
        (2160, False, (2048, 2160, 2161), 2048),
        # Patched: the fix keeps 2160 - 16 = 2144 (and 2048 - 16 = 2032): B resumes at 2144.
        (2160, True, (2032, 2048, 2144, 2160, 2161), 2144),
    ],
)
def test_follow_up_with_lookahead_hashes(
    shared: int, patched: bool, chunk_ends: tuple[int, ...], hit: int
) -> None:
    want = expected(Case(EAGLE, shared, 1), patched, lookahead=1)
    assert (want.chunk_ends, want.hit) == (chunk_ends, hit)
    # Lookahead hashes drop nothing: B resumes at the match itself.
    assert want.fa_eagle == want.fa_match


# One prefill chunk the layer exports from (the 64-token grid), 384-token blocks,
# one draft token, lookahead hashes: A = 544 shared + a 40-token tail = 584 tokens,
# B shares 544 and proves floor(543/16)*16 = 528.
GRID = Geometry(384, 16, 1, checkpoints="internal-grid")


@pytest.mark.parametrize(
    ("geometry", "patched", "hit"),
    [
        # A's checkpoint floor(583/16)*16 = 576 is past what B proves, and the one
        # chunk keeps no state at 384: B falls to 0.
        (GRID, False, 0),
        # The fix exports 576 - 16 = 560 and 384 - 16 = 368 in the pass: B at 368.
        (GRID, True, 368),
        # Exporting the block boundary too (the split path's chunk end at 384): B at 384.
        (replace(GRID, fix_exports_block_boundary=True), True, 384),
        # The split path ends a chunk at 384 on both trees; the export changes nothing.
        (replace(GRID, checkpoints="split"), False, 384),
        (replace(GRID, checkpoints="split", fix_exports_block_boundary=True), True, 384),
    ],
)
def test_the_block_boundary_a_chunk_runs_past(geometry: Geometry, patched: bool, hit: int) -> None:
    want = expected(Case(geometry, 544, 40), patched, lookahead=1)
    assert want.hit == hit
    # In the pass: one chunk, no step for any export; on the split path: 384, 576, 584
    # (and the fix's 368 and 560 as chunk ends: the split path exports nothing).
    split = geometry.checkpoints == "split"
    ends = ((368, 384, 560, 576, 584) if patched else (384, 576, 584)) if split else (584,)
    assert want.chunk_ends == ends


@pytest.mark.parametrize("regime", ["split", "internal-1", "internal-grid"])
def test_the_bench_pair_never_needs_the_block_boundary_export(regime: str) -> None:
    """The bench's A is B's context plus one probe token, so B's hit lies at or above
    the fix's predecessors and never on the last block boundary below them: its
    expectations hold whether or not the served tree exports that boundary, and
    the bench leaves ``fix_exports_block_boundary`` at its default."""
    for block in (64, 528, 1056, 2048, 2144):
        for num_spec, lookahead in ((1, 1), (1, 0), (3, 3)):
            plain = Geometry(block, 16, num_spec, budget=8192, checkpoints=regime)
            exporting = replace(plain, fix_exports_block_boundary=True)
            for shared in range(block - 40, 2 * block + 40, 3):
                assert (
                    expected(Case(plain, shared, 1), True, lookahead).hit
                    == expected(Case(exporting, shared, 1), True, lookahead).hit
                ), (block, num_spec, shared)


@pytest.mark.parametrize("regime", ["internal-1", "internal-grid"])
def test_a_resumed_prompt_keeps_its_block_boundary_anyway(regime: str) -> None:
    """A prompt that resumed from a hit leaves out the fix's exports less than
    ``FIX_MIN_GAIN`` above it, the block boundary export among them, though the
    split path ends a chunk there whatever the hit. It loses nothing: with blocks
    of 64 tokens or more a boundary that close lies in the block the prompt
    resumed inside, and vLLM ends that chunk on the block's end. So every such
    boundary is still a kept state, in the geometry model that ``make regress``
    holds the real scheduler to, hit for hit."""
    checked = 0
    for shared in range(40, 2 * 2144, 37):
        for block, (num_spec, lookahead) in ((64, (1, 1)), (384, (1, 1)), (2144, (3, 3))):
            geometry = Geometry(
                block, H, num_spec, checkpoints=regime, fix_exports_block_boundary=True
            )
            case = Case(replace(geometry, hash_lookahead=lookahead), shared, 40)
            cp = checkpoints_of(case, True, lookahead)
            for resume in range(H, case.producer_len, H):
                if cp.boundary and cp.boundary in resumed_fix_skips(case, cp, resume):
                    checked += 1
                    states = producer_states(case, True, lookahead, resume=resume)
                    assert cp.boundary in states, (block, shared, resume)
    assert checked > 100  # the rule does leave such boundaries out
