"""The fix changes metadata only: block sizes, page sizes and block counts are untouched.

Both trees run this module against the same expected values, so passing on both
means the geometry is identical with and without the mod.
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import BLOCKS, NUM_SPEC
from kit.geometry.geometry_model import UNIT, Geometry
from kit.rig.sched_harness import SchedulerRig, cache_geometry
from kit.vllm_tree.mods import load_mod

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

NUM_BLOCKS = 4096
FP32 = 4


@pytest.mark.parametrize("num_spec", NUM_SPEC)
@pytest.mark.parametrize("block", BLOCKS)
def test_geometry_as_configured(tiny_model_dir, block: int, num_spec: int) -> None:
    rig = SchedulerRig(
        tiny_model_dir,
        Geometry(block, UNIT, num_spec),
        num_blocks=NUM_BLOCKS,
    )
    assert cache_geometry(rig) == {
        "scheduler_block_size": block,
        "hash_block_size": UNIT,
        "coordinator_block_size": block,
        "group_block_sizes": [block, block],
        # K and V of one fp32 head of size 1 per token; one fp32 Mamba state per block.
        "page_sizes": [2 * block * FP32, FP32],
        "num_blocks": NUM_BLOCKS,
        "partial_hash_hits": True,
    }


def test_fix_does_not_touch_cache_sizing() -> None:
    """The modules that size the KV cache and its pages stay out of the mod. The
    model runner is in it only to hand the Mamba metadata builders the states
    the layer exports (``mamba_checkpoint_exports``): none of its changed lines
    names a sizing quantity."""
    mod = load_mod("fix-eagle-fine-prefix")
    sizing = {
        "v1/core/kv_cache_utils.py",
        "v1/kv_cache_spec_utils.py",
        "platforms/interface.py",
        "v1/worker/cpu_model_runner.py",
    }
    assert not sizing & set(mod.manifest["files"])
    runner = "v1/worker/gpu_model_runner.py"
    patch = (mod.directory / "mod.patch").read_text()
    section = patch.split(f"--- a/{runner}\n", 1)[1].split("\n--- a/", 1)[0]
    changed = [
        line[1:]
        for line in section.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed and any("mamba_checkpoint_exports" in line for line in changed)
    words = ("page_size", "num_blocks", "block_size", "kv_cache_config", "kv_cache_tensor")
    assert not [line for line in changed if any(w in line for w in words)]
