"""A served model's checkpoint regime, read off its hits (``kit.bench.regime_fit``).

The expectations are the geometry model's own (``ttft.bench_case``), for a geometry
where the regimes disagree: 1056-token blocks, S = 2048, lookahead hashes. There the
unpatched split path keeps the block boundary's state and cached B resumes at 1056,
while under either internal regime (FlashInfer GDN on GB10, for instance) it resumes
at 0: a bench that assumed the split path would fail a correct GB10 server.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kit.bench import regime_fit, ttft
from kit.geometry.geometry_model import REGIMES, Geometry, expected

GEO = Geometry(1056, 16, 1, hash_lookahead=1)
SHARED = (900, 1007, 2048, 2159)


def predicted(regime: str, patched: bool, shared: int) -> dict[str, int]:
    return {
        r: expected(
            ttft.bench_case(replace(GEO, checkpoints=r), shared), patched=patched, lookahead=1
        ).hit
        for r in REGIMES
    }


def rows(served: dict[str, str]) -> list[dict]:
    """Cached B rows of two repetitions at every S, each tree hitting as vLLM does
    under the regime ``served`` names, judged as a bench assuming the split path."""
    out = []
    for tree, regime in served.items():
        patched = tree == "patched"
        for rep in (0, 1):
            for shared in SHARED:
                by_regime = predicted(regime, patched, shared)
                hit = by_regime[regime]
                out.append(
                    {
                        "tree": tree,
                        "rep": rep,
                        "S": shared,
                        "kind": "cached_B",
                        "cached_tokens": hit,
                        "expected_cached": by_regime["split"],
                        "hit_ok": hit == by_regime["split"],
                        regime_fit.BY_REGIME: by_regime,
                    }
                )
        out.append({"tree": tree, "rep": 0, "S": 900, "kind": "turn2", "cached_tokens": 1})
    return out


def test_the_regimes_disagree_here() -> None:
    """The premise: unpatched at S = 2048, split 1056 against 0 on both internal regimes."""
    assert predicted("split", False, 2048) == {"split": 1056, "internal-1": 0, "internal-grid": 0}


def test_a_server_on_another_regime_is_judged_by_it() -> None:
    """GB10 on 0.34.0: FlashInfer exports on the grid on both trees. Assumed split,
    the unpatched rows at S = 2048 would fail; the hits fit internal-grid (and
    internal-1, which predicts the same here), and are judged by the first."""
    got = rows({"unpatched": "internal-grid", "patched": "internal-grid"})
    assert not all(r["hit_ok"] for r in got if "hit_ok" in r)
    regimes = regime_fit.fit(got, "split")
    assert regimes["unpatched"] == {
        "regime": "internal-1",
        "fits": ["internal-1", "internal-grid"],
        "observed": True,
    }
    assert all(r["hit_ok"] for r in got if "hit_ok" in r)
    assert {r["expected_cached"] for r in got if r["tree"] == "unpatched" and r["S"] == 2048} == {0}


def test_the_assumed_regime_stays_where_it_fits() -> None:
    """Strix on 0.34.0: unpatched split (HIP without the fix's exports), patched on
    the grid; the patched tree's hits fit every regime here, so it keeps the assumed."""
    got = rows({"unpatched": "split", "patched": "internal-grid"})
    regimes = regime_fit.fit(got, "split")
    assert regimes["unpatched"]["regime"] == "split"
    assert regimes["patched"] == {"regime": "split", "fits": list(REGIMES), "observed": True}


def test_hits_no_regime_explains_still_fail() -> None:
    got = rows({"unpatched": "split", "patched": "split"})
    bad = next(r for r in got if r["tree"] == "unpatched" and r["S"] == 2048)
    bad["cached_tokens"] = 512
    bad["hit_ok"] = False
    regimes = regime_fit.fit(got, "split")
    assert regimes["unpatched"] == {"regime": "split", "fits": [], "observed": True}
    assert not bad["hit_ok"]


@pytest.mark.parametrize("regime", REGIMES)
def test_the_kit_set_regime_is_not_read_off_the_hits(regime: str) -> None:
    assert regime_fit.assumed(regime)["patched"] == {
        "regime": regime,
        "fits": None,
        "observed": False,
    }
