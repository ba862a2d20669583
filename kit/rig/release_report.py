"""`make regress VLLM=<release>`: the geometry table on a later vLLM release.

The release runs from its sdist (``kit/vllm_tree/releases.py``) in its own process,
twice: with its default hashing (lookahead block hashes for EAGLE/MTP: each key
also covers the L tokens the drafter reads past it, no one-unit drop) and with
``disable_lookahead_block_hashes`` (the 0.32.0 hashing, which KV connectors
also get). Expectations:

- every case, tree and hashing has an exact expectation from the geometry
  model (``expected(case, patched, lookahead=L)``; L = 0 is the 0.32.0 model):
  a hit elsewhere is ``DIFFERS``;
- the ideal is the last hash boundary B shares, less EAGLE's unit with legacy
  hashes, or *including* the L lookahead tokens with lookahead hashes,
  ``floor((S - L) / H) * H``; a predicted hit below it is ``loss``, at it ``ok``.

Both modes report the EAGLE-specific loss: the hit without speculation, less
what EAGLE is entitled to (one unit; with lookahead hashes down to the ideal),
minus the hit. ``STALE STATE`` (B resumed from a state not made by its own
prefix) fails the run. Results: ``results/regression/<release>/regression.{json,md}``.

Beside the two modelled trees, the release as installed ("stock", the pristine
tree: no mod at all) is measured too and shown as columns of its own. The
geometry model describes the unpatched tree, which carries the defect fixes, so
stock is compared with unpatched, case by case (``= unpatched`` or ``differs``;
``STALE STATE`` where a defect fix keeps a state from being published wrong);
stock never fails the run.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from kit import bundle
from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import REGIMES, Case, expected, lookahead_ideal
from kit.rig import later_turns
from kit.rig.regress import (
    REGIME_NOTE,
    eagle_specific_loss,
    loss_totals,
    measure_many,
    regime_dir,
    without_speculation,
)
from kit.vllm_tree import pins, releases

ROOT = Path(__file__).resolve().parents[2]
MODES = ("lookahead", "legacy")


def verdict(case: Case, stage: str, row: dict) -> str:
    if not row["state_ok"]:
        return "STALE STATE"
    want = expected(as_measured(case, row), stage == "patched", row["hash_lookahead"]).hit
    if row["hit"] != want:
        return "DIFFERS"
    return "ok" if row["hit"] >= lookahead_ideal(case, row["hash_lookahead"]) else "loss"


def as_measured(case: Case, row: dict) -> Case:
    """The case with the layer the rig declared: a release whose builder writes no
    extra states (0.33.0) takes the fix's states as chunk ends."""
    extra = row.get("layer_extra_exports", case.geometry.layer_extra_exports)
    return replace(case, geometry=replace(case.geometry, layer_extra_exports=extra))


STOCK = "pristine"  # the stage name of the release as installed


def stock_verdict(row: dict, unpatched: dict | None) -> str:
    """Stock against the unpatched tree's measured hit (the model is unpatched's)."""
    if not row["state_ok"]:
        return "STALE STATE"
    if unpatched is None:
        return "-"
    return "= unpatched" if row["hit"] == unpatched["hit"] else "differs"


def column(stage: str, mode: str) -> str:
    return f"{'stock' if stage == STOCK else stage}/{mode}"


def build(version: str, measured: dict[tuple[str, str], dict], checkpoints: str = "split") -> dict:
    cases = all_cases(checkpoints)
    plain_of = without_speculation()
    rows = []
    for case_id, case in cases:
        line: dict = {"case": case_id, "k": case.num_spec, "S_mod_H": case.shared % case.unit}
        for (stage, mode), data in measured.items():
            row = data["rows"][case_id]
            base = data["rows"][plain_of[case_id]]["hit"]
            unpatched = measured.get(("unpatched", mode), {}).get("rows", {}).get(case_id)
            line[column(stage, mode)] = {
                "hit": row["hit"],
                "ideal": lookahead_ideal(case, row["hash_lookahead"]),
                "eagle_loss": eagle_specific_loss(case, row["hit"], base, row["hash_lookahead"]),
                "verdict": (
                    stock_verdict(row, unpatched) if stage == STOCK else verdict(case, stage, row)
                ),
            }
        rows.append(line)
    keys = [column(stage, mode) for stage, mode in measured if stage != STOCK]
    stock_keys = [column(stage, mode) for stage, mode in measured if stage == STOCK]
    later = {
        mode: later_turns.verdicts(
            measured[("unpatched", mode)]["later_turns"], measured[("patched", mode)]["later_turns"]
        )
        for mode in MODES
        if ("unpatched", mode) in measured and ("patched", mode) in measured
    }
    return {
        "vllm_version": version,
        "checkpoints": checkpoints,
        "pinned_version": pins.get("vllm.version"),
        "mods": {
            stage: [m.name for m in releases.release_mods(version, stage)]
            for stage in ("unpatched", "patched")
        },
        "stock": {k: dict(Counter(r[k]["verdict"] for r in rows)) for k in stock_keys},
        "unit": cases[0][1].unit,
        "rows": rows,
        "summary": {k: dict(Counter(r[k]["verdict"] for r in rows)) for k in keys},
        "eagle_specific_loss": {k: loss_totals([r[k]["eagle_loss"] for r in rows]) for k in keys},
        "sdist_sha256": releases.release_pins(version)["sdist_sha256"],
        "later_turns": later,
        "later_turns_summary": {mode: later_turns.summary(rows) for mode, rows in later.items()},
    }


def render(report: dict) -> str:
    from tabulate import tabulate

    keys = [*report.get("stock", {}), *report["summary"]]
    headers = ["case"] + [f"{k} hit (ideal)" for k in keys] + [f"{k}" for k in keys]
    body = [
        [r["case"]]
        + [f"{r[k]['hit']} ({r[k]['ideal']})" for k in keys]
        + [r[k]["verdict"] for k in keys]
        for r in report["rows"]
    ]
    mods_line = "; ".join(
        f"{stage}: {', '.join(names) or 'none'}" for stage, names in report["mods"].items()
    )
    if not report["mods"]["patched"]:
        mods_line += " (no fix made for this release: unpatched only)"
    return "\n".join(
        [
            f"# Regression on vLLM {report['vllm_version']} (sdist sha256 "
            f"{report['sdist_sha256'][:12]}), checkpoint regime "
            f"`{report.get('checkpoints', 'split')}`",
            "",
            __doc__.strip(),
            "",
            REGIME_NOTE,
            "",
            f"Mods: stock: none (the release as installed); {mods_line}.",
            "",
            f"Stock against unpatched: {report.get('stock', {})}",
            "",
            f"Summary: {report['summary']}",
            "",
            f"EAGLE-specific loss (cases, tokens): {report['eagle_specific_loss']}",
            "",
            tabulate(body, headers=headers, tablefmt="github"),
            "",
            *(
                line
                for mode, rows in report.get("later_turns", {}).items()
                for line in later_turns.render(f"{mode} hashes", rows)
            ),
        ]
    )


def run(
    version: str,
    quiet: bool = False,
    out_root: Path | None = None,
    regimes: tuple[str, ...] = REGIMES,
) -> int:
    from kit.weights.tiny_model import write_tiny_model

    try:
        stage_list = [STOCK, *releases.stages(version)]
    except releases.ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    # Trees first, one at a time: a missing one is built, and two builders must not race.
    tree_of = {stage: releases.tree(version, stage) for stage in stage_list}
    runs = {
        (stage, mode, regime): (tree_of[stage], stage == "patched", mode == "legacy", regime)
        for stage in stage_list
        for mode in MODES
        for regime in regimes
    }
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_many(runs, write_tiny_model(Path(tmp) / "tiny"))
    bad = False
    for regime in regimes:
        of_regime = {(st, mode): data for (st, mode, r), data in measured.items() if r == regime}
        report = build(version, of_regime, regime)
        out_dir = regime_dir((out_root or ROOT / "results" / "regression") / version, regime)
        text = render(report)
        bundle.write_regression(out_dir, report, text)
        if not quiet:
            print(text)
        print(f"[{regime}] summary: {report['summary']}")
        print(f"[{regime}] EAGLE-specific loss (cases, tokens): {report['eagle_specific_loss']}")
        print(f"[{regime}] wrote {out_dir / 'regression.json'} and regression.md")
        bad |= any({"STALE STATE", "DIFFERS"} & set(s) for s in report["summary"].values())
        print(f"[{regime}] later turns: {report['later_turns_summary']}")
        bad |= any(set(s) - {"ok"} for s in report["later_turns_summary"].values())
    from kit.rig.regression_figure import figure_for

    root = (out_root or ROOT / "results" / "regression") / version
    print(f"wrote {figure_for(root, f'Follow-up resume per grid case, vLLM {version}')}")
    return 1 if bad else 0
