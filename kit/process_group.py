"""A child's whole process group: who is still alive in it, and stopping all of it.

vLLM forks engine-core and worker processes, and pytest forks its workers; killing
only the leader orphans them. The kit starts such children as group leaders
(``start_new_session``) and stops the group, waiting until no member is left.
"""

from __future__ import annotations

import os
import signal
import time
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
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not group_members(pgid):
            return
    raise ProcessGroupError(f"process group {pgid} survived SIGKILL: {group_members(pgid)}")
