"""models.lock tools: lock, fetch, verify, export, import the kit's model weights.

The store uses the standard Hugging Face cache layout
(``models--org--name/snapshots/<commit>/...``) so vLLM finds the files with
``HF_HUB_OFFLINE=1``. ``lock`` and ``fetch`` talk to the hub (or to
``HF_ENDPOINT``); ``verify``, ``export`` and ``import`` never do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tarfile
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kit.paths import MODELS_DIR, MODELS_LOCK
from kit.vllm_tree.pins import UNRESOLVED, file_sha256

LOCK = MODELS_LOCK
DEFAULT_STORE = Path(os.environ.get("KIT_MODEL_STORE", MODELS_DIR / "hub"))
STAMP_DIR = ".kit-verified"
COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")


class LockError(RuntimeError):
    exit_code = 2


class VerifyError(RuntimeError):
    exit_code = 1


@dataclass
class LockedFile:
    path: str
    size: int
    sha256: str


@dataclass
class Entry:
    key: str
    repo: str
    revision: str
    targets: list[str]
    enabled: bool
    fields: dict
    files: list[LockedFile] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        return bool(COMMIT.fullmatch(self.revision)) and bool(self.files)


# -- reading and writing the lock -------------------------------------------
def _line_of(text: str, needle: str) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return number
    return 0


def load(path: Path = LOCK) -> tuple[dict, list[Entry]]:
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise LockError(f"{path}: missing") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{path}: malformed lock file: {exc}") from exc
    entries = []
    for key, raw in data.get("models", {}).items():
        where = f"{path}:{_line_of(text, f'[models.{key}]')} [models.{key}]"
        for name, kind in (("repo", str), ("revision", str), ("targets", list), ("enabled", bool)):
            if not isinstance(raw.get(name), kind):
                raise LockError(f"{where}: needs {name!r} as a {kind.__name__}")
        revision = raw["revision"]
        if revision != UNRESOLVED and not COMMIT.fullmatch(revision):
            raise LockError(
                f"{where}: revision {revision!r} is neither a 40-hex commit nor {UNRESOLVED!r}"
            )
        files = []
        for item in raw.get("files", []):
            if not (
                isinstance(item.get("path"), str)
                and isinstance(item.get("size"), int)
                and SHA256.fullmatch(str(item.get("sha256", "")))
            ):
                line = _line_of(text, f'"{item.get("path")}"') if item.get("path") else 0
                raise LockError(
                    f"{path}:{line}: file entry {item} of {key} needs path, "
                    "size and a 64-hex sha256"
                )
            files.append(LockedFile(item["path"], item["size"], item["sha256"]))
        fields = {k: v for k, v in raw.items() if k not in ("revision", "files")}
        entries.append(
            Entry(key, raw["repo"], revision, raw["targets"], raw["enabled"], fields, files)
        )
    return data, entries


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def dump(header: str, data: dict, entries: list[Entry]) -> str:
    out = [header.rstrip("\n"), f"version = {data.get('version', 1)}", ""]
    for entry in entries:
        out.append(f"[models.{entry.key}]")
        for key, value in entry.fields.items():
            out.append(f"{key} = {_toml_value(value)}")
        out.append(f"revision = {_toml_value(entry.revision)}")
        for f in entry.files:
            out += [
                "",
                f"[[models.{entry.key}.files]]",
                f"path = {_toml_value(f.path)}",
                f"size = {f.size}",
                f"sha256 = {_toml_value(f.sha256)}",
            ]
        out.append("")
    return "\n".join(out)


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


def select(entries: list[Entry], model: str | None, target: str | None) -> list[Entry]:
    chosen = [
        e
        for e in entries
        if (model is None or model in (e.key, e.repo)) and (target is None or target in e.targets)
    ]
    if model and not chosen:
        raise LockError(
            f"no model {model!r} in models.lock; known: " + ", ".join(e.key for e in entries)
        )
    return chosen


# -- online: lock and fetch --------------------------------------------------
def lock(path: Path, model: str | None, ref: str | None) -> list[str]:
    """Resolve entries to commits and record file sizes and sha256; rewrite only what changed."""
    from huggingface_hub import HfApi, hf_hub_download

    data, entries = load(path)
    api = HfApi()
    changed = []
    for entry in select(entries, model, None):
        wanted_ref = ref or (entry.revision if entry.revision != UNRESOLVED else None)
        info = api.model_info(entry.repo, revision=wanted_ref, files_metadata=True)
        files = []
        for sibling in sorted(info.siblings or [], key=lambda s: s.rfilename):
            if sibling.lfs is not None:
                files.append(LockedFile(sibling.rfilename, sibling.size, sibling.lfs.sha256))
                continue
            # Small git files carry no sha256 on the hub: hash the real bytes.
            with tempfile.TemporaryDirectory() as tmp:
                local = hf_hub_download(
                    entry.repo, sibling.rfilename, revision=info.sha, cache_dir=tmp
                )
                files.append(
                    LockedFile(
                        sibling.rfilename, Path(local).stat().st_size, file_sha256(Path(local))
                    )
                )
        if info.sha != entry.revision or files != entry.files:
            entry.revision, entry.files = info.sha, files
            entry.fields["resolved_from"] = wanted_ref or "default branch"
            changed.append(entry.key)
    if changed:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(dump(_header(path), data, entries))
        load(tmp)  # never write a lock we cannot read back
        tmp.replace(path)
    return changed


def _require_pinned(entries: list[Entry]) -> None:
    for entry in entries:
        if not entry.pinned:
            raise LockError(
                f"{entry.key} ({entry.repo}) is unresolved in models.lock: run "
                f"'make lock-models MODEL={entry.key}' on a machine with hub access"
            )


def fetch(entries: list[Entry], store: Path, workers: int = 4) -> None:
    from huggingface_hub import hf_hub_download

    _require_pinned(entries)
    store.mkdir(parents=True, exist_ok=True)
    todo = [(e, f) for e in entries for f in e.files if _problem(store, e, f, full=False)]
    need = sum(f.size for _, f in todo)
    free = shutil.disk_usage(store).free
    if need > free:
        raise LockError(
            f"{store}: needs {need / 1e9:.1f} GB free for {len(todo)} files, "
            f"has {free / 1e9:.1f} GB; free space or set KIT_MODEL_STORE"
        )

    def one(item: tuple[Entry, LockedFile]) -> None:
        entry, f = item
        # hf_hub_download resumes a partial .incomplete blob with a Range request.
        hf_hub_download(entry.repo, f.path, revision=entry.revision, cache_dir=store)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(one, todo))
    verify(entries, store, full=True)


# -- offline: verify, export, import -------------------------------------------
def snapshot(store: Path, entry: Entry) -> Path:
    return store / f"models--{entry.repo.replace('/', '--')}" / "snapshots" / entry.revision


def _stamp_path(store: Path, entry: Entry, f: LockedFile) -> Path:
    return store / STAMP_DIR / entry.revision / f"{hashlib.sha1(f.path.encode()).hexdigest()}"


def _problem(store: Path, entry: Entry, f: LockedFile, full: bool) -> str | None:
    path = snapshot(store, entry) / f.path
    if not path.exists():
        return "missing"
    stat = path.stat()
    if stat.st_size != f.size:
        return f"size {stat.st_size} != locked {f.size} (partial or corrupt)"
    stamp = _stamp_path(store, entry, f)
    # The fast path trusts a file whose stat matches its last full hash. Size and mtime
    # alone are not enough: a weight rewritten in place keeps its size, and its mtime
    # can be put back (os.utime, touch -r, cp -p, rsync -t). ctime cannot be set by a
    # user and changes with every write (and chmod, link, rename onto the file); the
    # inode changes when the file is replaced. A stamp from before (size and mtime
    # only) no longer matches: the next verify hashes once and writes the new one.
    expected_stamp = (
        f"{f.sha256} {stat.st_size} {stat.st_mtime_ns} {stat.st_ctime_ns} {stat.st_ino}"
    )
    if not full and stamp.is_file() and stamp.read_text() == expected_stamp:
        return None
    if file_sha256(path) != f.sha256:
        # The fast check must not pass this file again on the old stamp's word.
        stamp.unlink(missing_ok=True)
        return "sha256 differs from the lock (corrupt)"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(expected_stamp)
    return None


def _problems(entries: list[Entry], store: Path, full: bool) -> list[str]:
    _require_pinned(entries)
    problems = []
    for entry in entries:
        for f in entry.files:
            issue = _problem(store, entry, f, full)
            if issue:
                problems.append(f"{entry.key}: {f.path}: {issue}")
    return problems


def verify(entries: list[Entry], store: Path, full: bool = False) -> None:
    problems = _problems(entries, store, full)
    if problems:
        fixes = sorted({p.split(":")[0] for p in problems})
        hint = " ".join(f"'make fetch-models MODEL={k}'" for k in fixes)
        raise VerifyError("\n".join(problems) + f"\nfix: {hint}")


def export(entries: list[Entry], store: Path, tarball: Path) -> None:
    verify(entries, store, full=True)
    tmp = tarball.with_name(tarball.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for entry in entries:
            repo_dir = snapshot(store, entry).parent.parent
            tar.add(repo_dir, arcname=repo_dir.name)
    tmp.replace(tarball)


def _links_stay_inside(root: Path, what: str = "the store") -> None:
    """Every symlink under ``root`` resolves inside ``root`` (the HF layout links
    snapshots to ../../blobs; nothing may point out of the store)."""
    inside = root.resolve()
    for path in root.rglob("*"):
        if path.is_symlink():
            target = (path.parent / os.readlink(path)).resolve()
            if not target.is_relative_to(inside):
                raise VerifyError(
                    f"refused: {path.relative_to(root)} links to {os.readlink(path)}, outside "
                    f"{what}; the archive is not a kit model export. Nothing was imported"
                )


def _swap_in(store: Path, scratch: Path, names: list[str], entries: list[Entry]) -> None:
    """Move each model folder from ``scratch`` into ``store`` by rename, the folder it
    replaces moved aside into ``scratch`` (removed with it), and verify the models in
    their final place; on any failure or interruption every old folder is put back."""
    moved: list[tuple[Path, Path | None]] = []
    try:
        for name in names:
            dest, aside = store / name, scratch / f".old-{name}"
            had = dest.exists() or dest.is_symlink()
            if had:
                os.replace(dest, aside)
            moved.append((dest, aside if had else None))
            os.replace(scratch / name, dest)
        verify(entries, store, full=True)
    except BaseException:
        # No Ctrl-C may cut the restore short.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for dest, aside in reversed(moved):
                if dest.is_symlink() or dest.is_file():
                    dest.unlink()
                elif dest.exists():
                    shutil.rmtree(dest)
                if aside is not None:
                    os.replace(aside, dest)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise


# An import unpacks into ``<store>/.kit-import-<pid>-<random>``; the pid lets the next
# import or verify tell the folder of a killed import (``recover``) from a running one's.
SCRATCH_PREFIX = ".kit-import-"


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie has ended: it holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's: running
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: os.kill's answer stands
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def recover(store: Path) -> list[str]:
    """Undo what an import killed outright (``kill -9``, a power cut) left in the store:
    its scratch folder is removed, and a model it had moved aside into it (``.old-<name>``,
    ``_swap_in``) is put back in place of whatever stands there (the successor, never
    verified in place). A running import's folder is left alone. One line per folder."""
    said = []
    for scratch in sorted(store.glob(f"{SCRATCH_PREFIX}*")) if store.is_dir() else []:
        pid = scratch.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        restored = []
        for aside in sorted(scratch.glob(".old-*")):
            dest = store / aside.name.removeprefix(".old-")
            if dest.is_symlink() or dest.is_file():
                dest.unlink()
            elif dest.exists():
                shutil.rmtree(dest)
            os.replace(aside, dest)
            restored.append(dest.name)
        shutil.rmtree(scratch)
        back = f"; put back the model it had moved aside: {', '.join(restored)}" if restored else ""
        said.append(
            f"{store}: removed {scratch.name}, left by an import (pid {pid}) that was killed{back}"
        )
    return said


def import_(entries: list[Entry], store: Path, tarball: Path) -> None:
    """Unpack into a scratch store, verify every locked file, then move into place by
    rename and verify there; a model already in the store is replaced only once its
    successor verifies in place (``_swap_in``), and stays on any failure.

    The archive is untrusted: tar's "data" filter refuses absolute paths, ``..``,
    device nodes and links that leave the scratch folder, and every link left must
    resolve inside it."""
    if not entries:
        raise LockError("no model selected to import; name one with --model or --target")
    store.mkdir(parents=True, exist_ok=True)
    for line in recover(store):
        print(line, file=sys.stderr)
    prefix = f"{SCRATCH_PREFIX}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=store) as scratch:
        try:
            with tarfile.open(tarball) as tar:
                tar.extractall(scratch, filter="data")
        except tarfile.FilterError as exc:
            raise VerifyError(
                f"{tarball}: refused ({exc}); the archive is not a kit model export. "
                "Nothing was imported"
            ) from exc
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise VerifyError(
                f"{tarball}: not a readable tar.gz ({exc}); write it again with "
                "'make export-models'. Nothing was imported"
            ) from exc
        _links_stay_inside(Path(scratch))
        names = sorted({snapshot(store, e).parent.parent.name for e in entries})
        for name in names:
            # Each model folder is moved alone: its links must stay inside it, or they
            # dangle in the store (whole in the scratch folder, broken in place).
            if (Path(scratch) / name).is_dir():
                _links_stay_inside(Path(scratch) / name, f"its model folder {name}")
        problems = _problems(entries, Path(scratch), full=True)
        if problems:
            # The import exists for a machine without the network fetch-models needs.
            raise VerifyError(
                "\n".join(problems)
                + f"\nfix: {tarball} does not hold what models.lock pins; export it again on "
                "the machine that has the models (make export-models) and import that, or "
                "run make fetch-models where there is network. Nothing was imported"
            )
        _swap_in(store, Path(scratch), names, entries)


def _unreachable(exc: Exception) -> bool:
    """Whether the hub could not be reached: an OSError (requests' errors,
    huggingface_hub's offline mode) or an HTTP client's transport error (httpx's,
    which huggingface_hub raises and which is no OSError)."""
    if isinstance(exc, OSError):
        return True
    return any(
        cls.__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")
        and cls.__name__ == "TransportError"
        for cls in type(exc).__mro__
    )


def _offline(exc: Exception, what: str) -> str:
    """huggingface_hub raises OSErrors and httpx's transport errors (``_unreachable``)."""
    return (
        f"cannot reach the hub to {what} ({type(exc).__name__}: {str(exc)[:200]}); "
        "run this on a machine with hub access (or set HF_ENDPOINT to a mirror), "
        "then carry the store over with 'make export-models' / 'make import-models'"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lock-file", type=Path, default=LOCK)
    parser.add_argument(
        "--store",
        type=Path,
        default=DEFAULT_STORE,
        help="HF-cache-layout model store (default: %(default)s, or $KIT_MODEL_STORE)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd, text in (
        ("lock", "resolve revisions and record file hashes (online)"),
        ("fetch", "download exactly the locked files (online)"),
        ("verify", "check the store against the lock (offline)"),
        ("export", "write a tarball of the store (offline)"),
        ("import", "unpack and verify a tarball into the store (offline)"),
        ("list", "show the entries and whether they are pinned"),
    ):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("--model", help="one entry (key or repo); default: all enabled")
        p.add_argument("--target", choices=("cpu", "gb10", "strix"))
        if cmd == "lock":
            p.add_argument("--ref", help="hub ref to resolve (default: the entry's revision)")
        if cmd == "fetch":
            p.add_argument("--workers", type=int, default=4)
        if cmd == "verify":
            p.add_argument("--full", action="store_true", help="hash every file")
        if cmd in ("export", "import"):
            p.add_argument("tarball", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "lock":
            try:
                changed = lock(args.lock_file, args.model, args.ref)
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                raise LockError(_offline(exc, "lock")) from exc
            print(f"updated: {', '.join(changed)}" if changed else "lock unchanged")
            return 0
        _, entries = load(args.lock_file)
        chosen = select(entries, args.model, args.target)
        if not args.model:
            chosen = [e for e in chosen if e.enabled]
        if not chosen and args.cmd != "list":
            where = f" for target {args.target}" if args.target else ""
            raise LockError(
                f"no enabled model in {args.lock_file.name}{where}: nothing to {args.cmd}. "
                + (
                    "The cpu target serves the tiny generated model (make tiny-model), which "
                    "is not locked; "
                    if args.target == "cpu"
                    else ""
                )
                + "name an entry with MODEL=<key> or a target with TARGET=gb10|strix"
            )
        if args.cmd == "list":
            for e in chosen:
                state = "pinned" if e.pinned else UNRESOLVED
                print(f"{e.key:24s} {e.repo:36s} {state:10s} targets={','.join(e.targets)}")
        elif args.cmd == "fetch":
            try:
                fetch(chosen, args.store, args.workers)
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                raise LockError(_offline(exc, "fetch")) from exc
            print(f"fetched and verified {len(chosen)} model(s) in {args.store}")
        elif args.cmd == "verify":
            for line in recover(args.store):
                print(line, file=sys.stderr)
            verify(chosen, args.store, full=args.full)
            print(f"verified {len(chosen)} model(s) in {args.store}")
        elif args.cmd == "export":
            export(chosen, args.store, args.tarball)
            print(f"wrote {args.tarball}")
        else:
            import_(chosen, args.store, args.tarball)
            print(f"imported and verified {len(chosen)} model(s) into {args.store}")
    except (LockError, VerifyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
