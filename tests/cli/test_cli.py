"""`kit`: one command that lists every job and hands each its arguments."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kit import cli

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


def kit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kit.cli", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_help_lists_every_job() -> None:
    done = kit("--help")
    assert done.returncode == 0
    for job in cli.JOBS:
        assert f"\n  {job} " in done.stdout, job


def test_every_job_module_has_a_main() -> None:
    import importlib.util

    for job, (module, _) in cli.JOBS.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, job
        assert "\ndef main(" in Path(spec.origin).read_text(), job


@pytest.mark.parametrize("job", ["bench", "report", "mods", "models", "pins", "upstream-suite"])
def test_a_jobs_help_is_its_own_and_names_kit(job: str) -> None:
    done = kit(job, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: kit {job} ")


def test_a_kit_error_is_one_line_not_a_traceback() -> None:
    done = kit("regress", "--vllm", "9.9.9")
    assert done.returncode == 2
    assert done.stderr.startswith("error: vLLM 9.9.9 is not in pins.toml")
    assert "Traceback" not in done.stderr


def test_an_unknown_job_is_refused_with_the_list() -> None:
    done = kit("benchh")
    assert done.returncode == 2 and "no job 'benchh'" in done.stderr and "bench" in done.stderr


def test_the_console_script_is_kit() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"kit": "kit.cli:main"}


def test_make_help_lists_the_variables() -> None:
    done = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0
    for name in ("REPS", "VLLM", "MODEL", "ENGINE", "SHARED", "BUNDLES", "TARGET"):
        assert f"\n  {name} " in done.stdout, name
