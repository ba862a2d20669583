"""Prefix-cache retention as a dimension of the scheduler rig (docs/retention.md).

``vllm serve`` runs ``CacheConfig.prefix_cache_retention_interval = 0`` (Mamba
keeps only the replay boundaries and shared-prefix junctions), while the
``KVCacheConfig`` the rig builds by hand defaults to ``None`` (dense). The rig
takes either, or a positive multiple of the block, and hands it to vLLM's
coordinator; under 0 the follow-up's hits on the bench's geometry are the ones
docs/retention.md states, and on geometries where the retention decides the hit
the real scheduler's equal the geometry model's at dense, 0 and an interval (what
``make regress RETENTION=`` relies on).
Runs on whichever tree ``KIT_TREE`` picks (0.32.0's legacy hashing or 0.34.0's
lookahead hashing; unpatched or patched).
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_model import Case, Geometry, expected, retained_block_state
from kit.rig.sched_harness import SchedulerRig, run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

BLOCK = 2048
# The bench's two paths: (regime, step budget), kit/bench/serve_args.py PATHS.
PATHS = {"internal-1": 8192, "split": 2048}

# Cached B's hit under retention 0, per hashing, tree and S (one-token "." probe,
# 48-token follow-up, 2048-token blocks, H = 16, MTP k = 1), the same on both
# paths and the same as under dense retention: docs/retention.md.
HITS_AT_RETENTION_0 = {
    # 0.32.0 (and later releases' disable_lookahead_block_hashes).
    "legacy": {
        "unpatched": {900: 880, 1007: 0, 2048: 2032, 2159: 0},
        "patched": {900: 880, 1007: 976, 2048: 2032, 2159: 2128},
    },
    # 0.33.0/0.34.0's default hashing (one lookahead token).
    "lookahead": {
        "unpatched": {900: 896, 1007: 992, 2048: 0, 2159: 2144},
        "patched": {900: 896, 1007: 992, 2048: 2032, 2159: 2144},
    },
}


def _geometry(regime: str = "internal-1") -> Geometry:
    return Geometry(BLOCK, 16, 1, budget=PATHS[regime], checkpoints=regime)


@pytest.mark.parametrize("retention", [None, 0, BLOCK, 3 * BLOCK])
def test_the_rig_hands_retention_to_vllms_coordinator(tiny_model_dir, retention) -> None:
    rig = SchedulerRig(tiny_model_dir, _geometry(), retention=retention)
    assert rig.coordinator.retention_interval == retention
    assert rig.kv_cache_config.prefix_cache_retention_interval == retention
    assert rig.vllm_config.cache_config.prefix_cache_retention_interval == retention


def test_the_default_stays_dense(tiny_model_dir) -> None:
    assert SchedulerRig(tiny_model_dir, _geometry()).coordinator.retention_interval is None


@pytest.mark.parametrize("retention", [-BLOCK, 16, BLOCK + 16, 1.0, True])
def test_a_retention_vllm_would_refuse_is_refused(tiny_model_dir, retention) -> None:
    with pytest.raises((ValueError, TypeError), match="retention"):
        SchedulerRig(tiny_model_dir, _geometry(), retention=retention)


@pytest.mark.parametrize("regime", list(PATHS))
@pytest.mark.parametrize("shared", [900, 1007, 2048, 2159])
def test_bench_geometry_hits_at_the_server_default(
    tiny_model_dir, tree_is_patched: bool, regime: str, shared: int
) -> None:
    case = Case(_geometry(regime), shared, 1)
    rig, _, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched, retention=0)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    hashing = "lookahead" if lookahead else "legacy"
    stage = "patched" if tree_is_patched else "unpatched"
    assert rig.coordinator.retention_interval == 0
    assert b.hit == HITS_AT_RETENTION_0[hashing][stage][shared]
    assert b.resumed_from_own_prefix()
    # The geometry model (dense retention) predicts the same hit here.
    assert b.hit == expected(case, tree_is_patched, lookahead).hit


# A producer whose tail runs two blocks past what the follow-up shares (block 64,
# one block per step): B falls back to the block boundary 192, which dense
# retention keys and retention 0 does not (it is no replay boundary of A), on
# either tree; a 128-token interval keys 128. docs/retention.md.
LONG_TAIL = Case(Geometry(64, 16, 1, budget=64, checkpoints="split"), 194, 147)


@pytest.mark.parametrize("retention", [None, 0, 128])
def test_the_model_follows_retention_where_a_tail_outruns_the_follow_up(
    tiny_model_dir, tree_is_patched: bool, retention
) -> None:
    rig, _, b, _ = run_case(tiny_model_dir, LONG_TAIL, fix=tree_is_patched, retention=retention)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    assert b.resumed_from_own_prefix()
    assert b.hit == expected(LONG_TAIL, tree_is_patched, lookahead, retention).hit
    if lookahead:
        assert b.hit == {None: 192, 0: 0, 128: 128}[retention]


# `make regress RETENTION=` in small: geometries where the retention decides the hit,
# each at dense, 0 and an interval of 4 blocks (`regress.retention_interval`), on the
# tree under test (make test: the pinned release's patched and unpatched trees;
# KIT_TREE=0.34.0/<stage> a later release's). One block per step (budget 64), so A's
# chunk ends sit on every block boundary and the tail runs blocks past what B
# shares: dense keeps B's block floor, 4 blocks the multiple of 256 below it, 0
# only A's replay boundary (above B) and its own checkpoints.
RETENTION_BLOCKS = 4
RETENTION_CASES = {
    # S = 420 past block 0 and mid-block, no speculation: 384 / 0 / 256.
    "S420-k0-split": Case(Geometry(64, 16, 0, budget=64, checkpoints="split"), 420, 200),
    # The same with MTP k = 1 (0.32.0's hashing drops EAGLE's unit: 320 dense).
    "S420-k1-split": Case(Geometry(64, 16, 1, budget=64, checkpoints="split"), 420, 200),
    # The layer exports inside a two-block chunk (Mamba2's path): 384 or 256 dense.
    "S420-k1-internal-1": Case(Geometry(64, 16, 1, budget=128, checkpoints="internal-1"), 420, 200),
    # A mid-block resume: the patched tree's state at 272 (legacy) or 288
    # (lookahead), the unpatched tree's at a block; kept at every retention (the
    # fix's states and the prompt checkpoint are keyed on their own).
    "S295-k1-mid-block": Case(Geometry(64, 16, 1, budget=64, checkpoints="split"), 295, 20),
}


@pytest.mark.parametrize("retention", [None, 0, RETENTION_BLOCKS], ids=["dense", "0", "4-blocks"])
@pytest.mark.parametrize("name", list(RETENTION_CASES))
def test_the_model_is_the_scheduler_at_each_retention(
    tiny_model_dir, tree_is_patched: bool, name: str, retention
) -> None:
    from kit.rig.regress import retention_interval

    case = RETENTION_CASES[name]
    interval = retention_interval(retention, case.block)
    rig, _, b, _ = run_case(tiny_model_dir, case, fix=tree_is_patched, retention=interval)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    assert rig.coordinator.retention_interval == interval
    assert b.resumed_from_own_prefix()
    assert b.hit == expected(case, tree_is_patched, lookahead, interval).hit


@pytest.mark.parametrize("lookahead", [0, 1])
def test_the_retention_cases_are_ones_where_retention_decides(lookahead: int) -> None:
    """Guards the set above: 0 costs each long-tail case its hit, the interval
    keeps a hit of its own (between 0 and dense) in some, nothing moves the
    mid-block one's, and the fix moves the mid-block one."""
    three = 0
    for name, case in RETENTION_CASES.items():
        for patched in (False, True):
            dense, zero, every = (
                expected(case, patched, lookahead, case.block * r if r else r).hit
                for r in (None, 0, RETENTION_BLOCKS)
            )
            if "mid-block" in name:
                assert dense == zero == every, (name, patched)
                continue
            assert zero < dense and zero <= every <= dense, (name, patched)
            three += zero < every < dense
    assert three
    mid = RETENTION_CASES["S295-k1-mid-block"]
    assert expected(mid, True, lookahead, 0).hit % mid.block
    assert expected(mid, True, lookahead, 0).hit > expected(mid, False, lookahead, 0).hit


def test_retained_block_states() -> None:
    # Dense keeps every block; an interval at or below the block is dense too.
    assert retained_block_state(128, 341, 64, False, None)
    assert retained_block_state(128, 341, 64, False, 64)
    # 0: only the replay boundary, floor((N-1)/B)*B (no EAGLE drop) ...
    assert retained_block_state(320, 341, 64, False, 0)
    assert not retained_block_state(256, 341, 64, False, 0)
    # ... or one block below it and below floor(N/B)*B (EAGLE with the 0.32.0 hashing).
    assert retained_block_state(256, 341, 64, True, 0)
    assert not retained_block_state(320, 341, 64, True, 0)
    assert retained_block_state(64, 129, 64, True, 0)  # N = 129: 128 - 64 and 128 - 64
    # R > 0: the replay boundaries and every multiple of R.
    assert retained_block_state(128, 341, 64, False, 128)
    assert not retained_block_state(192, 341, 64, False, 128)
    # Position 0 is never a state.
    assert not retained_block_state(0, 65, 64, True, 0)


def test_a_regress_row_measured_at_a_retention_is_judged_by_it() -> None:
    """``regress.measure(..., retention=0)`` records it in each row; the verdict reads it."""
    from kit.rig.regress import verdict

    row = {"state_ok": True, "hash_lookahead": 1, "hit": 0}
    assert verdict(LONG_TAIL, row | {"retention": 0}, patched=False) == "loss"
    assert verdict(LONG_TAIL, row, patched=False) == "DIFFERS"  # dense says 192
