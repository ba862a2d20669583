"""Cached B against its control (issue 49): the ratio per tree, repetition and S,
its median and repetition-bootstrap interval per S and pooled, the bar's verdict,
and the table bench.md and ``make report`` show."""

from __future__ import annotations

import random
import statistics

import pytest

from kit.bench import md_blocks, ttft_stats

pytestmark = pytest.mark.cpu

SHARED = (900, 1007, 2048, 2159)


def _rows(ratio: dict[str, float], reps: int = 10, seed: int = 5) -> list[dict]:
    """cached B, control B (and cold A, no control) per tree, repetition and S, with
    cached B / control B about ``ratio[tree]``."""
    rng = random.Random(seed)
    rows = []
    for rep in range(reps):
        for shared in SHARED:
            for tree in ("unpatched", "patched"):
                control = 0.030 * (1 + rng.gauss(0, 0.02))
                base = {"rep": rep, "S": shared, "tree": tree, "hit_ok": True}
                base |= {"cached_tokens": 0, "expected_cached": 0}
                cached = control * ratio[tree] * (1 + rng.gauss(0, 0.02))
                rows += [
                    {**base, "kind": "control_B", "ttft_s": control},
                    {**base, "kind": "cached_B", "ttft_s": cached},
                    {**base, "kind": "cold_A", "ttft_s": 0.2},
                ]
    for r in rows:
        if r["kind"] == "cached_B":
            r["oracle"] = {"verdict": "same"}
    return rows


def test_the_ratio_pairs_cached_b_with_its_own_trees_control() -> None:
    rows = _rows({"unpatched": 5.0, "patched": 1.1})
    by_rep = ttft_stats.control_by_rep(rows, "patched")
    assert sorted(by_rep) == list(range(10)) and all(len(g) == 4 for g in by_rep.values())
    want = {
        (r["rep"], r["S"]): r["ttft_s"]
        for r in rows
        if r["tree"] == "patched" and r["kind"] == "cached_B"
    }
    control = {
        (r["rep"], r["S"]): r["ttft_s"]
        for r in rows
        if r["tree"] == "patched" and r["kind"] == "control_B"
    }
    assert by_rep[3] == sorted(want[(3, s)] / control[(3, s)] for s in SHARED)
    # A repetition without its control (or without a time) is left out.
    rows = [r for r in rows if not (r["rep"] == 3 and r["kind"] == "control_B")]
    assert 3 not in ttft_stats.control_by_rep(rows, "patched")


def test_per_s_and_pooled_over_whole_repetitions() -> None:
    rows = _rows({"unpatched": 5.0, "patched": 1.1})
    summary = ttft_stats.summarize(rows)
    lines = [s for s in summary if s.get("ratio_control")]
    assert [s["kind"] for s in lines] == ["cached_B"] * 4  # only on cached B's lines
    for line in lines:
        sel = [r for r in rows if r["S"] == line["S"]]
        ratios = [g[0] for g in ttft_stats.control_by_rep(sel, "patched").values()]
        patched = line["ratio_control"]["patched"]
        assert patched["n"] == 10 and patched["median"] == pytest.approx(statistics.median(ratios))
        # One ratio per repetition at one S: the bootstrap of the values.
        assert patched["ci95"] == pytest.approx(list(ttft_stats.bootstrap_median_ci(ratios)))
    pooled = ttft_stats.control_pooled(summary)
    by_rep = ttft_stats.control_by_rep(rows, "patched")
    assert pooled["patched"]["n"] == 40 and pooled["patched"]["S"] == list(SHARED)
    assert pooled["patched"]["ci95"] == pytest.approx(
        list(ttft_stats.cluster_bootstrap_median_ci(list(by_rep.values())))
    )
    assert pooled["patched"]["bar"] == "met"
    assert pooled["unpatched"]["median"] == pytest.approx(5.0, rel=0.05)
    assert pooled["unpatched"]["bar"].startswith("missed (median 5.")


def test_the_bar_reads_the_median_and_the_upper_end() -> None:
    verdict = ttft_stats.control_verdict
    assert verdict({"median": 1.20, "ci95": [1.1, 1.35]}) == "met"
    assert verdict({"median": 1.21, "ci95": [1.1, 1.30]}) == "missed (median 1.21)"
    assert verdict({"median": 1.10, "ci95": [1.0, 1.36]}) == "missed (median 1.10)"


def test_a_run_without_the_control_shows_nothing() -> None:
    rows = [r for r in _rows({"unpatched": 2.0, "patched": 1.0}) if r["kind"] != "control_B"]
    summary = ttft_stats.summarize(rows)
    assert not any("ratio_control" in s for s in summary)
    assert ttft_stats.control_pooled(summary) is None
    assert ttft_stats.control_lines(summary) == []


def test_bench_md_shows_the_control_table() -> None:
    rows = _rows({"unpatched": 5.0, "patched": 1.6})
    report = {
        "summary": ttft_stats.summarize(rows),
        "pooled_ratios": ttft_stats.pooled_ratios(rows),
    }
    text = "\n".join(md_blocks.result_blocks(report, "caption"))
    assert "Cached B against its control" in text
    assert "| pooled " in text and "missed (median 1.6" in text
    for shared in SHARED:
        assert f"| {shared} " in text


def test_the_client_server_gap_is_counted_per_tree_and_kind() -> None:
    """bench.md says how much of each client TTFT the HTTP hop and the API server took
    (client TTFT minus vLLM's own), and which requests took more than 10 ms there."""
    rows = [
        {"tree": "unpatched", "kind": "cached_B", "ttft_s": 0.0330, "server_ttft_s": 0.0300},
        {"tree": "unpatched", "kind": "repeat_B", "ttft_s": 0.0450, "server_ttft_s": 0.0100},
        {"tree": "patched", "kind": "cached_B", "ttft_s": 0.0220, "server_ttft_s": 0.0200},
        {"tree": "patched", "kind": "cold_A", "ttft_s": 0.1000, "server_ttft_s": None},
    ]
    gap = ttft_stats.hop_gap(rows)
    assert gap["unpatched"]["n"] == 2 and gap["unpatched"]["over"] == {"repeat_B": 1}
    assert gap["unpatched"]["max_ms"] == pytest.approx(35.0)
    assert gap["patched"] == {
        "n": 1,
        "median_ms": pytest.approx(2.0),
        "max_ms": pytest.approx(2.0),
        "over": {},
    }
    (line, _) = ttft_stats.hop_lines(gap)
    assert "unpatched median 19.0 ms, max 35.0 ms, above 10 ms: repeat_B 1 (of 2)" in line
    assert "patched median 2.0 ms, max 2.0 ms, above 10 ms: none (of 1)" in line
    assert ttft_stats.hop_gap([{**rows[3], "tree": "unpatched"}]) is None
    assert ttft_stats.hop_lines(None) == []
