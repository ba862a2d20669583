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


# cpu-kv-block-copy-per-pair: the same layout, several pairs at once, against
# the batched gather-then-scatter vLLM does (all sources read before any write).
PAIRS_CHECK = """
import json, sys, torch
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

n, page, mamba = 8, 4096, 2113
pairs, aliased = json.loads(sys.argv[1]), sys.argv[2] == "aliased"
raw = torch.zeros(2 * n * page, dtype=torch.int8)
caches = []
for layer in range(2):
    base = layer * n * page
    if aliased:
        caches.append(torch.as_strided(raw, (n, 1, 1, mamba), (page, mamba, mamba, 1), base))
    caches.append(torch.as_strided(
        raw.view(torch.bfloat16), (n, 1, 16, 128), (page // 2, 2048, 128, 1), base // 2))
torch.manual_seed(0)
raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8))
pages = raw.view(2, n, page)
expected = pages.clone()
src = torch.tensor([s for s, _ in pairs])
dst = torch.tensor([d for _, d in pairs])
expected[:, dst] = expected[:, src]
copy_kv_cache_blocks_inplace(caches, n, pairs)
print(json.dumps(bool(torch.equal(pages, expected))))
"""


@pytest.mark.tree
@pytest.mark.parametrize(
    ("pairs", "layout"),
    [
        ([(2, 4)], "aliased"),
        ([(2, 4), (1, 5), (7, 3)], "aliased"),
        # A block both read and written in one step: only the batched order is
        # right. One view per page: with two views per page vLLM's own copy is
        # not one batched copy either (the first view's copy changes what the
        # second reads), and copy-on-write never chains.
        ([(2, 4), (4, 5)], "one view per page"),
    ],
)
def test_cow_copies_every_pair_as_vllms_batched_copy_would(
    pairs: list[tuple[int, int]], layout: str
) -> None:
    """Each copied page equals its source as it was before any copy of the step
    and the other pages are untouched, on every view."""
    from tests.conftest import TREE

    assert TREE is not None, "no vLLM tree selected"
    done = subprocess.run(
        [sys.executable, "-c", PAIRS_CHECK, json.dumps(pairs), layout],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": os.pathsep.join(TREE.search_path)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is True, pairs
