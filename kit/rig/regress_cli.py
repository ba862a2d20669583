"""`make regress [VLLM=<release>] [RETENTION=0|dense|N]` / `kit regress [--vllm RELEASE]
[--retention 0|dense|N] [--out FOLDER]`: the geometry grid on every tree of one vLLM
release (default: the pinned one), every checkpoint regime and every hashing the
release has, at one prefix-cache retention (default dense; 0: ``vllm serve``'s; N:
every N blocks), reported by ``kit.rig.regress`` (its docstring: the verdicts, the
retention and the one failure rule).

Each tree is measured in its own process (vLLM can be imported once per process):
``measure`` is that process's entry, told on its command line what it runs
(``--fix``: the patched tree's switch on; ``--from-sdist``: a tree from the
release's sdist, which loads ``kit.vllm_tree.release_plugin``; ``--retention``).
Results: a terminal summary, ``regression.json`` and ``regression.md`` per regime and
``grid.png`` under ``--out`` (default ``releases.regression_dir``: a retention other
than the default in its own ``retention-...`` folder). Exit status 1 when
``regress.failures`` finds any; 2, with nothing written, on a retention it cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kit import bundle, schema
from kit.geometry.geometry_model import REGIMES
from kit.paths import REGRESSION_RESULTS
from kit.rig import later_turns, moved_to_pass, regress
from kit.vllm_tree import mods, releases, sdists, trees


def measure_all(
    tree_of: dict[str, trees.Tree],
    model_dir: Path,
    regimes: tuple[str, ...],
    retention: int | None = regress.DEFAULT_RETENTION,
) -> dict[tuple[str, str, str], dict]:
    """Every tree in every regime with the release's default hashing, then, where that
    hashing has lookahead tokens, once more with them disabled, all at ``retention``:
    (stage, hashing, regime) -> the measurement. Which hashings a release has is read
    from what it measured."""
    first = regress.measure_many(
        {
            (stage, regime): (tree, False, regime)
            for stage, tree in tree_of.items()
            for regime in regimes
        },
        model_dir,
        retention,
    )
    default = {regress.hashing_of(data) for data in first.values()}
    if len(default) != 1:
        raise RuntimeError(f"the trees measured different default hashings: {sorted(default)}")
    hashing = default.pop()
    measured = {(stage, hashing, regime): data for (stage, regime), data in first.items()}
    if hashing != "legacy":
        legacy = regress.measure_many(
            {
                (stage, regime): (tree, True, regime)
                for stage, tree in tree_of.items()
                for regime in regimes
            },
            model_dir,
            retention,
        )
        measured |= {(stage, "legacy", regime): data for (stage, regime), data in legacy.items()}
    # Columns in stage order, each stage's hashings together.
    order = {stage: i for i, stage in enumerate(tree_of)}
    return dict(
        sorted(measured.items(), key=lambda kv: (order[kv[0][0]], regress.HASHINGS.index(kv[0][1])))
    )


def run(
    version: str | None = None,
    out: Path | None = None,
    quiet: bool = False,
    regimes: tuple[str, ...] = REGIMES,
    retention: str | None = None,
) -> int:
    """Measure one release (default: the pinned one) at ``retention`` (``--retention``'s
    word; default ``regress.DEFAULT_RETENTION``), write its tables under ``out``
    (default: ``releases.regression_dir(results/regression, release, ...)``); 1 on a
    failure, 2 (nothing written) on a release or retention it cannot run."""
    from tabulate import tabulate

    from kit.weights.tiny_model import write_tiny_model

    try:
        interval = (
            regress.DEFAULT_RETENTION if retention is None else regress.parse_retention(retention)
        )
        version = releases.resolve(version)
        # Trees first, one at a time: a missing one is built, and two builders must not race.
        tree_of = releases.trees_of(version)
    except (
        regress.RetentionError,
        releases.ReleaseError,
        mods.ModError,
        sdists.SdistError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    out = out or releases.regression_dir(
        REGRESSION_RESULTS, version, interval, regress.DEFAULT_RETENTION
    )
    print(
        f"retention: {regress.retention_text(interval)}; later turns "
        f"{later_turns.retention_words()}; tables in {out}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_all(tree_of, write_tiny_model(Path(tmp) / "tiny"), regimes, interval)
    failed = []
    reports = {
        regime: regress.build(
            version, {(st, h): d for (st, h, r), d in measured.items() if r == regime}, regime
        )
        for regime in regimes
    }
    if moved_to_pass.applies(reports):
        # Where the fix moves a backend from the split path into the pass, its
        # users meet the two regimes at once: shown beside the split tables.
        view = moved_to_pass.build(reports)
        reports[moved_to_pass.BEFORE]["moved_to_pass"] = view
        print(f"[split -> pass] {view['hashings']}")
        failed += [f"[split -> pass] {problem}" for problem in moved_to_pass.failures(view)]
    for regime, report in reports.items():
        where = regress.regime_dir(out, regime)
        moved = report.get("moved_to_pass")
        sections = moved_to_pass.render(moved) if moved else []
        bundle.write_regression(where, report, regress.render(report, sections))
        if not quiet:
            print(tabulate(regress.terminal_table(report), headers=regress.table_headers(report)))
        print(f"[{regime}] summary: {report['summary']}")
        print(f"[{regime}] stock: {report['stock']}")
        print(f"[{regime}] fix effect: {report['fix_effect']}")
        print(f"[{regime}] EAGLE-specific loss (cases, tokens): {report['eagle_specific_loss']}")
        print(f"[{regime}] cold prompts, steps the fix adds: {report['cold_extra_steps']}")
        print(f"[{regime}] follow-ups resumed mid-block, steps: {report['resumed_steps']}")
        print(f"[{regime}] later turns: {report['later_turns_summary']}")
        print(f"[{regime}] cache geometry identical across trees: {report['geometry_identical']}")
        print(f"[{regime}] wrote {where / 'regression.json'} and regression.md")
        failed += [f"[{regime}] {problem}" for problem in regress.failures(report)]
    from kit.rig.regression_figure import figure_for

    print(f"wrote {figure_for(out, regress.figure_title(version, interval))}")
    for problem in failed:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd")
    m = sub.add_parser("measure", help="(internal) measure the tree this process imports")
    m.add_argument("--model-dir", type=Path, required=True, help="the tiny model's config")
    m.add_argument("--out", type=Path, required=True, help="the measurement's JSON file")
    m.add_argument(trees.FIX_ARG, action="store_true", help="turn on the patched tree's switch")
    m.add_argument(
        trees.FROM_SDIST_ARG,
        action="store_true",
        help="the tree is a release's sdist sources (loads kit.vllm_tree.release_plugin)",
    )
    m.add_argument(
        "--legacy-hashes",
        action="store_true",
        help="disable lookahead block hashes (a release that has them)",
    )
    m.add_argument("--checkpoints", choices=REGIMES, default="split", help="checkpoint regime")
    m.add_argument(
        "--retention",
        default=regress.retention_arg(regress.DEFAULT_RETENTION),
        help="the grid's prefix-cache retention: 0, dense or N (every N blocks)",
    )
    parser.add_argument(
        "--vllm",
        metavar="RELEASE",
        help="a release from pins.toml, or 'newest' (default: the pinned one)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the folder the tables and the figure go to (default: results/regression, a "
        "release other than the pinned one in its <release>/ folder)",
    )
    parser.add_argument(
        "--retention",
        metavar="0|dense|N",
        help="the grid's prefix-cache retention (vLLM's prefix_cache_retention_interval): "
        "0 (vllm serve's default), dense (default: every block state a chunk end reaches) "
        "or N, every N blocks of each case's block size; one other than the default "
        "writes to a retention-<0|N-blocks|dense>/ folder; the later turns stay dense",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summaries")
    args = parser.parse_args(argv)
    if args.cmd == "measure":
        trees.prepare(args.from_sdist)
        data = regress.measure(
            args.model_dir,
            args.fix,
            lookahead_hashes=not args.legacy_hashes,
            checkpoints=args.checkpoints,
            retention=regress.parse_retention(args.retention),
        )
        args.out.write_text(json.dumps(schema.stamp("regress-measure", data)))
        return 0
    return run(args.vllm, args.out, args.quiet, retention=args.retention)


if __name__ == "__main__":
    raise SystemExit(main())
