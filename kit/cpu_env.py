"""Make the two vLLM trees of the CPU environment: unpatched and patched.

"unpatched" is the pinned vLLM plus the target's enablement mods (cpu:
cpu-mamba-align-spec, which only lets MTP run with align mode on the CPU);
"patched" adds the fix under test. The two differ by the fix alone.

Both are hard-linked copies of the ``vllm`` package in ``.venv`` (cheap: only
files a mod rewrites get new inodes, because the engine replaces files by
rename). A stamp records what each tree was made from; a missing or stale stamp
means the tree is rebuilt, never used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from kit import mods, pins

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / ".trees"
STAMP = ".kit-tree.json"
TREE_NAMES = ("unpatched", "patched")


def venv_vllm(venv: Path = ROOT / ".venv") -> Path:
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


def _hardlink_copy(source: Path, dest: Path) -> None:
    shutil.copytree(
        source, dest, copy_function=os.link, ignore=shutil.ignore_patterns(mods.LOCK_NAME)
    )


def ensure_tree(name: str, target: str = "cpu", source: Path | None = None) -> Path:
    """Return ``.trees/<name>/vllm``, rebuilding it when missing or stale."""
    source = source or venv_vllm()
    home = tree_dir(name)
    wanted = _wanted_stamp(source, name, target)
    stamp = home / STAMP
    if stamp.is_file() and (home / "vllm").is_dir():
        try:
            if json.loads(stamp.read_text()) == wanted:
                return home / "vllm"
        except json.JSONDecodeError:
            pass
    build = home.with_name(f".{name}.building")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    _hardlink_copy(source, build / "vllm")
    stage_mods = mods.mods_for_target(target, name)
    if stage_mods:
        mods.apply(build / "vllm", stage_mods)
    (build / STAMP).write_text(json.dumps(wanted, indent=2) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    os.replace(build, home)
    return home / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="cpu", choices=mods.TARGETS)
    args = parser.parse_args(argv)
    try:
        for name in TREE_NAMES:
            path = ensure_tree(name, args.target)
            print(
                f"{name:10s} {path}  ({len(mods.read_provenance(path)['mods'])} mods, "
                f"pins {pins.file_sha256()[:12]})"
            )
    except mods.ModError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
