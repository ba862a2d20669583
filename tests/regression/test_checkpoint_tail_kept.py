"""The kept branch of ``MambaManager._cache_partial_tail_block`` on the real scheduler.

``fix-mamba-transient-checkpoint-tail`` (both trees) mends both branches: where
a chunk's own internal export is transient the manager evicts it, where it is
kept (the prompt checkpoint, a retained block boundary or the shared-prefix
junction) it re-keys the reserved block at it; either way it then publishes the
chunk end as the split path does. vLLM returned from both branches without
looking at the chunk end. These tests go through the ways the kept branch can
lose the chunk end's state or publish a wrong one:

- the chunk ends at the prompt checkpoint and its export is kept at a block
  boundary below it (different column): vLLM loses the chunk end (legacy
  hashing with EAGLE; a twin without speculation says why the other settings
  never get there), the mod publishes it;
- the final chunk's export and a block boundary want the same column: the
  boundary's full-block key is replaced, never served with the export's state;
- a chunk that ends on a block boundary exports one column below it: the chunk
  end is published from its own column, and the column the export overwrote is
  not served as the boundary below.

The code is the same in 0.32.0 (this tree) and 0.34.0
(``single_type_kv_cache_manager.py``: ``_needs_internal_checkpoint``,
``get_num_blocks_to_allocate``, ``_cache_partial_tail_block``). Geometry: block
384, H = 16, the layer's alignment 64 (``internal-grid``, FlashInfer GDN) or 1
(``internal-1``, Mamba2). ``fix=False`` throughout: the release's own rules
(with both trees' defect fixes), not fix-eagle-fine-prefix's extra stops.
The same on 0.34.0's own tree: tests/mods/test_release_checkpoint_tail.py (outside
tests/regression, which also runs inside the images, where no release tree can
be built).
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_model import Case, Geometry, expected, producer_prefill
from kit.rig.sched_harness import MAMBA_GROUP, SchedulerRig, run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

BLOCK = 384
CONTEXT = list(range(100, 3100))
FOLLOW_UP = list(range(5000, 5040))

# EAGLE (k = 1, 0.32.0 hashing): a 420-token prompt's checkpoint is
# 420 // 16 * 16 - 16 = 400 = 384 + 16, off the 64-token grid.
KEPT_BOUNDARY = Case(Geometry(BLOCK, 16, 1, checkpoints="internal-grid"), 416, 4)


def test_prompt_checkpoint_stop_is_published_beside_a_kept_boundary_export(
    tiny_model_dir,
) -> None:
    """The prompt checkpoint 400 is off the grid from 0, so the scheduler
    (``_mamba_block_aligned_split``) stops the first chunk there; with EAGLE the
    last cacheable block stop is 420 // 384 * 384 - 384 = 0, so no block stop
    comes first. The manager reserves the chunk's own export at
    checkpoint(400) = 384, valid from 0 (384 on the grid, column 0 above the
    initial state's column -1), and keeps it as a retained block boundary. The
    kept branch re-keys column 0 at 384; vLLM returned there, so 400, in
    column 1, was never published and B resumed at 384 (0.34.0's stock tree
    still does: tests/mods/test_release_checkpoint_tail.py). With the mod both are
    published: B matches attention at 416, is rewound to 400, and resumes there.
    """
    rig, a, b, bounds = run_case(tiny_model_dir, KEPT_BOUNDARY)
    assert rig.chunk_ends[a.request_id] == [400, 420]
    assert rig.exports[a.request_id] == [384]
    assert rig.partial_entries_of(a.request_id, MAMBA_GROUP) == [400]
    assert (bounds.fa_match, bounds.fa_eagle) == (416, 400)
    assert b.hit == bounds.hit == 400
    assert b.resumed_from_own_prefix()
    # The kit's geometry model publishes the chunk end too.
    assert producer_prefill(KEPT_BOUNDARY, patched=False).ends == (400, 420)
    assert expected(KEPT_BOUNDARY, patched=False).hit == 400


def test_without_speculation_the_block_stop_comes_first(tiny_model_dir) -> None:
    """Passes, and why the loss above needs the EAGLE drop of 0.32.0's hashing.

    Without EAGLE (and with 0.33.0/0.34.0's lookahead hashes, whose block stop
    is ``floor((N - L) / B) * B`` the same way) the last cacheable block stop is
    384 itself, below the prompt checkpoint 416, so the chunk that ends at the
    checkpoint starts on the block boundary: its export's column (0) is not
    above the initial state's (0), no export is reserved, and the chunk end is
    published by the split-path code.
    """
    case = Case(Geometry(BLOCK, 16, 0, checkpoints="internal-grid"), 416, 4)
    rig, a, b, bounds = run_case(tiny_model_dir, case)
    assert rig.chunk_ends[a.request_id] == [384, 416, 420]
    assert a.request_id not in rig.exports
    assert rig.partial_entries_of(a.request_id, MAMBA_GROUP) == [416]
    assert b.hit == bounds.hit == 416 and b.resumed_from_own_prefix()


@pytest.mark.parametrize("regime", ["internal-1", "internal-grid"])
def test_final_export_and_block_boundary_share_a_column(tiny_model_dir, regime: str) -> None:
    """Passes: two states want column 0, and the boundary's key never names the export.

    A (449 tokens) prefills in one chunk: the prompt checkpoint 448 is valid
    from 0 on both grids, so the scheduler drops the block stop at 384. The
    export lands in ``cdiv(449, 384) - 2 = 0``, the column the boundary 384
    owns. The full-block pass keys column 0 at 384 first; the kept branch
    re-keys it with ``replace_existing_hashes=True``, so nothing maps 384 to a
    state of 448 tokens. The state at 384 is never computed (the price of the
    saved step, not a wrong entry): B sharing 430 tokens resumes at 0, where the
    split path would resume at 384.
    """
    rig = SchedulerRig(tiny_model_dir, Geometry(BLOCK, 16, 0, checkpoints=regime))
    a = rig.run(CONTEXT[:449])
    assert rig.chunk_ends[a.request_id] == [449]
    assert rig.exports[a.request_id] == [448]
    assert rig.partial_entries_of(a.request_id, MAMBA_GROUP) == [448]
    assert rig.boundaries(CONTEXT[:430] + FOLLOW_UP).hit == 0
    b = rig.run(CONTEXT[:430] + FOLLOW_UP)
    assert b.hit == 0


def test_block_boundary_chunk_end_with_an_export_one_column_below(tiny_model_dir) -> None:
    """Passes: the chunk end is published from its own column, the export's is not
    served as the boundary below.

    Budget 768 cuts A (1000 tokens, internal-1) at the block boundary 768. The
    manager reserves that chunk's own export at checkpoint(768) = 752 in column
    ``cdiv(768, 384) - 2 = 0``, one column below 752's own: transient, so the
    full-block key 384 the pass gave column 0 is evicted, while column 1 holds
    the chunk end 768 and keeps its full-block key. B sharing 390 tokens finds
    nothing at 384 (not the 752-token state); B sharing 770 resumes at 768 from
    its own prefix.
    """
    rig = SchedulerRig(tiny_model_dir, Geometry(BLOCK, 16, 0, budget=768, checkpoints="internal-1"))
    a = rig.run(CONTEXT[:1000])
    assert rig.chunk_ends[a.request_id] == [768, 992, 1000]
    assert rig.exports[a.request_id] == [752]
    assert rig.partial_entries_of(a.request_id, MAMBA_GROUP) == [992]
    below = rig.run(CONTEXT[:390] + FOLLOW_UP)
    assert below.hit == 0
    at = rig.run(CONTEXT[:770] + FOLLOW_UP)
    assert at.hit == 768 and at.resumed_from_own_prefix()


def test_the_eagle_fix_masks_the_kept_branch_loss(tiny_model_dir, tree_is_patched: bool) -> None:
    """Patched tree only: fix-eagle-fine-prefix keeps 368 and 384 (one unit below
    the last block boundary and below the prompt checkpoint) as exports (the layer
    writes its extra states at any offset), and the prompt checkpoint 400 too,
    which the layer cannot export into the block table (off its 64-token grid):
    one chunk, no stop at 400, and 400 is published from its own block."""
    if not tree_is_patched:
        pytest.skip("fix-eagle-fine-prefix's switch exists only on the patched tree")
    rig, a, b, bounds = run_case(tiny_model_dir, KEPT_BOUNDARY, fix=True)
    assert rig.chunk_ends[a.request_id] == [420]
    assert rig.fix_exports[a.request_id] == [368, 384, 400]
    assert 400 in rig.partial_entries_of(a.request_id, MAMBA_GROUP)
    assert b.hit == bounds.hit == 400 and b.resumed_from_own_prefix()
