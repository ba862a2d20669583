"""`make bench` picks the target the host is, not merely one with a GPU tool, and
`make test TESTS=...` runs only the tests named. Checked with `make -n` (nothing runs)
and a stand-in nvidia-smi on PATH."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path: Path, *args: str, gpu: str | None = None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\necho '{gpu}'\n")
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("TARGET_HOST", None)
    done = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the cases are for an x86_64 host")
@pytest.mark.parametrize(
    "gpu,args,target",
    [
        (None, (), "cpu"),
        # An x86_64 host with an NVIDIA GPU is not a DGX Spark: the CPU default.
        ("NVIDIA H100 80GB HBM3", (), "cpu"),
        ("NVIDIA GB10", (), "cpu"),
        # Asked for: the x86_64 CUDA sibling of the gb10 flow.
        ("NVIDIA H100 80GB HBM3", ("ARCH=x86_64",), "gb10"),
        (None, ("TARGET_HOST=strix",), "strix"),
    ],
)
def test_bench_runs_the_target_the_host_is(
    tmp_path: Path, gpu: str | None, args: tuple[str, ...], target: str
) -> None:
    out = dry_run(tmp_path, "bench", *args, gpu=gpu)
    if target == "cpu":
        assert "kit.cli bench" in out and "kit.images.orchestrate" not in out
    else:
        assert "kit.images.orchestrate --engine auto" in out and f" {target} " in out


def test_make_test_with_tests_runs_only_those(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "test", "TESTS=tests/pins/test_pins.py")
    assert "pytest -q -p no:cacheprovider tests/pins/test_pins.py" in out
    assert "upstream_suite" not in out and "-m tree" not in out
    whole = dry_run(tmp_path, "test")
    assert "upstream_suite --reuse-flow" in whole and "upstream_suite --vllm newest" in whole


@pytest.mark.parametrize(
    "target,variable",
    [
        ("bench-cpu", "TURN_REPS=3"),
        ("turn-cost", "REPS=3"),
        ("turn-cost", "BENCH_ARGS=--step-log"),
        ("bench-gb10", "BENCH_ARGS=--step-log"),
        ("bench-cpu-image", "BENCH_ARGS=--step-log"),
    ],
)
def test_a_variable_the_target_ignores_is_refused(
    tmp_path: Path, target: str, variable: str
) -> None:
    out = dry_run(tmp_path, target, variable)
    assert "error:" in out and "exit 2" in out, out


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the cases are for an x86_64 host")
@pytest.mark.parametrize(
    "variable,option",
    [
        ("SHARED=1007", "--shared 1007"),
        ("DRY_RUN=1", "--print-serve-args"),
        ("VLLM=0.99.0", "--vllm 0.99.0"),
        ("ONE_SERVER=1", "--one-server"),
    ],
)
def test_bench_hands_the_cpu_bench_what_it_is_given(
    tmp_path: Path, variable: str, option: str
) -> None:
    """`make bench SHARED=1007` once started a full bench at every S; each variable the
    CPU bench understands reaches it (the rest are refused, above)."""
    out = dry_run(tmp_path, "bench", variable)
    assert "kit.cli bench" in out and option in out, out


def test_the_cpu_bench_refuses_what_the_container_flow_takes(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "bench-cpu", "NODES=2")
    assert "error: make bench-cpu ignores NODES" in out and "exit 2" in out, out
