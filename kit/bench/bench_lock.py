"""The checkout's bench lock: one measuring job at a time (``kit bench`` and ``kit
turn-cost``). Two at once share the CPUs and the compile caches under .cache/vllm,
each measures the other's load as its own, and both write the committed results."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from kit.paths import CACHE, ROOT

LOCK = CACHE / "bench.lock"


class BenchBusy(RuntimeError):
    """Another bench or turn-cost holds this checkout's bench lock."""


@contextmanager
def bench_lock() -> Iterator[None]:
    """Hold the bench lock (``LOCK``) for the block, or raise BenchBusy at once.

    ``flock``: the kernel drops it when its holder ends, however it ends (``kill -9``
    too), so there is no stale lock to clean up; the pid written into the file is
    only for the message. The descriptor is close-on-exec and ``subprocess`` closes
    it in children, so a server or a watchdog never holds it."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            who, stop = (f"pid {holder}", f"kill {holder}") if holder.isdigit() else ("", "")
            raise BenchBusy(
                f"another bench or turn-cost is running ({who or 'pid unknown'}) in this "
                f"checkout ({ROOT}): two at once share the CPUs, overlap their measurements "
                f"and write the same results; wait for it{f', or stop it ({stop})' if stop else ''}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
