"""The split-to-pass view of ``make regress`` (kit/rig/moved_to_pass.py): what a
Triton, HIP, CuteDSL, AITER FlyDSL or CPU GDN user meets when the fix moves the
backend into the pass. No scheduler needed: hand-made reports for the rules, the
committed newest-release tables for what the README states."""

from __future__ import annotations

import json

import pytest

from kit.paths import REGRESSION_RESULTS
from kit.rig import moved_to_pass, regress
from kit.vllm_tree import releases

pytestmark = pytest.mark.cpu

CASE = "B384-beyond-S544-r0-k1-U40"
PLAIN = regress.without_speculation()[CASE]
LOOKAHEAD_IDEAL = 528


def _cell(hit: int, steps: int, ideal: int = LOOKAHEAD_IDEAL) -> dict:
    return {"hit": hit, "ideal": ideal, "a_steps": steps}


def _turn(ends_u_p: list[int], sibling_u_p: list[int]) -> dict:
    return {
        "block": 64,
        "num_spec": 1,
        "user_len": 100,
        "chunk_ends_u_p": ends_u_p,
        "sibling_hit_u_p": sibling_u_p,
    }


def _report(regime: str, case: dict, plain: dict, turn: dict, mods: tuple[str, ...]) -> dict:
    """A report of ``regress.build``'s shape: the k = 1 case and its k = 0 twin."""
    return {
        "checkpoints": regime,
        "unit": 16,
        "mods": {"unpatched": [], "patched": list(mods)},
        "fix_effect": {"lookahead": {}},
        "rows": [
            {"case": CASE, "k": 1} | {f"{t}/lookahead": c for t, c in case.items()},
            {"case": PLAIN, "k": 0} | {f"{t}/lookahead": c for t, c in plain.items()},
        ],
        "later_turns": {"lookahead": [turn]},
    }


def _reports(grid_patched: dict, grid_turn: dict, mods=(moved_to_pass.MOVES_INTO_PASS,)):
    split = _report(
        "split",
        {"unpatched": _cell(384, 3), "patched": _cell(384, 3)},
        {"unpatched": _cell(384, 3, 544), "patched": _cell(384, 3, 544)},
        _turn([3, 4], [1040, 1056]),
        mods,
    )
    grid = _report(
        "internal-grid",
        {"unpatched": _cell(0, 1), "patched": grid_patched},
        {"unpatched": _cell(0, 1, 544), "patched": _cell(0, 1, 544)},
        grid_turn,
        mods,
    )
    return {"split": split, "internal-grid": grid}


def test_unpatched_split_against_patched_pass() -> None:
    """Patched k = 1 from the grid, unpatched from the split path; k = 0 stays split
    on both trees (the mod's gate), so its twin in the grid table is not read."""
    reports = _reports(_cell(368, 1), _turn([2, 3], [1040, 1056]))
    assert moved_to_pass.applies(reports)
    part = moved_to_pass.build(reports)["hashings"]["lookahead"]
    assert part["cold_steps"] == {"saved": 1, "same": 1}
    assert part["fix_effect"] == {"WORSE": 1, "same": 1}
    assert part["worse"] == [{"case": CASE, "unpatched": 384, "patched": 368}]
    # Without speculation the patched tree (split) resumes at 384: MTP alone costs 16.
    assert part["eagle_specific_loss"] == {"cases": 1, "tokens": 16}
    assert part["later_turns"] == {"turns": 1, "extra_steps": [], "sibling_lower": []}
    # No step is added, but a follow-up resumes lower than unpatched: that fails.
    assert moved_to_pass.failures(moved_to_pass.build(reports)) == [
        f"lookahead hashes: 1 WORSE: [{{'case': '{CASE}', 'unpatched': 384, 'patched': 368}}]"
    ]
    # Exporting the block boundary too: as unpatched, one step fewer, nothing fails.
    reports = _reports(_cell(384, 1), _turn([2, 3], [1040, 1056]))
    part = moved_to_pass.build(reports)["hashings"]["lookahead"]
    assert part["fix_effect"] == {"same": 2}
    assert part["eagle_specific_loss"] == {"cases": 0, "tokens": 0}
    assert moved_to_pass.failures(moved_to_pass.build(reports)) == []


def test_a_step_the_pass_adds_fails_the_run() -> None:
    reports = _reports(_cell(384, 4), _turn([2, 4], [1040, 1000]))
    view = moved_to_pass.build(reports)
    part = view["hashings"]["lookahead"]
    assert part["later_turns"]["extra_steps"] == ["B64-k1-user100"]
    assert part["later_turns"]["sibling_lower"] == ["B64-k1-user100"]
    assert moved_to_pass.failures(view) == [
        "lookahead hashes: later turns' siblings resume lower: ['B64-k1-user100']",
        "lookahead hashes: 1 cold prompts take a step more",
        "lookahead hashes: later turns take a step more: ['B64-k1-user100']",
    ]
    assert "| lookahead | 0 / 1 / 1 |" in "\n".join(moved_to_pass.render(view))


def test_only_where_the_patched_tree_moves_backends() -> None:
    reports = _reports(_cell(368, 1), _turn([2, 3], [1040, 1056]), mods=())
    assert not moved_to_pass.applies(reports)
    assert not moved_to_pass.applies({"split": reports["split"]})


def test_the_committed_newest_release_tables_hold_the_view() -> None:
    """The newest release's split table carries the view derived from its two regimes'
    tables, and it says what the README does: no step added, no follow-up or sibling
    resuming lower than unpatched, no EAGLE-specific loss, and steps saved."""
    base = releases.results_dir(REGRESSION_RESULTS, releases.newest())
    reports = {
        regime: json.loads((regress.regime_dir(base, regime) / "regression.json").read_text())
        for regime in (moved_to_pass.BEFORE, moved_to_pass.AFTER)
    }
    assert moved_to_pass.applies(reports)
    committed = reports["split"]["moved_to_pass"]
    assert committed == moved_to_pass.build(reports)
    assert moved_to_pass.failures(committed) == []
    for part in committed["hashings"].values():
        assert part["eagle_specific_loss"] == {"cases": 0, "tokens": 0}
        assert part["cold_steps"]["saved"] > 0
    # The split table carries the view as rendered from its own JSON.
    assert "\n".join(moved_to_pass.render(committed)) in (base / "regression.md").read_text()
