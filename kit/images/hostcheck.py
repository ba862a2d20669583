"""Check a GB10 or Strix Halo host before a run, and stop early with the fix.

Reads the same sources a person would (nvidia-smi, KFD's topology, /proc, /sys, /dev,
the user's groups) through a ``Probe``, so the tests can replay recorded outputs
from a folder with the same layout (``files/...`` and ``commands/<name>.txt``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3
# CUDA 13 needs an R580 driver; GB10 shipped with 580.x.
MIN_NVIDIA_DRIVER = (580, 0)
# Headroom the bench needs besides the model (KV cache, two servers at a time).
MIN_AVAILABLE_GIB = {"gb10": 48, "strix": 48}
# The ~70 GB BF16 model plus KV cache must fit in GTT on Strix Halo.
MIN_GTT_GIB = 96
PAGE = 4096


@dataclass
class Finding:
    ok: bool
    check: str
    detail: str
    fix: str = ""


class Probe:
    """The live host, or a recorded one when ``root`` is given."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root

    def read(self, path: str) -> str | None:
        target = self.root / "files" / path.lstrip("/") if self.root else Path(path)
        try:
            return target.read_text()
        except OSError:
            return None

    def exists(self, path: str) -> bool:
        return (
            (self.root / "files" / path.lstrip("/")).exists() if self.root else Path(path).exists()
        )

    def glob(self, pattern: str) -> list[str]:
        base = self.root / "files" if self.root else Path("/")
        return sorted("/" + str(p.relative_to(base)) for p in base.glob(pattern.lstrip("/")))

    def command(self, name: str, argv: list[str]) -> str | None:
        if self.root:
            recorded = self.root / "commands" / f"{name}.txt"
            return recorded.read_text() if recorded.is_file() else None
        if shutil.which(argv[0]) is None:
            return None
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done.stdout if done.returncode == 0 else None


def _meminfo_gib(probe: Probe, key: str) -> float | None:
    text = probe.read("/proc/meminfo") or ""
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 / GIB if match else None


def _memory(probe: Probe, target: str) -> Finding:
    available = _meminfo_gib(probe, "MemAvailable")
    need = MIN_AVAILABLE_GIB[target]
    if available is None:
        return Finding(False, "memory", "cannot read MemAvailable from /proc/meminfo")
    return Finding(
        available >= need,
        "memory",
        f"{available:.0f} GiB available, need {need}",
        "" if available >= need else "stop other workloads or containers first",
    )


def check_gb10(probe: Probe) -> list[Finding]:
    out = []
    arch = (probe.command("uname-m", ["uname", "-m"]) or "").strip()
    out.append(
        Finding(
            arch == "aarch64",
            "architecture",
            arch or "unknown",
            "" if arch == "aarch64" else "GB10 images are aarch64: run on the DGX Spark",
        )
    )
    smi = probe.command("nvidia-smi", ["nvidia-smi"])
    if smi is None:
        out.append(
            Finding(
                False,
                "nvidia driver",
                "nvidia-smi not found or failing",
                "install the NVIDIA driver (R580 or newer) and reboot",
            )
        )
        return out
    driver = re.search(r"Driver Version:\s*([\d.]+)", smi)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", smi)
    version = tuple(int(x) for x in driver.group(1).split(".")[:2]) if driver else (0, 0)
    out.append(
        Finding(
            version >= MIN_NVIDIA_DRIVER,
            "nvidia driver",
            f"driver {driver.group(1) if driver else '?'}, CUDA {cuda.group(1) if cuda else '?'}",
            ""
            if version >= MIN_NVIDIA_DRIVER
            else "CUDA 13 needs driver R580 or newer: update the DGX OS driver packages",
        )
    )
    out.append(
        Finding(
            "GB10" in smi,
            "gpu",
            "NVIDIA GB10" if "GB10" in smi else "no GB10 listed",
            "" if "GB10" in smi else "this target is for DGX Spark (GB10)",
        )
    )
    docker = probe.command("docker-info", ["docker", "info", "--format", "{{json .Runtimes}}"])
    has_runtime = bool(docker and "nvidia" in docker)
    out.append(
        Finding(
            has_runtime,
            "container runtime",
            "nvidia runtime registered" if has_runtime else "no nvidia runtime",
            ""
            if has_runtime
            else "install nvidia-container-toolkit and run 'nvidia-ctk runtime configure'",
        )
    )
    out.append(_memory(probe, "gb10"))
    return out


def check_strix(probe: Probe) -> list[Finding]:
    out = []
    kfd, render = probe.exists("/dev/kfd"), probe.glob("/dev/dri/renderD*")
    out.append(
        Finding(
            kfd and bool(render),
            "device nodes",
            f"/dev/kfd {'present' if kfd else 'missing'}, "
            f"render nodes: {', '.join(render) or 'none'}",
            ""
            if kfd and render
            else "load the amdgpu driver (ROCm-capable kernel) so /dev/kfd and "
            "/dev/dri/renderD* exist",
        )
    )
    groups = set((probe.command("groups", ["id", "-Gn"]) or "").split())
    missing = {"render", "video"} - groups
    out.append(
        Finding(
            not missing,
            "groups",
            f"user groups: {' '.join(sorted(groups))}",
            ""
            if not missing
            else f"sudo usermod -aG {','.join(sorted(missing))} $USER, then log in again",
        )
    )
    agents = gpu_agents(probe)
    found = "gfx1151" in agents
    out.append(
        Finding(
            found,
            "gpu",
            f"GPU agents: {', '.join(agents) or 'none'}",
            ""
            if found
            else "this target is for Strix Halo (gfx1151): load a kernel whose amdgpu "
            "driver lists it under /sys/class/kfd/kfd/topology/nodes",
        )
    )
    pages = (probe.read("/sys/module/ttm/parameters/pages_limit") or "").strip()
    gtt = int(pages) * PAGE / GIB if pages.isdigit() else 0.0
    cmdline = (probe.read("/proc/cmdline") or "").strip()
    out.append(
        Finding(
            gtt >= MIN_GTT_GIB,
            "gtt limit",
            f"ttm pages_limit = {pages or '?'} ({gtt:.0f} GiB); cmdline: {cmdline}",
            ""
            if gtt >= MIN_GTT_GIB
            else f"raise it to at least {MIN_GTT_GIB} GiB: add "
            f"ttm.pages_limit={MIN_GTT_GIB * GIB // PAGE} "
            f"amdgpu.gttsize={MIN_GTT_GIB * 1024} to the kernel command line",
        )
    )
    out.append(_memory(probe, "strix"))
    return out


def gfx_name(version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as a gfx name:
    110501 is gfx1151 (minor and stepping are written in hex)."""
    major, minor, step = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor:x}{step:x}"


def gpu_agents(probe: Probe) -> list[str]:
    """The GPU agents the kernel's KFD exposes; rocminfo (a ROCm install on the host,
    which the containers do not need) only where the topology cannot be read."""
    agents = []
    for path in probe.glob("/sys/class/kfd/kfd/topology/nodes/*/properties"):
        m = re.search(r"^gfx_target_version\s+(\d+)", probe.read(path) or "", re.M)
        if m and int(m.group(1)):  # CPU nodes report 0
            agents.append(gfx_name(int(m.group(1))))
    if not agents:
        rocminfo = probe.command("rocminfo", ["rocminfo"]) or ""
        agents = re.findall(r"Name:\s+(gfx\w+)", rocminfo)
    return sorted(set(agents))


CHECKS = {"gb10": check_gb10, "strix": check_strix}


def host_record(probe: Probe) -> dict:
    """What a results bundle records about the host."""
    return {
        "kernel": (probe.read("/proc/sys/kernel/osrelease") or "").strip(),
        "cmdline": (probe.read("/proc/cmdline") or "").strip(),
        "nvidia_smi": probe.command("nvidia-smi", ["nvidia-smi"]),
        "gpu_agents": gpu_agents(probe),
        "ttm_pages_limit": (probe.read("/sys/module/ttm/parameters/pages_limit") or "").strip(),
        "mem_total_gib": _meminfo_gib(probe, "MemTotal"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", choices=sorted(CHECKS))
    parser.add_argument("--recorded", type=Path, help="replay a recorded host folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    findings = CHECKS[args.target](Probe(args.recorded))
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=1))
    else:
        for f in findings:
            print(f"{'ok ' if f.ok else 'FAIL'} {f.check:18s} {f.detail}")
            if not f.ok:
                print(f"     fix: {f.fix}")
    return 0 if all(f.ok for f in findings) else 1


if __name__ == "__main__":
    raise SystemExit(main())
