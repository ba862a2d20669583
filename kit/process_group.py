"""A child's whole process group: who is still alive in it, and stopping all of it.

vLLM forks engine-core and worker processes, and pytest forks its workers; killing
only the leader orphans them. The kit starts such children as group leaders
(``start_new_session``) and stops the group, waiting until no member is left.

A group must also go when the kit cannot stop it (``kill -9`` of the kit, a closed
terminal's SIGHUP, an out-of-memory kill): ``Watchdog`` is a small process per
group that does it then (``WatchedPopen`` and ``run_watched`` start a child so; the
bench's servers start theirs themselves). Run as a script (``python process_group.py
--token T``) it is that watchdog, so this module imports nothing but the standard
library.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path


class ProcessGroupError(RuntimeError):
    pass


def _member_states(pgid: int) -> dict[int, str]:
    """Each process of a group and its /proc state letter (zombies included)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name, which is in parentheses and may hold spaces.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            found[int(entry.name)] = fields[0]
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc."""
    return sorted(pid for pid, state in _member_states(pgid).items() if state != "Z")


def parent_pid(pid: int) -> int | None:
    """A process's parent, read from /proc; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_title(pid: int) -> str:
    """A process's first command-line word: its program, or the title it set itself
    (vLLM's ``VLLM::EngineCore``, with setproctitle); "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def pause_group(pgid: int, settle: float = 2.0) -> None:
    """SIGSTOP every member of the group and wait (up to ``settle`` s) until each
    has stopped: the signal takes effect asynchronously, and a member still
    running on the other core would share the machine with whatever comes next."""
    os.killpg(pgid, signal.SIGSTOP)
    deadline = time.monotonic() + settle
    while (
        any(state not in "TtZ" for state in _member_states(pgid).values())
        and time.monotonic() < deadline
    ):
        time.sleep(0.001)


def resume_group(pgid: int) -> None:
    """SIGCONT every member of a group ``pause_group`` stopped."""
    os.killpg(pgid, signal.SIGCONT)


def stop_group(pgid: int, grace: float = 20.0) -> None:
    """SIGTERM the whole group, SIGKILL what is left after ``grace`` s, and wait until
    no member is alive. A group the bench paused (SIGSTOP) is continued first: a
    stopped process does not act on SIGTERM until it runs again."""
    left = stop_groups([pgid], grace)
    if left:
        raise ProcessGroupError(f"process group {pgid} survived SIGKILL: {left}")


def stop_groups(pgids: Iterable[int], grace: float) -> list[int]:
    """``stop_group`` for several groups at once (one grace for all); returns the
    members still alive after SIGKILL (none, unless a process cannot die)."""
    pgids = set(pgids)

    def members() -> list[int]:
        return [pid for pgid in pgids for pid in group_members(pgid)]

    for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        for pgid in list(pgids):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pgids.discard(pgid)
        deadline = time.monotonic() + wait
        while members() and time.monotonic() < deadline:
            time.sleep(0.1)
        if sig != signal.SIGCONT and not members():
            return []
    return members()


# The server's environment carries the watchdog's token; every process it starts
# inherits it (multiprocessing's spawned EngineCore too).
WATCH_ENV = "KIT_WATCHDOG_TOKEN"
WATCHDOG_GRACE = 10.0


class Watchdog:
    """A process that stops a server's process group when the kit is gone.

    Why this and not ``prctl(PR_SET_PDEATHSIG)`` on the server: the parent-death
    signal reaches one process (vLLM's EngineCore and workers, started by
    multiprocessing, are not covered), fires when the parent *thread* exits (the
    bench starts its servers from a thread pool), and is lost across the server's
    own exec. Here the watchdog holds the read end of a pipe whose only write end
    the kit holds (not inherited: ``os.pipe`` is close-on-exec and ``subprocess``
    closes other descriptors). However the kit ends, SIGKILL included, the kernel
    closes that end, the watchdog reads end-of-file and stops the server's whole
    group: SIGCONT (a server the bench paused), SIGTERM, SIGKILL after a grace. A
    kit that stops the server itself says "done" first, and the watchdog just exits.

    The kit names the group after starting it; a kit killed between the server's
    start and that line would leave it unnamed, so the server's environment also
    carries a token (``env``) that every process of the server inherits, and the
    watchdog stops the groups of the processes that carry it, too (also one that
    left the group). The watchdog runs in a session of its own, so a Ctrl-C or a
    hang-up of the kit's terminal does not reach it, and it writes what it did into
    ``log`` (the server's log)."""

    def __init__(self, log: Path | None, grace: float = WATCHDOG_GRACE) -> None:
        self.token = secrets.token_hex(16)
        read, write = os.pipe()
        self._write: int | None = write  # None once closed
        self._lock = threading.Lock()
        try:
            with open(os.devnull if log is None else log, "a") as out:
                # -I -S: no PYTHONPATH (a tree's) nor site-packages; standard library only.
                command = [sys.executable, "-I", "-S", __file__, "--grace", str(grace)]
                self.process = subprocess.Popen(
                    [*command, "--token", self.token],
                    stdin=read,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)

    def env(self) -> dict[str, str]:
        """What the server's environment gets: the token its processes carry."""
        return {WATCH_ENV: self.token}

    def watch(self, pgid: int) -> None:
        self._send(f"watch {pgid}\n")

    def _send(self, line: str) -> bool:
        with self._lock:
            if self._write is None:
                return False
            try:
                os.write(self._write, line.encode())
            except BrokenPipeError:  # the watchdog itself was killed
                return False
            return True

    def release(self, stopped: bool = True) -> None:
        """The kit is done with the group: ``stopped`` (it stopped the group itself):
        the watchdog exits; else it stops the group as if the kit had died."""
        if stopped:
            self._send("done\n")
        with self._lock:
            if self._write is None:
                return
            os.close(self._write)
            self._write = None
        if stopped:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class WatchedPopen(subprocess.Popen):
    """A child started as the leader of a process group of its own, with a
    ``Watchdog`` (its lines appended to ``watch_log``, if given) that stops the whole
    group when this process ends without stopping it, SIGKILL included.

    Stop it with ``stop`` (the group, then the watchdog told so); a child that ended
    by itself may leave its watchdog waiting until this process ends, when it finds
    nothing left to stop. A log the child writes that the watchdog appends to must be
    opened for appending, as the watchdog's is, so neither overwrites the other."""

    def __init__(
        self,
        args,
        *,
        watch_log: Path | None = None,
        env: dict[str, str] | None = None,
        **kwargs,
    ) -> None:
        self.watchdog = Watchdog(watch_log)
        try:
            # The token in the child's environment, so the watchdog finds every process
            # it starts (also one that leaves the group, or any started before ``watch``).
            base = os.environ if env is None else env
            super().__init__(
                args, env={**base, **self.watchdog.env()}, start_new_session=True, **kwargs
            )
        except BaseException:
            self.watchdog.release()
            raise
        self.watchdog.watch(self.pid)

    def stop(self, grace: float = 20.0) -> None:
        """``stop_group`` on the child's group and wait for the child; the watchdog is
        told the group is stopped, or, where a member survived, left to keep trying
        after this process (and ``ProcessGroupError`` raised)."""
        try:
            stop_group(self.pid, grace)
            self.wait(timeout=grace)
        except (ProcessGroupError, subprocess.TimeoutExpired):
            self.watchdog.release(stopped=False)
            raise ProcessGroupError(f"process group {self.pid} survived SIGKILL") from None
        self.watchdog.release()


def _tagged(token: str) -> set[int]:
    """Processes whose environment carries this token (read from /proc)."""
    mark = f"{WATCH_ENV}={token}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _watch(token: str, grace: float) -> int:
    """The watchdog's loop (``Watchdog``): stdin is the kit's pipe."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    kit = os.getppid()
    pgids: set[int] = set()
    for raw in sys.stdin.buffer:
        word, _, value = raw.decode().strip().partition(" ")
        if word == "watch":
            pgids.add(int(value))
        elif word == "done":
            return 0
    # End of file without "done": the kit is gone (or gave the group up).
    # Twice: a process still between fork and exec carries the token only after it.
    for _ in range(2):
        groups = pgids | {g for g in map(_pgid, _tagged(token)) if g is not None}
        groups.discard(os.getpgrp())
        if groups:
            print(
                f"kit watchdog: the kit (pid {kit}) ended without stopping this server; "
                f"stopping process group(s) {sorted(groups)}",
                flush=True,
            )
            left = stop_groups(groups, grace)
            if left:
                print(f"kit watchdog: processes {left} survived SIGKILL", flush=True)
                return 1
        pgids = set()
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the kit's server watchdog (Watchdog)")
    parser.add_argument("--grace", type=float, default=WATCHDOG_GRACE)
    parser.add_argument("--token", required=True)
    options = parser.parse_args()
    raise SystemExit(_watch(options.token, options.grace))


def run_watched(
    args: list[str],
    *,
    check: bool = False,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    grace: float = 10.0,
    **kwargs,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a long child (an image build, a suite in a container):
    it runs as a ``WatchedPopen``, so it dies with this process, SIGKILL included,
    and Ctrl-C or ``timeout`` stops its whole group, not only the leader."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = WatchedPopen(args, text=text, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.stop(grace)
        raise
    # The leader ended by itself: stop anything it left in its group, release the watchdog.
    proc.stop(grace)
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
