"""vLLM releases from pins.toml: trees by stage, and the regression table of each.

Tree-independent, so it runs once, in the patched-tree pass of `make test`. The
table tests download every release's sdist from PyPI once (sha256-checked,
cached in .cache/) and run the scheduler suite (kit/rig/regress_cli.py, the one
path for every release) on each later release's stock, unpatched and patched
trees in their own processes; a strict expected failure pins the unpatched
trees' measured probe loss.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import REGIMES, Case, Geometry, expected, lookahead_ideal
from kit.paths import REGRESSION_RESULTS
from kit.rig import later_turns, moved_to_pass, regress_cli
from kit.vllm_tree import releases

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


def test_every_release_is_pinned_by_sha256_not_by_an_index_url() -> None:
    # The sdist comes through pip's configured index; the pin guards its bytes.
    assert releases.known(), "pins.toml has no [releases]"
    for version, spec in releases.known().items():
        assert "sdist_url" not in spec, version
        assert re.fullmatch(r"[0-9a-f]{64}", spec["sdist_sha256"]), version


def test_unknown_release_is_refused_with_what_to_do() -> None:
    for refused in (
        lambda: releases.ensure_tree("0.0.1"),
        lambda: releases.tree("0.0.1", "pristine"),
        lambda: releases.resolve("0.0.1"),
    ):
        with pytest.raises(releases.ReleaseError, match=r"not in pins.toml.*sdist_sha256"):
            refused()
    assert regress_cli.run("0.0.1") == 2


def test_lookahead_ideal() -> None:
    # One lookahead token, nothing dropped: the last boundary B shares with its next token.
    assert lookahead_ideal(Case(Geometry(64, 16, 1), 1007, 1), 1) == 992
    assert lookahead_ideal(Case(Geometry(64, 16, 1), 1008, 1), 1) == 992
    assert lookahead_ideal(Case(Geometry(64, 16, 0), 1008, 1), 0) == 1008


def test_lookahead_model_reproduces_the_measured_0_33_facts() -> None:
    """The facts measured on 0.33.0 before the model had lookahead rules (B_phys
    2144, one-token probe): S = 4992 resumes at 4288, block-aligned S = 4288 at 0;
    the lookahead fix resumes one unit below S."""
    for shared, unpatched, patched in ((4992, 4288, 4976), (4288, 0, 4272), (4991, 4976, 4976)):
        case = Case(Geometry(2144, 16, 1), shared, 1)
        assert expected(case, patched=False, lookahead=1).hit == unpatched, shared
        assert expected(case, patched=True, lookahead=1).hit == patched, shared


LATER = sorted(v for v in releases.known() if releases.from_sdist(v))


def test_each_release_tree_differs_by_the_fix_alone() -> None:
    assert [m.name for m in releases.fixes(releases.pinned())] == ["fix-eagle-fine-prefix"]
    for version in LATER:
        fixes = [m.name for m in releases.fixes(version)]
        # 0.34.0 also gets the worker side of the fix's exports (FlashInfer GDN).
        worker = ["fix-eagle-fine-prefix-exports"] if version == "0.34.0" else []
        assert fixes == [*worker, "fix-eagle-fine-prefix-lookahead"]
    for version in releases.known():
        assert releases.stages(version) == ["pristine", "unpatched", "patched"]
    # What mods-drift compares against carries no mod at all.
    assert not releases.release_mods(releases.newest(), "pristine")


@pytest.fixture(scope="module", params=LATER)
def release_table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each later release's measured table: its real Scheduler on all 243 geometries,
    every tree, lookahead and legacy hashes (one run per release, ~1 min), written
    where --out says."""
    version = request.param
    out = tmp_path_factory.mktemp(f"regress-{version}")
    # The internal-checkpoint regimes on the newest release (the one GB10 and Hopper
    # run them on); the split path on every release.
    regimes = REGIMES if version == releases.newest() else ("split",)
    assert regress_cli.run(version, out=out, quiet=True, regimes=regimes) == 0
    table = json.loads((out / "regression.json").read_text())
    table["internal"] = {
        regime: json.loads((out / regime / "regression.json").read_text())
        for regime in regimes
        if regime != "split"
    }
    return table


def test_the_geometry_model_predicts_every_release_hit(release_table: dict) -> None:
    """Exact: every case, both modelled trees, both hashings, every regime measured
    resume where the model says (verdict DIFFERS otherwise), and never from a stale
    state; the cache geometry is the same on every tree."""
    for table in (release_table, *release_table["internal"].values()):
        assert table["hashings"] == ["lookahead", "legacy"]
        assert list(table["summary"]) == [
            f"{stage}/{h}" for stage in ("unpatched", "patched") for h in table["hashings"]
        ]
        for key, summary in table["summary"].items():
            assert set(summary) <= {"ok", "loss"}, (table["vllm_version"], key, summary)
            assert sum(summary.values()) == len(all_cases()), key
        assert table["geometry_identical"], table["geometry_differs"]
        assert "WORSE" not in str(table["fix_effect"])


def _probes(report: dict, key: str) -> dict[str, str]:
    return {
        row["case"]: row[key]["verdict"]
        for row in report["rows"]
        if row["k"] > 0 and row["case"].endswith("-U1")
    }


def test_lookahead_probe_loss_is_where_it_was_measured(release_table: dict) -> None:
    """Unpatched with lookahead hashes the "." probe is fine at S mod H = 7 and 15
    and loses at S mod H = 0 (a block or everything)."""
    rows = {row["case"]: row for row in release_table["rows"]}
    for case_id, verdict in _probes(release_table, "unpatched/lookahead").items():
        want = "loss" if rows[case_id]["S_mod_H"] == 0 else "ok"
        assert verdict == want, (case_id, verdict)


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(
            "unpatched",
            marks=pytest.mark.xfail(
                strict=True,
                reason="measured on 0.33.0 and 0.34.0: with lookahead hashes a one-token "
                "probe at S mod H = 0 falls back a block or to 0",
            ),
        ),
        "patched",
    ],
)
def test_every_context_load_probe_resumes_at_the_lookahead_ideal(
    release_table: dict, tree: str
) -> None:
    verdicts = _probes(release_table, f"{tree}/lookahead")
    losing = sorted(case for case, verdict in verdicts.items() if verdict != "ok")
    assert not losing, losing


def test_legacy_hashes_behave_as_0_32(release_table: dict) -> None:
    """disable_lookahead_block_hashes (and any KV connector) gives the 0.32.0
    picture: the EAGLE-specific loss per tree equals the pinned release's, whose only
    hashing is the legacy one (the committed table, the same code path)."""
    pinned = json.loads((ROOT / "results" / "regression" / "regression.json").read_text())
    assert pinned["hashings"] == ["legacy"]
    loss = release_table["eagle_specific_loss"]
    for key in ("unpatched/legacy", "patched/legacy"):
        assert loss[key] == pinned["eagle_specific_loss"][key], key


def test_fix_leaves_speculation_no_loss_of_its_own(release_table: dict) -> None:
    """With either hashing the patched tree resumes, in every speculative case, no
    lower than the same A and B without speculation allow (less EAGLE's unit with
    legacy hashes)."""
    for hashing in ("lookahead", "legacy"):
        losing = [
            row["case"]
            for row in release_table["rows"]
            if (row[f"patched/{hashing}"]["eagle_loss"] or 0) > 0
        ]
        assert not losing, (release_table["vllm_version"], hashing, losing)
    assert release_table["eagle_specific_loss"]["unpatched/lookahead"]["cases"] > 0


def test_a_later_turn_pays_nothing_for_a_state_the_fix_leaves_out(release_table: dict) -> None:
    """A conversation's later turn (kit/rig/later_turns.py) on every release, both
    hashings, every regime measured: the fix keeps the turn's predecessor only
    FIX_MIN_GAIN or more above the turn's hit, where a sibling then resumes;
    closer, the turn takes no more chunk ends than on the unpatched tree (fewer
    where the fix exports its prompt checkpoint) and the sibling resumes where the
    turn did. Both kinds occur."""
    for table in (release_table, *release_table["internal"].values()):
        for hashing, rows in table["later_turns"].items():
            where = (table["vllm_version"], table["checkpoints"], hashing)
            assert [r for r in rows if r["verdict"] != "ok"] == [], where
            assert {r["kept"] for r in rows} == {True, False}, where
            left_out = [r for r in rows if not r["kept"]]
            assert all(r["chunk_ends_u_p"][0] >= r["chunk_ends_u_p"][1] for r in left_out)
            if table["checkpoints"] == "internal-1":
                # Some turns the fix leaves a state in take the internal path (vLLM
                # exports their checkpoint from inside the step), so the skip in
                # the fix's decline of that export is exercised. (On the 64-token
                # grid of internal-grid their checkpoints lie off it.)
                assert any(r["exports_u_p"][0] for r in left_out), where


def test_a_kept_state_costs_no_step_where_the_layer_exports_it(release_table: dict) -> None:
    """Where the tree writes the fix's states inside the forward pass (0.34.0's
    patched tree, fix-eagle-fine-prefix-exports), on both internal regimes (any
    offset; the 64-token grid, where a state off it is a short tail in the same
    pass), a later turn that keeps its state ends no more chunks than on the
    unpatched tree. On the split path the layer exports nothing, so it may."""
    internal = release_table["internal"]
    if not internal or "fix-eagle-fine-prefix-exports" not in next(iter(internal.values()))[
        "mods"
    ].get("patched", []):
        pytest.skip("this release's patched tree takes the fix's states as chunk ends")
    assert set(internal) == {"internal-1", "internal-grid"}
    for regime, table in internal.items():
        for hashing, rows in table["later_turns"].items():
            kept = [r for r in rows if r["kept"]]
            assert kept and all(r["extra_steps"] == 0 for r in kept), (regime, hashing, kept)
        # Cold prompts (every grid case's producer): no chunk end of the fix's own.
        for hashing, extra in table["cold_extra_steps"].items():
            assert extra == {"max": 0, "cases": 0}, (regime, hashing, extra)
    split = [r for rows in release_table["later_turns"].values() for r in rows if r["kept"]]
    assert split and all(r["extra_steps"] >= 1 for r in split)
    assert all(e["cases"] > 0 for e in release_table["cold_extra_steps"].values())


def test_the_split_to_pass_view_is_the_committed_one(release_table: dict) -> None:
    """Where the patched tree moves a GDN backend (Triton, HIP, CuteDSL, AITER
    FlyDSL, CPU) into the pass, the freshly measured split table pairs unpatched
    split with patched grid as the committed table does (what the README and
    docs/results.md quote), and no cold prompt or later turn takes a step more
    there."""
    version = release_table["vllm_version"]
    committed = json.loads(
        (releases.results_dir(REGRESSION_RESULTS, version) / "regression.json").read_text()
    )
    if "moved_to_pass" not in committed:
        assert "moved_to_pass" not in release_table
        pytest.skip(f"{version}'s patched tree moves no backend into the pass")
    assert release_table["moved_to_pass"] == committed["moved_to_pass"]
    assert moved_to_pass.failures(release_table["moved_to_pass"]) == []


# Run in a release tree: the later-turn rows of the internal-1 regime, lookahead
# hashes; argv: model dir, output file, "fix" or "plain", "cut" or "no-cut" (the
# fix's skip of states just above a resumed prompt's hit switched off).
_LATER_TURNS = """
import json, sys
from pathlib import Path
import kit.vllm_tree.release_plugin  # noqa: F401
import vllm.v1.core.sched.scheduler as scheduler
import vllm.v1.core.single_type_kv_cache_manager as managers
from kit.rig import later_turns
model, out, fix, cut = sys.argv[1:]
if cut == "no-cut":
    # Both readers: the scheduler's stops and the manager's planned exports.
    scheduler.is_mamba_eagle_fix_state_skipped = lambda position, resume: False
    if hasattr(managers, "is_mamba_eagle_fix_state_skipped"):
        managers.is_mamba_eagle_fix_state_skipped = lambda position, resume: False
rows = later_turns.measure(Path(model), fix == "fix", True, "internal-1")
Path(out).write_text(json.dumps(rows))
"""


def _later_turn_rows(stage: str, cut: str, model: Path, out: Path) -> list[dict]:
    tree = releases.tree(releases.newest(), stage)
    fix = "fix" if stage == "patched" else "plain"
    cmd = [sys.executable, "-c", _LATER_TURNS, str(model), str(out), fix, cut]
    subprocess.run(cmd, check=True, env=tree.env(VLLM_LOGGING_LEVEL="ERROR"), cwd=ROOT)
    return json.loads(out.read_text())


def test_the_later_turn_check_fails_without_the_cut(tmp_path: Path) -> None:
    """The check above is not vacuous: on the newest release (internal-1, lookahead
    hashes), with the fix's skip switched off, the turns with a short message pay
    for the state (a chunk end, a declined export, or an export of its own) and
    their sibling resumes there; every row that fails is one the fix leaves out."""
    from kit.weights.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    plain = _later_turn_rows("unpatched", "cut", model, tmp_path / "plain.json")
    without = _later_turn_rows("patched", "no-cut", model, tmp_path / "no-cut.json")
    rows = later_turns.verdicts(plain, without)
    failing = [r for r in rows if r["verdict"] != "ok"]
    assert failing and all(not r["kept"] for r in failing), rows
    assert {r["block"] for r in failing} == set(later_turns.BLOCKS), failing


@pytest.mark.parametrize("tree", ["unpatched", "patched"])
def test_the_stress_finds_no_wrong_state_on_the_newest_release(tree: str) -> None:
    """The multi-request stress (kit/rig/stress.py) on every checkpoint path of the
    newest release's trees, which carry fix-mamba-mid-block-resume-stop."""
    from kit.rig import stress

    assert stress.main(["--vllm", releases.newest(), "--tree", tree, "--seeds", "2"]) == 0
