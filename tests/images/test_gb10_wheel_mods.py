"""The gb10 image's mods apply to the CUDA wheel's installed files, as the image applies them.

The kit builds a later release's trees from its sdist; the gb10 image installs the
release's prebuilt CUDA wheel instead (pins.toml [images.gb10] vllm, from its hash
lock). This test takes that wheel for aarch64 (DGX Spark) through pip's configured
index, once: it is kept in .cache/wheels/ (or found in $KIT_WHEELHOUSE) and checked
against the lock's sha256 every run. It unpacks only the wheel's ``vllm/**/*.py``
and runs the mod engine's CLI on them as the image's stages do: the unpatched
stage's mods, then the patched stage's over them (the image's patched layer), and
the patched stage's on a fresh copy. Every mod must apply.

Where the index is unreachable and no copy is kept, the test is skipped, saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kit.images import build as images
from kit.paths import CACHE, ROOT
from kit.pins import lock
from kit.vllm_tree import mods, pins

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

RELEASE = pins.image_release("gb10")
ARCH = "aarch64"
WHEELS = CACHE / "wheels"
# pip 23 takes --platform literally: every manylinux tag the image's glibc runs.
_GLIBC_MINOR = int(lock.IMAGE_GLIBC.split("_")[1])
PLATFORMS = [f"manylinux_2_{m}_{ARCH}" for m in range(_GLIBC_MINOR, 16, -1)]
# What pip prints when it cannot reach an index at all (not when the file is absent).
UNREACHABLE = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Name or service not known|"
    r"Temporary failure in name resolution|Network is unreachable|ProxyError|"
    r"Could not fetch URL|Max retries exceeded|Connection refused",
)


def locked_hashes(lock_path: Path, name: str) -> set[str]:
    """The sha256 hashes a uv hash lock lists for one package."""
    block = re.search(
        rf"^{re.escape(name)}==\S+((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{{64}})+)",
        lock_path.read_text(),
        re.M,
    )
    assert block, f"{lock_path.name} holds no {name}"
    return set(re.findall(r"sha256:([0-9a-f]{64})", block.group(1)))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def kept_wheel(want: set[str]) -> Path | None:
    """A copy of the wheel already here whose sha256 the lock lists."""
    folders = [Path(os.environ["KIT_WHEELHOUSE"])] if os.environ.get("KIT_WHEELHOUSE") else []
    for folder in [*folders, WHEELS]:
        for path in sorted(folder.glob(f"vllm-{RELEASE}-*{ARCH}.whl")):
            if sha256(path) in want:
                return path
    return None


@pytest.fixture(scope="module")
def wheel() -> Path:
    lock_path = images.lock_file("gb10", ARCH, RELEASE)
    if not lock_path.is_file():
        pytest.fail(f"locks/{lock_path.relative_to(images.LOCKS)} missing: run make lock-deps")
    want = locked_hashes(lock_path, "vllm")
    found = kept_wheel(want)
    if found is not None:
        return found
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    cmd += ["--python-version", pins.image_pins("gb10", RELEASE)["python"]]
    cmd += ["--implementation", "cp", "--retries", "1", "--timeout", "30"]
    cmd += ["-d", str(WHEELS), f"vllm=={RELEASE}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        why = next((line for line in said if UNREACHABLE.search(line)), None)
        if why is not None:
            pytest.skip(
                f"pip's configured index is unreachable, so the vLLM {RELEASE} {ARCH} wheel "
                f"cannot be fetched (put it in $KIT_WHEELHOUSE or {WHEELS}): {why.strip()[:240]}"
            )
        pytest.fail(f"pip download of the vLLM {RELEASE} {ARCH} wheel failed: {said[-3:]}")
    found = kept_wheel(want)
    assert found is not None, (
        f"pip fetched a vLLM {RELEASE} {ARCH} wheel into {WHEELS} whose sha256 is not in "
        f"{lock_path.name}: the index serves other bytes than the lock pins"
    )
    return found


def unpack_python(wheel: Path, dest: Path) -> Path:
    """Only the wheel's ``vllm/**/*.py``: the files the mods touch, as installed."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        whl.extractall(dest, members=names)
    return dest / "vllm"


def apply_stage(tree: Path, stage: str) -> dict[str, str]:
    """The image's step: the mod engine's CLI on the installed tree; mod -> what it did."""
    done = subprocess.run(
        [sys.executable, "-m", "kit.vllm_tree.mods", "apply", "--tree", str(tree)]
        + ["--target", "gb10", "--stage", stage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(re.findall(r"^([\w-]+): (applied|already applied)", done.stdout, re.M))


def names(stage: str) -> set[str]:
    return {m.name for m in mods.mods_for_target("gb10", stage, release=RELEASE)}


def test_the_wheel_is_the_locked_one_and_its_version_the_release(wheel: Path, tmp_path) -> None:
    tree = unpack_python(wheel, tmp_path)
    assert mods.tree_version(tree)[0] == RELEASE
    assert sha256(wheel) in locked_hashes(images.lock_file("gb10", ARCH, RELEASE), "vllm")


def test_every_gb10_mod_applies_to_the_wheels_files_stage_by_stage(
    wheel: Path, tmp_path: Path
) -> None:
    unpatched, patched = names("unpatched"), names("patched")
    assert unpatched and patched > unpatched, (unpatched, patched)
    tree = unpack_python(wheel, tmp_path / "image")
    # The unpatched image: its stage's mods, each applied.
    assert apply_stage(tree, "unpatched") == dict.fromkeys(unpatched, "applied")
    # The patched layer over it: the rest applied, the unpatched stage's kept.
    assert apply_stage(tree, "patched") == {
        **dict.fromkeys(unpatched, "already applied"),
        **dict.fromkeys(patched - unpatched, "applied"),
    }
    record = json.loads((tree.parent / "vllm_kit_mods.json").read_text())
    assert {m["name"] for m in record["mods"]} == patched
    assert record["vllm_version"] == RELEASE


def test_the_patched_stage_applies_to_a_fresh_copy_of_the_wheels_files(
    wheel: Path, tmp_path: Path
) -> None:
    tree = unpack_python(wheel, tmp_path)
    assert apply_stage(tree, "patched") == dict.fromkeys(names("patched"), "applied")
