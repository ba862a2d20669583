"""vLLM's own per-request times, read from its /metrics histograms around each bench
request, and their pooled ratios beside the client's TTFT."""

from __future__ import annotations

import pytest

from kit.bench import ttft_stats
from kit.bench.openai_client import one_request_times, parse_engine_times

# The lines of a real vLLM 0.32.0 CPU server's /metrics that matter here (buckets cut).
METRICS = """# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{engine="0",le="0.3",model_name="kit-model"}} 40.0
vllm:request_prefill_time_seconds_count{{engine="0",model_name="kit-model"}} {count}
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="kit-model"}} {prefill}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{{engine="0",model_name="kit-model"}} {count}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="kit-model"}} {ttft}
"""


def reading(count: int, prefill: float, ttft: float) -> dict:
    return parse_engine_times(METRICS.format(count=count, prefill=prefill, ttft=ttft))


def test_one_request_is_the_histograms_move() -> None:
    before, after = reading(53, 94.75, 94.99), reading(54, 94.79, 95.035)
    times = one_request_times(before, after)
    assert times["engine_prefill_s"] == pytest.approx(0.04)
    assert times["server_ttft_s"] == pytest.approx(0.045)


@pytest.mark.parametrize("moved", [0, 2])
def test_a_histogram_that_did_not_move_by_one_gives_no_time(moved: int) -> None:
    # Not yet observed (0), or another request in between (2): not this request's time.
    times = one_request_times(reading(53, 1.0, 1.0), reading(53 + moved, 1.5, 1.5))
    assert times == {"engine_prefill_s": None, "server_ttft_s": None}


def test_a_server_without_the_histograms_gives_no_time() -> None:
    assert parse_engine_times("vllm:prefix_cache_hits_total 1.0\n") == {}
    assert one_request_times({}, {}) == {"engine_prefill_s": None, "server_ttft_s": None}


def _row(tree: str, rep: int, ttft: float, engine: float | None) -> dict:
    return {
        "tree": tree,
        "rep": rep,
        "S": 1007,
        "kind": "turn2",
        "ttft_s": ttft,
        "engine_prefill_s": engine,
    }


def test_engine_ratios_pool_the_pairs_that_have_both_times() -> None:
    rows = []
    for rep in range(5):
        rows.append(_row("unpatched", rep, 0.050, 0.020))
        # Repetition 4's patched side has no engine time: its pair drops out there only.
        rows.append(_row("patched", rep, 0.060, None if rep == 4 else 0.021))
    client = {p["group"]: p for p in ttft_stats.pooled_ratios(rows)}
    engine = {p["group"]: p for p in ttft_stats.engine_pooled(rows)}
    assert client["turn2-turn4"]["n"] == 5
    assert client["turn2-turn4"]["median"] == pytest.approx(1.2)
    assert engine["turn2-turn4"]["n"] == 4
    assert engine["turn2-turn4"]["median"] == pytest.approx(1.05)
    lines = ttft_stats.engine_lines({"pooled_ratios_engine_prefill": list(engine.values())})
    assert any("turn2-turn4" in line and "1.05" in line for line in lines)


def test_rows_from_before_the_engine_times_give_no_table() -> None:
    rows = [_row("unpatched", 0, 0.05, None), _row("patched", 0, 0.05, None)]
    for row in rows:
        del row["engine_prefill_s"]
    assert ttft_stats.engine_pooled(rows) is None
    assert ttft_stats.engine_lines({"pooled_ratios_engine_prefill": None}) == []
