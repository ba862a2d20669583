"""`make device-check` with a DEVICE_PYTHON (default python3) that lacks torch or Triton:
one line naming what is missing and how to point DEVICE_PYTHON at a Python that has
them, exit 2, not a traceback. The missing package is stood in for by one that fails
to import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit.kernels import triton_check
from kit.paths import ROOT

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("module", ["torch", "triton"])
def test_a_python_without_torch_or_triton_is_one_line(tmp_path: Path, module: str) -> None:
    fake = tmp_path / "site" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = tmp_path / "dry.json"
    done = subprocess.run(
        [sys.executable, triton_check.__file__, "--bundle", "kit/kernels/device_bundle"]
        + ["--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"error: {sys.executable} cannot import {module}")
    assert "torch and triton" in lines[0] and "DEVICE_PYTHON=" in lines[0]
    assert not out.exists()
