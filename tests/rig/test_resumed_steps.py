"""A follow-up that resumes inside a Mamba block prefills in one engine step where
the layer exports, read from every committed regression table (``make regress``).

On the patched tree's internal regimes the fix exports the prompt checkpoint that
vLLM's column rule keeps out of the block table (docs/mid-block-zero-step.md,
case B) and the block boundary a resume inside a block runs past (case A, in place
of the mid-block stop), so every speculative case's B that resumes inside a block
takes one step, on every release, hashing and retention the tables hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.paths import RESULTS

pytestmark = pytest.mark.cpu

TABLES = sorted((RESULTS / "regression").glob("**/internal-*/regression.json"))
# The patched tree's mods that make its layer write several states per row (0.32.0's
# CPU GDN export, 0.34.0's worker side); without one (0.33.0) the fix's states
# and the prompt checkpoint stay chunk ends.
EXTRA_EXPORTS = {"cpu-gdn-prefill-checkpoint", "fix-eagle-fine-prefix-exports"}


def test_every_release_has_internal_tables() -> None:
    assert len(TABLES) >= 6, TABLES


@pytest.mark.parametrize("path", TABLES, ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_a_resume_inside_a_block_is_one_step_patched(path: Path) -> None:
    table = json.loads(path.read_text())
    if not EXTRA_EXPORTS & set(table["mods"]["patched"]):
        pytest.skip(f"vLLM {table['vllm_version']}'s layers export one state per row")
    steps = table.get("resumed_steps")
    assert steps, f"{path}: made before B's engine steps were recorded; run make regress"
    patched = {col: counts for col, counts in steps.items() if col.startswith("patched/")}
    assert patched, steps
    for col, counts in patched.items():
        assert counts["one_step"] > 0, (col, counts)
        assert counts["more_within_block"] == counts["more_across_boundary"] == 0, (col, counts)
