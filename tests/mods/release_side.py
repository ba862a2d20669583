"""How the worker-side mod tests of the newest release run their two halves: a
script on the release tree's patched stage (vLLM's own code, no kernel), and a
script under Triton's interpreter in .venv-triton (vLLM's kernels from the tree's
files). Shared by the FlashInfer, FLA and Mamba2 export tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kit.vllm_tree import trees

ROOT = Path(__file__).resolve().parents[2]
# The release fix-eagle-fine-prefix-exports is made for (its mod.toml).
RELEASE = "0.34.0"


def run_on_tree(script: str, tree: trees.Tree, *args: str, timeout: int = 600) -> None:
    """``python script on-tree ARGS`` with the tree's environment; fails with its stderr."""
    cmd = [sys.executable, script, "on-tree", *args]
    env = tree.env(VLLM_LOGGING_LEVEL="ERROR")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]


def run_interpreted(triton_env: Path, code: str, *args: str, timeout: int = 600) -> None:
    """``code`` in .venv-triton under Triton's interpreter, nothing of the kit's
    .venv or trees on its path; fails with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}
    cmd = [str(triton_env), "-c", code, *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]


def on_tree_config(model_dir: Path, geometry: Any) -> Any:
    """On the tree: vLLM's config for the tiny model at ``geometry``, its hash block
    resolved to the geometry's unit as the engine does when it sizes the KV cache."""
    import vllm.triton_utils

    # 0.34.0 refuses an x86 CPU config without Triton; nothing on-tree runs a kernel.
    vllm.triton_utils.HAS_TRITON = True
    from kit.rig.sched_harness import build_vllm_config

    config = build_vllm_config(model_dir, geometry)
    config.cache_config.hash_block_size = geometry.unit
    config.cache_config.cache_hit_alignment_tokens = geometry.unit
    return config
