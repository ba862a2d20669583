"""Build the kit's images: Docker/BuildKit for gb10, strix and cpu, buildah for the CPU proof.

Builds use the ``docker buildx build`` CLI (BuildKit) rather than the Docker SDK:
the SDK's build API talks to the legacy builder, which lacks the cache mounts and
``# syntax`` features the Dockerfiles use. Where only Podman is installed,
``podman build`` (buildah underneath, which has the same RUN mounts) takes its
place. Build arguments come from pins.toml.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from kit import mods, pins

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("unpatched", "patched")


# What the Dockerfiles COPY into /opt/kit; their hash labels the image.
KIT_SOURCES = ("pins.toml", "pyproject.toml", "models.lock", "kit", "mods", "tests")
SOURCE_LABEL = "io.hybrid-prefix-kit.source.sha256"
PINS_LABEL = "io.hybrid-prefix-kit.pins.sha256"


def source_sha256() -> str:
    """One hash over the kit files an image carries, so a stale image is never reused."""
    digest = hashlib.sha256()
    for name in KIT_SOURCES:
        top = ROOT / name
        files = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in files:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def build_args(target: str, release: str | None = None) -> dict[str, str]:
    args = pins.build_args(target, release=release)
    patched = mods.mods_for_target(target, "patched", release=args["VLLM_VERSION"])
    args["KIT_MODS"] = ",".join(f"{m.name}@{m.patch_sha256[:16]}" for m in patched)
    args["KIT_SOURCE_SHA256"] = source_sha256()
    return args


def is_current(labels: dict[str, str]) -> bool:
    """An image built from these pins and these kit sources."""
    return (
        labels.get(SOURCE_LABEL) == source_sha256() and labels.get(PINS_LABEL) == pins.file_sha256()
    )


def image_tag(target: str, stage: str, release: str | None = None) -> str:
    return f"hybrid-prefix-kit/{target}:{release or pins.get('vllm.version')}-{stage}"


def docker_build_cmd(
    target: str, stage: str, base_image: str | None = None, release: str | None = None
) -> list[str]:
    args = build_args(target, release)
    if base_image:
        args["BASE_IMAGE"] = base_image
    if not pins.is_resolved(args["BASE_IMAGE"]):
        raise mods.ModError(
            f"images.{target}.base in pins.toml is {args['BASE_IMAGE']!r}: resolve its digest "
            "(docker buildx imagetools inspect) or pass BASE_IMAGE=… to build anyway"
        )
    if shutil.which("docker") or not shutil.which("podman"):
        cmd = ["docker", "buildx", "build", "--load"]
    else:
        cmd = ["podman", "build", "--format", "docker"]  # the OCI format drops SHELL
    cmd += [
        "--target",
        stage,
        "-t",
        image_tag(target, stage, args["VLLM_VERSION"]),
        "-f",
        str(ROOT / "images" / target / "Dockerfile"),
    ]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    return [*cmd, str(ROOT)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", choices=mods.TARGETS)
    parser.add_argument("--stage", choices=STAGES, action="append")
    parser.add_argument("--base-image", help="override the pinned base (e.g. a local mirror)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--vllm",
        metavar="RELEASE",
        help="a later vLLM release from pins.toml [releases] (default: the pinned one)",
    )
    args = parser.parse_args(argv)
    (ROOT / "wheelhouse").mkdir(exist_ok=True)  # the Dockerfiles COPY it; may stay empty
    try:
        for stage in args.stage or STAGES:
            cmd = docker_build_cmd(args.target, stage, args.base_image, args.vllm)
            print("+", shlex.join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True)
    except (mods.ModError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print(
            "error: docker with the buildx plugin (or podman) is needed to build images",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
