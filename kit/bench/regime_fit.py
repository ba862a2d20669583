"""Which checkpoint regime a served model's server ran, read off its own hits.

How a server materialises Mamba/GDN states (``Geometry.checkpoints``: split,
internal-1, internal-grid) is the kit's to set only on the CPU, where its trees and
the CPU GDN export switch decide it. On a GPU target vLLM decides by its kernel
(FlashInfer GDN exports on a grid, Triton, HIP, CuteDSL, AITER FlyDSL and XPU's
SYCL GDN do with the fix's exports switched on, Mamba2 at any offset), and on some
geometries a cached follow-up's hit differs between regimes (blocks of 528 or
1056 tokens at S = 2048 under lookahead hashes: the split path keeps the block
boundary's state, the internal regimes do not). So a served run records, per
request that depends on it, the hit each regime predicts, and each tree is
judged against the one regime that predicts all of its hits; a tree no regime
explains fails as before.
"""

from __future__ import annotations

from kit.geometry.geometry_model import REGIMES
from kit.vllm_tree.trees import TREE_NAMES as TREES

# The row field with each regime's expected hit (``ttft.pair_requests``).
BY_REGIME = "expected_by_regime"


def fitting_regimes(rows: list[dict], tree: str) -> list[str]:
    """The regimes whose expectations every regime-dependent row of ``tree`` meets."""
    judged = [r for r in rows if r["tree"] == tree and BY_REGIME in r]
    return [
        regime
        for regime in REGIMES
        if all(r["cached_tokens"] == r[BY_REGIME][regime] for r in judged)
    ]


def fit(rows: list[dict], assumed: str) -> dict[str, dict]:
    """Per tree: the regime its hits fit (``assumed`` where it fits, else the first
    that does, its rows then judged by it) and every regime that fits. A tree no
    regime fits keeps ``assumed`` and its failing rows."""
    out = {}
    for tree in TREES:
        fits = fitting_regimes(rows, tree)
        chosen = assumed if assumed in fits or not fits else fits[0]
        if chosen != assumed:
            for row in rows:
                if row["tree"] == tree and BY_REGIME in row:
                    row["expected_cached"] = row[BY_REGIME][chosen]
                    row["hit_ok"] = row["cached_tokens"] == row["expected_cached"]
        out[tree] = {"regime": chosen, "fits": fits, "observed": True}
    return out


def assumed(regime: str) -> dict[str, dict]:
    """Per tree: the regime the kit set (the CPU), not read off the hits."""
    return {tree: {"regime": regime, "fits": None, "observed": False} for tree in TREES}
