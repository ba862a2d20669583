"""`make report`: render one results bundle, or two side by side (e.g. gb10 vs strix), as Markdown.

A bundle is a folder written by the bench (``bench.json`` inside, its schema
checked). With two bundles the cached follow-up rows are set next to each other
with their patched/unpatched ratios (``--figure PNG`` draws them), and what each
ran on (host, trees or images, mods) is listed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

from kit import bundle
from kit.bench.md_blocks import kernels_line, result_blocks, retention_text
from kit.bench.ttft_stats import ratio_text


def manifest_lines(manifest: dict) -> list[str]:
    lines = [
        f"  - target {manifest['target']}, engine {manifest['engine']}, "
        f"kit {manifest['kit_commit'][:12]}, models.lock {manifest['models_lock_sha256'][:12]}, "
        f"model {(manifest.get('model') or {}).get('repo', 'tiny random-weight (cpu)')}"
    ]
    for stage, image in manifest["images"].items():
        mods = ", ".join(
            f"{m['name']} ({m['patch_sha256'][:12]})"
            for m in image.get("record", {}).get("mods", [])
        )
        lines.append(f"  - {stage} image {image['id'][:19]}: {mods or 'no mods'}")
    for suite, result in manifest.get("suites", {}).items():
        lines.append(f"  - {suite}: {result}")
    # The host check's findings: what a first run on a GPU box reports back.
    host = manifest.get("host") or {}
    for finding in host.get("checks", []):
        verdict = "ok" if finding["ok"] else "FAIL"
        fix = f" (fix: {finding['fix']})" if finding.get("fix") else ""
        lines.append(f"  - host check {verdict}: {finding['check']}: {finding['detail']}{fix}")
    facts = {k: v for k, v in (host.get("record") or {}).items() if v not in (None, "", [])}
    if facts:
        lines.append("  - host: " + "; ".join(f"{k} {v}" for k, v in sorted(facts.items())))
    return lines


def run_lines(name: str, report: dict) -> list[str]:
    prov = report["run"]
    host = prov["host"]
    lines = [
        f"- **{name}**: {host.get('machine')} {host.get('cpu')}, {host.get('platform')}; "
        f"vLLM {prov['vllm']}; pins {prov['pins_sha256'][:12]}; "
        f"kit {host.get('kit_commit', '')[:12]}"
    ]
    for tree, record in prov["trees"].items():
        mods = ", ".join(f"{m['name']} ({m['patch_sha256'][:12]})" for m in record.get("mods", []))
        lines.append(f"  - {tree}: {mods or 'no mods'}")
    if report.get("manifest"):
        lines += manifest_lines(report["manifest"])
    return lines


def render(bundles: list[Path]) -> str:
    reports = [(b.name, bundle.load(b)) for b in bundles]
    out = ["# Hybrid prefix-cache kit: results", ""]
    for name, report in reports:
        geo = report["geometry"]
        out += [
            f"## {name}",
            "",
            f"Checkpoint path {report['path']} (regime {geo['checkpoints']}, step budget "
            f"{geo['budget']}); B_phys {geo['block']}, H {geo['unit']}, MTP k={geo['num_spec']}, "
            f"{retention_text(geo)}, "
            f"{report['reps']} repetitions; prompt pair: {report['prompt_pair']}.",
            "",
            *kernels_line(report),
            *result_blocks(report, "Pooled over every S:"),
            f"Oracle: {report['oracle']}",
            "",
        ]
    if len(reports) == 2:
        (left, a), (right, b) = reports
        rows = []
        for sa in a["summary"]:
            if sa["kind"] != "cached_B":
                continue
            sb = next(
                (s for s in b["summary"] if (s["S"], s["kind"]) == (sa["S"], "cached_B")), None
            )
            if sb is None:
                continue
            rows.append(
                [
                    sa["S"],
                    f"{sa['patched']['median_ms']:.1f}",
                    ratio_text(sa["ratio_patched_unpatched"]),
                    f"{sb['patched']['median_ms']:.1f}",
                    ratio_text(sb["ratio_patched_unpatched"]),
                ]
            )
            # Cached B against its control (bundles from before it: none).
            controls = [_control(sa), _control(sb)]
            if any(controls):
                rows[-1] += controls
        headers = [
            "S",
            f"{left} patched ms",
            f"{left} ratio p/u [95% CI] (min-max)",
            f"{right} patched ms",
            f"{right} ratio p/u [95% CI] (min-max)",
        ]
        if any(len(row) > len(headers) for row in rows):
            headers += [f"{left} patched B/control", f"{right} patched B/control"]
            rows = [row + [""] * (len(headers) - len(row)) for row in rows]
        out += [
            "## Side by side: cached follow-up",
            "",
            tabulate(rows, headers=headers, tablefmt="github"),
            "",
        ]
    out += ["## What ran", ""]
    for name, report in reports:
        out += run_lines(name, report)
    return "\n".join(out) + "\n"


def _control(line: dict) -> str:
    """A summary line's patched cached B / control ratio, or "" where it has none."""
    patched = (line.get("ratio_control") or {}).get("patched")
    return ratio_text(patched) if patched else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bundles", type=Path, nargs="+", help="one or two results folders")
    parser.add_argument("--out", type=Path, help="write the Markdown here instead of stdout")
    parser.add_argument(
        "--figure",
        type=Path,
        metavar="PNG",
        help="with two bundles: draw their cached follow-up ratios side by side here",
    )
    parser.add_argument(
        "--redraw",
        action="store_true",
        help="draw each bundle's figures again from its bench.json and raw.json",
    )
    args = parser.parse_args(argv)
    if len(args.bundles) > 2:
        parser.error("give one bundle, or two to compare")
    if args.figure and len(args.bundles) != 2:
        parser.error("--figure compares two bundles; give two")
    try:
        if args.redraw:
            for folder in args.bundles:
                for drawn in bundle.redraw(folder):
                    print(f"wrote {drawn}")
            return 0
        text = render(args.bundles)
        if args.figure:
            from kit.plot import compare_figure

            named = [(b.name, bundle.load(b)["summary"]) for b in args.bundles]
            compare_figure(named, args.figure)
    except bundle.BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
