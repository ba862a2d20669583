"""Multi-turn conversations on vLLM 0.34.0's trees, the fix's primary line.

tests/regression/test_conversation.py (continuations, exact resends, twenty-turn
conversations, a later turn's sibling) runs here on the newest release's
unpatched and patched trees (``KIT_TREE=0.34.0/<stage>``), where vLLM hashes
with lookahead tokens and, patched, the layer writes the fix's states from the
pass; the rig's geometry takes the tree's hashing, so each hit is the geometry
model's for that tree. CI's own runs of that file cover the pinned trees.

Here, not in tests/regression: the release trees are built from their sdist on
the host; the images run tests/regression with the network cut off.
"""

from __future__ import annotations

import pytest

from tests.mods.release_side import RELEASE, suite_outcomes

pytestmark = pytest.mark.cpu

SUITE = "tests/regression/test_conversation.py"
# The file's cases (parametrisations included) on any tree.
CASES = 63


@pytest.mark.parametrize("stage", ["unpatched", "patched"])
def test_every_conversation_case_passes_on_the_newest_release(
    stage: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    report = tmp_path_factory.mktemp(f"conversation-{RELEASE}-{stage}") / "junit.xml"
    outcomes = suite_outcomes(SUITE, f"{RELEASE}/{stage}", report)
    assert len(outcomes) == CASES, outcomes
    assert set(outcomes.values()) == {"passed"}, outcomes
