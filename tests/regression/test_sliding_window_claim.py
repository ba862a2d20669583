"""The models.lock claim about Step-3.7-Flash, tested on vLLM's real scheduler.

Step-3.7-Flash is full + sliding-window attention + NEXTN (MTP) layers, no
recurrent state. The claim was "SWA groups disable partial hash hits". What
vLLM 0.32.0 does (``partial_hash_hits_enabled``): fine-grained hits exist only
when an align-mode Mamba group has blocks larger than the hash unit, and then
every other prefix-cacheable group must support fine-grained lookups or match
at the hash unit. So a model without Mamba/GDN never gets them, SWA or not; and
a hybrid with an SWA group whose block is larger than the unit loses them too.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.structured_output import StructuredOutputManager

from kit.geometry.geometry_model import Geometry
from kit.rig.sched_harness import build_vllm_config

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

UNIT = 16


def _scheduler(model_dir, block: int, swa_block: int, mamba: bool) -> Scheduler:
    geo = Geometry(block, UNIT, num_spec=1)
    config = build_vllm_config(model_dir, geo)
    attn = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=block, **attn)),
        KVCacheGroupSpec(
            ["swa"], SlidingWindowSpec(block_size=swa_block, sliding_window=512, **attn)
        ),
    ]
    if mamba:
        groups.append(
            KVCacheGroupSpec(
                ["gdn"],
                MambaSpec(
                    block_size=block,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                    num_speculative_blocks=1,
                ),
            )
        )
    kv = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=groups)
    config.cache_config.num_gpu_blocks = 1024
    register_all_kvcache_specs(config)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
        hash_block_size=UNIT,
        log_stats=True,
    )


def _partial(s: Scheduler) -> bool:
    return s.kv_cache_manager.coordinator.enable_partial_hash_hits


def test_step_3_7_layout_has_no_partial_hits_because_it_has_no_mamba(tiny_model_dir) -> None:
    # Full + SWA + MTP, no recurrent state: off, whatever the SWA block.
    assert not _partial(_scheduler(tiny_model_dir, 64, 64, mamba=False))
    assert not _partial(_scheduler(tiny_model_dir, 64, UNIT, mamba=False))


def test_an_swa_group_disables_them_in_a_hybrid_unless_it_matches_at_the_unit(
    tiny_model_dir,
) -> None:
    assert not _partial(_scheduler(tiny_model_dir, 64, 64, mamba=True))
    assert _partial(_scheduler(tiny_model_dir, 64, UNIT, mamba=True))
