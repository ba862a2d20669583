"""SIGTERM to the upstream-suite runner: every pytest run (pristine, unpatched, patched,
and what each started) ends,
and the committed logs and junit files stay as they were. The runner's own code
path (kit.vllm_tree.upstream_suite.main) runs in a subprocess; only the suite is a stand-in
that never finishes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HANGING_TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_never_finishes():
    state = Path(os.environ["KIT_TEST_STATE"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    (state / f"{os.getpid()}-{child.pid}").write_text("")
    time.sleep(3600)
"""

DRIVER = """
import sys
from pathlib import Path
from kit.vllm_tree import releases, trees, upstream_suite
tests_dir, package, out = map(Path, sys.argv[1:4])
upstream_suite.extract_tests = lambda sdist, version=None: tests_dir
upstream_suite.sdists.release = lambda version, explicit=None: tests_dir
# Every stage's tree is the stand-in package; the last one carries the fix.
releases.trees_of = lambda version: {
    stage: trees.Tree(stage, package, stock=stage == releases.STOCK)
    for stage in releases.STAGES
}
trees.Tree.patched = property(lambda tree: tree.name == releases.STAGES[-1])
trees.Tree.release = property(lambda tree: "0.0.0")  # the stand-in package has no version
sys.exit(upstream_suite.main(["--out", str(out)]))
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_both_runs_and_keeps_the_committed_logs(
    tmp_path: Path, monkeypatch, sig: signal.Signals, code: int, inherited: str
) -> None:
    """``inherited``: how the runner's parent left SIGINT. A background job of a script
    starts with it ignored, and a runner that relied on Python's own Ctrl-C handling
    then never stopped (a CI run hung here)."""
    tests_dir, package, out, state = (tmp_path / n for n in ("t", "vllm", "out", "state"))
    suite = tests_dir / "tests/v1/core/prefix_cache"
    for folder in (suite, package, out, state):
        folder.mkdir(parents=True)
    (suite / "test_hang.py").write_text(HANGING_TEST)
    (tests_dir / "pytest.ini").write_text("[pytest]\n")
    committed = {}
    for name in ("unpatched", "patched"):
        for suffix in ("log", "xml"):
            path = out / f"upstream-{name}.{suffix}"
            path.write_text(f"the committed {name} {suffix}\n")
            committed[path] = path.read_text()
    monkeypatch.setenv("KIT_TEST_STATE", str(state))
    ignore = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tests_dir), str(package), str(out)],
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignore),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300  # a safety net, not a timing assertion
    while len(list(state.iterdir())) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the two suite runs never started"
        time.sleep(0.1)
    pids = [int(p) for entry in state.iterdir() for p in entry.name.split("-")]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    assert [p for p in pids if alive(p)] == []
    assert {p: p.read_text() for p in committed} == committed
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in committed)


def test_the_comparison_carries_its_schema() -> None:
    """Both writers of upstream-suite.json (this runner and the container flow) write
    the comparison as compare() returns it."""
    from kit import schema
    from kit.vllm_tree import upstream_suite

    report, _, ok = upstream_suite.compare(
        {"unpatched": {"t::a": "passed"}, "patched": {"t::a": "passed"}}
    )
    assert ok and schema.check("upstream-suite", report, "upstream-suite.json") is report
