"""Statistics and rendering of a TTFT run: medians with IQR per tree, patched/unpatched
ratios per repetition (median, min-max and a seeded bootstrap interval of the median,
per request kind and S and pooled), the oracle's tally, and every reason a run is not
evidence. Shared by the bench command and ``make report``.

The intervals are 95 % percentile bootstrap intervals over whole repetitions: each of
10,000 resamples draws the run's repetitions with replacement and takes the median of
every patched/unpatched ratio of the drawn repetitions, so the pairs of one repetition
(which share the servers' state and the host's moment) move together and are never
counted as independent of each other. Where a repetition holds one pair (one request
kind at one S), that is the bootstrap of the pairs."""

from __future__ import annotations

import math
import random
import statistics

from kit.bench.ttft import TREES

# The bootstrap of the median ratio: fixed, so the same rows give the same interval.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 20_260_320
CI_LEVEL = 0.95
# Request kinds pooled over every S (and, for the later turns, over the turns).
POOLED = (
    ("turn2-turn4", ("turn2", "turn3", "turn4")),
    ("cold_A", ("cold_A",)),
    ("cold_B", ("cold_B",)),
    # Both cold requests together (the fix's cost where no hit changes), then
    # every other kind on its own, so each kind's median over S shows.
    ("cold_A+cold_B", ("cold_A", "cold_B")),
    *((kind, (kind,)) for kind in ("cached_B", "repeat_B", "turn1", "turn2", "turn3", "turn4")),
)


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
        if kind == CONTROL[0]:
            control = control_ratio([r for r in rows if r["S"] == shared])
            if control:
                line["ratio_control"] = control
        out.append(line)
    return out


# -- cached B against its control (issue 49) ------------------------------------------

# The measurement and its control (``ttft.control_requests``): cached B's TTFT over
# the control follow-up's, same tree, repetition and S.
CONTROL = ("cached_B", "control_B")
# The bar on the patched tree's ratio: the median at most 1.20, the interval's upper
# end at most 1.35 (both).
CONTROL_BAR = {"median": 1.20, "upper": 1.35}


def control_by_rep(rows: list[dict], tree: str, key: str = "ttft_s") -> dict:
    """cached B / control B of ``key`` on ``tree``, grouped by repetition: {rep: sorted
    ratios, one per S}; only repetitions and S with both rows (and ``key`` known)."""
    sides: dict = {}
    for r in rows:
        if r["tree"] == tree and r["kind"] in CONTROL:
            sides.setdefault((r["rep"], r["S"]), {})[r["kind"]] = r
    out: dict = {}
    for (rep, _), pair in sorted(sides.items()):
        if len(pair) == 2 and all(side.get(key) for side in pair.values()):
            out.setdefault(rep, []).append(pair[CONTROL[0]][key] / pair[CONTROL[1]][key])
    return {rep: sorted(ratios) for rep, ratios in out.items()}


def _stats(by_rep: dict) -> dict:
    """``ratio_stats``, and the ratios per repetition (JSON keys are strings), so the
    pooled ratio can be drawn again over whole repetitions from the summary alone."""
    by_rep_text = {str(rep): group for rep, group in sorted(by_rep.items())}
    return {**ratio_stats(by_rep), "by_rep": by_rep_text}


def control_ratio(rows: list[dict], key: str = "ttft_s") -> dict | None:
    """Per tree, cached B / control B of ``key`` over the rows' repetitions and S
    (``control_by_rep``), with the bar's verdict on each; None where the rows hold no
    control (a run from before it)."""
    out = {}
    for tree in TREES:
        by_rep = control_by_rep(rows, tree, key)
        if by_rep:
            stats = _stats(by_rep)
            out[tree] = {**stats, "bar": control_verdict(stats)}
    return out or None


def control_verdict(stats: dict) -> str:
    """ "met" where the median and the interval's upper end are within ``CONTROL_BAR``,
    else "missed (median x.xx)", as the README words a bar."""
    if stats["median"] <= CONTROL_BAR["median"] and stats["ci95"][1] <= CONTROL_BAR["upper"]:
        return "met"
    return f"missed (median {stats['median']:.2f})"


def control_pooled(summary: list[dict]) -> dict | None:
    """cached B / control B pooled over every S of the summary, per tree: the ratios
    of each repetition at every S drawn together (``control_ratio`` per S keeps them
    per repetition); None where no S has a control."""
    lines = [s["ratio_control"] for s in summary if s.get("ratio_control")]
    out = {}
    for tree in TREES:
        by_rep: dict = {}
        for line in lines:
            for rep, group in (line.get(tree) or {}).get("by_rep", {}).items():
                by_rep.setdefault(int(rep), []).extend(group)
        if by_rep:
            stats = _stats(by_rep)
            out[tree] = {**stats, "S": [s["S"] for s in summary if s.get("ratio_control")]}
            out[tree]["bar"] = control_verdict(stats)
    return out or None


def control_lines(summary: list[dict]) -> list[str]:
    """bench.md's table of cached B / control B per S and pooled, both trees; nothing
    for a run without the control."""
    from tabulate import tabulate

    pooled = control_pooled(summary)
    if not pooled:
        return []
    per_s = [(str(s["S"]), s["ratio_control"]) for s in summary if s.get("ratio_control")]
    body = []
    for label, line in [*per_s, ("pooled", pooled)]:
        p, u = line.get("patched"), line.get("unpatched")
        body.append(
            [
                label,
                p["n"] if p else "",
                _control_cell(p),
                p["bar"] if p else "",
                _control_cell(u),
            ]
        )
    bar = f"{CONTROL_BAR['median']:.2f} / {CONTROL_BAR['upper']:.2f}"
    headers = [
        "S",
        "pairs",
        "patched B/control [95% CI] (min-max)",
        f"bar {bar}",
        "unpatched B/control (reference)",
    ]
    return [
        "Cached B against its control, each tree's own (cached B TTFT / control TTFT of "
        "the same repetition and S; the control resumes a fresh context at a block "
        "boundary and prefills as many uncached tokens as the fix's cached B: one engine "
        "step on the patched internal path, two unpatched and on the split path "
        "(docs/methodology.md); bar: median at most "
        f"{CONTROL_BAR['median']:.2f} and interval's upper end at most "
        f"{CONTROL_BAR['upper']:.2f}):",
        "",
        tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
        "",
    ]


def _control_cell(stats: dict | None) -> str:
    return ratio_text(stats) if stats else ""


def paused(row: dict) -> bool:
    """Whether the host paused the machine during the request (``host_steal``)."""
    return (row.get("stolen_s") or 0) > 0


def paired_ratios(rows: list[dict], key: str, drop_paused: bool = False) -> list[float]:
    """patched/unpatched of ``key`` for every pair of rows from the same repetition, S,
    request kind and turn (the two sides run back to back), sorted: the order the
    rows came in does not matter. ``drop_paused`` leaves out every pair with a side
    the host paused."""
    return sorted(r for ratios in ratios_by_rep(rows, key, drop_paused).values() for r in ratios)


def ratios_by_rep(rows: list[dict], key: str, drop_paused: bool = False) -> dict:
    """The paired ratios (``paired_ratios``) grouped by repetition: {rep: sorted ratios},
    only repetitions with at least one pair. A repetition is the unit the bootstrap
    draws: its pairs ran in the same round over every S and request kind, on the same
    servers, so they are not independent of each other."""
    pairs: dict = {}
    for r in rows:
        pair = (r["rep"], r.get("S"), r.get("kind"), r.get("turn"))
        pairs.setdefault(pair, {})[r["tree"]] = r
    out: dict = {}
    for (rep, *_), p in pairs.items():
        if (
            len(p) == 2
            # A row from before the kit recorded ``key``, or a time vLLM did not report.
            and all(side.get(key) for side in p.values())
            and not (drop_paused and any(map(paused, p.values())))
        ):
            out.setdefault(rep, []).append(p["patched"][key] / p["unpatched"][key])
    return {rep: sorted(ratios) for rep, ratios in out.items()}


def paired_ratio(rows: list[dict], key: str, drop_paused: bool = False) -> dict:
    """The paired ratios of ``key`` (``paired_ratios``): how many, median, min, max, and
    the 95 % bootstrap interval of the median over whole repetitions
    (``cluster_bootstrap_median_ci``)."""
    return ratio_stats(ratios_by_rep(rows, key, drop_paused))


def ratio_stats(by_rep: dict) -> dict:
    """How many ratios, their median, min, max, and the 95 % bootstrap interval of the
    median over whole repetitions (``by_rep``: repetition -> its ratios)."""
    ratios = sorted(r for group in by_rep.values() for r in group)
    return {
        "n": len(ratios),
        "median": statistics.median(ratios),
        "ci95": list(cluster_bootstrap_median_ci(list(by_rep.values()))),
        "min": ratios[0],
        "max": ratios[-1],
    }


def bootstrap_median_ci(
    values: list[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``values``, each value drawn on
    its own: ``resamples`` draws of len(values) with replacement from a generator
    seeded with ``seed``, each draw's median, and the (1 - level)/2 and (1 + level)/2
    quantiles of those medians (linear between order statistics). The values are
    sorted first, so the same values in any order give the same interval. It treats
    the values as independent; the bench's ratios are not (``paired_ratio`` uses
    ``cluster_bootstrap_median_ci``), and this equals that with one value per group."""
    if not values:
        raise ValueError("no values to bootstrap")
    return cluster_bootstrap_median_ci([[v] for v in values], resamples, seed, level)


def cluster_bootstrap_median_ci(
    groups: list[list[float]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of every value in ``groups``,
    drawing whole groups (a cluster bootstrap; the bench's groups are repetitions):
    ``resamples`` draws of len(groups) groups with replacement from a generator seeded
    with ``seed``, the median of all values of each draw's groups, and the (1 - level)/2
    and (1 + level)/2 quantiles of those medians (linear between order statistics).
    Groups and the values inside each are sorted first, so the same groups in any order
    give the same interval; with one value per group it is the bootstrap of the values
    (``bootstrap_median_ci``), draw for draw."""
    clusters = sorted(sorted(g) for g in groups if g)
    if not clusters:
        raise ValueError("no values to bootstrap")
    rng = random.Random(seed)
    n = len(clusters)
    medians = sorted(
        statistics.median([v for g in rng.choices(clusters, k=n) for v in g])
        for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return _quantile(medians, tail), _quantile(medians, 1 - tail)


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between order statistics."""
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (pos - low) * (ordered[high] - ordered[low])


def pooled_ratios(rows: list[dict], drop_paused: bool = False, key: str = "ttft_s") -> list[dict]:
    """The paired ratios of ``key`` for the request kinds in ``POOLED``, over every S
    (and turn); ``drop_paused``: only the pairs the host did not pause."""
    out = []
    for group, kinds in POOLED:
        sel = [r for r in rows if r["kind"] in kinds]
        if not sel or not paired_ratios(sel, key, drop_paused):
            continue
        out.append(
            {
                "group": group,
                "kinds": list(kinds),
                "S": sorted({r["S"] for r in sel}),
                **paired_ratio(sel, key, drop_paused),
            }
        )
    return out


def host_pauses(rows: list[dict]) -> dict | None:
    """How many requests per tree the host paused, or None where the rows do not
    know (no steal counter, or a bundle from before the kit recorded it)."""
    if all(r.get("stolen_s") is None for r in rows):
        return None
    return {
        tree: {
            "requests": sum(r["tree"] == tree for r in rows),
            "paused": sum(r["tree"] == tree and paused(r) for r in rows),
        }
        for tree in TREES
    }


def ratio_method() -> dict:
    """What bench.json says about its ratios."""
    return {
        "ratio": "patched TTFT / unpatched TTFT of the same repetition, S and request kind",
        "interval": (
            f"{CI_LEVEL:.0%} percentile bootstrap of the median of those ratios over whole "
            "repetitions, each resample drawing repetitions with replacement with all their ratios"
        ),
        "resampled": "repetition",
        "resamples": BOOTSTRAP_RESAMPLES,
        "seed": BOOTSTRAP_SEED,
        "pooled": {group: list(kinds) for group, kinds in POOLED},
    }


def ratio_text(r: dict) -> str:
    """median [95 % interval] (min-max)."""
    ci = r.get("ci95")
    interval = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
    return f"{r['median']:.2f}{interval} ({r['min']:.2f}-{r['max']:.2f})"


def pooled_table(pooled: list[dict]) -> tuple[list[str], list[list]]:
    headers = ["requests", "S", "pairs", "ratio p/u median", "95% CI", "min-max"]
    body = [
        [
            p["group"],
            " ".join(map(str, p["S"])),
            p["n"],
            f"{p['median']:.2f}",
            f"{p['ci95'][0]:.2f}-{p['ci95'][1]:.2f}",
            f"{p['min']:.2f}-{p['max']:.2f}",
        ]
        for p in pooled
    ]
    return headers, body


def unpaused_lines(report: dict) -> list[str]:
    """The pooled table again without the pairs the host paused (``host_steal``),
    where the run recorded steal; nothing otherwise."""
    from tabulate import tabulate

    pauses = report.get("host_pauses")
    if not pauses:
        return []
    counts = ", ".join(f"{tree} {c['paused']} of {c['requests']}" for tree, c in pauses.items())
    lines = [f"Requests during which the host paused this machine (steal time): {counts}."]
    if report.get("pooled_ratios_unpaused"):
        headers, body = pooled_table(report["pooled_ratios_unpaused"])
        lines += [
            "Pooled again, leaving out every pair with a paused side (a pause hits either "
            "tree at random and adds its length to that request):",
            "",
            tabulate(body, headers=headers, tablefmt="github"),
        ]
    return [*lines, ""]


ENGINE_KEY = "engine_prefill_s"


def engine_pooled(rows: list[dict]) -> list[dict] | None:
    """The pooled ratios of vLLM's own prefill time (``openai_client.ENGINE_TIMES``),
    or None where no row has it (a bundle from before the kit recorded it)."""
    return pooled_ratios(rows, key=ENGINE_KEY) or None


def engine_lines(report: dict) -> list[str]:
    """The pooled table of the engine's own prefill time, where the run has it."""
    from tabulate import tabulate

    pooled = report.get("pooled_ratios_engine_prefill")
    if not pooled:
        return []
    headers, body = pooled_table(pooled)
    return [
        "The same pairs timed by vLLM itself (request_prefill_time: from the engine step "
        "that schedules the request to the output with its first token, both stamped in "
        "the engine core; no HTTP, API server or IPC time in it):",
        "",
        tabulate(body, headers=headers, tablefmt="github"),
        "",
    ]


# A client TTFT this much above the server's own is called out (bench.md).
HOP_GAP_MS = 10.0


def hop_gap(rows: list[dict]) -> dict | None:
    """Per tree, the time between the client and vLLM's own TTFT (client TTFT minus
    ``vllm:time_to_first_token_seconds``, arrival at the API server to the first
    token): the HTTP hop, the API server's event loop and the output's way back.
    Median and max in ms, and the requests more than ``HOP_GAP_MS`` above, by kind.
    None where the rows have no server TTFT."""
    out = {}
    for tree in TREES:
        gaps = [
            (r["kind"], 1000 * (r["ttft_s"] - r["server_ttft_s"]))
            for r in rows
            if r["tree"] == tree and r.get("ttft_s") and r.get("server_ttft_s")
        ]
        if not gaps:
            continue
        ms = sorted(g for _, g in gaps)
        over: dict[str, int] = {}
        for kind, gap in gaps:
            if gap > HOP_GAP_MS:
                over[kind] = over.get(kind, 0) + 1
        out[tree] = {
            "n": len(ms),
            "median_ms": statistics.median(ms),
            "max_ms": ms[-1],
            "over": dict(sorted(over.items())),
        }
    return out or None


def hop_lines(gap: dict | None) -> list[str]:
    """bench.md's line on the client-server gap (``hop_gap``), or nothing."""
    if not gap:
        return []

    def said(tree: str, g: dict) -> str:
        over = ", ".join(f"{kind} {n}" for kind, n in g["over"].items()) or "none"
        return (
            f"{tree} median {g['median_ms']:.1f} ms, max {g['max_ms']:.1f} ms, above "
            f"{HOP_GAP_MS:.0f} ms: {over} (of {g['n']})"
        )

    return [
        "Client TTFT minus vLLM's own (`vllm:time_to_first_token_seconds`: the HTTP hop, "
        "the API server and the way back): "
        + "; ".join(said(tree, g) for tree, g in gap.items())
        + ".",
        "",
    ]


def table(summary: list[dict]) -> tuple[list[str], list[list]]:
    headers = [
        "S",
        "request",
        "unpatched ms (IQR)",
        "cached",
        "patched ms (IQR)",
        "cached",
        "expected u/p",
        "ratio p/u [95% CI] (min-max)",
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
                ratio_text(r),
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
