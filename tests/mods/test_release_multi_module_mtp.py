"""Multi-module MTP's prefill lookahead on vLLM 0.34.0's unpatched tree.

``fix-mtp-prefill-lookahead-progress`` keeps a chunk that ends fewer than k tokens
before the prefill end. tests/regression/test_multi_module_mtp.py checks on the
pinned tree that this changes only prompts the unmodified rule never finished;
here the same check runs on the newest release, which hashes with lookahead
tokens by default (tests/bench/test_hash_lookahead.py;
``KIT_TREE=0.34.0/unpatched``; both stages carry the mod).
"""

from __future__ import annotations

import pytest

from tests.mods.release_side import RELEASE, suite_outcomes

pytestmark = pytest.mark.cpu

SUITE = (
    "tests/regression/test_multi_module_mtp.py::test_the_kept_chunk_changes_only_prompts_that_hung"
)


def test_the_kept_chunk_changes_only_prompts_that_hung_on_the_newest_release(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    report = tmp_path_factory.mktemp(f"multi-mtp-{RELEASE}") / "junit.xml"
    outcomes = suite_outcomes(SUITE, f"{RELEASE}/unpatched", report)
    assert len(outcomes) == 2, outcomes
    assert set(outcomes.values()) == {"passed"}, outcomes
