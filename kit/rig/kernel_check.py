"""`make kernel-check`: the kit's CPU kernels against vLLM's own Triton kernels, same inputs.

Two sides, two environments. This module runs in the kit's .venv against a
vLLM tree (``KIT_TREE``, default patched): it draws seeded random cases, runs
the CPU code the kit's CPU default executes on them, and writes inputs and
results to ``cases.pt``. ``kit/rig/kernel_check_triton.py`` runs in .venv-triton
(kit/rig/kernel_env.py: torch, pinned Triton, no vLLM) under Triton's interpreter:
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

``--perturb`` breaks the CPU side on purpose (``align-bias``: the accepted-token
bias off by one in the mod's post-copy decision; ``gdn-position``: each chunk
state, and each state inside a chunk, taken one token early) to show the check
fails.
``--export DIR`` writes what a GPU machine needs (cases, kernel sources, the
script) for the compiled kernels: ``TRITON_INTERPRET`` unset, ``--device cuda``.

Exit status: 0 every case within tolerance; 1 a case is not; 2 could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kit import schema
from kit.bundle import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
TRITON_SIDE = ROOT / "kit" / "rig" / "kernel_check_triton.py"
DEFAULT_OUT = ROOT / "results" / "kernel-check.json"
KERNEL_PATHS = ("vllm/v1/worker", "vllm/third_party/flash_linear_attention")
PERTURBATIONS = ("align-bias", "gdn-position")
KINDS = ("postprocess", "precopy", "batch_memcpy", "gdn")

# The GDN comparison's tolerances, on max |difference| / max |CPU value| over a
# case. Both kernels take the same bf16 q, k, v and round inside: FLA keeps A,
# w, u, v_new and the per-chunk h in the input dtype (bf16 on a GPU, fp16
# under the interpreter: see kernel_check_triton.run_gdn), the CPU kernel
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


def gdn_case(name: str, seed: int, lengths: list[int], initial: list[bool], perturb: str | None):
    import torch

    gen = torch.Generator().manual_seed(seed)
    total, d = sum(lengths), GDN_HEAD_DIM

    def bf16(*shape: int) -> Any:
        x = torch.randn(*shape, generator=gen).bfloat16()
        # Below fp16's normal range a bf16 value may not survive the cast to fp16
        # that the interpreter run needs; these inputs never reach there.
        return torch.where(x.abs() < 2**-14, torch.zeros_like(x), x)

    q = bf16(1, total, GDN_K_HEADS, d)
    k = bf16(1, total, GDN_K_HEADS, d)
    v = bf16(1, total, GDN_V_HEADS, d)
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


def kernel_sources(dest: Path) -> Path:
    """The needed files of the pinned vLLM sdist (fetched and sha256-checked) under ``dest``."""
    from kit.vllm_tree import pins, sdists

    sdist = sdists.pinned()
    for subdir in KERNEL_PATHS:
        sdists.unpack(sdist, pins.get("vllm.version"), subdir, dest)
    return dest


def run(
    out: Path,
    kernels: Path | None = None,
    perturb: str | None = None,
    kinds: set[str] | None = None,
) -> dict[str, Any]:
    """Build the cases here, run vLLM's kernels in .venv-triton under the interpreter,
    write the comparison to ``out``; returns it."""
    import torch

    from kit.rig import kernel_env

    python = kernel_env.ensure()
    cases = build_cases(perturb, kinds)
    with tempfile.TemporaryDirectory(prefix="kernel-check-") as tmp:
        work = Path(tmp)
        source = kernels or kernel_sources(work / "kernels")
        torch.save(cases, work / "cases.pt")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env.pop("PYTHONPATH", None)  # nothing of the kit's .venv or trees on its path
        done = subprocess.run(
            [
                str(python),
                "-W",
                "ignore::RuntimeWarning",  # numpy on masked-off lanes of the interpreter
                str(TRITON_SIDE),
                "--kernels",
                str(source),
                "--cases",
                str(work / "cases.pt"),
                "--device",
                "cpu",
                "--out",
                str(work / "result.json"),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode not in (0, 1):
            raise KernelCheckError(
                f"the Triton side failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
        result = json.loads((work / "result.json").read_text())
    if kernels is None:
        from kit.vllm_tree import pins

        result["kernels"] = f"vllm-{pins.get('vllm.version')}.tar.gz (sha256-checked sdist)"
    else:
        result["kernels"] = _shown(kernels)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(schema.stamp("kernel-check", result), indent=1) + "\n")
    return result


def export(dest: Path, perturb: str | None = None) -> None:
    """What a GPU machine needs (torch and Triton there, no vLLM, no network)."""
    import torch

    dest.mkdir(parents=True, exist_ok=True)
    kernel_sources(dest / "kernels")
    torch.save(build_cases(perturb), dest / "cases.pt")
    shutil.copy2(TRITON_SIDE, dest / TRITON_SIDE.name)
    (dest / "run.sh").write_text(
        "#!/usr/bin/env bash\n"
        "# vLLM's compiled Triton kernels against the kit's CPU results (kit.rig.kernel_check).\n"
        'set -euo pipefail\ncd "$(dirname "$0")"\nunset TRITON_INTERPRET\n'
        "python kernel_check_triton.py --kernels kernels --cases cases.pt --device cuda "
        '--out "${1:-result-cuda.json}"\n'
    )
    (dest / "run.sh").chmod(0o755)


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"vLLM kernels: Triton {result['triton']}, device {result['device']}"
        f"{' (interpreter)' if result['interpreter'] else ''}; CPU port: {result['cpu_port']}"
    ]
    for case in result["cases"]:
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
        else:
            detail = "bit for bit" if case["ok"] else "differs"
        lines.append(f"  {mark} {case['name']}: {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the result JSON file")
    parser.add_argument("--kernels", type=Path, help="kernel source folder (default: the sdist's)")
    parser.add_argument("--perturb", choices=PERTURBATIONS, help="break the CPU side on purpose")
    parser.add_argument("--export", type=Path, metavar="DIR", help="write a GPU run's files to DIR")
    args = parser.parse_args(argv)
    from kit.rig import kernel_env
    from kit.vllm_tree import pins, sdists, trees

    try:
        trees.select().activate()
        if args.export:
            export(args.export, args.perturb)
            print(f"{args.export}: run ./run.sh on a machine with a GPU, torch and Triton")
            return 0
        result = run(args.out, args.kernels, args.perturb)
    except (KernelCheckError, kernel_env.KernelEnvError, sdists.SdistError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(result))
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
