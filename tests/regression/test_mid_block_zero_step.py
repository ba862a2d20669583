"""The engine step a mid-block resume pays under internal prefill checkpoints.

``fix-mamba-mid-block-resume-stop`` (both trees) ends a chunk that starts inside
a Mamba block at the next block boundary, also when the layer could export the
prompt checkpoint in one pass. ``docs/mid-block-zero-step.md`` has the design of
the zero-step forms. Both are built in the fix (patched tree, EAGLE/MTP, a
layer that exports several states per row):

- case A: a chunk that starts inside a block and runs past its boundary
  exports the boundary state into a block of its own, and the key the
  full-block pass gives the column below the boundary (which holds the chunk's
  initial state) moves to that export;
- case B: the bench's cached B (S = 2159, block 2048), whose chunk never
  reaches a block boundary, exports its prompt checkpoint, which
  ``is_mamba_prefill_checkpoint_valid``'s column rule refuses, into a block of
  its own.

Without speculation the fix is off, so a stock layer keeps the stop (strict
xfail).
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import PROBE_TOKEN, prompts
from kit.geometry.geometry_model import (
    Case,
    Geometry,
    checkpoint_position,
    expected,
    resumed_chunk_ends,
)
from kit.rig.sched_harness import SchedulerRig, run_case, tree_has_lookahead_hashes
from kit.rig.stress import Arrival

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

CONTEXT = list(range(100, 3100))
# Block 384, H = 16, no drafting, Mamba2-like layer (alignment 1). A (420
# tokens) prefills in one chunk and exports its checkpoint 416; B (1200
# tokens) resumes there, inside block 1 ([384, 768)) at a hash-aligned
# position, and its rest [416, 1200) could export B's checkpoint 1184 in one
# pass (its column cdiv(1200, 384) - 2 = 2 lies above the initial state's
# column (416 - 1) // 384 = 1).
MID_BLOCK = Geometry(384, 16, 0, checkpoints="internal-1")


def _mid_block_run(tiny_model_dir):
    rig = SchedulerRig(tiny_model_dir, MID_BLOCK)
    a = rig.run(CONTEXT[:420])
    assert rig.chunk_ends[a.request_id] == [420]
    assert rig.exports[a.request_id] == [416]
    b = rig.run(CONTEXT[:1200])
    assert b.hit == 416 and b.resumed_from_own_prefix()
    c = rig.run(CONTEXT[:800])
    return rig, b, c


def test_mid_block_resume_pays_a_chunk_end_at_the_boundary(tiny_model_dir) -> None:
    """Today (passes): B runs [416, 768) then [768, 1200) with the export at 1184;
    C (800 tokens) resumes at 768 from a state of its own 768 tokens."""
    rig, b, c = _mid_block_run(tiny_model_dir)
    assert rig.chunk_ends[b.request_id] == [768, 1200]
    assert rig.exports[b.request_id] == [1184]
    assert c.hit == 768 and c.resumed_from_own_prefix()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "without EAGLE/MTP the fix is off: Scheduler._mamba_block_aligned_split "
        "(with fix-mamba-mid-block-resume-stop) ends a chunk that starts mid-block "
        "at the next boundary, and stock layers write one checkpoint per row "
        "(compute_mamba_prefill_checkpoints), so B pays a chunk end"
    ),
)
def test_mid_block_resume_in_one_pass(tiny_model_dir) -> None:
    """The zero-step form without speculation: one chunk [416, 1200) exporting
    768 and 1184, and C still resumes at 768 from its own prefix."""
    rig, b, c = _mid_block_run(tiny_model_dir)
    assert rig.chunk_ends[b.request_id] == [1200]
    assert sorted(rig.exports[b.request_id]) == [768, 1184]
    assert c.hit == 768 and c.resumed_from_own_prefix()


def test_mid_block_resume_on_the_flashinfer_grid_is_not_only_the_stop(tiny_model_dir) -> None:
    """Passes: on FlashInfer's 64-token grid the same B takes four chunks, and the
    stop at 768 is one of three it cannot skip: 1184 is off the grid from 768
    (416 tokens), so the split path's block stop (1152) and tail stop (1184)
    follow. An in-pass boundary export from 416 would be off the grid as well
    (768 - 416 = 352)."""
    rig = SchedulerRig(tiny_model_dir, Geometry(384, 16, 0, checkpoints="internal-grid"))
    a = rig.run(CONTEXT[:420])
    assert rig.chunk_ends[a.request_id] == [384, 416, 420]
    b = rig.run(CONTEXT[:1200])
    assert b.hit == 416
    assert rig.chunk_ends[b.request_id] == [768, 1152, 1184, 1200]
    assert b.request_id not in rig.exports


# Cached B of the bench: 2048-token blocks, one draft token, the CPU default's
# internal path (alignment 1), S = 2159 plus the probe. The patched tree's B
# resumes inside block 1 (2128; 2144 with lookahead hashes), and its prompt
# (2207) ends in the same block.
CACHED_B_2159 = Case(Geometry(2048, 16, 1, checkpoints="internal-1"), 2159, 1)


def _cached_b(tiny_model_dir, case: Case):
    rig, _, b, _ = run_case(tiny_model_dir, case, fix=True)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    assert b.hit == expected(case, True, lookahead).hit and b.resumed_from_own_prefix()
    _, b_tokens = prompts(case)
    return rig, b, b_tokens, checkpoint_position(len(b_tokens), case, lookahead)


def test_cached_b_2159_in_one_pass(tiny_model_dir, tree_is_patched: bool) -> None:
    """Patched: one chunk from the hit to 2207, exporting B's prompt checkpoint
    (2176; 2192 with lookahead hashes) into a block of its own. The layer cannot
    export it into the block table: its column ``cdiv(2207, 2048) - 2 = 0`` is
    not above the initial state's column 1, so vLLM would stop there (two engine
    steps). A later turn resumes there from exactly B's first tokens."""
    if not tree_is_patched:
        pytest.skip("unpatched B resumes at 0 and prefills in one chunk")
    rig, b, b_tokens, tail = _cached_b(tiny_model_dir, CACHED_B_2159)
    assert b.hit < tail < 2207
    assert rig.chunk_ends[b.request_id] == [2207]
    assert rig.exports[b.request_id] == [tail]
    c = rig.run(b_tokens + list(range(5000, 5040)))
    assert c.hit == tail and c.resumed_from_own_prefix()


def test_cached_b_2159_on_the_split_path_stops_at_the_checkpoint(
    tiny_model_dir, tree_is_patched: bool
) -> None:
    """Without internal checkpoints the prompt checkpoint stays a chunk end."""
    if not tree_is_patched:
        pytest.skip("unpatched B resumes at 0 and prefills in one chunk")
    case = Case(Geometry(2048, 16, 1, checkpoints="split"), 2159, 1)
    rig, b, _, tail = _cached_b(tiny_model_dir, case)
    assert rig.chunk_ends[b.request_id] == [tail, 2207]


def test_a_mid_block_resume_exports_the_boundary_it_runs_past(
    tiny_model_dir, tree_is_patched: bool
) -> None:
    """Case A. B (4200 tokens, 0.32.0 hashing, EAGLE) resumes at 3008, inside
    block 1, and runs past 4096: one chunk, exporting the boundary 4096 besides
    its prompt checkpoint 4176 and the fix's 4080 and 4160. The full-block pass
    keys block 1's column at 4096, but that column holds B's initial state (3008
    tokens): the key moves to the export, and only the export holds it. Under
    this hashing no follow-up resumes at 4096 (EAGLE drops the unit below an
    attention match at 4096); one sharing 4100 tokens resumes at 4080."""
    if not tree_is_patched:
        pytest.skip("fix-eagle-fine-prefix's switch exists only on the patched tree")
    geo = Geometry(2048, 16, 1, checkpoints="internal-1")
    context = list(range(100, 4400))
    rig = _legacy_rig(tiny_model_dir, geo)
    rig.run(context[:3024] + [PROBE_TOKEN])
    b = rig.run(context[:3024] + list(range(5000, 5000 + 4200 - 3024)))
    assert b.hit == 3008 and b.resumed_from_own_prefix()
    assert rig.chunk_ends[b.request_id] == [4200]
    assert tuple(rig.chunk_ends[b.request_id]) == resumed_chunk_ends(geo, 4200, 3008, True)
    assert sorted(rig.exports[b.request_id]) == [4080, 4096, 4160, 4176]
    assert rig.mamba_states_keyed_at(list(b.prompt), 4096) == [tuple(b.prompt[:4096])]
    c = rig.run(list(b.prompt[:4100]) + list(range(6000, 6040)))
    assert c.hit == 4080 and c.resumed_from_own_prefix()


def test_a_mid_block_resume_at_the_boundary_reads_its_own_state(
    tiny_model_dir, tree_is_patched: bool
) -> None:
    """Case A with lookahead hashes (0.33.0 on): B (4200 tokens, MTP k = 1)
    resumes inside block 1 and runs past 4096 in one chunk; a follow-up sharing
    4112 of B's tokens resumes at 4096 from exactly B's first 4096 tokens."""
    if not tree_is_patched or not tree_has_lookahead_hashes():
        pytest.skip("this tree hashes without lookahead tokens")
    geo = Geometry(2048, 16, 1, checkpoints="internal-1")
    context = list(range(100, 4400))
    rig = SchedulerRig(tiny_model_dir, geo, fix=True)
    rig.run(context[:3024] + [PROBE_TOKEN])
    b = rig.run(context[:3024] + list(range(5000, 5000 + 4200 - 3024)))
    assert b.hit % geo.block and b.resumed_from_own_prefix()
    assert rig.chunk_ends[b.request_id] == [4200]
    assert 4096 in rig.exports[b.request_id]
    assert rig.mamba_states_keyed_at(list(b.prompt), 4096) == [tuple(b.prompt[:4096])]
    c = rig.run(list(b.prompt[:4112]) + list(range(6000, 6040)))
    assert c.hit == 4096 and c.resumed_from_own_prefix()


def _legacy_rig(tiny_model_dir, geo: Geometry, max_num_seqs: int = 16) -> SchedulerRig:
    """A patched rig with the 0.32.0 hashing (later releases through their switch)."""
    return SchedulerRig(
        tiny_model_dir,
        geo,
        fix=True,
        lookahead_hashes=not tree_has_lookahead_hashes(),
        max_num_seqs=max_num_seqs,
    )


def test_a_step_exports_at_most_its_budget_of_prompt_checkpoints(
    tiny_model_dir, tree_is_patched: bool
) -> None:
    """Where the fix's exports are published only once written (0.34.0), FlashInfer
    GDN runs a bounded number of exports off its grid per batch: the scheduler
    exports at most ``MAMBA_MAX_PROMPT_CHECKPOINT_EXPORTS`` prompt checkpoints a
    step and ends the chunk at the others, as without the fix. One more cold
    prompt than that (420 tokens, checkpoint 400 off the 64-token grid) in one
    step: that many exported, one a chunk end, every state right."""
    from vllm.v1 import kv_cache_interface

    budget = getattr(kv_cache_interface, "MAMBA_MAX_PROMPT_CHECKPOINT_EXPORTS", None)
    if not tree_is_patched or budget is None:
        pytest.skip("this tree's fix exports prompt checkpoints without a step budget")
    geo = Geometry(384, 16, 1, checkpoints="internal-grid")
    rig = _legacy_rig(tiny_model_dir, geo, max_num_seqs=budget + 1)
    prompts = [tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + 420)) for i in range(budget + 1)]
    assert rig.drive([Arrival(0, p, 1) for p in prompts]) == []
    exported = [rid for rid, positions in rig.fix_exports.items() if 400 in positions]
    assert len(rig.fix_exports) == budget + 1 and len(exported) == budget


def test_the_tail_cap_keeps_each_rows_prompt_checkpoint_first() -> None:
    """FlashInfer GDN's builder keeps each row's highest export off the grid (its
    prompt checkpoint where it has one) before the rest, in row order."""
    try:
        from vllm.v1.attention.backends.gdn_attn import (
            FLASHINFER_GDN_MAX_TAILS,
            cap_flashinfer_tails,
        )
        from vllm.v1.kv_cache_interface import MAMBA_MAX_PROMPT_CHECKPOINT_EXPORTS
    except ImportError:
        pytest.skip("this tree's GDN builder runs no tails")
    # Every prompt checkpoint one step plans fits the batch's tails.
    assert MAMBA_MAX_PROMPT_CHECKPOINT_EXPORTS <= FLASHINFER_GDN_MAX_TAILS
    rows = [[(16, 1), (32, 2)], [(48, 3)], [(64, 4), (80, 5)]]
    pairs = [(0, 116), (0, 132), (1, 248), (2, 364), (2, 380)]
    per_row, kept, dropped = cap_flashinfer_tails(rows, pairs, 64, max_tails=3)
    assert per_row == [[(32, 2)], [(48, 3)], [(64, 4), (80, 5)]]
    assert kept == [(0, 132), (1, 248), (2, 364), (2, 380)] and dropped == 1


def test_the_tail_cap_keeps_a_mid_block_boundary_first() -> None:
    """The block boundary above a chunk that starts inside a block (vLLM's own
    state, exported instead of the mid-block stop) goes before every other tail.
    Row 0 starts at 100 (block 128) and exports 128 and 160; row 1 starts at 200
    and exports 220 and 240: with room for two, row 0 keeps both."""
    try:
        from vllm.v1.attention.backends.gdn_attn import cap_flashinfer_tails
    except ImportError:
        pytest.skip("this tree's GDN builder runs no tails")
    rows = [[(28, 1), (60, 2)], [(20, 3), (40, 4)]]
    pairs = [(0, 128), (0, 160), (1, 220), (1, 240)]
    per_row, kept, dropped = cap_flashinfer_tails(rows, pairs, 64, max_tails=2, block_size=128)
    assert per_row == [[(28, 1), (60, 2)], []] and kept == pairs[:2] and dropped == 2
    # Without the block size each row's highest goes first, as before.
    per_row, _, _ = cap_flashinfer_tails(rows, pairs, 64, max_tails=2)
    assert per_row == [[(60, 2)], [(40, 4)]]
