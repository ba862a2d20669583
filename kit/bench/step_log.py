"""Engine steps from vLLM's own iteration log: where a turn's time goes on a server.

``kit bench --step-log`` starts both servers with ``--enable-logging-iteration-details``;
the engine then logs every step's scheduled tokens and elapsed time (scheduling,
the worker's forward pass and the output's processing). Steps are grouped by what
they ran (prefill tokens, or decode tokens) and compared per tree: the median
time of the same kind of step on both servers of one run. A step kind that only
one tree runs (a prefill a hit shortened) has no pair and is left out."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

FLAG = "--enable-logging-iteration-details"
# The level both lines are logged at, for servers started with FLAG.
ENV = {"VLLM_LOGGING_LEVEL": "INFO"}
# vLLM 0.32.0's line (v1/metrics/loggers.py _log_iteration_details).
LINE = re.compile(
    r"Iteration\(\d+\): \d+ context requests, (?P<ctx>\d+) context tokens, "
    r"\d+ generation requests, (?P<gen>\d+) generation tokens, "
    r"iteration elapsed time: (?P<ms>[\d.]+) ms(?! \(dummy\))"
)
MIN_STEPS = 5  # fewer steps of a kind on a tree: no median worth printing
# The fenced fix's line (fix-eagle-fine-prefix-lookahead, vLLM 0.33.0 on), logged with
# the iteration details for every step that carried its exports: how many the
# scheduler planned, the worker reported written, and the scheduler then keyed.
FENCE = re.compile(
    r"Mamba checkpoint exports: (?P<planned>\d+) planned, (?P<written>\d+) reported "
    r"written, (?P<keyed>\d+) keyed"
)
FENCE_KEYS = ("planned", "written", "keyed")


def steps(log: Path) -> dict[tuple[str, int], list[float]]:
    """Elapsed ms per step, keyed ("prefill", context tokens) or ("decode", tokens);
    a step with both keys on its prefill tokens (prefills beside decodes)."""
    out: dict[tuple[str, int], list[float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        found = LINE.search(line)
        if not found:
            continue
        ctx, gen = int(found["ctx"]), int(found["gen"])
        key = ("prefill", ctx) if ctx else ("decode", gen)
        out.setdefault(key, []).append(float(found["ms"]))
    return out


def compare(per_tree: dict[str, dict[tuple[str, int], list[float]]]) -> list[dict]:
    """Per step kind that both trees ran at least MIN_STEPS times: counts, medians and
    the difference patched minus unpatched."""
    unpatched, patched = per_tree["unpatched"], per_tree["patched"]
    rows = []
    for kind, tokens in sorted(set(unpatched) & set(patched)):
        u, p = unpatched[(kind, tokens)], patched[(kind, tokens)]
        if min(len(u), len(p)) < MIN_STEPS:
            continue
        mu, mp = statistics.median(u), statistics.median(p)
        rows.append(
            {
                "step": kind,
                "tokens": tokens,
                "n": {"unpatched": len(u), "patched": len(p)},
                "median_ms": {"unpatched": mu, "patched": mp},
                "diff_ms": mp - mu,
            }
        )
    return rows


def from_logs(logs: dict[str, list[Path]]) -> list[dict] | None:
    """The comparison from each tree's server logs (several where the tree's server
    was started more than once), or None when a tree has no log or no iteration
    lines (a run without --step-log)."""
    per_tree: dict[str, dict[tuple[str, int], list[float]]] = {}
    for tree, paths in logs.items():
        merged: dict[tuple[str, int], list[float]] = {}
        for path in paths:
            for key, times in steps(path).items():
                merged.setdefault(key, []).extend(times)
        if not merged:
            return None
        per_tree[tree] = merged
    return compare(per_tree)


def fence(logs: dict[str, list[Path]]) -> dict[str, dict[str, int]]:
    """Per tree, the fix's exports over the run from its servers' step logs: steps
    that carried some, and how many were planned, reported written and keyed. A tree
    whose vLLM logs no such line (no fenced fix, or no step log) is left out."""
    out: dict[str, dict[str, int]] = {}
    for tree, paths in logs.items():
        found = [
            m
            for path in paths
            for m in map(FENCE.search, path.read_text(errors="replace").splitlines())
            if m
        ]
        if found:
            totals = {key: sum(int(m[key]) for m in found) for key in FENCE_KEYS}
            out[tree] = {"steps": len(found), **totals}
    return out


def fence_problems(counts: dict[str, dict[str, int]], fix_tree: str) -> list[str]:
    """What the fence's counts say went wrong: the server under test exported none
    (the fix's states never went through the fence), or an export planned was not
    reported written, or one reported written was not keyed (the bench resets the
    prefix cache only between requests, so nothing in flight is invalidated)."""
    got = counts.get(fix_tree)
    if not got or not got["planned"]:
        return [f"fence: the {fix_tree} server's step log shows no export of the fix"]
    problems = []
    if got["written"] != got["planned"]:
        problems.append(
            f"fence: {fix_tree} planned {got['planned']} exports, the worker reported "
            f"{got['written']} written"
        )
    if got["keyed"] != got["written"]:
        problems.append(
            f"fence: {fix_tree} keyed {got['keyed']} of {got['written']} exports reported written"
        )
    return problems


def fence_lines(counts: dict[str, dict[str, int]] | None) -> list[str]:
    """bench.md's line on the fence, or nothing."""
    if not counts:
        return []
    said = "; ".join(
        f"{tree}: {c['planned']} planned, {c['written']} reported written, {c['keyed']} "
        f"keyed, in {c['steps']} steps"
        for tree, c in counts.items()
    )
    return [
        "The fix's exports through the fence (publish after write; each server's step "
        f"log, warm-up included): {said}.",
        "",
    ]


def lines(rows: list[dict] | None) -> list[str]:
    """bench.md's table, or nothing."""
    from tabulate import tabulate

    if not rows:
        return []
    body = [
        [
            r["step"],
            r["tokens"],
            f"{r['n']['unpatched']} / {r['n']['patched']}",
            f"{r['median_ms']['unpatched']:.2f} / {r['median_ms']['patched']:.2f}",
            f"{r['diff_ms']:+.2f}",
        ]
        for r in rows
    ]
    headers = ["step", "tokens", "steps u/p", "median ms u/p", "p - u ms"]
    return [
        "Engine steps from vLLM's iteration log (`--step-log`; every step of the run, "
        "warm-up included; step kinds both trees ran at least "
        f"{MIN_STEPS} times):",
        "",
        # Strings as written: a signed difference keeps its sign.
        tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
        "",
    ]
