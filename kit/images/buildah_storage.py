"""Where and how buildah keeps the kit's images: one answer for the builder and the runner.

Overlay where this kernel lets us mount it: a layer then holds only what its
step changed, so the patched stage is one small layer over the unpatched image
and a container starts without copying the image. Otherwise vfs, which copies
the whole root file system (~4 GB for the cpu image) for every layer and every
container. ``KIT_BUILDAH_STORAGE=overlay|vfs`` overrides the probe.

As root the kit keeps its own store per driver (``/var/lib/containers/
hybrid-prefix-kit-<driver>``): one store cannot change its driver once it holds
images, and a machine's default store may already use the other one.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

DRIVERS = ("overlay", "vfs")
ENV = "KIT_BUILDAH_STORAGE"


class StorageError(RuntimeError):
    pass


def overlay_mounts() -> bool:
    """Mount a throw-away overlay: the only reliable test of what the kernel allows here."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory(prefix="kit-overlay-probe-") as tmp:
        parts = {name: Path(tmp) / name for name in ("lower", "upper", "work", "merged")}
        for path in parts.values():
            path.mkdir()
        opts = f"lowerdir={parts['lower']},upperdir={parts['upper']},workdir={parts['work']}"
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(parts["merged"])],
            capture_output=True,
        )
        if done.returncode != 0:
            return False
        subprocess.run(["umount", str(parts["merged"])], capture_output=True)
        return True


@functools.cache
def driver() -> str:
    chosen = os.environ.get(ENV)
    if chosen:
        if chosen not in DRIVERS:
            raise StorageError(f"{ENV}={chosen!r}: use one of {', '.join(DRIVERS)}")
        return chosen
    return "overlay" if overlay_mounts() else "vfs"


def flags() -> list[str]:
    """The global options every buildah call of the kit passes."""
    name = driver()
    if os.geteuid() != 0:
        # Rootless buildah keeps its store under the user's home; vfs needs no helper.
        return ["--storage-driver", name]
    return [
        "--storage-driver",
        name,
        "--root",
        f"/var/lib/containers/hybrid-prefix-kit-{name}",
        "--runroot",
        f"/run/containers/hybrid-prefix-kit-{name}",
    ]


def layers_are_cheap() -> bool:
    """Whether caching every build step costs only what the step wrote (not with vfs)."""
    return driver() == "overlay"
