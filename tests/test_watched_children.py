"""The kit's long-running children outside the bench die with the kit, ``kill -9``
included (``kit.process_group.WatchedPopen``: a process group of their own and a
watchdog that stops it when the kit is gone): the container flow's ``buildah run``
processes (``kit.images.containers._ProcessContainer``) and its network-namespace
holder (``BuildahEngine.network``), the upstream suite's pytest runs
(``kit.vllm_tree.upstream_suite.start_suite``), and the image builds, debootstrap
and the suites inside an image (``kit.process_group.run_watched``). The bench's
servers have their own test (tests/bench/test_faults_servers.py). Each kit here is a
small driver that starts the child the way the kit does, with a stand-in command; the
test SIGKILLs the driver."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kit.process_group import WatchedPopen, group_members
from tests.bench.test_bench_faults import alive

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent

# The child: it starts a grandchild (both in the child's group), writes both pids
# into the file it is given, then sleeps.
CHILD = r"""
import os, subprocess, sys, time
state = sys.argv[1]
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with open(state + ".tmp", "w") as f:
    f.write(f"{os.getpid()}\n{grand.pid}\n")
os.replace(state + ".tmp", state)
time.sleep(3600)
"""

# The kit: starts the child the way ``how`` says, then waits to be killed.
DRIVER = r"""
import sys, time, types
from pathlib import Path
how, child, state, home = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
command = [sys.executable, child, state]
if how == "container":
    from kit.images import containers
    box = containers._ProcessContainer("box", command)
elif how == "upstream-suite":
    from kit.vllm_tree import upstream_suite
    upstream_suite.exclusions = lambda release: {}
    upstream_suite.suite_paths = lambda tests_dir: []
    upstream_suite.suite_env = lambda tree, tests_dir: None
    upstream_suite.pytest_command = lambda tree, tests_dir, *args: command
    tree = types.SimpleNamespace(release="stand-in", from_sdist=False)
    proc, junit = upstream_suite.start_suite("patched", home, home, tree)
elif how == "image-build":
    # The image builds, debootstrap and the suites in an image (run_watched).
    from kit.process_group import run_watched
    run_watched(command, check=True)
elif how == "network-holder":
    from kit.images import containers
    engine = containers.BuildahEngine(storage=())
    with engine.network() as net:
        holder = engine.holders[net.name]
        Path(state).write_text(f"{holder.pid}\n")
        time.sleep(3600)
print("started", flush=True)
time.sleep(3600)
"""


@pytest.fixture()
def leftovers() -> Iterator[Callable[[list[int]], None]]:
    """Whatever the test registers is SIGKILLed at the end, so a failing test leaves
    nothing running for the next."""
    pids: list[int] = []
    yield pids.extend
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _can_unshare_net() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30
    )
    return done.returncode == 0


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("how", ["container", "upstream-suite", "image-build", "network-holder"])
def test_kill_9_of_the_kit_stops_its_watched_children(how: str, tmp_path: Path, leftovers) -> None:
    if how == "network-holder" and not _can_unshare_net():
        pytest.skip("no network namespace here (BuildahEngine.network needs unshare as root)")
    child, state = tmp_path / "child.py", tmp_path / "pids"
    child.write_text(CHILD)
    driver = [sys.executable, "-c", DRIVER, how, str(child), str(state), str(tmp_path)]
    kit = subprocess.Popen(
        driver, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    leftovers([kit.pid])
    deadline = time.monotonic() + 60
    while not state.is_file():
        assert kit.poll() is None, kit.communicate()[0]
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.1)
    pids = [int(line) for line in state.read_text().split()]
    leftovers(pids)
    assert pids and all(alive(p) for p in pids)
    assert all(os.getpgid(p) != os.getpgid(kit.pid) for p in pids)  # a group of their own
    kit.kill()
    kit.communicate(timeout=60)
    assert _wait_gone(pids, 30) == [], f"{how}: children outlived the kit"


def test_a_watched_child_stopped_by_the_kit_takes_its_group_and_watchdog(
    tmp_path: Path, leftovers
) -> None:
    child, state = tmp_path / "child.py", tmp_path / "pids"
    child.write_text(CHILD)
    log = tmp_path / "log"
    proc = WatchedPopen([sys.executable, str(child), str(state)], watch_log=log)
    leftovers([proc.pid, proc.watchdog.process.pid])
    deadline = time.monotonic() + 60
    while not state.is_file():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.1)
    pids = [int(line) for line in state.read_text().split()]
    leftovers(pids)
    assert set(group_members(proc.pid)) >= set(pids)
    proc.stop(grace=5)
    assert group_members(proc.pid) == [] and proc.returncode is not None
    # Told "done", the watchdog exits at once and stops nothing.
    assert proc.watchdog.process.wait(timeout=10) == 0
    assert "stopping" not in log.read_text()
    proc.stop(grace=5)  # twice is harmless


def test_run_watched_returns_like_subprocess_run_and_releases_its_watchdog(
    tmp_path: Path,
) -> None:
    """``run_watched`` as the image builds use it: output captured, the exit status
    checked (``CalledProcessError``), a timeout stops the child's whole group, and a
    child that ended by itself leaves no watchdog behind."""
    from kit.process_group import run_watched

    done = run_watched([sys.executable, "-c", "print('built')"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "built\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_watched([sys.executable, "-c", "raise SystemExit(3)"], check=True)
    child, state = tmp_path / "child.py", tmp_path / "pids"
    child.write_text(CHILD)
    with pytest.raises(subprocess.TimeoutExpired):
        run_watched([sys.executable, str(child), str(state)], timeout=5)
    pids = [int(line) for line in state.read_text().split()]
    assert _wait_gone(pids, 30) == []
