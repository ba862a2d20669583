"""The end-to-end oracle's verdicts and the bench's failure list (no server needed)."""

from __future__ import annotations

import math

import pytest

from kit.bench import ttft_stats
from kit.bench.oracle import first_position_diff, judge

pytestmark = pytest.mark.cpu

COLD = [{7: -1.0, 8: -1.5, 9: -3.0}, {4: -0.5, 5: -0.6}]


def test_same_state_same_tokens_is_same() -> None:
    near = [{7: -1.00001, 8: -1.50002, 9: -3.0}, {4: -0.5, 5: -0.6}]
    verdict = judge([7, 4], [7, 4], near, COLD, tolerance=0.005)
    assert verdict.kind == "same" and verdict.split_at is None
    assert verdict.first_logprob_diff == pytest.approx(2e-5)


def test_later_split_with_matching_first_position_is_a_tie() -> None:
    near = [{7: -1.0, 8: -1.5, 9: -3.0}, {5: -0.55, 4: -0.56}]
    verdict = judge([7, 5], [7, 4], near, COLD, tolerance=0.005)
    assert (verdict.kind, verdict.split_at) == ("tie", 1)


def test_first_position_beyond_tolerance_is_wrong_even_with_equal_tokens() -> None:
    off = [{7: -1.2, 8: -1.5, 9: -3.0}, {4: -0.5, 5: -0.6}]
    assert judge([7, 4], [7, 4], off, COLD, tolerance=0.005).kind == "wrong"


def test_missing_top_token_is_wrong() -> None:
    assert first_position_diff({1: -0.1, 8: -1.5}, COLD[0]) == math.inf
    assert judge([1, 4], [7, 4], [{1: -0.1, 8: -1.5}], COLD).kind == "wrong"


def test_failures_name_tree_s_and_repetition() -> None:
    rows = [
        {
            "tree": "patched",
            "S": 1007,
            "rep": 3,
            "kind": "cached_B",
            "hit_ok": False,
            "cached_tokens": 0,
            "expected_cached": 976,
            "oracle": {"verdict": "wrong", "first_logprob_diff": 0.04},
        },
        {
            "tree": "unpatched",
            "S": 900,
            "rep": 0,
            "kind": "turn2",
            "hit_ok": True,
            "cached_tokens": 928,
            "expected_cached": 928,
        },
    ]
    lines = ttft_stats.failures(rows, distinct_cold=3)
    assert len(lines) == 2
    assert all("patched S=1007 rep=3" in line for line in lines)
    assert ttft_stats.failures(rows[1:], distinct_cold=1) == [
        "ORACLE: every cold request got the same answer: it proves nothing"
    ]
