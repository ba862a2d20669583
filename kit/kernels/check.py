"""`make kernel-check`: the kit's CPU kernels against vLLM's own Triton kernels, same inputs.

Two sides, two environments. This module runs in the kit's .venv against a
vLLM tree (``KIT_TREE``, default patched): it draws seeded random cases, runs
the CPU code the kit's CPU default executes on them, and writes inputs and
results to ``cases.pt``. ``kit/kernels/triton_check.py`` runs in .venv-triton
(kit/kernels/triton_env.py: torch, pinned Triton, no vLLM) under Triton's interpreter:
it loads vLLM 0.32.0's kernels from the pinned sdist's files, runs them on the
same inputs and compares.

(a) align-mode state copies, mod ``cpu-mamba-align-spec``:
    ``postprocess`` — the mod's ``postprocess_mamba_align_cpu`` against
    ``postprocess_mamba_fused_kernel``; ``precopy`` — vLLM's scalar pre-copy
    (``preprocess_mamba``, which the mod selects without Triton) against
    ``precopy_mamba_align_fused_kernel``; ``batch_memcpy`` — the mod's memmove
    loop against ``batch_memcpy_kernel``. Bytes are moved, so: bit for bit.
(b) the chunked gated delta rule: vLLM's CPU GDN prefill kernel
    (``chunk_gated_delta_rule_cpu``, what ``ops/cpu/gdn_attention.py`` calls)
    against FLA's ``chunk_gated_delta_rule_fwd`` (the body of
    ``chunk_gated_delta_rule``): final states, the output, and the state at every
    64-token chunk boundary (FLA's ``h``; on the CPU the split schedule: the
    kernel run on the prefix up to that boundary), and the state at positions
    inside chunks (``GDN_MID_OFFSETS``; FLA runs each such prefix as a sequence
    of its own), on random batches of sequences with random lengths and initial
    states. Both are also held to a float64 recurrence. Where the tree carries
    mod ``cpu-gdn-prefill-checkpoint``, its export (one call for the batch, a
    state written at every boundary and at every position inside a chunk) is
    held to FLA's states the same way. Tolerances and their reasons: ``GDN_TOLERANCE``.

(c) exports, states at requested positions inside one varlen prefill (rows
    resumed from a state among them) taken from what that one forward pass
    already materialises, no extra pass: ``gdn_export`` from FLA's ``h`` and final
    states, ``ssd_export`` from vLLM's Mamba2 SSD scan
    (``mamba_chunk_scan_combined_varlen`` with ``return_intermediate_states``, the
    chunk layout from vLLM's own metadata builder). Each case asks for positions
    on and off the kernel's grid, laid out by intent; the Triton side's planners
    (``triton_check.gdn_export_plan``: ``p - start`` a multiple of 64, or p
    the row's end; ``ssd_export_plan``: p a chunk end) must refuse exactly the off
    ones, and the exported states must match a float64 recurrence and, for GDN,
    the CPU export of mod ``cpu-gdn-prefill-checkpoint`` where the tree has it.
    These, and ``gdn``, also run on vLLM 0.34.0's kernel files (LATER_RELEASES),
    under ``releases`` in the result; ``gdn`` also on that release's patched tree
    (PATCHED_FLA: FLA as fix-eagle-fine-prefix-exports changes it), where storing
    every chunk's float32 state must leave ``h``, the output and the final states
    bit for bit.

``--perturb`` breaks the CPU side on purpose (``align-bias``: the accepted-token
bias off by one in the mod's post-copy decision; ``gdn-position``: each chunk
state, and each state inside a chunk, taken one token early, and so are the GDN
exports' references; ``ssd-position``: the SSD exports' references one token
early) to show the check fails.
``--export [DIR]`` writes the device bundle (default kit/kernels/device_bundle):
the cases, each release's kernel files and a manifest, all a GPU machine needs
(torch and Triton; no vLLM, no kit, no network) for ``make device-check``
(``triton_check.py --bundle DIR --device cuda``; ``--dry-run`` runs it
under the interpreter on tiny cases).

Exit status: 0 every case within tolerance; 1 a case is not; 2 could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kit import schema
from kit.bundle import cpu_kernels
from kit.kernels import triton_check as triton_side
from kit.paths import RESULTS, ROOT
from kit.vllm_tree import releases as known_releases

HERE = Path(__file__).resolve().parent
TRITON_SIDE = HERE / "triton_check.py"
DEFAULT_OUT = RESULTS / "kernel-check.json"
KERNEL_PATHS = (
    "vllm/v1/worker",
    "vllm/third_party/flash_linear_attention",
    "vllm/model_executor/layers/mamba/ops",
)
PERTURBATIONS = ("align-bias", "gdn-position", "ssd-position")
KINDS = ("postprocess", "precopy", "batch_memcpy", "gdn", "gdn_export", "ssd_export")
# The later release whose FLA and SSD kernels run on the same cases (the kinds that
# use them only: the align copies are checked against the pinned release's): the
# newest in pins.toml.
LATER_RELEASES = (known_releases.newest(),)
LATER_KINDS = ("gdn", "gdn_export", "ssd_export")
# The newest release's FLA files as fix-eagle-fine-prefix-exports changes them (the
# chunk kernel stores the Triton GDN path's in-pass exports in float32), from its patched
# tree: the ``gdn`` cases, plus that path's own bit-for-bit checks.
PATCHED_FLA = (known_releases.newest(), "patched")
PATCHED_KINDS = ("gdn",)
# The device bundle (make device-check): cases, kernel files, manifest; in the
# repository, so that a GPU machine needs nothing else.
DEVICE_BUNDLE = HERE / "device_bundle"
# One small case per kind: what the bundle's dry run (CI, no GPU) runs.
TINY_CASES = {
    "postprocess": "postprocess-float32-conv8-k1-s0",
    "precopy": "precopy-float32-conv8-k1-s0",
    "batch_memcpy": "batch_memcpy-s0",
    "gdn": "gdn-200",
    "gdn_export": "gdn_export-small",
    "ssd_export": "ssd_export-c32-small",
}

# The GDN comparison's tolerances, on max |difference| / max |CPU value| over a
# case. Both kernels take the same bf16 q, k, v and round inside: FLA keeps A,
# w, u, v_new and the per-chunk h in the input dtype (bf16 on a GPU, fp16
# under the interpreter: see triton_check.run_gdn), the CPU kernel
# rounds its own intermediates to bf16 (against a float64 recurrence its
# states are off by ~0.7 % of their scale). Two independent roundings of
# ~2^-8 relative each, accumulated over a few chunks: 2 % of the state's scale
# holds them with room, while one token of state too many or too few moves a
# chunk state by tens of percent here (``--perturb gdn-position``).
GDN_TOLERANCE = {"final_state": 0.02, "chunk_states": 0.02, "output": 0.03}

# Small shapes: the interpreter runs every Triton program in numpy.
BLOCK = 16
NUM_BLOCKS = 64
NUM_REQS = 6
MAX_BLOCKS_PER_REQ = 10
GDN_HEAD_DIM = 64  # the smallest head size the CPU GDN kernel takes
GDN_K_HEADS, GDN_V_HEADS = 1, 2  # grouped like Qwen3-Next (v heads = 2 x k heads)
GDN_CHUNK = 64  # FLA_CHUNK_SIZE
# States inside a chunk, each row's where it has them (plus one token short of
# its end): one token in; 32 and 48 into the first chunk, where a fix state
# 2-3 units above a chunk start falls (the bench's later turns exported theirs
# there until the fix left out states just above a resumed prompt's hit); 48
# into the second. FLA's ``h``
# holds chunk starts only, so there FLA runs each prefix as a sequence of its own.
GDN_MID_OFFSETS = (1, 32, 48, GDN_CHUNK + 48)


class KernelCheckError(RuntimeError):
    exit_code = 2


# --------------------------------------------------------------------------
# (a) align-mode copies on the CPU
# --------------------------------------------------------------------------


def _copy_layout(dtype: Any, conv_dim: int, num_spec: int) -> dict[str, Any]:
    """A GDN-like Mamba group with two layers (four state tensors), as vLLM lays them out."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    conv_len, heads, head_dim = 3 + num_spec, 2, 4
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((conv_len, conv_dim), (heads, head_dim, head_dim)),
        dtypes=(dtype, dtype),
        mamba_type="gdn_attention",
        mamba_cache_mode="align",
        num_speculative_blocks=num_spec,
    )
    layers = ["gdn.0", "gdn.1"]
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    states = {
        name: [
            torch.randn(NUM_BLOCKS, conv_len, conv_dim).to(dtype),
            torch.randn(NUM_BLOCKS, heads, head_dim, head_dim).to(dtype),
        ]
        for name in layers
    }
    return {
        "spec": spec,
        "config": config,
        "copy_funcs": {
            spec.mamba_type: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
        },
        "forward_context": {name: SimpleNamespace(kv_cache=s) for name, s in states.items()},
        "states": [t for s in states.values() for t in s],
        "kinds": ["conv", "temporal"] * len(layers),
    }


def _buffers(layout: dict[str, Any]) -> Any:
    import torch
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils

    def make_buffer(*size: int, dtype: Any, numpy: bool = True) -> Any:
        return CpuGpuBuffer(
            *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=numpy
        )

    return mamba_utils.MambaBuffers.create(
        max_num_reqs=NUM_REQS,
        kv_cache_config=layout["config"],
        copy_funcs=layout["copy_funcs"],
        make_buffer=make_buffer,
        device=torch.device("cpu"),
        with_postprocess_align=True,
    )


class _Table:
    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def get_numpy_array(self) -> Any:
        return self.rows


def _block_table(rng: random.Random) -> Any:
    import numpy as np

    ids = list(range(1, NUM_BLOCKS))
    rng.shuffle(ids)
    return np.array(ids[: NUM_REQS * MAX_BLOCKS_PER_REQ], dtype=np.int32).reshape(
        NUM_REQS, MAX_BLOCKS_PER_REQ
    )


def _snapshot(layout: dict[str, Any]) -> list[Any]:
    return [t.clone() for t in layout["states"]]


def postprocess_case(name: str, seed: int, dtype: Any, conv_dim: int, num_spec: int) -> dict:
    """One step's post-copy for a batch in decode with ``num_spec`` drafts, through the mod."""
    import torch
    from vllm.v1.worker import mamba_utils

    rng = random.Random(seed)
    torch.manual_seed(seed)
    layout = _copy_layout(dtype, conv_dim, num_spec)
    table = _block_table(rng)
    bufs = _buffers(layout)
    ctx = bufs.postprocess_align
    rows = []
    for row in range(NUM_REQS):
        # Near a block boundary, so that most steps cross one (and the copies run).
        computed = rng.randrange(1, 5) * BLOCK + rng.randrange(-num_spec - 1, 2)
        scheduled = 1 + num_spec
        src = min((computed + scheduled - 1) // BLOCK, MAX_BLOCKS_PER_REQ - 1 - num_spec)
        accepted = rng.randint(1, num_spec + 1)
        rows.append((accepted, src, scheduled, computed, num_spec))
        ctx.mamba_state_idx_buf.np[row] = src
        ctx.num_scheduled_tokens_buf.np[row] = scheduled
        ctx.num_computed_tokens_buf.np[row] = computed
        ctx.num_draft_tokens_buf.np[row] = num_spec
    before = _snapshot(layout)
    num_accepted = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    accepted_cpu = torch.zeros(NUM_REQS, dtype=torch.int32)
    mamba_utils.postprocess_mamba_align_cpu(
        bufs=bufs,
        num_reqs=NUM_REQS,
        num_accepted_tokens=num_accepted,
        num_accepted_tokens_cpu_tensor=accepted_cpu,
        input_batch=SimpleNamespace(block_table={0: _Table(table)}),
        kv_cache_config=layout["config"],
        forward_context=layout["forward_context"],
        mamba_state_copy_funcs=layout["copy_funcs"],
    )
    return {
        "name": name,
        "kind": "postprocess",
        "block_size": BLOCK,
        "kinds": layout["kinds"],
        "states": before,
        "block_table": torch.from_numpy(table.copy()),
        "num_accepted": num_accepted,
        "state_idx": torch.tensor([r[1] for r in rows], dtype=torch.int32),
        "num_scheduled": torch.tensor([r[2] for r in rows], dtype=torch.int32),
        "num_computed": torch.tensor([r[3] for r in rows], dtype=torch.int32),
        "num_draft": torch.tensor([r[4] for r in rows], dtype=torch.int32),
        "cpu": {"states": _snapshot(layout), "num_accepted": accepted_cpu},
    }


def precopy_case(name: str, seed: int, dtype: Any, conv_dim: int, num_spec: int) -> dict:
    """One step's pre-copy: vLLM's ``preprocess_mamba`` as the CPU default runs it."""
    import numpy as np
    import torch
    from vllm.v1.worker import mamba_utils

    rng = random.Random(seed)
    torch.manual_seed(seed)
    layout = _copy_layout(dtype, conv_dim, num_spec)
    table = _block_table(rng)
    bufs = _buffers(layout)
    req_ids = [f"r{i}" for i in range(NUM_REQS)]
    prev_idx: dict[str, int] = {}
    requests, scheduled, accepted, src_cols, dst_cols = {}, {}, [], [], []
    for row, req_id in enumerate(req_ids):
        # The running state lands in column cdiv(computed + scheduled, B) - 1.
        dst = rng.randrange(1, MAX_BLOCKS_PER_REQ - num_spec)
        n_sched = 1 + num_spec
        computed = dst * BLOCK + rng.randrange(1, BLOCK + 1) - n_sched
        situation = ("crossed", "same block", "crossed", "fresh")[row % 4]
        if situation == "fresh":
            computed, n_sched, dst = 0, rng.randrange(1, BLOCK + 1), 0
            src = -1
        else:
            src = dst - 1 if situation == "crossed" else dst
            prev_idx[req_id] = src
        requests[req_id] = SimpleNamespace(
            num_computed_tokens=computed,
            block_ids={0: table[row].tolist()},
        )
        scheduled[req_id] = n_sched
        accepted.append(rng.randint(1, num_spec + 1))
        src_cols.append(src)
        dst_cols.append(dst)
    input_batch = SimpleNamespace(
        req_ids=req_ids,
        num_accepted_tokens_cpu=np.array(accepted, dtype=np.int32),
        block_table={0: _Table(table)},
    )
    scheduler_output = SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        num_scheduled_tokens=scheduled,
    )
    before = _snapshot(layout)
    mamba_utils.preprocess_mamba(
        scheduler_output,
        layout["config"],
        SimpleNamespace(enable_prefix_caching=True),
        prev_idx,
        input_batch,
        requests,
        layout["forward_context"],
        layout["copy_funcs"],
        bufs.preprocess,
        align_ctx=bufs.postprocess_align,
    )
    got_dst = [prev_idx[r] for r in req_ids]
    if got_dst != dst_cols:
        raise KernelCheckError(
            f"{name}: preprocess_mamba put the states at {got_dst}, not {dst_cols}"
        )
    return {
        "name": name,
        "kind": "precopy",
        "kinds": layout["kinds"],
        "states": before,
        "block_table": torch.from_numpy(table.copy()),
        "num_accepted": torch.tensor(accepted, dtype=torch.int32),
        "src_col": torch.tensor(src_cols, dtype=torch.int32),
        "dst_col": torch.tensor(dst_cols, dtype=torch.int32),
        "cpu": {"states": _snapshot(layout)},
    }


def batch_memcpy_case(name: str, seed: int) -> dict:
    """Byte copies within one buffer: disjoint entries, odd sizes and offsets, and
    left-overlapping ones (a conv window shifted inside its own block) longer than
    the kernel's 1024-byte tile."""
    import torch
    from vllm.v1.worker import mamba_utils

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (1 << 15,), dtype=torch.uint8, generator=gen)
    src, dst, sizes = [], [], []
    region = 4096  # each entry owns one region: no entry reads what another writes
    for i in range(8):
        base = i * region
        size = rng.randrange(1, 2500)
        if i % 3 == 2:
            shift = rng.randrange(1, 64)
            d = base + rng.randrange(0, region - size - shift)
            s = d + shift
        else:
            half = region // 2
            size = min(size, half - 8)
            s = base + rng.randrange(0, half - size)
            d = base + half + rng.randrange(0, half - size)
        src.append(s)
        dst.append(d)
        sizes.append(size)
    before = buf.clone()
    mamba_utils.batch_memcpy(
        torch.tensor([buf.data_ptr() + s for s in src], dtype=torch.uint64),
        torch.tensor([buf.data_ptr() + d for d in dst], dtype=torch.uint64),
        torch.tensor(sizes, dtype=torch.int32),
    )
    return {
        "name": name,
        "kind": "batch_memcpy",
        "buffer": before,
        "src": torch.tensor(src, dtype=torch.int64),
        "dst": torch.tensor(dst, dtype=torch.int64),
        "sizes": torch.tensor(sizes, dtype=torch.int64),
        "cpu": {"buffer": buf},
    }


# --------------------------------------------------------------------------
# (b) the CPU GDN prefill kernel
# --------------------------------------------------------------------------


def _cpu_gdn(
    q: Any, k: Any, v: Any, g: Any, beta: Any, s0_kv: Any, cu: list[int]
) -> tuple[Any, Any]:
    """vLLM's CPU prefill kernel as gdn_attention.py calls it: states pooled and indexed,
    updated in place; returns (output, final states [N, H, K, V])."""
    import torch
    import vllm._custom_ops as ops

    n = len(cu) - 1
    pool = torch.zeros(n + 1, *s0_kv.shape[1:], dtype=torch.float32)
    pool[1:] = s0_kv  # slot 0 stays unused, like vLLM's null block
    out, _ = ops.chunk_gated_delta_rule_cpu(
        query=q,
        key=k,
        value=v,
        g=g,
        beta=beta,
        initial_state=pool,
        output_final_state=True,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=torch.arange(1, n + 1, dtype=torch.int32),
    )
    return out, pool[1:].clone()


def _cpu_gdn_export(
    q: Any, k: Any, v: Any, g: Any, beta: Any, s0_kv: Any, cu: list[int], offsets: list[list[int]]
) -> dict[str, Any] | None:
    """The checkpoint export of mod ``cpu-gdn-prefill-checkpoint`` (its recurrence with
    checkpoints, one call for the whole batch): the states it writes at ``offsets``
    (per row, tokens into the row), its final states and output. None where the tree
    does not carry the mod."""
    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    export = getattr(gdn_attention, "_chunk_gated_delta_rule_cpu", None)
    if export is None:
        return None
    n = len(cu) - 1
    wanted = sum(len(o) for o in offsets)
    pool = torch.zeros(1 + n + wanted, *s0_kv.shape[1:], dtype=torch.float32)
    pool[1 : n + 1] = s0_kv
    # A state the export never writes stays NaN and fails every comparison.
    pool[n + 1 :] = float("nan")
    slots, points = iter(range(n + 1, n + 1 + wanted)), []
    for row_offsets in offsets:
        points.append([(o, next(slots)) for o in row_offsets])
    out = export(
        q,
        k,
        v,
        g,
        beta,
        pool,
        torch.tensor(cu, dtype=torch.int32),
        torch.arange(1, n + 1, dtype=torch.int32),
        points,
    )
    return {
        "states_kv": pool[n + 1 :].clone(),
        "final_kv": pool[1 : n + 1].clone(),
        "o": out[0].float(),
    }


def _float64_states(
    q: Any, k: Any, v: Any, g: Any, beta: Any, s0: Any, stops: list[int]
) -> list[Any]:
    """The gated delta rule token by token in float64 (state [H, K, V]); the state after
    each of ``stops`` tokens. q is not needed for states; kept for symmetry of calls."""
    import torch

    del q
    s = s0.double().clone()
    kn = k.double() / (k.double().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    group = v.shape[1] // k.shape[1]
    out, want = [], set(stops)
    if 0 in want:
        out.append(s.clone())
    for t in range(v.shape[0]):
        for h in range(v.shape[1]):
            kt = kn[t, h // group]
            s[h] *= torch.exp(g[t, h].double())
            s[h] += beta[t, h].double() * torch.outer(kt, v[t, h].double() - s[h].T @ kt)
        if t + 1 in want:
            out.append(s.clone())
    return out


def _bf16_normal(gen: Any, *shape: int, scale: float = 1.0) -> Any:
    """Seeded bf16 normals. Below fp16's normal range a bf16 value may not survive the
    cast to fp16 that the interpreter run needs; these inputs never reach there."""
    import torch

    x = (torch.randn(*shape, generator=gen) * scale).bfloat16()
    return torch.where(x.abs() < 2**-14, torch.zeros_like(x), x)


def _gdn_inputs(seed: int, lengths: list[int], initial: list[bool]) -> tuple[Any, ...]:
    """Seeded q, k, v, g, beta, initial states [N, H, K, V] and cu_seqlens of a batch."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    total, d = sum(lengths), GDN_HEAD_DIM
    q = _bf16_normal(gen, 1, total, GDN_K_HEADS, d)
    k = _bf16_normal(gen, 1, total, GDN_K_HEADS, d)
    v = _bf16_normal(gen, 1, total, GDN_V_HEADS, d)
    # Log-space gates and write strengths in the ranges vLLM's gating produces.
    g = -(torch.rand(1, total, GDN_V_HEADS, generator=gen) * 0.4 + 0.01)
    beta = torch.rand(1, total, GDN_V_HEADS, generator=gen).clamp(0.05).bfloat16()
    s0 = torch.randn(len(lengths), GDN_V_HEADS, d, d, generator=gen) * 0.1
    for i, has in enumerate(initial):
        if not has:
            s0[i] = 0  # vLLM zeroes the slot of a sequence without a prior state
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, g, beta, s0, cu


def gdn_case(name: str, seed: int, lengths: list[int], initial: list[bool], perturb: str | None):
    import torch

    q, k, v, g, beta, s0, cu = _gdn_inputs(seed, lengths, initial)
    d = GDN_HEAD_DIM
    out, final = _cpu_gdn(q, k, v, g, beta, s0, cu)

    def split_schedule(row: int, end: int) -> Any:
        """The CPU kernel run on the row's first ``end`` tokens: a chunk ending there."""
        if end == 0:
            return s0[row]
        sl = slice(cu[row], cu[row] + end)
        _, state = _cpu_gdn(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s0[row : row + 1], [0, end]
        )
        return state[0]

    shift = 1 if perturb == "gdn-position" else 0
    chunk_rows, chunk_states, ref_chunks, ref_final = [], [], [], []
    mid_states, ref_mids, mid_index, mid_cu, mid_rows = [], [], [], [0], []
    export_offsets: list[list[int]] = []
    per_row: list[tuple[int, int]] = []  # (chunk-boundary states, states inside chunks)
    offset = 0  # FLA's h is indexed by chunk over the whole batch
    for i, n in enumerate(lengths):
        a = cu[i]
        stops = list(range(GDN_CHUNK, n, GDN_CHUNK))
        # A position one token in has no state one token early to take instead.
        mids = sorted({m for m in (*GDN_MID_OFFSETS, n - 1) if shift < m < n and m % GDN_CHUNK})
        # The export's states in this order: chunk boundaries, then inside chunks.
        export_offsets.append([stop - shift for stop in [*stops, *mids]])
        per_row.append((len(stops), len(mids)))
        for c, stop in enumerate(stops, start=1):
            chunk_rows.append(offset + c)
            chunk_states.append(split_schedule(i, stop - shift))
        for m in mids:
            mid_states.append(split_schedule(i, m - shift))
            # FLA's side: the prefix as a sequence of its own (true positions).
            mid_index.extend(range(a, a + m))
            mid_cu.append(mid_cu[-1] + m)
            mid_rows.append(i)
        sl = slice(a, a + n)
        row = (q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl].float(), s0[i])
        ref = _float64_states(*row, [*stops, n])
        ref_chunks.extend(ref[:-1])
        ref_final.append(ref[-1])
        ref_mids.extend(_float64_states(*row, mids))
        offset += -(-n // GDN_CHUNK)
    empty = torch.zeros(0, GDN_V_HEADS, d, d)
    exported = _cpu_gdn_export(q, k, v, g, beta, s0, cu, export_offsets)
    if exported is not None:
        # Back into chunk-boundary states and states inside chunks.
        states, at, chunk_part, mid_part = exported.pop("states_kv"), 0, [], []
        for boundaries, inside in per_row:
            chunk_part.extend(states[at : at + boundaries])
            mid_part.extend(states[at + boundaries : at + boundaries + inside])
            at += boundaries + inside
        exported["states_kv"] = torch.stack(chunk_part) if chunk_part else empty
        exported["mid_states_kv"] = torch.stack(mid_part) if mid_part else empty
    return {
        "name": name,
        "kind": "gdn",
        # Present where the tree carries the export mod: checked like the split schedule.
        **({"export": exported} if exported is not None else {}),
        "lengths": lengths,
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "initial_state_vk": s0.transpose(-1, -2).contiguous(),
        "chunk_rows": torch.tensor(chunk_rows, dtype=torch.int64),
        # The prefixes ending inside chunks: their tokens, one sequence each.
        "mid_index": torch.tensor(mid_index, dtype=torch.int64),
        "mid_cu_seqlens": torch.tensor(mid_cu, dtype=torch.int32),
        "mid_initial_state_vk": s0[mid_rows].transpose(-1, -2).contiguous() if mid_rows else empty,
        "tolerance": GDN_TOLERANCE,
        "cpu": {
            "final_kv": final,
            "chunk_states_kv": torch.stack(chunk_states) if chunk_states else empty,
            "mid_states_kv": torch.stack(mid_states) if mid_states else empty,
            "o": out[0].float(),
        },
        "reference": {
            "final_kv": torch.stack(ref_final).float(),
            "chunk_states_kv": torch.stack(ref_chunks).float() if ref_chunks else empty,
            "mid_states_kv": torch.stack(ref_mids).float() if ref_mids else empty,
        },
    }


# --------------------------------------------------------------------------
# (c) exports: states at requested positions from one forward pass
# --------------------------------------------------------------------------

# Each batch: (name, seed, rows of (start, length, has an initial state)). ``start``
# is where this prefill begins in its request (its computed tokens; a resumed request
# brings its state from there). Rows: a fresh prompt over two chunk boundaries; one
# resumed at 100, off the 64 grid, so its chunks start at 100 and 164 and the
# request's block boundaries 128 and 192 fall inside chunks; one resumed on a
# boundary and exactly one chunk long (its end is the final state, h has no row
# there); a single token.
GDN_EXPORT_BATCHES = (
    (
        "gdn_export-fresh-resumed",
        21,
        ((0, 150, False), (100, 130, True), (128, 64, True), (0, 1, False)),
    ),
    ("gdn_export-small", 22, ((0, 70, False), (37, 40, True))),
)
# The exports' tolerance, on max |difference| / max |reference|: as the chunk states'
# (GDN_TOLERANCE): the exported states are FLA's h rows, stored in the input dtype
# (bf16 on a GPU, fp16 under the interpreter), and final states, in fp32. Measured
# under the interpreter: 5.0e-4 from float64, 5.0e-3 from the CPU export (whose own
# bf16 intermediates put it 4.6e-3 from float64); one token early: 119-150 %.
GDN_EXPORT_TOLERANCE = {"states": GDN_TOLERANCE["chunk_states"]}

# Mamba2 (Nemotron-H's mixer) at small sizes: 4 heads in 2 groups (so the head to
# group mapping is not the identity), head dim 8, state 16.
SSD_HEADS, SSD_HEAD_DIM, SSD_GROUPS, SSD_STATE = 4, 8, 2, 16
# Each: (name, seed, chunk size, rows of (start, length, has an initial state,
# forced checkpoint offset or 0)). vLLM lays SSD chunks on multiples of the chunk
# size in absolute positions (a resumed row's first chunk finishes the partial one)
# and ends one more chunk at a row's checkpoint offset, so the state there exists too.
SSD_EXPORT_CASES = (
    (
        "ssd_export-c16",
        31,
        16,
        ((0, 50, False, 0), (37, 70, True, 20), (64, 33, True, 0)),
    ),
    ("ssd_export-c32-small", 32, 32, ((0, 40, False, 0), (50, 30, True, 0))),
)
# On max |difference| / max |float64|. Both the states (fp32 in the kernels, fp32 in
# the cache: Nemotron-H's mamba_ssm_cache_dtype) and the output (the input dtype)
# are sums of terms the kernels round to the input dtype on the way (B scaled by
# dt and the decay, C B^T, x): bf16 on a GPU (2^-9 relative each), fp16 under the
# interpreter (measured there: states 2.4e-4, output 4.8e-4). A state one token off
# moves by 66-157 % of scale (``--perturb ssd-position``).
SSD_TOLERANCE = {"states": 0.02, "output": 0.03}


def _requests(start: int, end: int, on: set[int], off: set[int]) -> tuple[list[int], list[int]]:
    """(every requested position, those off the kernel's grid), both sorted; ``on`` and
    ``off`` as the case lays them out (a position in both is on the grid)."""
    off = {p for p in off if start <= p <= end} - on
    return sorted(on | off), sorted(off)


def gdn_export_case(
    name: str, seed: int, rows: tuple[tuple[int, int, bool], ...], perturb: str | None
) -> dict[str, Any]:
    """A varlen prefill whose rows ask for states at positions on and off FLA's chunk
    grid. Laid out here by intent: on the grid are ``start + 64 i`` and the row's end
    (the chunks start where this prefill does); off it are positions just past the
    start, inside the first chunks, one short of the end, and the request's own
    multiples of 64 where the row resumed off them. References at every requested
    position: the float64 recurrence and, where the tree has it, the CPU export."""
    import torch

    lengths = [n for _, n, _ in rows]
    q, k, v, g, beta, s0, cu = _gdn_inputs(seed, lengths, [has for *_, has in rows])
    requested, off_grid = [], []
    for start, n, _ in rows:
        end = start + n
        on = {start + GDN_CHUNK * i for i in range(-(-n // GDN_CHUNK))} | {end}
        request_grid = {p for p in range(start + 1, end) if p % GDN_CHUNK == 0}
        off = {start + 1, start + 48, start + 100, end - 1} | request_grid
        wanted, refused = _requests(start, end, on, off)
        requested.append(wanted)
        off_grid.append(refused)
    shift = 1 if perturb == "gdn-position" else 0
    # Tokens into each row at which the references are taken (one early if perturbed).
    offsets = [
        [max(p - start - shift, 0) for p in wanted]
        for (start, _, _), wanted in zip(rows, requested, strict=True)
    ]
    reference = []
    for i, row_offsets in enumerate(offsets):
        sl = slice(cu[i], cu[i + 1])
        states = _float64_states(
            q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl].float(), s0[i], row_offsets
        )
        at = {o: s for o, s in zip(sorted(set(row_offsets)), states, strict=True)}
        reference.extend(at[o] for o in row_offsets)
    case: dict[str, Any] = {
        "name": name,
        "kind": "gdn_export",
        "lengths": lengths,
        "starts": [start for start, _, _ in rows],
        "requested": requested,
        "off_grid": off_grid,
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "initial_state_vk": s0.transpose(-1, -2).contiguous(),
        "tolerance": GDN_EXPORT_TOLERANCE,
        "reference": {"states_kv": torch.stack(reference).float()},
    }
    # The CPU export writes states strictly inside a row; at 0 it is the initial
    # state, at the row's end the final state it leaves in the row's slot.
    inside = [
        [o for o in sorted(set(r)) if 0 < o < n] for r, n in zip(offsets, lengths, strict=True)
    ]
    exported = _cpu_gdn_export(q, k, v, g, beta, s0, cu, inside)
    if exported is not None:
        cpu, at_row = [], 0
        for i, (row_offsets, n) in enumerate(zip(offsets, lengths, strict=True)):
            slot = {o: at_row + j for j, o in enumerate(inside[i])}
            at_row += len(inside[i])
            for o in row_offsets:
                if o == 0:
                    cpu.append(s0[i])
                elif o == n:
                    cpu.append(exported["final_kv"][i])
                else:
                    cpu.append(exported["states_kv"][slot[o]])
        case["cpu"] = {"states_kv": torch.stack(cpu).float()}
    return case


def _float64_ssd(
    x: Any, dt: Any, a: Any, b: Any, c: Any, d: Any, dt_bias: Any, s0: Any, stops: list[int]
) -> tuple[list[Any], Any]:
    """Mamba2's selective state space recurrence token by token in float64, as
    MambaMixer2 asks vLLM's scan for it: dt = softplus(dt + dt_bias) per head,
    h_t = exp(dt A) h_{t-1} + dt x_t B_t^T (state [heads, head dim, state]),
    y_t = h_t C_t + D x_t; head h reads group h // (heads / groups). Returns the
    state after each of ``stops`` tokens (in that order) and y [tokens, heads, head dim]."""
    import torch

    per_group = x.shape[1] // b.shape[1]
    h = s0.double().clone()
    x64, b64, c64 = x.double(), b.double(), c.double()
    b64 = b64.repeat_interleave(per_group, dim=1)
    c64 = c64.repeat_interleave(per_group, dim=1)
    steps = torch.nn.functional.softplus(dt.double() + dt_bias.double())
    decay = torch.exp(steps * a.double())
    states, ys = {0: h.clone()}, []
    for t in range(x.shape[0]):
        h = decay[t][:, None, None] * h + (steps[t][:, None] * x64[t])[:, :, None] * b64[t][:, None]
        ys.append(torch.einsum("hpn,hn->hp", h, c64[t]) + d.double()[:, None] * x64[t])
        states[t + 1] = h.clone()
    return [states[s] for s in stops], torch.stack(ys)


def ssd_export_case(
    name: str,
    seed: int,
    chunk: int,
    rows: tuple[tuple[int, int, bool, int], ...],
    perturb: str | None,
) -> dict[str, Any]:
    """A varlen Mamba2 prefill whose rows ask for states on and off the SSD scan's
    chunk ends, with the chunk layout vLLM's metadata builder makes for it (its own
    code, from the tree). By intent, on the grid: the request's multiples of the chunk
    size inside the row, its end and its forced checkpoint; off it: the start (the
    initial state is not a chunk end), one past it, one chunk past it (a grid
    relative to the start, as FLA's, is not the SSD's), one short of the end, one past
    the checkpoint."""
    import torch
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    gen = torch.Generator().manual_seed(seed)
    lengths = [n for _, n, _, _ in rows]
    total, heads = sum(lengths), SSD_HEADS
    x = _bf16_normal(gen, total, heads, SSD_HEAD_DIM)
    b = _bf16_normal(gen, total, SSD_GROUPS, SSD_STATE)
    c = _bf16_normal(gen, total, SSD_GROUPS, SSD_STATE)
    # dt before softplus, A < 0, D, dt_bias: per-token decays of 0.6-0.99.
    dt = (torch.rand(total, heads, generator=gen) * 2.5 - 3.0).bfloat16()
    a = -(torch.rand(heads, generator=gen) * 0.9 + 0.1)
    d = torch.randn(heads, generator=gen)
    dt_bias = torch.rand(heads, generator=gen) * 0.5
    s0 = torch.randn(len(rows), heads, SSD_HEAD_DIM, SSD_STATE, generator=gen) * 0.5
    for i, (_, _, has, _) in enumerate(rows):
        if not has:
            s0[i] = 0
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_chunks, seq_idx, last, _ = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        chunk,
        len(rows),
        torch.tensor([start for start, *_ in rows]),
        torch.tensor(cu),
        [ckpt for *_, ckpt in rows],
    )
    requested, off_grid, reference, ys = [], [], [], []
    shift = 1 if perturb == "ssd-position" else 0
    for i, (start, n, _, ckpt) in enumerate(rows):
        end = start + n
        on = {p for p in range(start + 1, end + 1) if p % chunk == 0} | {end}
        on |= {start + ckpt} if ckpt else set()
        off = {start, start + 1, start + chunk, end - 1} | ({start + ckpt + 1} if ckpt else set())
        wanted, refused = _requests(start, end, on, off)
        requested.append(wanted)
        off_grid.append(refused)
        sl = slice(cu[i], cu[i + 1])
        states, y = _float64_ssd(
            x[sl],
            dt[sl],
            a,
            b[sl],
            c[sl],
            d,
            dt_bias,
            s0[i],
            [max(p - start - shift, 0) for p in wanted],
        )
        reference.extend(states)
        ys.append(y)
    return {
        "name": name,
        "kind": "ssd_export",
        "chunk_size": chunk,
        "lengths": lengths,
        "starts": [start for start, *_ in rows],
        "requested": requested,
        "off_grid": off_grid,
        "x": x,
        "dt": dt,
        "A": a,
        "B": b,
        "C": c,
        "D": d,
        "dt_bias": dt_bias,
        "initial_states": s0,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "cu_chunk_seqlens": torch.tensor(cu_chunks, dtype=torch.int32),
        "seq_idx": torch.tensor(seq_idx, dtype=torch.int32),
        "last_chunk_indices": torch.tensor(last, dtype=torch.int32),
        "tolerance": SSD_TOLERANCE,
        "reference": {"states": torch.stack(reference), "y": torch.cat(ys)},
    }


# --------------------------------------------------------------------------
# cases, the run, the command
# --------------------------------------------------------------------------


def build_cases(perturb: str | None = None, kinds: set[str] | None = None) -> dict[str, Any]:
    """The cases (``kinds``: a subset of KINDS, default all) with the CPU side's results
    (needs the vLLM tree importable)."""
    import torch
    import vllm
    from vllm.v1.worker import mamba_utils

    if not hasattr(mamba_utils, "postprocess_mamba_align_cpu"):
        raise KernelCheckError(f"{vllm.__file__}: cpu-mamba-align-spec is not applied")
    kinds = set(KINDS) if kinds is None else kinds
    if not kinds or not kinds <= set(KINDS):
        raise KernelCheckError(f"unknown case kinds {sorted(kinds)}; known: {KINDS}")
    if perturb not in (None, *PERTURBATIONS):
        raise KernelCheckError(f"unknown perturbation {perturb!r}; known: {PERTURBATIONS}")
    original = mamba_utils.align_postprocess_decision
    if perturb == "align-bias":

        def off_by_one(*args: int) -> tuple[int, int, int] | None:
            decision = original(*args)
            if decision is None or decision[1] == 0:
                return decision
            return decision[0], decision[1] - 1, decision[2]

        mamba_utils.align_postprocess_decision = off_by_one
    try:
        cases = []
        for spec, (dtype, conv_dim) in enumerate(((torch.float32, 8), (torch.bfloat16, 5))):
            tag = f"{str(dtype).removeprefix('torch.')}-conv{conv_dim}"
            for num_spec in (1, 3):
                for seed in range(2):
                    s = 100 * spec + 10 * num_spec + seed
                    cases.append(
                        postprocess_case(
                            f"postprocess-{tag}-k{num_spec}-s{seed}", s, dtype, conv_dim, num_spec
                        )
                    )
                    cases.append(
                        precopy_case(
                            f"precopy-{tag}-k{num_spec}-s{seed}", s, dtype, conv_dim, num_spec
                        )
                    )
        cases += [batch_memcpy_case(f"batch_memcpy-s{s}", s) for s in range(2)]
        cases = [c for c in cases if c["kind"] in kinds]
        gdn_batches = [
            ([200], [False]),  # one sequence, no prior state, three chunk boundaries
            ([64, 129, 1], [True, False, True]),  # on a boundary, one past, a single token
            ([63, 65, 128, 30], [True, True, False, True]),  # one short of / past a boundary
        ]
        for i, (lengths, initial) in enumerate(gdn_batches if "gdn" in kinds else []):
            cases.append(
                gdn_case(f"gdn-{'-'.join(map(str, lengths))}", 7 + i, lengths, initial, perturb)
            )
        for name, seed, rows in GDN_EXPORT_BATCHES if "gdn_export" in kinds else ():
            cases.append(gdn_export_case(name, seed, rows, perturb))
        for name, seed, chunk, ssd_rows in SSD_EXPORT_CASES if "ssd_export" in kinds else ():
            cases.append(ssd_export_case(name, seed, chunk, ssd_rows, perturb))
    finally:
        mamba_utils.align_postprocess_decision = original
    return {
        "cases": cases,
        "cpu_port": {
            "vllm": vllm.__version__,
            "tree": _shown(Path(vllm.__file__).parent),
            # The CPU GDN kernel picks its code path by ISA: torch's capability,
            # which of vLLM's CPU libraries loads (AVX2, AVX-512, AVX-512 BF16)
            # and whether the CPU has AMX tiles.
            "cpu_kernels": cpu_kernels(),
            "perturb": perturb,
        },
    }


def _shown(path: Path) -> str:
    """A path as the results show it: relative to the checkout when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def kernel_sources(dest: Path, version: str | None = None) -> Path:
    """The needed files of a vLLM sdist (default the pinned one; fetched and
    sha256-checked) under ``dest``."""
    from kit.vllm_tree import pins, sdists

    version = version or pins.get("vllm.version")
    sdist = sdists.release(version)
    for subdir in KERNEL_PATHS:
        sdists.unpack(sdist, version, subdir, dest)
    return dest


def patched_fla_tree() -> Any:
    """The release tree whose FLA files carry fix-eagle-fine-prefix-exports."""
    from kit.vllm_tree import releases

    return releases.tree(*PATCHED_FLA)


def patched_fla_key() -> str:
    """Its name under ``releases`` in a result and a bundle manifest (also a file
    name: the device script keeps each release's files and result under it)."""
    return "-".join(PATCHED_FLA)


def _triton_side(
    python: Path, kernels: Path, cases: Path, out: Path, kinds: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """One run of triton_check.py in .venv-triton under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTHONPATH", None)  # nothing of the kit's .venv or trees on its path
    command = [
        str(python),
        "-W",
        "ignore::RuntimeWarning",  # numpy on masked-off lanes of the interpreter
        str(TRITON_SIDE),
        "--kernels",
        str(kernels),
        "--cases",
        str(cases),
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    if kinds is not None:
        command += ["--kinds", ",".join(kinds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise KernelCheckError(
            f"the Triton side failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


def run(
    out: Path,
    kernels: Path | None = None,
    perturb: str | None = None,
    kinds: set[str] | None = None,
    later: bool = True,
) -> dict[str, Any]:
    """Build the cases here, run vLLM's kernels in .venv-triton under the interpreter
    (the pinned release's; with ``later`` and no perturbation, also each of
    LATER_RELEASES' on the LATER_KINDS cases, under ``releases``), write the comparison
    to ``out``; returns it."""
    import torch

    from kit.kernels import triton_env

    python = triton_env.ensure()
    cases = build_cases(perturb, kinds)
    with tempfile.TemporaryDirectory(prefix="kernel-check-") as tmp:
        work = Path(tmp)
        source = kernels or kernel_sources(work / "kernels")
        torch.save(cases, work / "cases.pt")
        result = _triton_side(python, source, work / "cases.pt", work / "result.json")
        present = {c["kind"] for c in cases["cases"]}
        result["releases"] = {}
        # A perturbation breaks the CPU side or the references, not the kernels: the
        # pinned release's kernels show it; the later releases' add nothing.
        for version in LATER_RELEASES if later and kernels is None and not perturb else ():
            run_kinds = tuple(k for k in LATER_KINDS if k in present)
            if not run_kinds:
                continue
            later_result = _triton_side(
                python,
                kernel_sources(work / f"kernels-{version}", version),
                work / "cases.pt",
                work / f"result-{version}.json",
                run_kinds,
            )
            later_result["kernels"] = f"vllm-{version}.tar.gz (sha256-checked sdist)"
            result["releases"][version] = later_result
            result["ok"] = result["ok"] and later_result["ok"]
        if later and kernels is None and not perturb and "gdn" in present:
            tree = patched_fla_tree()
            patched = _triton_side(
                python,
                tree.package.parent,
                work / "cases.pt",
                work / "result-patched.json",
                PATCHED_KINDS,
            )
            patched["kernels"] = f"{_shown(tree.package)} (mods applied)"
            result["releases"][patched_fla_key()] = patched
            result["ok"] = result["ok"] and patched["ok"]
    if kernels is None:
        from kit.vllm_tree import pins

        result["kernels"] = f"vllm-{pins.get('vllm.version')}.tar.gz (sha256-checked sdist)"
    else:
        result["kernels"] = _shown(kernels)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(schema.stamp("kernel-check", result), indent=1) + "\n")
    return result


def _bundle_members(tree: Path) -> list[Path]:
    """The files a release's kernels need, relative to its unpacked sdist: the align
    kernels' module, FLA's ops and the SSD scan's files."""
    members = [Path(triton_side.MAMBA_UTILS)]
    members += sorted(p.relative_to(tree) for p in (tree / triton_side.FLA_OPS).glob("*.py"))
    members += [Path(triton_side.MAMBA_OPS) / f for f in triton_side.SSD_FILES]
    missing = [str(m) for m in members if not (tree / m).is_file()]
    if missing:
        raise KernelCheckError(f"{tree}: no {', '.join(missing)}")
    return members


def _write_tar(tree: Path, members: list[Path], target: Path) -> None:
    """A reproducible tar.gz (sorted, no times or owners): the same sources, the same
    bytes, the same sha256 in the manifest."""
    import gzip
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            data = (tree / member).read_bytes()
            info = tarfile.TarInfo(member.as_posix())
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    with target.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(buffer.getvalue())


def export(dest: Path = DEVICE_BUNDLE, perturb: str | None = None) -> dict[str, Any]:
    """The device bundle: what a GPU machine needs (torch and Triton there, no vLLM, no
    kit, no network): ``cases.pt``, each release's kernel files as
    ``kernels-<version>.tar.gz``, and ``manifest.json`` (their sha256, which kinds run
    on which release, the dry run's tiny cases). ``triton_check.py --bundle``
    runs it; ``make device-check``. Returns the manifest."""
    import torch

    from kit.vllm_tree import pins

    cases = build_cases(perturb)
    names = {c["name"] for c in cases["cases"]}
    missing = sorted(set(TINY_CASES.values()) - names)
    if missing:
        raise KernelCheckError(f"TINY_CASES names no case {missing}")
    dest.mkdir(parents=True, exist_ok=True)
    torch.save(cases, dest / "cases.pt")
    pinned = pins.get("vllm.version")
    releases = {}
    with tempfile.TemporaryDirectory(prefix="kernel-bundle-") as tmp:
        for version, kinds in ((pinned, KINDS), *((v, LATER_KINDS) for v in LATER_RELEASES)):
            tree = kernel_sources(Path(tmp) / version, version)
            name = f"kernels-{version}.tar.gz"
            _write_tar(tree, _bundle_members(tree), dest / name)
            releases[version] = {
                "kernels": name,
                "sha256": pins.file_sha256(dest / name),
                "kinds": list(kinds),
            }
        tree = patched_fla_tree().package.parent
        name = f"kernels-{patched_fla_key()}.tar.gz"
        _write_tar(tree, _bundle_members(tree), dest / name)
        releases[patched_fla_key()] = {
            "kernels": name,
            "sha256": pins.file_sha256(dest / name),
            "kinds": list(PATCHED_KINDS),
        }
    manifest = {
        "made_by": "kit kernel-check --export (kit/kernels/check.py)",
        "note": "python kit/kernels/triton_check.py --bundle DIR --device cuda --out R.json",
        "cases": {"file": "cases.pt", "sha256": pins.file_sha256(dest / "cases.pt")},
        "cpu_port": cases["cpu_port"],
        "releases": releases,
        "tiny": {name: kind for kind, name in TINY_CASES.items()},
    }
    (dest / triton_side.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _case_line(case: dict[str, Any]) -> str:
    mark = "ok  " if case["ok"] else "FAIL"
    if case["kind"] == "gdn":
        detail = (
            f"final rel {case['final_state']['max_rel']:.2e}, "
            f"chunk states ({case['chunk_states']['count']}) rel "
            f"{case['chunk_states']['max_rel']:.2e}, output rel {case['output']['max_rel']:.2e}"
        )
        if "mid_states" in case:
            detail += (
                f", inside chunks ({case['mid_states']['count']}) rel "
                f"{case['mid_states']['max_rel']:.2e}"
            )
        if "export" in case:
            exp = case["export"]
            detail += (
                f"; export: chunk states rel {exp['chunk_states']['max_rel']:.2e}, "
                f"final rel {exp['final_state']['max_rel']:.2e}"
            )
            if "mid_states" in exp:
                detail += f", inside chunks rel {exp['mid_states']['max_rel']:.2e}"
        if "stored_states" in case:
            stored = case["stored_states"]
            same = all(stored.values())
            shown = "output, final and h as stock" if same else "DIFFERS"
            detail += f"; stored float32 states: {shown}"
    elif case["kind"] in ("gdn_export", "ssd_export"):
        pos = case["positions"]
        refused = sum(len(r) for r in pos["refused"])
        detail = (
            f"{pos['count']} exported, {refused} refused"
            f"{'' if pos['as_expected'] else ' (NOT the positions expected)'}; "
        )
        if case["kind"] == "gdn_export":
            detail += f"vs float64 rel {case['triton_vs_float64']['max_rel']:.2e}"
            if "triton_vs_cpu_export" in case:
                detail += (
                    f", vs CPU export rel {case['triton_vs_cpu_export']['max_rel']:.2e} "
                    f"(CPU export vs float64, all {case['cpu_export_vs_float64']['count']}: "
                    f"{case['cpu_export_vs_float64']['max_rel']:.2e})"
                )
        else:
            detail += (
                f"states vs float64 rel {case['states_vs_float64']['max_rel']:.2e}, "
                f"output rel {case['output_vs_float64']['max_rel']:.2e}"
            )
    else:
        detail = "bit for bit" if case["ok"] else "differs"
    return f"  {mark} {case['name']}: {detail} ({case['seconds']} s)"


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"vLLM kernels: Triton {result['triton']}, device {result['device']}"
        f"{' (interpreter)' if result['interpreter'] else ''}; CPU port: {result['cpu_port']}"
    ]
    lines += [_case_line(case) for case in result["cases"]]
    for version, later in result.get("releases", {}).items():
        lines.append(f"vLLM {version}'s FLA and SSD kernels on the same cases:")
        lines += [_case_line(case) for case in later["cases"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the result JSON file")
    parser.add_argument("--kernels", type=Path, help="kernel source folder (default: the sdist's)")
    parser.add_argument("--perturb", choices=PERTURBATIONS, help="break the CPU side on purpose")
    parser.add_argument(
        "--export",
        type=Path,
        nargs="?",
        const=DEVICE_BUNDLE,
        metavar="DIR",
        help=f"write the device bundle to DIR (default {_shown(DEVICE_BUNDLE)})",
    )
    args = parser.parse_args(argv)
    from kit.kernels import triton_env
    from kit.vllm_tree import pins, sdists, trees

    try:
        trees.select().activate()
        if args.export:
            export(args.export, args.perturb)
            print(f"{args.export}: make device-check (or triton_check.py --bundle) runs it")
            return 0
        result = run(args.out, args.kernels, args.perturb)
    except (KernelCheckError, triton_env.KernelEnvError, sdists.SdistError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(result))
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
