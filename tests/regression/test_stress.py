"""Many requests over one context at once: no chunk starts from a wrong Mamba state.

``kit.rig.stress`` adds waves of requests (random shared lengths, probes and long
tails, a step budget that cuts prefills, arrivals while others prefill) to the
real scheduler and checks every resume and every prefill chunk against the
ledger, on every checkpoint path. The tree under test carries
``fix-mamba-mid-block-resume-stop`` (both stages): without it the internal
paths publish a stale block-boundary state (``mods/fix-mamba-mid-block-resume-stop``).
"""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kit.geometry.geometry_model import REGIMES, Geometry
from kit.rig.stress import run_seed, stress

pytestmark = [pytest.mark.cpu, pytest.mark.tree]


@pytest.mark.parametrize("regime", REGIMES)
def test_no_chunk_starts_from_a_wrong_state(
    tiny_model_dir, tree_is_patched: bool, regime: str
) -> None:
    found = stress(tiny_model_dir, range(3), (regime,), fix=tree_is_patched)
    assert found[regime] == []


def test_the_reported_reproducer_is_clean(tiny_model_dir, tree_is_patched: bool) -> None:
    """The case the mod README reports: block 384, budget 1536, seed 1, no drafting."""
    for regime in ("internal-1", "internal-grid"):
        geo = Geometry(384, num_spec=0, budget=1536, checkpoints=regime)
        assert run_seed(tiny_model_dir, geo, 1, fix=tree_is_patched) == []


@pytest.fixture
def no_mid_block_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the split invariant: a chunk that starts mid-block is never clipped,
    so it runs past the block boundary whose state it should have written."""
    original = Scheduler._mamba_block_aligned_split

    def unclipped(self, request, num_new_tokens, local=0, external=0):
        start = request.num_computed_tokens + local + external
        if start % self.cache_config.block_size:
            return num_new_tokens
        return original(self, request, num_new_tokens, local, external)

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", unclipped)


@pytest.mark.usefixtures("no_mid_block_stop")
@pytest.mark.parametrize("regime", ["split", "internal-1"])
def test_the_stress_finds_a_broken_invariant(tiny_model_dir, regime: str) -> None:
    found = stress(tiny_model_dir, range(3), (regime,), num_spec=(0,))
    stale = found[regime]
    assert stale, "the stress did not notice chunks running past their block"
    # What it finds is the symptom the mod fixes: a boundary state of fewer tokens.
    assert any(v["same_prefix"] and v["state_covers"] < v["position"] for v in stale)
