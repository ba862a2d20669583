"""Time the host took the machine away: the ``steal`` column of ``/proc/stat``.

On a virtual machine whose CPU quota is below its vCPU count (the kit's 2-core
build machine: measured, both cores busy for 20 s gives about one 100 ms pause a
second, one core busy gives none), the hypervisor pauses the whole machine and
the guest counts the pause as steal time. A request running then is slower by
the pause, on either tree at random; the bench records each request's steal so
its report can leave those pairs out (``ttft_stats.pooled_ratios``)."""

from __future__ import annotations

import os
from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL_FIELD = 8  # cpuN user nice system idle iowait irq softirq steal ...


def steal_s(stat: Path = PROC_STAT) -> float | None:
    """Seconds of steal so far: the most any one CPU has counted (a host pause
    stops every vCPU at once), or None where the kernel does not report it."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = [
        int(fields[STEAL_FIELD])
        for fields in (line.split() for line in lines)
        if fields[0].startswith("cpu") and fields[0] != "cpu" and len(fields) > STEAL_FIELD
    ]
    if not ticks:
        return None
    return max(ticks) / os.sysconf("SC_CLK_TCK")


def stolen_between(before: float | None, after: float | None) -> float | None:
    """The steal counted between two readings; None when either is unknown."""
    if before is None or after is None:
        return None
    return max(0.0, after - before)
