"""A test run leaves the committed results as they were (tests/conftest.py checks it at
the end of every pytest session): a test that writes into ``results/`` would dirty a
clean checkout and pass its own output off as the record. Standard library only."""

from __future__ import annotations

import subprocess
from pathlib import Path

GONE = (-1, -1)


def committed(root: Path) -> dict[str, tuple[int, int]]:
    """Each git-tracked file under ``root/results``: (size, mtime_ns), ``GONE`` when
    missing; {} outside a git checkout (nothing to compare)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "results"], cwd=root, capture_output=True
        )
    except OSError:
        return {}
    if listed.returncode != 0:
        return {}
    state = {}
    for name in filter(None, listed.stdout.decode(errors="replace").split("\0")):
        try:
            found = (root / name).stat()
        except FileNotFoundError:
            state[name] = GONE
        else:
            state[name] = (found.st_size, found.st_mtime_ns)
    return state


def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """The tracked files whose size or modification time differs (rewritten or removed)."""
    return sorted(name for name, state in before.items() if after.get(name, GONE) != state)
