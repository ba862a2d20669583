"""`make setup` killed outright (kill -9): its pip dies with it (a watched process
group, kit.process_group.WatchedPopen), and holds the setup lock until it is gone, so
the next setup, even one started while the killed one is still a zombie, waits, then
keeps exactly one finished venv (``recover``: the stamp decides which) and strands no
``.venv.old-*``.

The setup runs as a child process on a venv in tmp_path (never the checkout's .venv)
with a stand-in Python (``FAKE_PYTHON``): its ``-m venv`` makes a venv of itself, its
``-m pip install`` writes into that venv (slowly while ``slow`` exists), anything
else (the probes, pip uninstall, the trees step) succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kit.vllm_tree import setup_env
from tests.vllm_tree.test_faults_setup import _alive, _dead_pid, _leftovers, _old_venv

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = r"""#!{python}
import os, shutil, signal, sys, time
from pathlib import Path
control = Path({control!r})
args = sys.argv[1:]
if args[:2] == ["-m", "venv"]:
    (Path(args[2]) / "bin").mkdir(parents=True)
    shutil.copy(sys.argv[0], Path(args[2]) / "bin" / "python")
elif args[:3] == ["-m", "pip", "install"] and (control / "slow").exists():
    venv = Path(sys.argv[0]).parent.parent
    (control / "pip.tmp").write_text(str(os.getpid()))
    os.replace(control / "pip.tmp", control / "pip.pid")
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(time.monotonic()))
    # Writes into the venv as pip does, and goes on for 3 s after a SIGTERM (a pip
    # finishing what it writes); 120 s at most, so a test that fails leaves no runaway.
    start = time.monotonic()
    while time.monotonic() - (stopped or [start])[0] < (3 if stopped else 120):
        try:
            (venv / f"pip-{{os.getpid()}}").write_text(str(time.time()))
        except OSError:  # the venv is being moved or removed: write on where it is
            pass
        time.sleep(0.05)
    sys.exit(1)
"""

DRIVER = """
import sys, types
from pathlib import Path
from kit.vllm_tree import pins, setup_env
venv, fake = Path(sys.argv[1]), sys.argv[2]
setup_env.VENV, setup_env.PY = venv, venv / "bin" / "python"
setup_env.STAMP = venv / ".kit-setup.json"
setup_env.kit_installed = lambda: True
python = tuple(int(x) for x in str(pins.get("cpu.python")).split("."))
setup_env.sys = types.SimpleNamespace(
    version_info=(*python, 0, "final", 0),
    version=f"{python[0]}.{python[1]}.0 (fake)",
    executable=fake,  # `-m venv` makes a venv of the stand-in
    stderr=sys.stderr,
)
sys.exit(setup_env.main(sys.argv[3:]))
"""


@pytest.fixture()
def leftovers() -> Iterator[Callable[[int], None]]:
    """Whatever the test registers is SIGKILLed at the end (a failing test leaves no
    stand-in pip running)."""
    pids: list[int] = []
    yield pids.append
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _setup(venv: Path, fake: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(venv), str(fake), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(until: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.mark.parametrize("at_once", [False, True], ids=["after", "while-a-zombie"])
def test_kill_9_of_setup_takes_its_pip_and_the_next_setup_keeps_one_venv(
    tmp_path: Path, leftovers, at_once: bool
) -> None:
    venv, control, fake = tmp_path / "venv", tmp_path / "control", tmp_path / "python"
    control.mkdir()
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, control=str(control)))
    fake.chmod(0o755)
    first = _setup(venv, fake)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, (out, err)
    (venv / "marker").write_text("the working venv\n")
    stamp = (venv / ".kit-setup.json").read_text()

    (control / "slow").touch()
    killed = _setup(venv, fake, "--force")
    leftovers(killed.pid)
    try:
        _wait(lambda: (control / "pip.pid").is_file(), 120, "the stand-in pip never started")
        pip = int((control / "pip.pid").read_text())
        leftovers(pip)
        assert not (venv / "marker").exists()  # the working venv is aside meanwhile
        killed.kill()
        (control / "slow").unlink()
        if at_once:
            # Not reaped: the killed setup is a zombie (its pid still "exists"), its pip
            # still writing (3 s after its SIGTERM). The next setup must wait for the lock.
            _wait(lambda: _state(killed.pid) == "Z", 10, "the killed setup is no zombie")
            assert _alive(pip)
        else:
            killed.wait(timeout=30)
            _wait(lambda: not _alive(pip), 10, "the stand-in pip outlived the killed setup")
        second = _setup(venv, fake)
        out, err = second.communicate(timeout=120)
    finally:
        killed.stdout.close()
        killed.stderr.close()
        killed.wait(timeout=30)
    assert second.returncode == 0, (out, err)
    if at_once:
        assert "another setup is running here; waiting for it" in out, out
    assert not _alive(pip)
    assert _leftovers(venv) == []  # no .venv.old-* (nor trash) stranded
    assert (venv / "marker").read_text() == "the working venv\n"
    assert (venv / ".kit-setup.json").read_text() == stamp
    time.sleep(0.5)  # a pip still running would write on meanwhile
    assert sorted(p.name for p in venv.iterdir()) == [".kit-setup.json", "bin", "marker"]


def _finished_venv(path: Path, text: str, mtime: float) -> None:
    """A finished venv (stamped) whose build finished at ``mtime``."""
    _old_venv(path)
    (path / "marker").write_text(text)
    os.utime(path / ".kit-setup.json", (mtime, mtime))


def test_a_finished_venv_stays_and_every_copy_aside_goes(tmp_path: Path) -> None:
    """A copy aside beside a finished venv (a setup killed between the stamp and the
    removal, or one stranded by an older kit) is never put back over it."""
    venv = tmp_path / "venv"
    _finished_venv(venv, "the new venv\n", time.time())
    _finished_venv(tmp_path / f"venv.old-{_dead_pid()}", "an older venv\n", time.time() - 60)
    (tmp_path / f"venv.trash-{_dead_pid()}" / "lib").mkdir(parents=True)
    setup_env.recover(venv)
    assert (venv / "marker").read_text() == "the new venv\n"
    assert _leftovers(venv) == []


def test_the_newest_finished_copy_replaces_a_half_built_venv(tmp_path: Path, capsys) -> None:
    """Several copies aside (an older kit stranded one): the newest finished one comes
    back, an unfinished one (a half-removed copy, no stamp) never does, the rest go."""
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)  # half of a build
    names = sorted(f"venv.old-{_dead_pid()}" for _ in range(3))
    # The newest first in name order: which one comes back is not the order of names.
    _finished_venv(tmp_path / names[0], "the newest\n", time.time() - 10)
    _finished_venv(tmp_path / names[1], "an older one\n", time.time() - 100)
    (tmp_path / names[2] / "lib").mkdir(parents=True)
    (tmp_path / names[2] / "marker").write_text("half removed\n")
    setup_env.recover(venv)
    assert (venv / "marker").read_text() == "the newest\n"
    assert not (venv / "lib").exists()
    assert _leftovers(venv) == []
    assert f"left in {names[0]}" in capsys.readouterr().out


def test_a_half_built_venv_with_no_finished_copy_is_left_to_the_rebuild(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (tmp_path / f"venv.old-{_dead_pid()}" / "lib").mkdir(parents=True)  # no stamp
    setup_env.recover(venv)
    assert (venv / "lib").is_dir() and _leftovers(venv) == []


def test_each_step_holds_a_copy_of_the_setup_lock(tmp_path: Path) -> None:
    """What makes a setup wait for the pip of a killed one: every step holds the lock's
    descriptor (the folder's), which the kernel lets go only when the step is gone."""
    probe = (
        "import os, sys\n"
        "fds = [os.path.realpath(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')]\n"
        "sys.exit(0 if sys.argv[1] in fds else f'no copy of the setup lock: {fds}')"
    )
    with setup_env._setup_lock(tmp_path / "venv"):
        setup_env.run([sys.executable, "-c", probe, str(tmp_path.resolve())])
    assert setup_env._held_lock == []
    with pytest.raises(setup_env.CommandFailed, match="no copy of the setup lock"):
        setup_env.run([sys.executable, "-c", probe, str(tmp_path.resolve())])  # not under the lock
