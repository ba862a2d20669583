"""cpu-mamba-align-spec: the CPU postprocess equals a straightforward reference.

Random GDN-like states (a conv state and a temporal state per block) and random
block tables; for k draft tokens and every accepted count 1..k+1 the mod's
``postprocess_mamba_align_cpu`` must leave exactly the states and accepted
counts the reference computes with plain tensor indexing.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

mamba_utils = pytest.importorskip("vllm.v1.worker.mamba_utils")
if not hasattr(mamba_utils, "postprocess_mamba_align_cpu"):
    pytest.skip("cpu-mamba-align-spec is not applied to this tree", allow_module_level=True)

from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateCopyFuncCalculator,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

BLOCK = 16
CONV_LEN, CONV_DIM = 3, 8
HEADS, HEAD_DIM = 2, 4
NUM_BLOCKS = 64
NUM_REQS = 6
MAX_BLOCKS_PER_REQ = 10


def make_config(num_spec: int) -> tuple[KVCacheConfig, MambaSpec]:
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((CONV_LEN, CONV_DIM), (HEADS, HEAD_DIM, HEAD_DIM)),
        dtypes=(torch.float32, torch.float32),
        mamba_type="gdn_attention",
        mamba_cache_mode="align",
        num_speculative_blocks=num_spec,
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["gdn.0"], spec)],
    )
    return config, spec


def make_buffer(*size, dtype, numpy=True):
    return CpuGpuBuffer(
        *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=numpy
    )


class Table:
    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def get_numpy_array(self) -> np.ndarray:
        return self.rows


def reference(conv, temporal, tables, reqs, block):
    """Plain indexing: what the fused kernel does, request by request."""
    conv_out, temporal_out = conv.clone(), temporal.clone()
    accepted_out, copies = [], 0
    for row, (acc, src, scheduled, computed, drafts) in enumerate(reqs):
        running = computed + scheduled - drafts
        new_computed = running + acc - 1
        aligned = new_computed // block * block
        if aligned < running:
            accepted_out.append(acc)
            continue
        bias = aligned - running
        dest = aligned // block - 1
        accepted_out.append(1 if src == dest else acc)
        if src == dest and bias == 0:
            continue
        ids = tables[row]
        copies += 1
        temporal_out[ids[dest]] = temporal[ids[src + bias]]
        conv_out[ids[dest], : CONV_LEN - bias] = conv[ids[src], bias:]
    return conv_out, temporal_out, accepted_out, copies


def random_batch(rng: random.Random, num_spec: int, accepted: int):
    """Requests in decode with k drafts, positioned so some cross a block boundary."""
    reqs = []
    for _ in range(NUM_REQS):
        computed = rng.randrange(BLOCK, 5 * BLOCK)
        scheduled = 1 + num_spec
        src = (computed + scheduled - 1) // BLOCK  # the block the step writes
        src = min(src, MAX_BLOCKS_PER_REQ - 1 - num_spec)
        reqs.append((accepted, src, scheduled, computed, num_spec))
    return reqs


@pytest.mark.parametrize("num_spec", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_cpu_postprocess_matches_reference(num_spec: int, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config, spec = make_config(num_spec)
    copy_funcs = {spec.mamba_type: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()}
    conv = torch.randn(NUM_BLOCKS, CONV_LEN, CONV_DIM)
    temporal = torch.randn(NUM_BLOCKS, HEADS, HEAD_DIM, HEAD_DIM)
    forward_context = {"gdn.0": SimpleNamespace(kv_cache=[conv, temporal])}
    ids = list(range(1, NUM_BLOCKS))
    rng.shuffle(ids)
    tables = np.array(ids[: NUM_REQS * MAX_BLOCKS_PER_REQ], dtype=np.int32).reshape(
        NUM_REQS, MAX_BLOCKS_PER_REQ
    )
    input_batch = SimpleNamespace(block_table={0: Table(tables)})
    total_copies = 0
    for accepted in range(1, num_spec + 2):
        bufs = mamba_utils.MambaBuffers.create(
            max_num_reqs=NUM_REQS,
            kv_cache_config=config,
            copy_funcs=copy_funcs,
            make_buffer=make_buffer,
            device=torch.device("cpu"),
            with_postprocess_align=True,
        )
        reqs = random_batch(rng, num_spec, accepted)
        ctx = bufs.postprocess_align
        for row, (_acc, src, scheduled, computed, drafts) in enumerate(reqs):
            ctx.mamba_state_idx_buf.np[row] = src
            ctx.num_scheduled_tokens_buf.np[row] = scheduled
            ctx.num_computed_tokens_buf.np[row] = computed
            ctx.num_draft_tokens_buf.np[row] = drafts
        want_conv, want_temporal, want_accepted, copies = reference(
            conv, temporal, tables, reqs, BLOCK
        )
        total_copies += copies
        accepted_cpu = torch.zeros(NUM_REQS, dtype=torch.int32)
        mamba_utils.postprocess_mamba_align_cpu(
            bufs=bufs,
            num_reqs=NUM_REQS,
            num_accepted_tokens=torch.tensor([r[0] for r in reqs], dtype=torch.int32),
            num_accepted_tokens_cpu_tensor=accepted_cpu,
            input_batch=input_batch,
            kv_cache_config=config,
            forward_context=forward_context,
            mamba_state_copy_funcs=copy_funcs,
        )
        assert accepted_cpu.tolist() == want_accepted
        assert torch.equal(conv, want_conv)
        assert torch.equal(temporal, want_temporal)
    assert total_copies > 0  # some steps crossed a block boundary


def test_batch_memcpy_on_cpu_copies_bytes() -> None:
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(64, dtype=torch.float32)
    ptrs = torch.tensor([src.data_ptr(), src[32:].data_ptr()], dtype=torch.int64)
    outs = torch.tensor([dst[16:].data_ptr(), dst.data_ptr()], dtype=torch.int64)
    sizes = torch.tensor([8 * 4, 4 * 4], dtype=torch.int64)
    mamba_utils.batch_memcpy(ptrs, outs, sizes)
    assert dst[16:24].tolist() == src[:8].tolist()
    assert dst[:4].tolist() == src[32:36].tolist()
    assert dst[4:16].abs().sum() == 0
