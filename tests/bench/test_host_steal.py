"""Host pauses: the steal counter the bench reads around each request, and the pooled
ratios that leave the paused pairs out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kit.bench import host_steal, ttft_stats

STAT = """cpu  3880831 0 553096 7182112 37624 0 6873 {total} 0 0
cpu0 1940000 0 276000 3591000 18000 0 3400 {cpu0} 0 0
cpu1 1940831 0 277096 3591112 19624 0 3473 {cpu1} 0 0
intr 1 2 3
ctxt 123
"""


def _stat(tmp_path: Path, cpu0: int, cpu1: int) -> Path:
    path = tmp_path / "stat"
    path.write_text(STAT.format(total=cpu0 + cpu1, cpu0=cpu0, cpu1=cpu1))
    return path


def test_steal_is_the_most_any_one_cpu_counted(tmp_path: Path) -> None:
    # A host pause stops every vCPU at once: summing the CPUs would count it twice.
    ticks = os.sysconf("SC_CLK_TCK")
    assert host_steal.steal_s(_stat(tmp_path, 40, 55)) == pytest.approx(55 / ticks)


def test_no_counter_no_number(tmp_path: Path) -> None:
    assert host_steal.steal_s(tmp_path / "missing") is None
    short = tmp_path / "short"
    short.write_text("cpu0 1 2 3 4\n")
    assert host_steal.steal_s(short) is None
    assert host_steal.stolen_between(None, 1.0) is None
    assert host_steal.stolen_between(1.0, 1.25) == pytest.approx(0.25)


def test_this_machine_reports_a_counter_that_never_goes_back() -> None:
    first = host_steal.steal_s()
    if first is None:
        pytest.skip("no /proc/stat steal counter here")
    assert host_steal.steal_s() >= first


def _row(tree: str, rep: int, kind: str, ttft: float, stolen: float | None) -> dict:
    return {"tree": tree, "rep": rep, "S": 1007, "kind": kind, "ttft_s": ttft, "stolen_s": stolen}


def test_paused_pairs_are_left_out_of_the_second_pooling() -> None:
    rows = []
    for rep in range(4):
        rows.append(_row("unpatched", rep, "turn2", 0.050, 0.0))
        # Repetition 1: the host paused the patched request by 100 ms.
        paused = rep == 1
        rows.append(_row("patched", rep, "turn2", 0.150 if paused else 0.051, 0.1 if paused else 0))
    every = {p["group"]: p for p in ttft_stats.pooled_ratios(rows)}
    unpaused = {p["group"]: p for p in ttft_stats.pooled_ratios(rows, drop_paused=True)}
    assert every["turn2-turn4"]["n"] == 4 and every["turn2-turn4"]["max"] == pytest.approx(3.0)
    assert unpaused["turn2-turn4"]["n"] == 3
    assert unpaused["turn2-turn4"]["max"] == pytest.approx(1.02)
    assert ttft_stats.host_pauses(rows) == {
        "unpatched": {"requests": 4, "paused": 0},
        "patched": {"requests": 4, "paused": 1},
    }
    report = {
        "host_pauses": ttft_stats.host_pauses(rows),
        "pooled_ratios_unpaused": list(unpaused.values()),
    }
    lines = ttft_stats.unpaused_lines(report)
    assert "patched 1 of 4" in lines[0] and any("| turn2-turn4" in line for line in lines)


def test_rows_without_a_steal_reading_give_no_second_pooling() -> None:
    # Bundles from before the kit recorded steal, or a kernel without the counter.
    rows = [_row(tree, 0, "turn2", 0.05, None) for tree in ("unpatched", "patched")]
    assert ttft_stats.host_pauses(rows) is None
    assert ttft_stats.unpaused_lines({"host_pauses": None}) == []
    for r in rows:
        del r["stolen_s"]
    assert ttft_stats.host_pauses(rows) is None
