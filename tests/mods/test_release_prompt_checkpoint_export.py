"""The fix's in-pass exports of a resumed prompt on vLLM 0.34.0's patched tree.

tests/regression/test_mid_block_zero_step.py runs here on the release tree
(``KIT_TREE=0.34.0/patched``): a resumed prompt whose checkpoint vLLM's column
rule refuses exports it into a block of its own (one engine step, case B), one
that starts inside a block and runs past its boundary exports the boundary and
takes over the key of the column below it (case A, also read back by a
follow-up resuming there), a step exports at most
``MAMBA_MAX_PROMPT_CHECKPOINT_EXPORTS`` prompt checkpoints, and FlashInfer
GDN's tail cap keeps a mid-block boundary, then each row's prompt checkpoint,
first. On the pinned tree the step budget, the two tail-cap tests and the
lookahead read-back skip (no budget, no tails, legacy hashes only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mods.release_side import RELEASE, suite_outcomes

pytestmark = pytest.mark.cpu

SUITE = "tests/regression/test_mid_block_zero_step.py"


def test_every_case_passes_on_the_release_tree(tmp_path: Path) -> None:
    outcomes = suite_outcomes(SUITE, f"{RELEASE}/patched", tmp_path / "junit.xml")
    assert outcomes.pop("test_mid_block_resume_in_one_pass") == "xfailed", outcomes
    assert len(outcomes) == 9 and set(outcomes.values()) == {"passed"}, outcomes
