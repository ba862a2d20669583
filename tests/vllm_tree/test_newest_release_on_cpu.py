"""Why the newest release cannot serve the CPU default end to end, pinned on its own code.

The CPU bench needs MTP (one draft token) on an x86_64 CPU. The newest release's
stock tree, as the kit runs it (its Python over the .venv's dependencies, where
Triton cannot load a CPU backend), refuses both ways a CPU server could start:
its x86 platform refuses to build a config without Triton (triton-cpu, which the
package index does not carry), and the no-Triton runner it offers on other CPUs
takes one sampled token per decode step, i.e. no speculative decoding. The
README's status line and docs/results.md rest on these two facts; what runs
instead is the scheduler level (`make regress VLLM=...`, vLLM's own suite).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import offline_hub, releases

pytestmark = pytest.mark.cpu

CONFIG_ON_X86 = """
import platform
from vllm.config import ModelConfig, VllmConfig
from vllm.triton_utils import HAS_TRITON
assert platform.machine() == "x86_64" and not HAS_TRITON
try:
    VllmConfig(model_config=ModelConfig(model="facebook/opt-125m"))
except RuntimeError as exc:
    print(exc)
else:
    print("built")
"""


@pytest.fixture(scope="module")
def stock() -> Path:
    return releases.ensure_tree(releases.newest(), "pristine")


@pytest.mark.skipif(sys.platform != "linux", reason="the kit's CPU default is x86_64 Linux")
def test_its_x86_cpu_platform_refuses_without_triton(stock: Path, tmp_path: Path) -> None:
    tree = releases.tree(releases.newest(), "pristine")
    env = tree.env(HF_HOME=str(offline_hub.write(tmp_path / "hf")), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", CONFIG_ON_X86], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "requires Triton (triton-cpu)" in done.stdout


def test_its_no_triton_cpu_runner_takes_no_draft_tokens(stock: Path) -> None:
    source = (stock / "v1/worker/cpu/standalone_model_runner.py").read_text()
    assert "if self.decode_query_len != 1:" in source
    # Adjacent string literals joined, as Python joins them.
    assert "supports one sampled token per decode step" in re.sub(r'"\s+"', "", source)
    platform = (stock / "platforms/cpu.py").read_text()
    # The standalone runner is what a CPU without Triton gets, and only off x86.
    assert "return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86" in platform
