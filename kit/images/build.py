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
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kit.paths import IMAGES_DIR, LOCKS, ROOT, WHEELHOUSE
from kit.process_group import run_watched
from kit.vllm_tree import mods, pins

# The image stages: the release's modded trees (kit.vllm_tree.releases.STAGES less
# the release as installed, which has no image of its own).
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


# The platforms each target builds for; gb10's Dockerfile also makes the x86_64
# CUDA sibling (Hopper/Blackwell datacenter GPUs) from the same lock layout.
ARCHES = {"gb10": ("aarch64", "x86_64"), "strix": ("x86_64",), "cpu": ("x86_64",)}
DOCKER_PLATFORMS = {"aarch64": "linux/arm64", "x86_64": "linux/amd64"}


def default_arch(target: str) -> str:
    """The host's arch where the target has an image for it, else the target's first."""
    machine = platform.machine().lower().replace("arm64", "aarch64").replace("amd64", "x86_64")
    return machine if machine in ARCHES[target] else ARCHES[target][0]


def image_tag(target: str, stage: str, release: str | None = None, arch: str | None = None) -> str:
    # The sibling gets its own name so one host can hold both without confusion.
    name = target if arch in (None, ARCHES[target][0]) else f"{target}-{arch}"
    return f"hybrid-prefix-kit/{name}:{release or pins.image_release(target)}-{stage}"


def lock_file(target: str, arch: str, release: str | None = None) -> Path | None:
    """The hash lock an image installs from for a release (default: the image's own,
    ``pins.image_release``); the cpu image has its wheelhouse instead. The Dockerfiles
    read the same path, ``locks/vllm-${VLLM_VERSION}/<target>-<arch>.txt``."""
    if target == "cpu":
        return None
    return LOCKS / f"vllm-{release or pins.image_release(target)}" / f"{target}-{arch}.txt"


def missing_lock(target: str, lock: Path) -> str:
    """One line: the image's lock is not there, and what to run where."""
    index = pins.load()["images"][target].get("torch_index")  # strix: AMD's wheel index
    where = f"on a machine that reaches {index}" if index else "where pip's index is reachable"
    return (
        f"locks/{lock.relative_to(LOCKS)} is missing: run `make lock-deps` {where}, then commit it"
    )


def locked_vllm(lock: Path) -> str | None:
    """The vLLM release whose wheel a hash lock holds (``vllm==<version>``), if any."""
    found = re.search(r"^vllm==([^\s;+]+)", lock.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def docker_build_cmd(
    target: str,
    stage: str,
    base_image: str | None = None,
    release: str | None = None,
    arch: str | None = None,
    source_build: bool | None = None,
) -> list[str]:
    args = build_args(target, release)
    arch = arch or default_arch(target)
    if arch not in ARCHES[target]:
        raise mods.ModError(
            f"the {target} image is made for {', '.join(ARCHES[target])}, not {arch}"
        )
    if base_image:
        args["BASE_IMAGE"] = base_image
    if source_build is not None and "SOURCE_BUILD" in args:
        args["SOURCE_BUILD"] = "1" if source_build else "0"
    if not pins.is_resolved(args["BASE_IMAGE"]):
        raise mods.ModError(
            f"images.{target}.base in pins.toml is {args['BASE_IMAGE']!r}: run `make lock` "
            f"once on a machine that reaches the registry (it resolves the digest), or pass "
            f"BASE_IMAGE=<name>@sha256:<digest> to build anyway"
        )
    lock = lock_file(target, arch, args["VLLM_VERSION"])
    if lock is not None and not lock.is_file():
        raise mods.ModError(missing_lock(target, lock))
    held = locked_vllm(lock) if lock is not None else None
    if "SOURCE_BUILD" in args and held != args["VLLM_VERSION"]:
        raise mods.ModError(
            f"locks/{lock.relative_to(LOCKS) if lock else '?'} holds the vLLM {held or 'no'} "
            f"wheel, not {args['VLLM_VERSION']}: run `make lock-deps` again"
        )
    if shutil.which("docker") or not shutil.which("podman"):
        cmd = ["docker", "buildx", "build", "--load"]
    else:
        cmd = ["podman", "build", "--format", "docker"]  # the OCI format drops SHELL
    cmd += [
        "--platform",
        DOCKER_PLATFORMS[arch],
        "--target",
        stage,
        "-t",
        image_tag(target, stage, args["VLLM_VERSION"], arch),
        "-f",
        str(IMAGES_DIR / target / "Dockerfile"),
    ]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    return [*cmd, str(ROOT)]


# -- checks against the pinned sdist (tests and dry runs; no GPU, no build) ----
# A path inside vLLM's source tree that a Dockerfile or a lock input relies on.
SDIST_PATH = re.compile(r"(?<![\w/.-])((?:requirements|cmake|tools|docker)/[\w./-]+|[\w-]+\.py)\b")


def sdist_references(text: str) -> set[str]:
    """vLLM source paths a Dockerfile names (requirements/…, tools/…, *.py at the top)."""
    found = set()
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for path in SDIST_PATH.findall(line):
            if not path.startswith(("kit/", "kit.")):
                found.add(path)
    return found


def supported_cuda_archs(cmakelists: str, cuda_version: str) -> str:
    """CUDA_SUPPORTED_ARCHS as the pinned CMakeLists.txt sets it for one CUDA version:
    its own if/elseif block, run by cmake."""
    start = cmakelists.index("if(DEFINED CMAKE_CUDA_COMPILER_VERSION AND")
    end = cmakelists.index("endif()", start) + len("endif()")
    script = (
        "cmake_minimum_required(VERSION 3.20)\n"
        f"set(CMAKE_CUDA_COMPILER_VERSION {cuda_version})\n"
        f"{cmakelists[start:end]}\n"
        'message("${CUDA_SUPPORTED_ARCHS}")\n'
    )
    return _cmake(script).strip()


def cuda_archs(arch_list: str, cuda_version: str, src: Path, torch_cmake: Path) -> dict:
    """What a source build compiles for TORCH_CUDA_ARCH_LIST=arch_list: torch's own
    CUDA_SELECT_NVCC_ARCH_FLAGS makes the gencode flags, then vLLM's functions from
    ``src/cmake/utils.cmake`` filter them as CMakeLists.txt does (the global list,
    and the SM90+ kernels' list)."""
    supported = supported_cuda_archs((src / "CMakeLists.txt").read_text(), cuda_version)
    script = f"""cmake_minimum_required(VERSION 3.20)
include({torch_cmake})
include({src / "cmake" / "utils.cmake"})
set(CMAKE_CUDA_COMPILER_VERSION {cuda_version})
CUDA_SELECT_NVCC_ARCH_FLAGS(_flags "{arch_list}")
string(REPLACE ";" " " CMAKE_CUDA_FLAGS "${{_flags}}")
clear_cuda_gencode_flags(CUDA_ARCH_FLAGS)
extract_unique_cuda_archs_ascending(CUDA_ARCHS "${{CUDA_ARCH_FLAGS}}")
message("requested=${{CUDA_ARCHS}}")
cuda_archs_loose_intersection(CUDA_ARCHS "{supported}" "${{CUDA_ARCHS}}")
message("global=${{CUDA_ARCHS}}")
cuda_archs_sm90plus(_sm90 "${{CUDA_ARCHS}}")
message("sm90plus=${{_sm90}}")
"""
    result = {"supported": supported.split(";")}
    for line in _cmake(script).splitlines():
        key, _, value = line.partition("=")
        if key in ("requested", "global", "sm90plus"):
            result[key] = [v for v in value.split(";") if v]
    return result


def _cmake(script: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.cmake"
        path.write_text(script)
        done = subprocess.run(["cmake", "-P", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise mods.ModError(f"cmake -P failed: {done.stderr.strip()}")
    return done.stderr  # message() without a mode writes to stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", choices=mods.TARGETS)
    parser.add_argument("--stage", choices=STAGES, action="append")
    parser.add_argument("--base-image", help="override the pinned base (e.g. a local mirror)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--arch", choices=sorted(DOCKER_PLATFORMS), help="default: this host's")
    parser.add_argument(
        "--source-build",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gb10: compile vLLM from its tag instead of the locked wheel (default: pins.toml)",
    )
    parser.add_argument(
        "--vllm",
        metavar="RELEASE",
        help="a vLLM release the image builds (pins.toml [images.<target>]; "
        "default: its vllm, the pinned one for cpu)",
    )
    args = parser.parse_args(argv)
    WHEELHOUSE.mkdir(exist_ok=True)  # the Dockerfiles COPY it; may stay empty
    try:
        for stage in args.stage or STAGES:
            cmd = docker_build_cmd(
                args.target, stage, args.base_image, args.vllm, args.arch, args.source_build
            )
            print("+", shlex.join(cmd), flush=True)
            if not args.dry_run:
                # Watched: the build dies with this process, SIGKILL included.
                run_watched(cmd, check=True)
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
