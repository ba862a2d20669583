"""Statistics and rendering of a TTFT run: medians with IQR per tree, patched/unpatched
ratios per repetition, the oracle's tally, and every reason a run is not evidence.
Shared by the bench command and ``make report``."""

from __future__ import annotations

import statistics

from kit.ttft import TREES


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["S"], r["kind"]) for r in rows})
    for shared, kind in keys:
        line = {"S": shared, "kind": kind}
        for tree in TREES:
            sel = [r for r in rows if r["tree"] == tree and (r["S"], r["kind"]) == (shared, kind)]
            ttft = sorted(r["ttft_s"] for r in sel)
            # inclusive: quartiles stay inside the measured range for small n.
            q = (
                statistics.quantiles(ttft, n=4, method="inclusive")
                if len(ttft) > 1
                else [ttft[0]] * 3
            )
            line[tree] = {
                "n": len(sel),
                "median_ms": 1000 * statistics.median(ttft),
                "iqr_ms": [1000 * q[0], 1000 * q[2]],
                "min_ms": 1000 * ttft[0],
                "max_ms": 1000 * ttft[-1],
                "median_cached": statistics.median(r["cached_tokens"] for r in sel),
                "expected_cached": sel[0]["expected_cached"],
                "flagged_no_hit": sum(not r["hit_ok"] for r in sel),
                # cached_B only: the oracle's verdicts against the cold reference.
                "verdicts": {
                    v: sum(r["oracle"]["verdict"] == v for r in sel)
                    for v in ("same", "tie", "wrong")
                }
                if kind == "cached_B"
                else None,
            }
        line["ratio_patched_unpatched"] = paired_ratio(
            [r for r in rows if (r["S"], r["kind"]) == (shared, kind)], "ttft_s"
        )
        out.append(line)
    return out


def paired_ratio(rows: list[dict], key: str) -> dict:
    """patched/unpatched of ``key`` per repetition (the two sides run back to back):
    median, min and max."""
    pairs: dict = {}
    for r in rows:
        pairs.setdefault(r["rep"], {})[r["tree"]] = r[key]
    ratios = sorted(p["patched"] / p["unpatched"] for p in pairs.values() if len(p) == 2)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def table(summary: list[dict]) -> tuple[list[str], list[list]]:
    headers = [
        "S",
        "request",
        "unpatched ms (IQR)",
        "cached",
        "patched ms (IQR)",
        "cached",
        "expected u/p",
        "ratio p/u (min-max)",
        "hit != expected u/p",
        "answer = cold u/p (ties, wrong)",
    ]
    body = []
    for s in summary:
        u, p, r = s["unpatched"], s["patched"], s["ratio_patched_unpatched"]
        body.append(
            [
                s["S"],
                s["kind"],
                f"{u['median_ms']:.1f} ({u['iqr_ms'][0]:.1f}-{u['iqr_ms'][1]:.1f})",
                f"{u['median_cached']:.0f}",
                f"{p['median_ms']:.1f} ({p['iqr_ms'][0]:.1f}-{p['iqr_ms'][1]:.1f})",
                f"{p['median_cached']:.0f}",
                f"{u['expected_cached']}/{p['expected_cached']}",
                f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})",
                f"{u['flagged_no_hit']}/{p['flagged_no_hit']}",
                "" if u.get("verdicts") is None else f"{_answers(u)} / {_answers(p)}",
            ]
        )
    return headers, body


def _answers(side: dict) -> str:
    v = side["verdicts"]
    return f"{v['same']}/{side['n']} ({v['tie']}, {v['wrong']})"


def failures(rows: list[dict], distinct_cold: int) -> list[str]:
    """Every reason this run is not evidence, one line each, naming tree, S and repetition."""
    out = []
    for r in rows:
        if not r["hit_ok"]:
            out.append(
                f"HIT: {r['tree']} S={r['S']} rep={r['rep']} {r['kind']}: "
                f"{r['cached_tokens']} cached tokens, the geometry says {r['expected_cached']}"
            )
        if r.get("oracle", {}).get("verdict") == "wrong":
            out.append(
                f"ORACLE: {r['tree']} S={r['S']} rep={r['rep']}: the cached answer's first "
                f"position differs from the cold run's by {r['oracle']['first_logprob_diff']} "
                "(a restored state is not the state it claims to be)"
            )
    if distinct_cold <= 1:
        out.append("ORACLE: every cold request got the same answer: it proves nothing")
    return out


def oracle_summary(rows: list[dict], tolerance: float) -> dict:
    """The oracle's verdicts over the cached follow-ups, and whether it could fail at all
    (only when the cold answers depend on the context)."""
    judged = [r for r in rows if r["kind"] == "cached_B"]
    distinct = distinct_cold_answers(rows)
    return {
        "tolerance_first_logprob": tolerance,
        "verdicts": {
            v: sum(r["oracle"]["verdict"] == v for r in judged) for v in ("same", "tie", "wrong")
        },
        "max_first_logprob_diff": max(
            (
                float("inf") if (d := r["oracle"]["first_logprob_diff"]) is None else d
                for r in judged
            ),
        ),
        "distinct_cold_answers": distinct,
        "can_fail": distinct > 1,
        "wrong": sorted(
            {(r["tree"], r["S"], r["rep"]) for r in judged if r["oracle"]["verdict"] == "wrong"}
        ),
    }


def distinct_cold_answers(rows: list[dict]) -> int:
    return len({tuple(r["token_ids"]) for r in rows if r["kind"] in ("cold_A", "cold_B")})
