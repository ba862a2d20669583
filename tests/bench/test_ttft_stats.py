"""The bench's interval resamples whole repetitions (a cluster bootstrap), not pairs:
the pairs of one repetition share the servers' state and the host's moment, so an
offset common to a repetition must widen the interval instead of averaging out."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from kit.bench import ttft_stats

pytestmark = pytest.mark.cpu

RESULTS = Path(__file__).resolve().parents[2] / "results"
# Two consecutive 10-repetition runs of the same code on the same machine.
BUNDLES = ("20261205-130404-cpu-b13fed", "20261205-130931-cpu-eb23e0")
LATER_TURNS = ("turn2", "turn3", "turn4")


def _pair(rep: int, shared: int, kind: str, unpatched: float, ratio: float) -> list[dict]:
    base = {"rep": rep, "S": shared, "kind": kind}
    return [
        {**base, "tree": "unpatched", "ttft_s": unpatched},
        {**base, "tree": "patched", "ttft_s": unpatched * ratio},
    ]


def _offset_rows(offsets: bool) -> list[dict]:
    """10 repetitions x 4 S x 3 turns; with ``offsets`` every pair of a repetition
    shares that repetition's factor (a slow server state, a busy host moment)."""
    rng = random.Random(3)
    rows = []
    for rep in range(10):
        shift = rng.gauss(0, 0.05) if offsets else 0.0
        for shared in (900, 1007, 2048, 2159):
            for kind in LATER_TURNS:
                rows += _pair(rep, shared, kind, 0.05, 1.0 + shift + rng.gauss(0, 0.01))
    return rows


def _pooled(rows: list[dict], group: str) -> dict:
    return next(p for p in ttft_stats.pooled_ratios(rows) if p["group"] == group)


def test_an_offset_shared_by_a_repetition_widens_the_interval() -> None:
    rows = _offset_rows(offsets=True)
    ratios = ttft_stats.paired_ratios(rows, "ttft_s")
    pairs_low, pairs_high = ttft_stats.bootstrap_median_ci(ratios)
    turns = _pooled(rows, "turn2-turn4")
    low, high = turns["ci95"]
    assert turns["n"] == 120 and turns["median"] == pytest.approx(statistics.median(ratios))
    # 120 pairs but 10 independent repetitions: the pair bootstrap is far too narrow.
    assert high - low > 2 * (pairs_high - pairs_low)
    assert low <= turns["median"] <= high


def test_without_a_shared_offset_both_bootstraps_agree_roughly() -> None:
    rows = _offset_rows(offsets=False)
    pairs_low, pairs_high = ttft_stats.bootstrap_median_ci(ttft_stats.paired_ratios(rows, "ttft_s"))
    low, high = _pooled(rows, "turn2-turn4")["ci95"]
    assert 0.5 < (high - low) / (pairs_high - pairs_low) < 2


def test_a_hand_made_cluster_sample() -> None:
    # Draws of two repetitions from {[1.2, 1.2], [1.2, 1.21]}: the pooled median is 1.205
    # only when both draws are the second (P = 1/4), 1.2 otherwise; the pair bootstrap
    # of the same four ratios reaches 1.21 (P(median = 1.21) = 0.051 > 0.025).
    assert ttft_stats.cluster_bootstrap_median_ci([[1.2, 1.2], [1.21, 1.2]]) == (1.2, 1.205)
    assert ttft_stats.bootstrap_median_ci([1.2, 1.2, 1.2, 1.21]) == (1.2, 1.21)
    rows = [
        *_pair(0, 1007, "cold_B", 0.1, 1.2),
        *_pair(0, 2159, "cold_B", 0.1, 1.2),
        *_pair(1, 1007, "cold_B", 0.2, 1.2),
        *_pair(1, 2159, "cold_B", 0.2, 1.21),
    ]
    assert _pooled(rows, "cold_B")["ci95"] == pytest.approx([1.2, 1.205])
    with pytest.raises(ValueError):
        ttft_stats.cluster_bootstrap_median_ci([])
    with pytest.raises(ValueError):
        ttft_stats.cluster_bootstrap_median_ci([[], []])


def test_one_pair_per_repetition_is_the_pair_bootstrap_draw_for_draw() -> None:
    rng = random.Random(11)
    values = [rng.gauss(1.0, 0.1) for _ in range(10)]
    assert ttft_stats.cluster_bootstrap_median_ci(
        [[v] for v in values]
    ) == ttft_stats.bootstrap_median_ci(values)
    rows = [r for rep, v in enumerate(values) for r in _pair(rep, 2159, "cached_B", 0.2, v)]
    line = ttft_stats.paired_ratio(rows, "ttft_s")
    assert line["ci95"] == list(
        ttft_stats.bootstrap_median_ci(ttft_stats.paired_ratios(rows, "ttft_s"))
    )


def test_the_interval_ignores_row_order_and_repetition_labels() -> None:
    rows = _offset_rows(offsets=True)
    first = _pooled(rows, "turn2-turn4")
    shuffled = rows[:]
    random.Random(5).shuffle(shuffled)
    relabelled = [dict(r, rep=100 - r["rep"]) for r in shuffled]
    assert _pooled(shuffled, "turn2-turn4") == first
    assert _pooled(relabelled, "turn2-turn4") == first


def test_the_method_names_the_repetition() -> None:
    method = ttft_stats.ratio_method()
    assert method["resampled"] == "repetition"
    assert "whole repetitions" in method["interval"]
    assert "over whole repetitions" in ttft_stats.__doc__


@pytest.mark.parametrize("name", BUNDLES)
def test_a_committed_bundle(name: str) -> None:
    """Per S the committed intervals come back unchanged (one pair per repetition);
    pooled over S the later turns' interval widens over whole repetitions."""
    folder = next(f for f in (RESULTS / name, RESULTS / "archive" / name) if f.is_dir())
    rows = json.loads((folder / "raw.json").read_text())
    stored = json.loads((folder / "bench.json").read_text())
    for line in stored["summary"]:
        if line["kind"] != "cached_B":
            continue
        sel = [r for r in rows if (r["S"], r["kind"]) == (line["S"], "cached_B")]
        assert ttft_stats.paired_ratio(sel, "ttft_s")["ci95"] == pytest.approx(
            line["ratio_patched_unpatched"]["ci95"]
        )
    turns = [r for r in rows if r["kind"] in LATER_TURNS]
    ratios = ttft_stats.paired_ratios(turns, "ttft_s")
    old = next(p for p in stored["pooled_ratios"] if p["group"] == "turn2-turn4")
    # The bundle was written with the pair bootstrap: it is recomputed exactly.
    assert list(ttft_stats.bootstrap_median_ci(ratios)) == pytest.approx(old["ci95"])
    new = ttft_stats.paired_ratio(turns, "ttft_s")
    assert new["median"] == pytest.approx(old["median"]) and new["n"] == old["n"] == 120
    assert new["ci95"][1] - new["ci95"][0] > old["ci95"][1] - old["ci95"][0]
