"""vLLM releases beyond the pinned one, for the scheduler-level suite.

Each ``[releases."<version>"]`` in pins.toml becomes
``.trees/releases/<version>/<stage>/vllm``: the ``vllm`` package from that
release's sdist (sha256-checked), over the ``.venv``'s dependencies. Only the
scheduler and the KV-cache manager run, which are plain Python, so the CPU
platform is forced (``VLLM_TARGET_DEVICE=cpu``; the sdist's version string does
not say "cpu"). Stages: ``pristine`` (no mod; what `make mods-drift` checks
against), ``unpatched`` and ``patched`` (the cpu target's mods made for this
release, as for the pinned release's trees). Without a patched-stage mod made
for the release it is measured unpatched only.
Idempotent: a stamp names the sdist and the mods a tree came from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kit.vllm_tree import mods, pins, sdists, trees

ROOT = Path(__file__).resolve().parents[2]
TREES = ROOT / ".trees" / "releases"


class ReleaseError(RuntimeError):
    exit_code = 2


def known() -> dict[str, dict]:
    return pins.load().get("releases", {})


def newest() -> str:
    """The highest release in pins.toml [releases]."""
    if not known():
        raise ReleaseError("pins.toml has no [releases]; add one with its tag and sdist_sha256")
    return max(known(), key=lambda v: tuple(int(x) for x in v.split(".")))


def release_pins(version: str) -> dict:
    releases = known()
    if version not in releases:
        names = ", ".join(sorted(releases)) or "none"
        raise ReleaseError(
            f"vLLM {version} is not in pins.toml [releases] (known: {names}); add its "
            "tag and sdist_sha256 there first"
        )
    return releases[version]


STAGES = ("pristine", "unpatched", "patched")


def release_mods(version: str, stage: str = "patched", target: str = "cpu") -> list[mods.Mod]:
    """The mods a stage gets on this release (the engine refuses a mod made for another one)."""
    if stage == "pristine":
        return []
    return mods.mods_for_target(target, stage, release=version)


def fixes(version: str) -> list[mods.Mod]:
    """The mods under test on this release: patched stage only."""
    unpatched = {m.name for m in release_mods(version, "unpatched")}
    return [m for m in release_mods(version, "patched") if m.name not in unpatched]


def stages(version: str) -> list[str]:
    return ["unpatched", "patched"] if fixes(version) else ["unpatched"]


def ensure_tree(version: str, stage: str = "unpatched") -> Path:
    """``.trees/releases/<version>/<stage>/vllm``, rebuilt when missing or stale."""
    if stage not in STAGES:
        raise ReleaseError(f"unknown stage {stage!r}; use one of {STAGES}")
    spec = release_pins(version)
    patch_mods = release_mods(version, stage)
    if stage == "patched" and not fixes(version):
        raise ReleaseError(f"no mod is made for vLLM {version}: there is no patched tree")
    want = {
        "sdist_sha256": spec["sdist_sha256"],
        "mods": [[m.name, m.patch_sha256] for m in patch_mods],
    }

    def fill(build: Path) -> None:
        sdist = sdists.release(version)
        sdists.unpack(sdist, version, "vllm", build)
        if patch_mods:
            mods.apply(build / "vllm", patch_mods)

    return trees.stamped_folder(TREES / version / stage, want, fill, "vllm") / "vllm"


def ensure_deps(version: str) -> Path:
    """``.trees/releases/<version>/deps``: the release's requirements the .venv lacks
    (pins.toml ``requirements``), installed with --no-deps; rebuilt when the list changes."""
    wanted = sorted(release_pins(version).get("requirements", []))

    def fill(build: Path) -> None:
        if not wanted:
            return
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(build)]
        done = subprocess.run([*cmd, *wanted], capture_output=True, text=True)
        if done.returncode != 0:
            raise ReleaseError(
                f"vLLM {version}: pip could not install {wanted}: "
                f"{done.stderr.strip().splitlines()[-1:]}; check the requirements in pins.toml"
            )

    return trees.stamped_folder(TREES / version / "deps", wanted, fill)


def tree(version: str, stage: str = "unpatched") -> trees.Tree:
    """This release's tree of a stage, with the dependencies it adds to the .venv's;
    the CPU platform is forced (the sdist's version string does not say "cpu")."""
    return trees.Tree(
        stage,
        ensure_tree(version, stage),
        extra_paths=(ensure_deps(version),),
        extra_env={"VLLM_TARGET_DEVICE": "cpu"},
    )


def select(name: str | None = None) -> trees.Tree:
    """The tree ``KIT_TREE`` names: what ``trees.select`` takes, or
    ``<release>/<stage>`` for a later release's tree (e.g. ``0.34.0/patched``)."""
    name = name or os.environ.get(trees.SELECT_ENV, "patched")
    if "/" not in name:
        return trees.select(name)
    version, stage = name.split("/", 1)
    return tree(version, stage)
