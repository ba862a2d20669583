"""`make regress`: measure every geometry on the unpatched and the patched tree, report both.

Each tree is measured in its own process (vLLM can be imported once per
process). Results: a terminal table, ``regression.json`` and ``regression.md``
under ``results/regression/``. Exit status 1 when the patched tree misses an
expectation or does worse than the unpatched one anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kit import schema
from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import Case, expected, lookahead_ideal
from kit.rig import later_turns
from kit.vllm_tree import pins, trees

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "results" / "regression"


def measure(
    model_dir: Path, fix: bool, lookahead_hashes: bool = True, checkpoints: str = "split"
) -> dict:
    """Run in a process whose ``vllm`` is the tree under test; ``checkpoints``: the regime."""
    import vllm

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        # A release tree from its sdist (kit/vllm_tree/releases.py).
        import kit.vllm_tree.release_plugin  # noqa: F401
    from kit.rig.sched_harness import cache_geometry, run_case

    rows = {}
    geometry = {}
    for case_id, case in all_cases(checkpoints):
        rig, a, b, bounds = run_case(model_dir, case, fix=fix, lookahead_hashes=lookahead_hashes)
        rows[case_id] = {
            "a_chunk_ends": rig.chunk_ends[a.request_id],
            "fa_match": bounds.fa_match,
            "fa_eagle": bounds.fa_eagle,
            "hit": b.hit,
            "state_ok": b.resumed_from_own_prefix(),
            "fa_partials": rig.partial_entries_of(a.request_id, 0),
            "mamba_partials": rig.partial_entries_of(a.request_id, 1),
            "hash_lookahead": getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0),
            # Whether the layer took the fix's states as exports (else chunk ends).
            "layer_extra_exports": bool(
                getattr(
                    rig.kv_cache_config.kv_cache_groups[1].kv_cache_spec,
                    "prefill_checkpoint_extra_exports",
                    False,
                )
            ),
        }
        geometry[f"B{case.block}-k{case.num_spec}"] = cache_geometry(rig)
    return {
        "vllm_file": vllm.__file__,
        "checkpoints": checkpoints,
        "rows": rows,
        "geometry": geometry,
        "later_turns": later_turns.measure(model_dir, fix, lookahead_hashes, checkpoints),
    }


def measure_on(
    tree: trees.Tree,
    model_dir: Path,
    fix: bool,
    legacy_hashes: bool = False,
    checkpoints: str = "split",
) -> dict:
    """Every geometry, measured in a subprocess that imports exactly this tree's vllm."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            "kit.rig.regress_cli",
            "measure",
            "--model-dir",
            str(model_dir),
        ]
        cmd += ["--out", out.name, "--checkpoints", checkpoints]
        cmd += ["--fix"] if fix else []
        cmd += ["--legacy-hashes"] if legacy_hashes else []
        subprocess.run(cmd, check=True, env=tree.env(VLLM_LOGGING_LEVEL="ERROR"), cwd=ROOT)
        data = schema.unstamp("regress-measure", json.loads(Path(out.name).read_text()), out.name)
    if not data["vllm_file"].startswith(str(tree.package)):
        raise RuntimeError(f"{tree}: measured {data['vllm_file']}, not this tree")
    data["mods_record"] = tree.mods_record()
    return data


def measure_many(
    runs: dict[Hashable, tuple[trees.Tree, bool, bool, str]], model_dir: Path
) -> dict[Hashable, dict]:
    """``measure_on(tree, model_dir, fix, legacy_hashes, checkpoints)`` for each key, as
    many at once as there are cores: each is its own single-threaded process."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = {
            key: pool.submit(measure_on, tree, model_dir, fix, legacy, regime)
            for key, (tree, fix, legacy, regime) in runs.items()
        }
        return {key: job.result() for key, job in jobs.items()}


def verdict(case: Case, unpatched: int, patched: int) -> str:
    if (unpatched, patched) != (
        expected(case, patched=False).hit,
        expected(case, patched=True).hit,
    ):
        return "UNEXPECTED"
    if patched < unpatched:
        return "WORSE"
    if unpatched < case.ideal <= patched:
        return "fixed"
    if patched == case.ideal:
        return "ok"
    if patched > unpatched:
        return "better"  # up to the state without speculation, short of the ideal
    return "known loss"


def eagle_specific_loss(
    case: Case, hit: int, hit_without_spec: int, lookahead: int = 0
) -> int | None:
    """What speculation alone costs: (the same A and B without it, less what EAGLE
    is entitled to) - hit.

    None without speculation. With the 0.32.0 hashing EAGLE is entitled to drop
    one unit; with lookahead hashes (0.33.0 on) to stop at the last boundary B
    shares together with its lookahead tokens. Anything beyond is lost only
    because drafting is on.
    """
    if not case.eagle:
        return None
    if lookahead:
        return min(hit_without_spec, lookahead_ideal(case, lookahead)) - hit
    return max(hit_without_spec - case.unit, 0) - hit


def without_speculation() -> dict[str, str]:
    """Each case id -> the id of the same geometry with k = 0."""
    cases = all_cases()
    plain = {(c.block, c.shared, c.tail): cid for cid, c in cases if c.num_spec == 0}
    return {cid: plain[(c.block, c.shared, c.tail)] for cid, c in cases}


def loss_totals(losses: list[int | None]) -> dict[str, int]:
    """Cases that lose tokens to speculation alone, and how many tokens in all."""
    return {
        "cases": sum((x or 0) > 0 for x in losses),
        "tokens": sum(max(x or 0, 0) for x in losses),
    }


def build_report(unpatched: dict, patched: dict, checkpoints: str = "split") -> dict:
    rows = []
    plain_of = without_speculation()
    for case_id, case in all_cases(checkpoints):
        u, p = unpatched["rows"][case_id], patched["rows"][case_id]
        want = expected(case, patched=True)
        plain = plain_of[case_id]
        rows.append(
            {
                "case": case_id,
                "B_phys": case.block,
                "S": case.shared,
                "S_mod_H": case.shared % case.unit,
                "k": case.num_spec,
                "U": case.tail,
                "ideal": case.ideal,
                "heuristic_covers": case.heuristic_covers,
                "expected": want.hit,
                "expected_unpatched": expected(case, patched=False).hit,
                "unpatched": u["hit"],
                "patched": p["hit"],
                "eagle_loss_unpatched": eagle_specific_loss(
                    case, u["hit"], unpatched["rows"][plain]["hit"]
                ),
                "eagle_loss_patched": eagle_specific_loss(
                    case, p["hit"], patched["rows"][plain]["hit"]
                ),
                "unpatched_fa": [u["fa_match"], u["fa_eagle"]],
                "patched_fa": [p["fa_match"], p["fa_eagle"]],
                "state_ok": u["state_ok"] and p["state_ok"],
                "verdict": verdict(case, u["hit"], p["hit"])
                if u["state_ok"] and p["state_ok"]
                else "STALE STATE",
            }
        )
    later = later_turns.verdicts(unpatched["later_turns"], patched["later_turns"])
    return {
        "unit": all_cases()[0][1].unit,
        "checkpoints": checkpoints,
        "rows": rows,
        "summary": dict(Counter(r["verdict"] for r in rows)),
        "eagle_specific_loss": {
            tree: loss_totals([r[f"eagle_loss_{tree}"] for r in rows])
            for tree in ("unpatched", "patched")
        },
        "later_turns": later,
        "later_turns_summary": later_turns.summary(later),
        "geometry_identical": unpatched["geometry"] == patched["geometry"],
        "geometry": patched["geometry"],
        "run": {
            "trees": {"unpatched": unpatched["mods_record"], "patched": patched["mods_record"]},
            "pins_sha256": pins.file_sha256(),
            "vllm_version": pins.get("vllm.version"),
        },
    }


REGIME_NOTE = (
    "Checkpoint regimes: `split` = the scheduler ends a prefill chunk where a Mamba/GDN "
    "state is kept (vLLM's CPU and Triton GDN paths, HIP GDN on gfx1151); `internal-1` = the "
    "layer exports the state from inside one forward pass at any offset (Mamba2, e.g. "
    "Nemotron-H); `internal-grid` = the same on lcm(H, 64) (Qwen GDN on FlashInfer: 0.34.0 "
    "on Hopper, Blackwell and GB10)."
)


def regime_dir(out: Path, regime: str) -> Path:
    """The split tables stay where they always were; the internal ones beside them."""
    return out if regime == "split" else out / regime


COLUMNS = (
    "case",
    "ideal",
    "unpatched",
    "patched",
    "eagle_loss_unpatched",
    "eagle_loss_patched",
    "heuristic_covers",
    "verdict",
)


def render_markdown(report: dict) -> str:
    from tabulate import tabulate

    lines = [
        f"# Regression: follow-up resume under EAGLE/MTP, vLLM {report['run']['vllm_version']}, "
        f"checkpoint regime `{report.get('checkpoints', 'split')}`",
        "",
        REGIME_NOTE,
        "",
        f"H = {report['unit']}. `ideal` = floor(S/H)*H, less H under EAGLE (k > 0). "
        "`heuristic_covers` = U < 2H - (S mod H) under EAGLE.",
        "",
        f"Summary: {report['summary']}; cache geometry identical across trees: "
        f"{report['geometry_identical']}.",
        "",
        "`eagle_loss_*` = (the same A and B without speculation, less H) - hit: what "
        "speculation alone costs. Cases with a loss and tokens lost, per tree: "
        f"{report['eagle_specific_loss']}.",
        "",
        tabulate(
            [[r[c] for c in COLUMNS] for r in report["rows"]], headers=COLUMNS, tablefmt="github"
        ),
        "",
        *later_turns.render("0.32.0 hashing", report.get("later_turns", [])),
    ]
    return "\n".join(lines)
