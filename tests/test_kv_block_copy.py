"""Copy-on-write of a shared partial block in a hybrid KV cache (mod fix-cow-aliased-kv-copy).

The views are laid out as vLLM 0.32.0 lays out the tiny model's cache
(``KVCacheTensor``: layer-outer, two layers per allocation, each block one
page): at every layer address a Mamba state view (int8, the unpadded state
bytes) comes first, then the attention view (bf16, the whole page). The copy
is vLLM's own ``copy_kv_cache_blocks_inplace`` from the tree under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kit.vllm_tree import trees
from kit.vllm_tree.kv_copy_check import CHECK, LAYERS

pytestmark = pytest.mark.cpu


def _fractions(python: str, env_path: str | None) -> list[float]:
    env = {"PYTHONPATH": env_path} if env_path else {}
    done = subprocess.run(
        [python, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.tree
def test_cow_copy_of_aliased_views_copies_whole_page() -> None:
    from tests.conftest import TREE

    assert TREE is not None, "no vLLM tree selected"
    fractions = _fractions(sys.executable, os.pathsep.join(TREE.search_path))
    assert fractions == [1.0] * LAYERS, (
        f"the copied attention block equals its source only in {fractions} of its bytes: "
        "the Mamba view at the same address hid the attention view"
    )


def test_pristine_vllm_still_has_the_aliasing_bug() -> None:
    """vLLM 0.32.0 as installed: the bug the mod exists for (drop the mod when this fails)."""
    venv_python = trees.venv_vllm().parents[3] / "bin" / "python"
    fractions = _fractions(str(venv_python), None)
    # K (the first half of each page) is copied through the Mamba view, V only up
    # to the Mamba extent: about 51.6 % of the page.
    assert all(0.5 < f < 0.6 for f in fractions), fractions
