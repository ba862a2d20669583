"""Build the kit's images: Docker/BuildKit for gb10, strix and cpu, buildah for the CPU proof.

Builds use the ``docker buildx build`` CLI (BuildKit) rather than the Docker SDK:
the SDK's build API talks to the legacy builder, which lacks the cache mounts and
``# syntax`` features the Dockerfiles use. Build arguments come from pins.toml.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from scripts import mods, pins

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("unpatched", "patched")


def build_args(target: str) -> dict[str, str]:
    args = pins.build_args(target)
    args["KIT_MODS"] = ",".join(
        f"{m.name}@{m.patch_sha256[:16]}" for m in mods.mods_for_target(target, "patched")
    )
    return args


def image_tag(target: str, stage: str) -> str:
    return f"hybrid-prefix-kit/{target}:{pins.get('vllm.version')}-{stage}"


def docker_build_cmd(target: str, stage: str, base_image: str | None = None) -> list[str]:
    args = build_args(target)
    if base_image:
        args["BASE_IMAGE"] = base_image
    if not pins.is_resolved(args["BASE_IMAGE"]):
        raise mods.ModError(
            f"images.{target}.base in pins.toml is {args['BASE_IMAGE']!r}: resolve its digest "
            "(docker buildx imagetools inspect) or pass BASE_IMAGE=… to build anyway"
        )
    cmd = [
        "docker",
        "buildx",
        "build",
        "--load",
        "--target",
        stage,
        "-t",
        image_tag(target, stage),
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
        "--print-run-flags",
        action="store_true",
        help="print the docker run flags for the target and exit",
    )
    args = parser.parse_args(argv)
    if args.print_run_flags:
        from scripts.containers import RUN_SPECS

        print(shlex.join(RUN_SPECS[args.target].cli_flags()))
        return 0
    (ROOT / "wheelhouse").mkdir(exist_ok=True)  # the Dockerfiles COPY it; may stay empty
    try:
        for stage in args.stage or STAGES:
            cmd = docker_build_cmd(args.target, stage, args.base_image)
            print("+", shlex.join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True)
    except mods.ModError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError:
        print("error: docker with the buildx plugin is needed to build images", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
