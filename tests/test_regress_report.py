"""The regression report's EAGLE-specific loss and verdicts (no scheduler needed)."""

from __future__ import annotations

import pytest

from kit.geometry.geometry_model import Case, Geometry
from kit.rig.loss_sweep import random_cases, sweep
from kit.rig.regress import eagle_specific_loss, verdict

pytestmark = pytest.mark.cpu


def test_no_speculation_has_no_eagle_loss() -> None:
    assert (
        eagle_specific_loss(Case(Geometry(64, 16, 0), 64, 40), hit=64, hit_without_spec=64) is None
    )


def test_loss_beyond_the_unit_eagle_is_entitled_to() -> None:
    # B64-boundary-S64-r0, U = 40: 64 without speculation, 0 with it.
    case = Case(Geometry(64, 16, 1), 64, 40)
    assert eagle_specific_loss(case, hit=0, hit_without_spec=64) == 48
    assert eagle_specific_loss(case, hit=48, hit_without_spec=64) == 0


def test_a_miss_without_speculation_is_not_eagle_s_fault() -> None:
    assert eagle_specific_loss(Case(Geometry(64, 16, 3), 167, 40), hit=0, hit_without_spec=0) == 0


def test_lookahead_hashes_entitle_eagle_to_the_last_proven_boundary() -> None:
    # S = 167 (S mod H = 7): lookahead hashes reach 160 like the plain server, no unit lost.
    probe = Case(Geometry(64, 16, 1), 167, 1)
    assert eagle_specific_loss(probe, hit=160, hit_without_spec=160, lookahead=1) == 0
    # Block-aligned S = 64: the key of unit 48..64 needs token 64, so 48 is the most.
    aligned = Case(Geometry(64, 16, 1), 64, 20)
    assert eagle_specific_loss(aligned, hit=0, hit_without_spec=64, lookahead=1) == 48
    assert eagle_specific_loss(aligned, hit=48, hit_without_spec=64, lookahead=1) == 0


def test_verdict_tells_an_improvement_short_of_the_ideal_from_a_fix() -> None:
    # B384-beyond-S544-r0, U = 40: 0 unpatched, 368 patched (the state without
    # speculation allows 384 - 16); the ideal 528 needs a state nobody keeps.
    case = Case(Geometry(384, 16, 1), 544, 40)
    assert verdict(case, unpatched=0, patched=368) == "better"
    # B64-boundary-S64-r0, U = 40: 0 unpatched, 48 = the ideal patched.
    assert verdict(Case(Geometry(64, 16, 1), 64, 40), unpatched=0, patched=48) == "fixed"
    # A result the geometry model does not predict is never dressed up.
    assert verdict(case, unpatched=0, patched=384) == "UNEXPECTED"


def test_the_fix_leaves_speculation_only_budget_cut_losses() -> None:
    """The geometry model over random geometries (make loss-sweep): with the fix a
    prefill that fits in one step never loses to speculation, and every loss left
    sits at a block state a step-budget cut made."""
    trees = sweep(random_cases(2000, seed=7))
    for hashing in ("legacy", "lookahead"):
        row = trees[f"patched/{hashing}"]
        assert row["of_which_one_step_prefill"] == 0, hashing
        assert row["of_which_at_a_budget_cut_block_state"] == row["lose_to_speculation"]
    assert trees["unpatched/legacy"]["of_which_one_step_prefill"] > 0


def test_the_regression_grid_picture_shows_losses(tmp_path) -> None:
    """A speculative case that loses to speculation alone is red with a black mark;
    one at the ideal is green; drawn from a table like the committed ones."""
    from PIL import Image

    from kit.rig.regression_figure import CELL_H, CELL_W, GREEN, LABEL_W, RED, draw, strips_of

    table = {
        "rows": [
            {
                "ideal": 48,
                "unpatched": 0,
                "patched": 48,
                "eagle_loss_unpatched": 48,
                "eagle_loss_patched": 0,
            },
        ]
    }
    strips = strips_of(table)
    assert strips == [("unpatched", [(0, 48, True)]), ("patched", [(48, 48, False)])]
    path = draw("t", [("split", strips)], tmp_path / "grid.png")
    image = Image.open(path).convert("RGB")
    first = 40 + 22  # the title, then the regime's heading
    assert image.getpixel((LABEL_W + CELL_W // 2, first + CELL_H // 2)) == RED
    assert image.getpixel((LABEL_W + CELL_W // 2, first + CELL_H + 2)) == (0, 0, 0)
    second = first + CELL_H + 4 + 4
    assert image.getpixel((LABEL_W + CELL_W // 2, second + CELL_H // 2)) == GREEN
