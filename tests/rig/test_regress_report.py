"""The regression report's EAGLE-specific loss, verdicts and failure rule (no scheduler
needed): one vocabulary and one rule for every release (kit/rig/regress.py)."""

from __future__ import annotations

import pytest

from kit.geometry.geometry_model import Case, Geometry
from kit.rig.loss_sweep import random_cases, sweep
from kit.rig.regress import eagle_specific_loss, failures, fix_effect, verdict

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


def _row(hit: int, state_ok: bool = True, lookahead: int = 0) -> dict:
    return {"hit": hit, "state_ok": state_ok, "hash_lookahead": lookahead}


def test_verdicts_are_ok_loss_differs_or_stale_state() -> None:
    # B384-beyond-S544-r0, U = 40: 0 unpatched, 368 patched (the state without
    # speculation allows 384 - 16); the ideal 528 needs a state nobody keeps.
    case = Case(Geometry(384, 16, 1), 544, 40)
    assert verdict(case, _row(0), patched=False) == "loss"
    assert verdict(case, _row(368), patched=True) == "loss"
    # A result the geometry model does not predict is never dressed up.
    assert verdict(case, _row(384), patched=True) == "DIFFERS"
    assert verdict(case, _row(368, state_ok=False), patched=True) == "STALE STATE"
    # B64-boundary-S64-r0, U = 40: 48 = the ideal patched.
    assert verdict(Case(Geometry(64, 16, 1), 64, 40), _row(48), patched=True) == "ok"
    # Stock (patched None) is not what the model describes: only against the ideal.
    assert verdict(case, _row(384), patched=None) == "loss"
    assert verdict(case, _row(0, state_ok=False), patched=None) == "STALE STATE"


def test_fix_effect_tells_an_improvement_short_of_the_ideal_from_a_fix() -> None:
    assert fix_effect(ideal=528, unpatched=0, patched=368) == "better"
    assert fix_effect(ideal=48, unpatched=0, patched=48) == "fixed"
    assert fix_effect(ideal=48, unpatched=48, patched=48) == "same"
    assert fix_effect(ideal=48, unpatched=48, patched=0) == "WORSE"


def _report(**changes) -> dict:
    report = {
        "summary": {"unpatched/legacy": {"ok": 2, "loss": 1}, "patched/legacy": {"ok": 3}},
        "stock": {"stock/legacy": {"ok": 1, "STALE STATE": 2}},
        "fix_effect": {"legacy": {"fixed": 1, "same": 2}},
        "later_turns_summary": {"legacy": {"ok": 18}},
        "geometry_identical": True,
        "geometry_differs": [],
    }
    return report | changes


def test_one_failure_rule_for_every_release() -> None:
    """Stock never fails a run; unpatched or patched off the model, a stale state,
    a case the fix makes worse, a later turn not ok or a geometry that differs do."""
    assert failures(_report()) == []
    bad = _report(summary={"patched/lookahead": {"ok": 1, "DIFFERS": 2, "STALE STATE": 1}})
    assert failures(bad) == ["patched/lookahead: 2 DIFFERS", "patched/lookahead: 1 STALE STATE"]
    assert failures(_report(fix_effect={"legacy": {"WORSE": 1}}))
    assert failures(_report(later_turns_summary={"legacy": {"ok": 1, "stale state": 1}}))
    assert failures(_report(geometry_identical=False, geometry_differs=["stock/legacy"])) == [
        "cache geometry differs on stock/legacy"
    ]


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
                "case": "B64-boundary-S64-r0-k1-U40",
                "k": 1,
                "unpatched/legacy": {"hit": 0, "ideal": 48, "eagle_loss": 48},
                "patched/legacy": {"hit": 48, "ideal": 48, "eagle_loss": 0},
                "fix_effect/legacy": "fixed",
            },
        ]
    }
    strips = strips_of(table)
    assert strips == [("unpatched/legacy", [(0, 48, True)]), ("patched/legacy", [(48, 48, False)])]
    path = draw("t", [("split", strips)], tmp_path / "grid.png")
    image = Image.open(path).convert("RGB")
    first = 40 + 22  # the title, then the regime's heading
    assert image.getpixel((LABEL_W + CELL_W // 2, first + CELL_H // 2)) == RED
    assert image.getpixel((LABEL_W + CELL_W // 2, first + CELL_H + 2)) == (0, 0, 0)
    second = first + CELL_H + 4 + 4
    assert image.getpixel((LABEL_W + CELL_W // 2, second + CELL_H // 2)) == GREEN


def _measured(patched: bool, shift: int = 0) -> dict:
    """A tree's measurement as the geometry model predicts it (legacy hashing), the
    first case's hit moved by ``shift``."""
    from kit.geometry.geometry_cases import all_cases
    from kit.geometry.geometry_model import expected

    rows = {}
    for i, (case_id, case) in enumerate(all_cases()):
        model = expected(case, patched)
        rows[case_id] = {
            "hit": model.hit + (shift if i == 0 else 0),
            "state_ok": True,
            "hash_lookahead": 0,
            "fa_match": model.fa_match,
            "fa_eagle": model.fa_eagle,
            "a_chunk_ends": list(model.chunk_ends),
        }
    return {"rows": rows, "geometry": {"B64-k1": {"num_blocks": 4096}}, "later_turns": []}


def test_the_image_tables_take_the_same_path() -> None:
    """The container flow's table (two images, patched-ness from their records' mods)
    is built, judged and rendered by the same code as every release's."""
    from kit.rig import regress
    from kit.vllm_tree import pins

    release = pins.get("vllm.version")
    records = {
        "unpatched": {"vllm_version": release, "mods": [{"name": "fix-cow-aliased-kv-copy"}]},
        "patched": {"vllm_version": release, "mods": [{"name": "fix-eagle-fine-prefix"}]},
    }
    measured = {}
    for stage, record in records.items():
        data = _measured(patched=stage == "patched") | {"mods_record": record}
        data["tree"] = regress.image_tree_record(stage, record)
        measured[(stage, regress.hashing_of(data))] = data
    report = regress.build(release, measured)
    assert list(report["summary"]) == ["unpatched/legacy", "patched/legacy"]
    assert report["fix_effect"]["legacy"].get("WORSE", 0) == 0
    assert report["fix_effect"]["legacy"]["fixed"] > 0
    assert regress.failures(report) == []
    assert "# Regression on vLLM" in regress.render(report)
    # A hit the model does not predict fails the run, on any release.
    measured[("patched", "legacy")]["rows"] = _measured(True, shift=16)["rows"]
    assert regress.failures(regress.build(release, measured)) == ["patched/legacy: 1 DIFFERS"]


def test_a_retention_is_read_as_dense_0_or_a_count_of_blocks() -> None:
    from kit.rig import regress

    assert regress.parse_retention("dense") is None
    assert regress.parse_retention("0") == 0
    assert regress.parse_retention("4") == 4
    # N blocks: vLLM's interval is N times each case's block size (the grid's differ).
    assert regress.retention_interval(4, 64) == 256
    assert regress.retention_interval(4, 2144) == 4 * 2144
    assert regress.retention_interval(0, 64) == 0
    assert regress.retention_interval(None, 64) is None
    for word in (None, 0, 4):
        assert regress.parse_retention(regress.retention_arg(word)) == word
    for bad in ("-1", "abc", "", "1.5", "+4", "None"):
        with pytest.raises(regress.RetentionError, match="RETENTION=0"):
            regress.parse_retention(bad)


def test_a_retention_other_than_the_default_has_a_folder_of_its_own(tmp_path) -> None:
    from kit.rig import regress
    from kit.vllm_tree import releases

    default = regress.DEFAULT_RETENTION
    for version in (releases.pinned(), releases.newest()):
        base = releases.results_dir(tmp_path, version)
        assert releases.regression_dir(tmp_path, version, default, default) == base
        assert releases.regression_dir(tmp_path, version, 0, None) == base / "retention-0"
        assert releases.regression_dir(tmp_path, version, 4, None) == base / "retention-4-blocks"
        assert releases.regression_dir(tmp_path, version, None, 0) == base / "retention-dense"
    assert releases.regression_dir(tmp_path, releases.pinned(), 0, None) == (
        tmp_path / "retention-0"
    )


@pytest.mark.parametrize("bad", ["-1", "abc"])
def test_make_regress_refuses_a_bad_retention_before_anything(tmp_path, capsys, bad) -> None:
    from kit.rig import regress_cli

    assert regress_cli.main(["--retention", bad, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: retention") and "RETENTION=0" in err
    assert not any(tmp_path.iterdir())


def test_a_table_says_the_retention_it_ran_at() -> None:
    """Rows measured at retention 0 (the grid's hits are the dense ones there:
    docs/retention.md) are judged at it, the report records it, and the Markdown
    names it in its first lines with the later turns' (dense)."""
    from kit.rig import regress
    from kit.vllm_tree import pins

    release = pins.get("vllm.version")
    record = {"vllm_version": release, "mods": []}
    measured = {}
    for stage in ("unpatched", "patched"):
        data = _measured(patched=stage == "patched") | {"mods_record": record, "retention": 0}
        for row in data["rows"].values():
            row["retention"] = 0
        data["tree"] = regress.image_tree_record(stage, record) | {"patched": stage == "patched"}
        measured[(stage, "legacy")] = data
    report = regress.build(release, measured)
    assert report["retention"] == 0 and report["later_turns_retention"] is None
    assert regress.failures(report) == []
    head = regress.render(report).splitlines()[:3]
    assert head[0].endswith("retention 0")
    assert "the grid at 0 (vllm serve's default" in head[2]
    assert "the later turns at dense" in head[2]
    # A table from before retention was a dimension reads as dense.
    for data in measured.values():
        del data["retention"]
        for row in data["rows"].values():
            del row["retention"]
    assert (
        regress.render(regress.build(release, measured)).splitlines()[0].endswith("retention dense")
    )
    # Trees measured at different retentions make no table.
    measured[("patched", "legacy")]["retention"] = 4
    with pytest.raises(RuntimeError, match="different retentions"):
        regress.build(release, measured)
