"""A write the disk refuses (full, over quota, past the file size limit): bundle writes
go beside and are renamed, so the old file stays and no ``.tmp`` is left, and the bench
says in one line which path and what to do, naming failed.json only where it exists."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit import bundle
from kit.bench import bench_lock
from kit.bench import run as bench
from kit.paths import ROOT

pytestmark = pytest.mark.cpu

LIMITS = pytest.mark.parametrize(
    "code,todo", [(errno.ENOSPC, "free space"), (errno.EFBIG, "ulimit -f")], ids=["ENOSPC", "EFBIG"]
)


def _refusing(monkeypatch, code: int) -> None:
    """Every Path.write_text writes a little, then fails as the disk would."""
    write_text = Path.write_text

    def refused(self: Path, data: str, *args, **kwargs) -> int:
        write_text(self, data[:8], *args, **kwargs)
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(Path, "write_text", refused)


@LIMITS
def test_a_refused_write_keeps_the_old_file_and_leaves_no_tmp(
    tmp_path: Path, monkeypatch, code: int, todo: str
) -> None:
    path = tmp_path / "bench.json"
    path.write_text('{"old": 1}\n')
    _refusing(monkeypatch, code)
    with pytest.raises(OSError) as caught:
        bundle.write_json(path, {"new": list(range(100))})
    monkeypatch.undo()
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    line = bundle.write_problem(caught.value)
    assert line.startswith(f"{path}.tmp: ") and todo in line


@LIMITS
def test_a_bench_stopped_by_the_disk_is_one_line_naming_the_path(
    tmp_path: Path, monkeypatch, capsys, code: int, todo: str
) -> None:
    monkeypatch.setattr(bench_lock, "LOCK", tmp_path / "bench.lock")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    out = tmp_path / "out"

    def refused(*args, **kwargs):
        _refusing(monkeypatch, code)  # failed.json meets the same disk
        raise OSError(code, os.strerror(code), str(out / bundle.RAW))

    monkeypatch.setattr(bench, "run", refused)
    assert bench.main(["--shared", "900", "--model-dir", str(model), "--out", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {out / bundle.RAW}: ") and todo in lines[0], lines[0]
    assert f"no {bundle.FAILED}" in lines[0] and f"with {bundle.FAILED}" not in lines[0]
    assert not list(out.glob("*.tmp")) and not (out / bundle.FAILED).exists()


def test_the_file_size_limit_is_an_error_not_a_kill(tmp_path: Path) -> None:
    """Under ``ulimit -f`` a write past the limit raises EFBIG (Python ignores SIGXFSZ)
    and leaves neither the file nor its ``.tmp``."""
    child = (
        "import errno, sys; from pathlib import Path; from kit import bundle\n"
        "try:\n"
        "    bundle.write_json(Path(sys.argv[1]), {'rows': list(range(5000))})\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno]); print(bundle.write_problem(exc))\n"
    )
    path = tmp_path / "big.json"
    done = subprocess.run(
        ["bash", "-c", 'ulimit -f 1 && exec "$0" -c "$1" "$2"', sys.executable, child, str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    code, line = done.stdout.splitlines()
    assert code == "EFBIG" and "ulimit -f" in line
    assert list(tmp_path.iterdir()) == []


def test_failed_json_is_still_written_where_the_disk_allows(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert bench._give_up(out, False, "why", "failed", say=False) == out
    assert json.loads((out / bundle.FAILED).read_text())["reason"] == "why"
