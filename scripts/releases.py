"""vLLM releases beyond the pinned one, for the scheduler-level suite.

Each ``[releases."<version>"]`` in pins.toml becomes
``.trees/releases/<version>/unpatched/vllm``: the ``vllm`` package from that
release's sdist (sha256-checked), over the ``.venv``'s dependencies. Only the
scheduler and the KV-cache manager run, which are plain Python, so the CPU
platform is forced (``VLLM_TARGET_DEVICE=cpu``; the sdist's version string does
not say "cpu"). A mod whose ``vllm_version`` is the release gives a patched tree
beside it; without one the release is measured unpatched only.
Idempotent: a stamp names the sdist a tree came from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from scripts import mods, pins
from scripts.upstream_suite import fetch_sdist, unpack_sdist_dir

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / ".trees" / "releases"
STAMP = ".kit-tree.json"


class ReleaseError(RuntimeError):
    exit_code = 2


def known() -> dict[str, dict]:
    return pins.load().get("releases", {})


def release_pins(version: str) -> dict:
    releases = known()
    if version not in releases:
        names = ", ".join(sorted(releases)) or "none"
        raise ReleaseError(
            f"vLLM {version} is not in pins.toml [releases] (known: {names}); add its "
            "sdist_url and sdist_sha256 there first"
        )
    return releases[version]


def release_mods(version: str, target: str = "cpu") -> list[mods.Mod]:
    """The mods made for this release (the engine refuses a mod made for another one)."""
    return [
        mod
        for mod in mods.mods_for_target(target, "patched")
        if mod.manifest["vllm_version"] == version
    ]


def stages(version: str) -> list[str]:
    return ["unpatched", "patched"] if release_mods(version) else ["unpatched"]


def ensure_tree(version: str, stage: str = "unpatched") -> Path:
    """``.trees/releases/<version>/<stage>/vllm``, rebuilt when missing or stale."""
    spec = release_pins(version)
    patch_mods = release_mods(version) if stage == "patched" else []
    if stage == "patched" and not patch_mods:
        raise ReleaseError(f"no mod is made for vLLM {version}: there is no patched tree")
    want = {
        "sdist_sha256": spec["sdist_sha256"],
        "mods": [[m.name, m.patch_sha256] for m in patch_mods],
    }
    home = TREES / version / stage
    stamp = home / STAMP
    if stamp.is_file() and (home / "vllm").is_dir():
        try:
            if json.loads(stamp.read_text()) == want:
                return home / "vllm"
        except json.JSONDecodeError:
            pass
    sdist = fetch_sdist(version, spec["sdist_url"], spec["sdist_sha256"])
    build = home.with_name(f".{stage}.building")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    unpack_sdist_dir(sdist, version, "vllm", build)
    if patch_mods:
        mods.apply(build / "vllm", patch_mods)
    (build / STAMP).write_text(json.dumps(want, indent=1) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    os.replace(build, home)
    return home / "vllm"


def env(version: str, stage: str = "unpatched") -> dict[str, str]:
    """Environment for a process whose ``vllm`` is this release's tree."""
    tree = ensure_tree(version, stage)
    return dict(
        os.environ,
        PYTHONPATH=f"{tree.parent}{os.pathsep}{ROOT}",
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_LOGGING_LEVEL="ERROR",
    )
