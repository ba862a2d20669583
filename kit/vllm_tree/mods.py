"""The mod engine: list, check, apply and revert the kit's patches to a vLLM package tree.

A mod is ``mods/<name>/`` with ``mod.toml`` (manifest), ``mod.patch`` (unified
diff, paths relative to the ``vllm`` package directory) and ``README.md``.
The engine never imports vLLM: inside image builds an import can initialise a GPU.
Apply and revert are all-or-nothing, also when the process is killed midway: every
new file is staged beside its target, then a journal naming the staged files and
the new mods record is written (the commit point), then the files are renamed into
place and the record written. A run killed before the journal changed nothing; one
killed after it is finished by the next apply, revert, list or check. The record
holds the sha256 of every file a mod touched, so what a tree carries is checked
against its contents (``verify_record``), never taken from the record alone.
"""

from __future__ import annotations

import argparse
import enum
import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kit.paths import ROOT
from kit.vllm_tree import pins, udiff

MODS_DIR = ROOT / "mods"
MODS_RECORD_NAME = "vllm_kit_mods.json"
LOCK_NAME = ".kit-mods.lock"
JOURNAL_NAME = ".kit-mods-journal.json"
# Tests only: SIGKILL this process at a named point of a commit (e.g. "renamed:1",
# after the first file is renamed into place) to prove a crash can be finished.
KILL_AT_ENV = "KIT_TEST_MODS_KILL_AT"
REQUIRED_KEYS = {
    "name": str,
    "summary": str,
    "why": str,
    "upstream": list,
    # One release, or a list when one patch was measured on several.
    "vllm_version": (str, list),
    "files": list,
    "targets": list,
}
TARGETS = ("cpu", "gb10", "strix")
STAGES = ("unpatched", "patched")


class ModError(RuntimeError):
    """Bad input: the message names what is wrong and what to do."""

    exit_code = 2


class ModBusy(ModError):
    exit_code = 3


class State(enum.Enum):
    APPLIES = "applies"
    APPLIED = "already applied"
    DRIFT = "does not apply (drift)"


STATE_EXIT = {State.APPLIES: 0, State.APPLIED: 10, State.DRIFT: 20}


@dataclass(frozen=True)
class Mod:
    name: str
    directory: Path
    manifest: dict
    patch_text: str

    @property
    def patch_sha256(self) -> str:
        return hashlib.sha256(self.patch_text.encode()).hexdigest()

    @property
    def releases(self) -> list[str]:
        """The vLLM releases this patch was made and measured for."""
        return self.manifest["vllm_version"]

    @property
    def files(self) -> list[udiff.FilePatch]:
        return udiff.parse(self.patch_text)


def load_mod(name: str, mods_dir: Path = MODS_DIR) -> Mod:
    directory = mods_dir / name
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) or not directory.is_dir():
        known = ", ".join(available(mods_dir)) or "none"
        raise ModError(f"unknown mod {name!r}; known mods: {known}")
    manifest_path = directory / "mod.toml"
    try:
        manifest = tomllib.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise ModError(f"mod {name}: {manifest_path} is missing") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ModError(f"mod {name}: malformed manifest {manifest_path}: {exc}") from exc
    for key, kind in REQUIRED_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ModError(f"mod {name}: manifest {manifest_path} needs {key!r} as a {kinds}")
    releases = manifest["vllm_version"]
    if isinstance(releases, str):
        releases = [releases]
    if not releases or not all(isinstance(v, str) for v in releases):
        raise ModError(f"mod {name}: 'vllm_version' must name at least one release")
    manifest["vllm_version"] = releases
    if manifest["name"] != name:
        raise ModError(f"mod {name}: manifest names itself {manifest['name']!r}")
    bad = set(manifest["targets"]) - set(TARGETS)
    if bad:
        raise ModError(f"mod {name}: unknown targets {sorted(bad)}; use {TARGETS}")
    # Which tree/image stages get the mod: the fix under test only "patched";
    # platform enablement both, so the two stages differ by the fix alone.
    manifest.setdefault("stages", ["patched"])
    if not manifest["stages"] or set(manifest["stages"]) - set(STAGES):
        raise ModError(f"mod {name}: stages must be a non-empty subset of {STAGES}")
    # A switched mod is turned on by its server flag and, in-process, by the
    # CacheConfig field behind it; the kit needs both.
    switch = {"enable_flag", "cache_config_field"} & set(manifest)
    if len(switch) == 1:
        missing = ({"enable_flag", "cache_config_field"} - switch).pop()
        raise ModError(
            f"mod {name}: manifest {manifest_path} has {switch.pop()!r} but not {missing!r}"
        )
    patch_path = directory / "mod.patch"
    if not patch_path.is_file():
        raise ModError(f"mod {name}: {patch_path} is missing")
    patch_text = patch_path.read_text()
    try:
        files = udiff.parse(patch_text)
    except udiff.PatchFormatError as exc:
        raise ModError(f"mod {name}: malformed patch {patch_path}: {exc}") from exc
    touched = sorted(f.path for f in files)
    if touched != sorted(manifest["files"]):
        raise ModError(
            f"mod {name}: manifest lists files {sorted(manifest['files'])} "
            f"but the patch touches {touched}"
        )
    if not (directory / "README.md").is_file():
        raise ModError(f"mod {name}: README.md is missing; explain the change to a reviewer")
    return Mod(name, directory, manifest, patch_text)


def available(mods_dir: Path = MODS_DIR) -> list[str]:
    if not mods_dir.is_dir():
        return []
    return sorted(p.name for p in mods_dir.iterdir() if (p / "mod.toml").is_file())


def mods_for_target(
    target: str,
    stage: str = "patched",
    mods_dir: Path = MODS_DIR,
    release: str | None = None,
) -> list[Mod]:
    """The mods an image target's stage gets on a vLLM release (default: the pinned
    one), in name order."""
    release = release or pins.get("vllm.version")
    if target not in TARGETS:
        raise ModError(f"unknown target {target!r}; use one of {TARGETS}")
    if stage not in STAGES:
        raise ModError(f"unknown stage {stage!r}; use one of {STAGES}")
    loaded = [load_mod(n, mods_dir) for n in available(mods_dir)]
    return [
        m
        for m in loaded
        if target in m.manifest["targets"]
        and stage in m.manifest["stages"]
        and release in m.releases
    ]


def switched_mods(target: str, release: str | None = None) -> list[Mod]:
    """The patched stage's mods that are off until their switch is on: each names
    its server flag (``enable_flag``) and ``CacheConfig`` field (``cache_config_field``)."""
    return [
        m
        for m in mods_for_target(target, "patched", release=release)
        if "enable_flag" in m.manifest
    ]


def switch_fields(target: str, tree: Path) -> dict[str, bool]:
    """``CacheConfig`` fields that turn on the switched mods made for a tree's release."""
    release = tree_version(tree)[0]
    return {m.manifest["cache_config_field"]: True for m in switched_mods(target, release)}


# -- the vLLM tree --------------------------------------------------------------
def tree_version(tree: Path) -> tuple[str, str | None]:
    """vLLM version and commit of a package directory, read from _version.py."""
    if not (tree / "__init__.py").is_file() or not (tree / "v1").is_dir():
        raise ModError(
            f"{tree} is not a vLLM package directory (no __init__.py and v1/); "
            "pass the 'vllm' directory inside site-packages or a source checkout"
        )
    version_file = tree / "_version.py"
    if not version_file.is_file():
        raise ModError(f"{tree}: no _version.py; cannot tell which vLLM this is")
    text = version_file.read_text()
    version = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", text)
    commit = re.search(r"__commit_id__\s*=\s*commit_id\s*=\s*['\"]([^'\"]+)", text)
    if not version:
        raise ModError(f"{version_file}: no __version__ found")
    # A source build's local label (0.34.0+cu130) names the same release.
    return version.group(1).split("+", 1)[0], commit.group(1) if commit else None


def _read(tree: Path, rel: str) -> str:
    path = tree / rel
    if not path.is_file():
        raise ModError(f"{path}: file the mod touches is missing from the tree")
    return path.read_text()


def _transform(mod: Mod, contents: dict[str, str], tree: Path, reverse: bool) -> dict[str, str]:
    out = dict(contents)
    for fp in mod.files:
        fp = fp.reversed() if reverse else fp
        source = out.get(fp.path)
        if source is None:
            source = _read(tree, fp.path)
        try:
            out[fp.path] = udiff.apply_file(source, fp)
        except udiff.HunkFailed as exc:
            raise ModError(
                f"mod {mod.name}: {exc} in {tree / fp.path}; the tree drifted from "
                f"vLLM {', '.join(mod.releases)} the mod was made for"
            ) from exc
    return out


def state(mod: Mod, tree: Path, contents: dict[str, str] | None = None) -> State:
    contents = contents or {}
    try:
        _transform(mod, contents, tree, reverse=False)
        return State.APPLIES
    except ModError:
        pass
    try:
        _transform(mod, contents, tree, reverse=True)
        return State.APPLIED
    except ModError:
        return State.DRIFT


@contextmanager
def _locked(tree: Path) -> Iterator[None]:
    lock_path = tree / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise ModError(
            f"{tree}: cannot create {LOCK_NAME} ({exc.strerror}); is it read-only?"
        ) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ModBusy(
                f"{tree}: another mod apply/revert holds {LOCK_NAME}; wait for it to finish"
            ) from exc
        yield
    finally:
        os.close(fd)


def _check_compiles(tree: Path, contents: dict[str, str]) -> None:
    for rel, text in contents.items():
        if rel.endswith(".py"):
            try:
                compile(text, str(tree / rel), "exec")
            except SyntaxError as exc:
                raise ModError(f"{tree / rel}: patched source does not compile: {exc}") from exc


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _kill_point(name: str) -> None:
    if os.environ.get(KILL_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _durable_write(path: Path, data: bytes, mode: int | None = None) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(path, mode)


def journal_path(tree: Path) -> Path:
    return tree / JOURNAL_NAME


def _commit(tree: Path, contents: dict[str, str], record: dict) -> None:
    """Stage every file, write the journal (the commit point), then finish it."""
    staged: list[dict] = []
    pending = journal_path(tree).with_name(JOURNAL_NAME + ".tmp")
    try:
        for rel, text in contents.items():
            target = tree / rel
            tmp = target.with_name(f".{target.name}.kit-tmp")
            data = text.encode()
            _durable_write(tmp, data, target.stat().st_mode & 0o777)
            staged.append({"path": rel, "tmp": tmp.name, "sha256": _sha256(data)})
        _durable_write(pending, json.dumps({"files": staged, "record": record}).encode())
        _kill_point("staged")
        os.replace(pending, journal_path(tree))
    except OSError as exc:
        for entry in staged:
            (tree / entry["path"]).with_name(entry["tmp"]).unlink(missing_ok=True)
        pending.unlink(missing_ok=True)
        raise ModError(
            f"{tree}: cannot write ({exc.strerror}: {exc.filename}); "
            "is the tree read-only? Nothing was changed"
        ) from exc
    _kill_point("journal")
    _finish(tree)


def _finish(tree: Path) -> bool:
    """Finish a commit the journal describes (a crash after the commit point): rename
    what is still staged, check the rest already holds its new contents, write the
    record. Returns whether there was one to finish."""
    journal = journal_path(tree)
    if not journal.is_file():
        return False
    try:
        plan = json.loads(journal.read_text())
        entries, record = plan["files"], plan["record"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModError(
            f"{journal}: unreadable journal of an interrupted apply/revert ({exc}); the tree's "
            "state is unknown: delete the tree and rebuild it (make setup)"
        ) from exc
    for number, entry in enumerate(entries, start=1):
        target = tree / entry["path"]
        tmp = target.with_name(entry["tmp"])
        if tmp.is_file():
            # A rename (not an in-place write) also breaks hard links, so a
            # hard-linked copy of the tree never changes its source.
            os.replace(tmp, target)
            _kill_point(f"renamed:{number}")
        elif not target.is_file() or _sha256(target.read_bytes()) != entry["sha256"]:
            raise ModError(
                f"{journal}: {target} is neither staged nor in its new state; the tree was "
                "changed by something else: delete the tree and rebuild it (make setup)"
            )
    _write_record(tree, record)
    journal.unlink()
    return True


def mods_record_path(tree: Path) -> Path:
    return tree.parent / MODS_RECORD_NAME


def read_mods_record(tree: Path) -> dict:
    path = mods_record_path(tree)
    if not path.is_file():
        return {"mods": [], "files": {}}
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("mods"), list):
            raise ValueError("no 'mods' list")
    except (OSError, ValueError) as exc:
        raise ModError(
            f"{path}: unreadable mods record ({exc}); what the tree carries is unknown: "
            "delete the tree and rebuild it (make setup)"
        ) from exc
    return record


def verify_record(tree: Path) -> dict:
    """The tree's mods record, after checking that every file it names still has the
    recorded contents and no apply/revert is half done."""
    if journal_path(tree).is_file():
        raise ModError(
            f"{tree}: an apply/revert was interrupted; run any 'kit mods apply/revert' on the "
            "tree to finish it, or rebuild the tree"
        )
    record = read_mods_record(tree)
    changed = [
        rel
        for rel, sha in record.get("files", {}).items()
        if not (tree / rel).is_file() or _sha256((tree / rel).read_bytes()) != sha
    ]
    if changed:
        raise ModError(
            f"{tree}: {', '.join(changed)} differ from its mods record: the tree was changed "
            "outside the mod engine; rebuild it (make setup)"
        )
    return record


def _new_record(
    tree: Path, applied: list[Mod], removed: list[str], contents: dict[str, str]
) -> dict:
    """The record after this apply/revert, made before any file changes: whatever it
    needs (the pins, the old record) fails while the tree is still untouched."""
    version, commit = tree_version(tree)
    record = read_mods_record(tree)
    try:
        commit = commit or pins.get("vllm.commit_abbrev")
        pins_sha256 = pins.file_sha256()
    except (pins.PinError, OSError) as exc:
        raise ModError(f"cannot read the pins ({exc}); fix pins.toml. Nothing was changed") from exc
    keep = [
        m
        for m in record.get("mods", [])
        if m["name"] not in removed and m["name"] not in {a.name for a in applied}
    ]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    keep += [{"name": m.name, "patch_sha256": m.patch_sha256, "applied_at": now} for m in applied]
    files = dict(record.get("files", {}))
    files.update({rel: _sha256(text.encode()) for rel, text in contents.items()})
    return {
        "vllm_version": version,
        "vllm_commit": commit,
        "pins_sha256": pins_sha256,
        "updated_at": now,
        "mods": keep,
        # Every file a mod changed, as it is now: verify_record compares.
        "files": dict(sorted(files.items())),
    }


def _write_record(tree: Path, record: dict) -> None:
    path = mods_record_path(tree)
    tmp = path.with_name(path.name + ".tmp")
    _durable_write(tmp, (json.dumps(record, indent=2) + "\n").encode())
    os.replace(tmp, path)


def _run(tree: Path, mods: list[Mod], force: bool, reverse: bool) -> list[str]:
    version, _ = tree_version(tree)
    for mod in mods:
        if version not in mod.releases and not force:
            raise ModError(
                f"mod {mod.name} was made for vLLM {', '.join(mod.releases)}, "
                f"the tree at {tree} is vLLM {version}; re-measure and port the mod, "
                "or pass --force to try anyway"
            )
    messages: list[str] = []
    with _locked(tree):
        if _finish(tree):
            messages.append("finished an interrupted apply/revert first")
        contents: dict[str, str] = {}
        changed: list[Mod] = []
        order = list(reversed(mods)) if reverse else mods
        for mod in order:
            current = state(mod, tree, contents)
            if current is State.DRIFT:
                # Re-run the forward transform to name the failing file and hunk.
                _transform(mod, contents, tree, reverse=reverse)
            if (current is State.APPLIED) != reverse:
                verb = "already applied" if not reverse else "not applied"
                messages.append(f"{mod.name}: {verb}, nothing to do")
                continue
            contents = _transform(mod, contents, tree, reverse=reverse)
            changed.append(mod)
            messages.append(f"{mod.name}: {'reverted' if reverse else 'applied'}")
        if changed:
            _check_compiles(tree, contents)
            if reverse:
                record = _new_record(tree, [], [m.name for m in changed], contents)
            else:
                record = _new_record(tree, changed, [], contents)
            _commit(tree, contents, record)
    return messages


def apply(tree: Path, mods: list[Mod], force: bool = False) -> list[str]:
    return _run(tree, mods, force, reverse=False)


def revert(tree: Path, mods: list[Mod], force: bool = False) -> list[str]:
    return _run(tree, mods, force, reverse=True)


# -- CLI ----------------------------------------------------------------------
def _select(args: argparse.Namespace) -> list[Mod]:
    if args.target:
        return mods_for_target(args.target, args.stage, release=tree_version(args.tree)[0])
    if not args.mods:
        raise ModError("name at least one mod, or pass --target cpu|gb10|strix")
    return [load_mod(n) for n in args.mods]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd, text in (
        ("list", "mods and their state against a tree"),
        ("check", "dry run; exit 0 applies, 10 already applied, 20 drift"),
        ("apply", "apply the named mods atomically"),
        ("revert", "revert the named mods atomically"),
    ):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("mods", nargs="*", help="mod names (default for list: all)")
        p.add_argument("--tree", type=Path, required=True, help="the 'vllm' package directory")
        p.add_argument("--target", choices=TARGETS, help="all mods for this image target")
        p.add_argument(
            "--stage",
            choices=STAGES,
            default="patched",
            help="with --target: the mods of this stage (default: %(default)s)",
        )
        if cmd in ("apply", "revert"):
            p.add_argument(
                "--force",
                action="store_true",
                help="apply even if the tree's vLLM version differs from the mod's pin",
            )
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    try:
        if args.cmd in ("list", "check") and journal_path(tree).is_file():
            with _locked(tree):
                _finish(tree)
            print(f"{tree}: finished an interrupted apply/revert first")
        if args.cmd == "list":
            version, _ = tree_version(tree)
            names = args.mods or available()
            selected = (
                mods_for_target(args.target, args.stage, release=version)
                if args.target
                else [load_mod(n) for n in names]
            )
            print(f"tree: {tree} (vLLM {version})")
            for mod in selected:
                print(
                    f"{mod.name:28s} {state(mod, tree).value:24s} "
                    f"targets={','.join(mod.manifest['targets'])} "
                    f"stages={','.join(mod.manifest['stages'])}  {mod.manifest['summary']}"
                )
            return 0
        if args.cmd == "check":
            tree_version(tree)
            worst = 0
            for mod in _select(args):
                st = state(mod, tree)
                print(f"{mod.name}: {st.value}")
                worst = max(worst, STATE_EXIT[st])
            return worst
        fn = apply if args.cmd == "apply" else revert
        for line in fn(tree, _select(args), force=args.force):
            print(line)
        if args.cmd == "apply":
            print(f"mods record: {mods_record_path(tree)}")
        return 0
    except (ModError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)


if __name__ == "__main__":
    raise SystemExit(main())
