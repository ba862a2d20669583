"""`make turn-cost` beside a running bench: it takes the bench's lock (one measuring
job per checkout, kit.bench.bench_lock) and refuses in one line, and it writes its
results file beside and renames it, so a stopped or failed write never leaves half a
committed file. The measuring children are stood in for; nothing runs vLLM."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kit.bench import bench_lock, ttft, turn_cost

pytestmark = pytest.mark.cpu


def _rows(tree: str, reps: int, shared: int, path: str, one_process: bool = False) -> list[dict]:
    return [
        {"tree": tree, "path": path, "rep": rep, "turn": turn, "wall_s": 0.1 * turn + rep}
        | {"step_n": 9}
        for rep in range(reps)
        for turn in (1, 2)
    ]


@pytest.fixture(autouse=True)
def own_lock(tmp_path: Path, monkeypatch) -> None:
    """A lock file of the test's own: a bench running in this checkout stays unseen."""
    monkeypatch.setattr(bench_lock, "LOCK", tmp_path / "bench.lock")


def test_turn_cost_beside_a_bench_refuses_in_one_line(tmp_path: Path, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("turn-cost measured beside a running bench")

    monkeypatch.setattr(turn_cost, "_run_tree", never)
    out = tmp_path / "turn-cost.json"
    with bench_lock.bench_lock():  # what a running bench holds
        assert turn_cost.main(["--reps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: another bench or turn-cost is running")
    assert f"(pid {os.getpid()})" in err[0] and "wait for it" in err[0]
    assert not out.exists()


def test_turn_cost_that_cannot_finish_its_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.setattr(turn_cost, "_run_tree", _rows)
    out = tmp_path / "turn-cost-internal.json"
    out.write_text('{"the committed": "record"}\n')
    write_text = Path.write_text

    def full_disk(self: Path, data: str, *args, **kwargs) -> int:
        write_text(self, data[:20], *args, **kwargs)  # half of it, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        turn_cost.main(["--reps", "1", "--out", str(out)])
    monkeypatch.setattr(Path, "write_text", write_text)
    assert out.read_text() == '{"the committed": "record"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.lock", out.name]


def test_turn_cost_writes_its_file_under_the_lock(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(turn_cost, "_run_tree", _rows)
    out = tmp_path / "turn-cost-internal.json"
    assert turn_cost.main(["--reps", "2", "--out", str(out)]) == 0
    assert {r["tree"] for r in json.loads(out.read_text())["rows"]} == set(ttft.TREES)
