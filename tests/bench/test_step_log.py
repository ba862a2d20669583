"""vLLM's iteration log read into per-tree engine-step medians (``kit bench --step-log``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.bench import step_log

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "(APIServer pid=839) INFO 12-04 16:53:07 [loggers.py:199] Engine 000: "


def _line(i: int, ctx: int, gen: int, ms: float, dummy: bool = False) -> str:
    return (
        f"{PREFIX}Iteration({i}): {int(ctx > 0)} context requests, {ctx} context tokens, "
        f"{int(gen > 0)} generation requests, {gen} generation tokens, "
        f"iteration elapsed time: {ms:.2f} ms{' (dummy)' if dummy else ''}, "
        "CPU KV cache usage: 0.7%"
    )


def _log(tmp_path: Path, tree: str, extra_ms: float, tag: str = "") -> Path:
    lines = ['INFO:     127.0.0.1:32782 - "GET /metrics HTTP/1.1" 200 OK']
    for i in range(6):
        lines.append(_line(3 * i, 64, 0, 22.0 + extra_ms + 0.1 * i))
        lines.append(_line(3 * i + 1, 0, 2, 7.8 + 0.01 * i))
        lines.append(_line(3 * i + 2, 0, 0, 0.0, dummy=True))
    if tree == "patched":
        lines.append(_line(99, 1024, 0, 130.0))  # a kind only one tree ran
    path = tmp_path / f"server-{tree}{tag}.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_steps_are_grouped_by_what_they_ran(tmp_path: Path) -> None:
    got = step_log.steps(_log(tmp_path, "patched", 1.0))
    assert sorted(got) == [("decode", 2), ("prefill", 64), ("prefill", 1024)]
    assert len(got[("prefill", 64)]) == 6 and got[("prefill", 64)][0] == pytest.approx(23.0)
    # Dummy steps and other log lines are not steps.
    assert sum(map(len, got.values())) == 13


def test_the_trees_compare_on_the_step_kinds_both_ran(tmp_path: Path) -> None:
    logs = {
        tree: [_log(tmp_path, tree, 1.2 if tree == "patched" else 0.0)]
        for tree in ("unpatched", "patched")
    }
    rows = step_log.from_logs(logs)
    assert [(r["step"], r["tokens"]) for r in rows] == [("decode", 2), ("prefill", 64)]
    prefill = rows[1]
    assert prefill["n"] == {"unpatched": 6, "patched": 6}
    assert prefill["diff_ms"] == pytest.approx(1.2)
    assert rows[0]["diff_ms"] == pytest.approx(0.0)
    text = "\n".join(step_log.lines(rows))
    assert "| prefill | 64 " in text and "| +1.20 " in text and "| +0.00 " in text


def test_a_tree_started_in_several_sessions_pools_its_logs(tmp_path: Path) -> None:
    # One-server runs start each tree's server once per session (server-<tree>-<n>.log).
    logs = {
        tree: [_log(tmp_path, tree, 0.0, f"-{n}") for n in (1, 2)]
        for tree in ("unpatched", "patched")
    }
    prefill = step_log.from_logs(logs)[1]
    assert prefill["n"] == {"unpatched": 12, "patched": 12}


def test_no_log_or_no_iteration_lines_gives_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain.log"
    plain.write_text("nothing to see\n")
    assert step_log.from_logs({"unpatched": [], "patched": [plain]}) is None
    assert step_log.from_logs({"unpatched": [plain], "patched": [plain]}) is None
    assert step_log.lines(None) == []


def test_the_switch_reaches_both_servers_arguments() -> None:
    def plan(*extra: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "kit.bench", "--print-serve-args", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    assert step_log.FLAG in plan("--step-log")["args"]
    assert step_log.FLAG not in plan()["args"]


def test_servers_started_elsewhere_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kit.bench", "--step-log", "--merge-sessions", "x", "--out", "y"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--step-log reads the logs" in done.stderr


def test_the_fence_counts_sum_per_tree_and_name_what_went_wrong(tmp_path: Path) -> None:
    """The fenced fix's step-log lines summed per tree; the bench fails when the server
    under test exported none, or a count falls short of the one before it."""
    line = (
        "INFO [scheduler.py:2503] Mamba checkpoint exports: "
        "{} planned, {} reported written, {} keyed"
    )
    patched = tmp_path / "server-patched.log"
    patched.write_text("\n".join([line.format(2, 2, 2), "noise", line.format(3, 3, 3)]) + "\n")
    unpatched = tmp_path / "server-unpatched.log"
    unpatched.write_text("Iteration(1): no exports here\n")
    counts = step_log.fence({"unpatched": [unpatched], "patched": [patched]})
    assert counts == {"patched": {"steps": 2, "planned": 5, "written": 5, "keyed": 5}}
    assert step_log.fence_problems(counts, "patched") == []
    assert "5 planned, 5 reported written, 5 keyed, in 2 steps" in step_log.fence_lines(counts)[0]
    assert step_log.fence_problems({}, "patched") == [
        "fence: the patched server's step log shows no export of the fix"
    ]
    short = {"patched": {"steps": 1, "planned": 4, "written": 3, "keyed": 2}}
    assert step_log.fence_problems(short, "patched") == [
        "fence: patched planned 4 exports, the worker reported 3 written",
        "fence: patched keyed 2 of 3 exports reported written",
    ]
    assert step_log.fence_lines(None) == []
