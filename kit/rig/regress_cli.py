"""`make regress` / `kit regress`: measure every geometry on the unpatched and the
patched tree, report both.

Each tree is measured in its own process (vLLM can be imported once per
process): ``measure`` is that process's entry. Results: a terminal table,
``regression.json`` and ``regression.md`` under ``results/regression/``. Exit
status 1 when the patched tree misses an expectation or does worse than the
unpatched one anywhere. The command lives apart from ``kit.rig.regress`` (the
measurements and the report) so that ``kit.rig.release_report``, which reuses them,
and this command, which hands a later release to it, import no cycle.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kit import bundle, schema
from kit.geometry.geometry_model import REGIMES
from kit.rig.regress import (
    COLUMNS,
    DEFAULT_OUT,
    build_report,
    measure,
    measure_many,
    regime_dir,
    render_markdown,
)
from kit.vllm_tree import pins, trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd")
    m = sub.add_parser("measure", help="(internal) measure the tree this process imports")
    m.add_argument("--model-dir", type=Path, required=True, help="the tiny model's config")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--fix", action="store_true", help="turn on the patched tree's switch")
    m.add_argument(
        "--legacy-hashes", action="store_true", help="disable lookahead block hashes (0.33.0+)"
    )
    m.add_argument("--checkpoints", choices=REGIMES, default="split", help="checkpoint regime")
    parser.add_argument(
        "--vllm",
        metavar="VERSION",
        help="measure this release from pins.toml [releases] (default: the pinned vllm.version); "
        "writes results/regression/<VERSION>/",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="where regression.json/.md go (default: %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    if args.cmd == "measure":
        args.out.write_text(
            json.dumps(
                schema.stamp(
                    "regress-measure",
                    measure(
                        args.model_dir,
                        args.fix,
                        lookahead_hashes=not args.legacy_hashes,
                        checkpoints=args.checkpoints,
                    ),
                )
            )
        )
        return 0
    if args.vllm and args.vllm != pins.get("vllm.version"):
        from kit.rig import release_report

        return release_report.run(args.vllm, args.quiet)

    from tabulate import tabulate

    from kit.weights.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny")
        runs = {
            (name, regime): (trees.pinned(name), name == "patched", False, regime)
            for name in trees.TREE_NAMES
            for regime in REGIMES
        }
        measured = measure_many(runs, model_dir)
    failed = False
    for regime in REGIMES:
        report = build_report(measured["unpatched", regime], measured["patched", regime], regime)
        out = regime_dir(args.out, regime)
        bundle.write_regression(out, report, render_markdown(report))
        if not args.quiet:
            print(tabulate([[r[c] for c in COLUMNS] for r in report["rows"]], headers=COLUMNS))
        print(
            f"[{regime}] summary: {report['summary']}  "
            f"geometry identical: {report['geometry_identical']}"
        )
        print(
            f"[{regime}] EAGLE-specific loss (cases, tokens) per tree: "
            f"{report['eagle_specific_loss']}"
        )
        print(f"[{regime}] wrote {out / 'regression.json'} and regression.md")
        print(f"[{regime}] later turns: {report['later_turns_summary']}")
        bad = {"UNEXPECTED", "WORSE", "STALE STATE"} & set(report["summary"])
        bad |= set(report["later_turns_summary"]) - {"ok"}
        failed |= bool(bad) or not report["geometry_identical"]
    from kit.rig.regression_figure import figure_for

    print(f"wrote {figure_for(args.out, 'Follow-up resume per grid case, pinned release')}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
