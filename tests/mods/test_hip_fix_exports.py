"""Internal checkpoints on vLLM 0.34.0's HIP, CuteDSL and AITER FlyDSL GDN paths
(mod ``fix-eagle-fine-prefix-exports``), checked on the CPU with vLLM's own
builder and layer code.

Strix Halo (gfx1151) prefills GDN with one fused HIP kernel that keeps no
state but the final one, so stock 0.34.0 ends a chunk at every state the fix
keeps (one engine step each). With the mod, the fix switched on and EAGLE/MTP,
the layer declares the same 64-token grid as on Triton, and runs a prefill
with exports in pieces that end at them (``plan_prefill_pieces``,
``run_prefill_pieces``): the kernel calls the split path makes, with its
states, in one engine step.

Everything runs on the release tree's patched stage, in one subprocess: vLLM's
``GDNAttentionMetadataBuilder`` resolving the HIP backend plans a batch with a
decode row, vLLM's prompt checkpoints and the fix's extras; ``run_prefill_pieces``
runs that plan with the HIP kernel replaced by a sequential recurrence that
keeps its contract (varlen, ``cu_seqlens``, float32 final states). Every export
must be bit for bit the state the split path stores (the same recurrence run
row by row, engine step by engine step, through the cache's dtype), and every
output token the split path's; both near a float64 recurrence over the
unsplit row. Not run here: the HIP kernel itself (it needs a gfx115x GPU) and
the exporter's block writes (``test_flashinfer_fix_exports.py`` runs those on
the same plan layout).

CuteDSL (opt-in, SM100/110) and AITER FlyDSL (gfx942/950) keep no state but the
final one either, and take varlen metadata besides ``cu_seqlens``: CuteDSL FLA's
chunk table (``prepare_metadata_cutedsl``), AITER its own
(``build_gdn_flydsl_prefill_metadata``). The builder makes it per round of
pieces. Here the same builder resolving each plans the same pieces, and the
layer's own ``forward_cutedsl`` / ``forward_aiter_flydsl`` run them through
stand-ins of the metadata builders and kernels that lay out the rows from that
metadata, as the kernels do: every export and output is the split path's bit
for bit, and the first round's metadata reused for every round breaks it. Not
run here: those kernels and builders (CUTLASS's DSL and AITER need their GPUs).

A step in pieces holds one state per piece, a buffer the profile run never sizes,
so the builder caps the extra exports a batch runs in pieces as it caps
FlashInfer's tails (``FLASHINFER_GDN_MAX_TAILS``, the same rule: vLLM's own
states first). A batch offered 24 extras keeps 16, vLLM's among them, on every
backend in pieces; the runner reports exactly those, and on HIP the layer hands
the exporter exactly those, each the split path's state.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods.release_side import batch_metadata, export_rows, on_tree_config, run_on_tree

pytestmark = pytest.mark.cpu

BLOCK = 256  # Mamba block (align mode)
GRID = 64  # the layer's checkpoint grid with H = 64
STATE_LEN = 3
COLS = 8
HEADS, DIM = 2, 8
# Rows (seq_len, query_len, prefilling); exports (position, block) per row, as
# in test_fla_fix_exports.py: on the grid and off it.
DECODE = (500, 1, False)
COLD = (600, 600, True)  # prompt checkpoint at 576; extras 512, 448 and 500
RESUMED = (1000, 300, True)  # query from 700: extras at offsets 128, 256 and 196
SHORT = (130, 130, True)  # one block: no checkpoint, one piece
ROWS = [DECODE, COLD, RESUMED, SHORT]
EXPORTS = {
    1: [(512, 1001), (448, 1002), (500, 1003)],
    2: [(828, 1011), (956, 1012), (896, 1013)],
}
# Backends that take varlen metadata per round of pieces, beside HIP.
METADATA_BACKENDS = ("cutedsl", "aiter_flydsl")
CHUNK = 64  # FLA's chunk, CuteDSL's and AITER's K5 recurrence's
# Every backend that runs a prefill in pieces (the CPU resolves "triton").
PIECES_BACKENDS = ("hip", "cutedsl", "aiter_flydsl", "sycl")

# More extra exports than FLASHINFER_GDN_MAX_TAILS (16) in one batch in pieces,
# at the positions the scheduler plans (get_mamba_eagle_fix_exports: block 256,
# hash unit 64, lookahead 1). Six cold prompts of 650 tokens: vLLM's prompt
# checkpoint at 640 in its column (a checkpoint row, never dropped), the fix's
# 448, 512 and 576 as extras. Two resumed chunks starting inside a block, whose
# column cannot take the prompt checkpoint: vLLM's own states (the boundary
# above the start, the prompt checkpoint) and one of the fix's, highest last:
# from 700, 768 (vLLM's), 896 (the fix's), 960 (vLLM's); from 400, 512
# (vLLM's), 576 (the fix's), 640 (vLLM's). 24 extras, 4 of them vLLM's.
CAP = 16
MANY = [(650, 650, True)] * 6 + [(1000, 300, True), (700, 300, True)]
MANY_EXPORTS = {
    **{r: [(448, 2000 + 3 * r), (512, 2001 + 3 * r), (576, 2002 + 3 * r)] for r in range(6)},
    6: [(768, 2100), (896, 2101), (960, 2102)],
    7: [(512, 2110), (576, 2111), (640, 2112)],
}
VLLM_OWN = {(6, 768), (6, 960), (7, 512), (7, 640)}


def _on_tree(model_dir: Path, out: Path) -> None:
    import torch
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as layer
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionMetadataBuilder,
        plan_prefill_pieces,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, GRID, 1, checkpoints="internal-grid"))
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((5, STATE_LEN), (HEADS, DIM, DIM)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=GRID,
        prefill_checkpoint_extra_exports=True,
    )
    common = batch_metadata(ROWS, EXPORTS, COLS)
    _install_stand_ins()

    def build(backend: str):  # noqa: ANN202 - the builder, on the tree
        # The CPU resolves Triton; the builder asks the layer module which backend.
        resolve = layer._resolve_gdn_prefill_backend
        layer._resolve_gdn_prefill_backend = lambda vllm_config: ("auto", backend)
        try:
            return GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
        finally:
            layer._resolve_gdn_prefill_backend = resolve

    builder = build("hip")
    md = builder.build(0, common)
    plan = md.flashinfer_checkpoint_plan
    pieces = plan.pieces
    exports = export_rows(plan.export_query_starts, plan.exports, plan.rows)
    result = {
        "backend": builder.gdn_prefill_backend,
        "plans": builder.plan_flashinfer_checkpoints,
        "num_checkpoints": plan.num_checkpoints,
        "tails": plan.tails is not None,
        "prefill_query_start_loc": md.prefill_query_start_loc.tolist(),
        "num_decode_tokens": md.num_decode_tokens,
        "exports": exports,
        "pieces": _pieces_layout(pieces),
        # Literal layouts of the planner alone.
        "literal": plan_prefill_pieces([0, 64, 0], [100, 200], [[], [32, 90], [99]]),
    }
    try:
        plan_prefill_pieces([0, 300], [200], None)
        result["past_the_query"] = "accepted"
    except ValueError as exc:
        result["past_the_query"] = str(exc)
    result["kernels"] = {
        str(dtype).removeprefix("torch."): _run(layer, md, exports, dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }
    result["layer"] = _run(layer, md, exports, torch.bfloat16, via_layer=True)
    total = md.prefill_query_start_loc.tolist()[-1]
    result["mutants"] = {
        name: _run(layer, md, exports, torch.float32, pieces=mutant)
        for name, mutant in _mutations(pieces, total).items()
    }
    result["cu_seqlens_dtype"] = str(pieces.cu_seqlens.dtype)
    result["metadata_backends"] = {
        backend: _metadata_backend(layer, build(backend), common, result)
        for backend in METADATA_BACKENDS
    }
    result["capped"] = {backend: _capped(layer, build(backend)) for backend in PIECES_BACKENDS}
    (out / "plan.json").write_text(json.dumps(result, indent=1))


def _capped(layer, builder) -> dict:  # noqa: ANN001
    """The MANY batch (24 extra exports) planned as pieces: the extras kept and
    reported, the pieces' states, and, on HIP, what the layer hands the exporter
    (each state checked against the split path) next to the runner's report."""
    import types

    import torch
    from vllm.v1.worker.gpu.attn_utils import mamba_checkpoint_exports_written

    md = builder.build(0, batch_metadata(MANY, MANY_EXPORTS, COLS))
    plan = md.flashinfer_checkpoint_plan
    checkpoint = md.checkpoint
    result = {
        "backend": builder.gdn_prefill_backend,
        "kept": [list(pair) for pair in checkpoint.kept_extra_exports or ()],
        "offsets": checkpoint.offsets,
        "num_states": plan.num_checkpoints,
        "dropped": getattr(builder, "num_dropped_tail_exports", None),
    }
    # The runner's report for the step, one request per row.
    req_ids = [f"r{r}" for r in range(len(MANY))]
    planned = {req_ids[r]: {0: pairs} for r, pairs in MANY_EXPORTS.items()}
    groups = [[types.SimpleNamespace(layer_names=["layer"])]]
    written = mamba_checkpoint_exports_written(planned, req_ids, {"layer": md}, groups)
    result["reported"] = sorted([req_ids.index(q), p] for q, ps in written.items() for p in ps)
    if builder.gdn_prefill_backend == "hip":
        exports = export_rows(plan.export_query_starts, plan.exports, plan.rows)
        run = _run(layer, md, exports, torch.float32, via_layer=True)
        extra_blocks = {block for pairs in MANY_EXPORTS.values() for _, block in pairs}
        result["run"] = run
        # (row, position) of every extra state the exporter was handed.
        result["handed"] = sorted(
            [c["sequence"], MANY[c["sequence"]][0] - MANY[c["sequence"]][1] + c["offset"]]
            for c in run["exports"]
            if c["block"] in extra_blocks
        )
    return result


def _pieces_layout(pieces) -> dict:  # noqa: ANN001
    """A plan's pieces as host lists."""
    return {
        "token_bounds": pieces.token_bounds,
        "state_bounds": pieces.state_bounds,
        "cu_seqlens": pieces.cu_seqlens.tolist(),
        "sources": pieces.sources.tolist(),
        "sequences": pieces.sequences.tolist(),
        "finals": pieces.finals.tolist(),
    }


def _metadata_backend(layer, builder, common, hip: dict) -> dict:  # noqa: ANN001
    """CuteDSL or AITER FlyDSL: the builder's plan against HIP's, the metadata it
    makes per round, and the pieces through the layer's own forward method (its
    metadata builder and kernel stood in for), also with stale metadata."""
    import dataclasses

    import torch

    md = builder.build(0, common)
    plan = md.flashinfer_checkpoint_plan
    pieces = plan.pieces
    exports = export_rows(plan.export_query_starts, plan.exports, plan.rows)
    forward = _forward_method(layer, builder.gdn_prefill_backend)
    stale = dataclasses.replace(
        pieces, kernel_args=[pieces.kernel_args[0]] * len(pieces.kernel_args)
    )
    # A batch without checkpoints (SHORT: one block) plans nothing and takes the
    # whole batch's varlen metadata.
    unplanned = builder.build(0, batch_metadata([SHORT], None, COLS))
    return {
        "whole_batch_metadata": {
            "pieces": _whole_batch_metadata(md),
            "no checkpoint": _whole_batch_metadata(unplanned),
        },
        "unplanned": unplanned.flashinfer_checkpoint_plan is None,
        "backend": builder.gdn_prefill_backend,
        "plans": builder.plan_flashinfer_checkpoints,
        "tails": plan.tails is not None,
        "same_plan_as_hip": _pieces_layout(pieces) == hip["pieces"]
        and exports == hip["exports"]
        and plan.num_checkpoints == hip["num_checkpoints"],
        "cu_seqlens_dtype": str(pieces.cu_seqlens.dtype),
        "rounds": [_described(args) for args in pieces.kernel_args],
        "layer": {
            str(dtype).removeprefix("torch."): _run(
                layer, md, exports, dtype, via_layer=True, prefill=forward
            )
            for dtype in (torch.float32, torch.bfloat16)
        },
        "stale": _stale(layer, md, exports, stale, forward),
    }


def _whole_batch_metadata(md) -> list[str]:  # noqa: ANN001
    """Which of the whole prefill batch's varlen metadata the builder made."""
    names = ("chunk_indices", "chunk_offsets", "aiter_prefill_metadata")
    return [name for name in names if getattr(md, name) is not None]


def _stale(layer, md, exports, pieces, forward) -> dict:  # noqa: ANN001
    """The pieces with stale metadata: later rounds have fewer sequences than the
    first round's metadata names, so the kernel reaches past their states."""
    import torch

    try:
        return _run(layer, md, exports, torch.float32, pieces=pieces, prefill=forward)
    except IndexError as exc:
        return {"error": f"IndexError: {exc}"}


def _forward_method(layer, backend: str):  # noqa: ANN001, ANN202
    """vLLM's ``ChunkGatedDeltaRule.forward_cutedsl`` or ``forward_aiter_flydsl``
    (neither reads ``self``), as ``_forward_pieces_prefill`` reaches it."""
    import functools

    method = {
        "cutedsl": layer.ChunkGatedDeltaRule.forward_cutedsl,
        "aiter_flydsl": layer.ChunkGatedDeltaRule.forward_aiter_flydsl,
    }[backend]
    return functools.partial(method, None)


def _described(args: dict) -> dict:
    """A round's kernel arguments as the test reads them: CuteDSL's chunk table
    (its used rows) and offsets, or AITER's sequence lengths."""
    if "aiter_prefill_metadata" in args:
        return {"aiter_seq_lens": args["aiter_prefill_metadata"].seq_lens}
    offsets = args["chunk_offsets"]
    return {
        "chunk_offsets": offsets.tolist(),
        "chunk_indices": args["chunk_indices"][: int(offsets[-1])].tolist(),
        "dtypes": [str(args["chunk_indices"].dtype), str(offsets.dtype)],
    }


def _chunk_rows(lengths: list[int]) -> list[tuple[int, int]]:
    """(sequence, chunk) for every CHUNK-token chunk of sequences this long."""
    return [(n, i) for n, length in enumerate(lengths) for i in range(-(-length // CHUNK))]


def _lengths(cu_seqlens: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(cu_seqlens)]


def _install_stand_ins() -> None:
    """CuteDSL's module and AITER's two entry points, replaced by stand-ins that
    keep their contracts on the CPU: the metadata a kernel lays its rows out by,
    and kernels that lay them out by it (so stale metadata gives other states),
    each chunk through ``_kernel``'s recurrence."""
    import types

    import torch
    from vllm._aiter_ops import rocm_aiter_ops

    def prepare_metadata_cutedsl(cu_seqlens, total_tokens, chunk_size=CHUNK):  # noqa: ANN001, ANN202
        # int32 (sequence, chunk) rows, as many as the kernel's upper bound from
        # total_tokens, and cumulative chunk counts per sequence.
        assert chunk_size == CHUNK
        lengths = _lengths(cu_seqlens.tolist())
        n = len(lengths)
        upper = (n - 1) + -(-(total_tokens - (n - 1)) // CHUNK)
        rows = _chunk_rows(lengths)[:upper]
        indices = torch.full((upper, 2), -1, dtype=torch.int32)
        indices[: len(rows)] = torch.tensor(rows, dtype=torch.int32).view(-1, 2)
        counts = [-(-length // CHUNK) for length in lengths]
        offsets = torch.tensor(list(itertools.accumulate(counts, initial=0)), dtype=torch.int32)
        return indices, offsets

    def chunk_gated_delta_rule_cutedsl(**kw):  # noqa: ANN003, ANN202
        cu_seqlens = kw["cu_seqlens"]
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"CuteDSL is compiled for int32 cu_seqlens, not {cu_seqlens.dtype}")
        assert kw.get("core_attn_out") is None  # the pieces take the output back
        rows = kw["chunk_indices"][: int(kw["chunk_offsets"][-1])].tolist()
        return _chunked(kw, cu_seqlens.tolist(), rows)

    module = types.ModuleType("vllm.model_executor.layers.mamba.ops.gdn_chunk_cutedsl")
    module.prepare_metadata_cutedsl = prepare_metadata_cutedsl
    module.chunk_gated_delta_rule_cutedsl = chunk_gated_delta_rule_cutedsl
    sys.modules[module.__name__] = module

    def build_gdn_flydsl_prefill_metadata(seq_lens_cpu, cu_seqlens):  # noqa: ANN001, ANN202
        return types.SimpleNamespace(seq_lens=list(seq_lens_cpu), cu_seqlens=cu_seqlens)

    def gdn_flydsl_prefill(**kw):  # noqa: ANN003, ANN202
        assert kw["output_final_state"] and not kw["use_qk_l2norm_in_kernel"]
        # The varlen layout is the metadata's, built once per batch (or round).
        seq_lens = kw["aiter_prefill_metadata"].seq_lens
        bounds = list(itertools.accumulate(seq_lens, initial=0))
        return _chunked(kw, bounds, _chunk_rows(seq_lens))

    rocm_aiter_ops.build_gdn_flydsl_prefill_metadata = build_gdn_flydsl_prefill_metadata
    rocm_aiter_ops.gdn_flydsl_prefill = gdn_flydsl_prefill


def _chunked(kw: dict, bounds: list[int], rows: list) -> tuple:
    """A chunked kernel's contract over the inputs in ``kw`` (q, k, v, g, beta,
    initial_state): ``rows`` (sequence, chunk) in order, each chunk the recurrence
    over its CHUNK tokens of ``bounds``' sequence from where the previous chunk
    left it; float32 final states. A layout past the batch's tokens, or a
    sequence beyond its states (stale metadata), is an IndexError."""
    import torch

    inputs = tuple(kw[name] for name in ("q", "k", "v", "g", "beta"))
    if bounds[-1] > inputs[0].shape[1]:
        raise IndexError(f"the layout's {bounds[-1]} tokens run past the batch's")
    initial_state = kw["initial_state"]
    out = torch.zeros_like(kw["v"])
    states = [initial_state[n].float() for n in range(initial_state.shape[0])]
    for n, i in rows:
        a = bounds[n] + i * CHUNK
        b = min(a + CHUNK, bounds[n + 1])
        if b <= a:  # a chunk past its sequence's end (stale metadata) reads nothing
            continue
        o, states[n] = _row_recurrence(inputs, a, b, states[n], torch.float32)
        out[0, a:b] = o.to(out.dtype)
    return out, torch.stack(states)


def _recurrence(q, k, v, g, beta, h):  # noqa: ANN001, ANN202 - tensors, on the tree
    """The gated delta rule over one sequence, token by token, from state ``h``
    ([heads, v, k]); the output and the final state."""
    import torch

    out = []
    for t in range(q.shape[0]):
        h = h * torch.exp(g[t]).view(-1, 1, 1)
        kv = torch.einsum("hvk,hk->hv", h, k[t])
        h = h + torch.einsum("hv,hk->hvk", beta[t].view(-1, 1) * (v[t] - kv), k[t])
        out.append(torch.einsum("hvk,hk->hv", h, q[t]) * q.shape[-1] ** -0.5)
    return torch.stack(out), h


def _row_recurrence(inputs, a: int, b: int, h, dtype):  # noqa: ANN001, ANN202
    """``_recurrence`` over tokens ``a:b`` of a [1, T, ...] batch's ``inputs`` (q, k,
    v, g, beta), from ``h``, all in ``dtype``."""
    return _recurrence(*(t[0, a:b].to(dtype) for t in inputs), h.to(dtype))


def _kernel(*, q, k, v, g, beta, initial_state, cu_seqlens):  # noqa: ANN001, ANN202
    """A stand-in for ``chunk_gdn_hip_fwd`` with its contract: varlen rows of a
    [1, T, ...] batch, float32 final states [N, heads, v, k], output like v."""
    import torch

    bounds = cu_seqlens.tolist()
    out = torch.empty_like(v)
    finals = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        o, h = _row_recurrence((q, k, v, g, beta), a, b, initial_state[n], torch.float32)
        out[0, a:b] = o.to(v.dtype)
        finals.append(h)
    return out, torch.stack(finals)


def _inputs(total: int, rows: int, dtype):  # noqa: ANN001, ANN202
    import torch

    gen = torch.Generator().manual_seed(34)
    q = torch.nn.functional.normalize(torch.randn(1, total, HEADS, DIM, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, total, HEADS, DIM, generator=gen), dim=-1)
    v = torch.randn(1, total, HEADS, DIM, generator=gen)
    g = -(torch.rand(1, total, HEADS, generator=gen) * 0.4 + 0.01)
    beta = torch.rand(1, total, HEADS, generator=gen).clamp(0.05)
    h0 = (torch.randn(rows, HEADS, DIM, DIM, generator=gen) * 0.1).to(dtype)
    half = torch.bfloat16
    return q.to(half), k.to(half), v.to(half), g, beta.to(half), h0


def _through_layer(layer, md, inputs, h0, prefill=None):  # noqa: ANN001, ANN202
    """The layer's own ``_forward_pieces_prefill`` and ``_export_checkpoints`` on
    the plan, the prefill op being ``prefill`` (default: the HIP kernel replaced
    by ``_kernel``) and vLLM's exporter one that records what it is handed: the
    output, the final states, and per export (its start, offset and row) the
    state it would store."""
    import functools
    from types import SimpleNamespace

    import torch

    def hip(*, output_final_state, use_qk_l2norm_in_kernel, **kw):  # noqa: ANN001, ANN202
        assert output_final_state and not use_qk_l2norm_in_kernel
        return _kernel(**kw)

    chunk_gated_delta_rule = prefill or hip
    handed: dict = {}
    fake = SimpleNamespace(
        chunk_gated_delta_rule=chunk_gated_delta_rule,
        _checkpoint_exporter=SimpleNamespace(
            export=lambda checkpoint, **kw: handed.update(checkpoint=checkpoint, **kw)
        ),
    )
    cls = layer.QwenGatedDeltaNetAttention
    fake._export_checkpoints = functools.partial(cls._export_checkpoints, fake)
    total = inputs[0].shape[1]
    out, finals = cls._forward_pieces_prefill(
        fake,
        *inputs,
        md,
        h0,
        ssm_state=torch.zeros(1),
        conv_state=torch.zeros(1),
        conv_input=torch.zeros(md.num_decode_tokens + total, 1),
    )
    exported = export_rows(handed["cu_seqlens"], handed["checkpoint"], handed["recurrent_rows"])
    return out, finals, handed["recurrent_checkpoint"], exported


def _run(layer, md, exports, dtype, pieces=None, via_layer=False, prefill=None) -> dict:  # noqa: ANN001
    """The plan's pieces through ``run_prefill_pieces`` (or the layer's methods
    around it), the prefill being ``prefill`` (as the layer calls it) or the HIP
    stand-in, against the split path."""
    import functools

    import torch

    qsl = md.prefill_query_start_loc.tolist()
    q, k, v, g, beta, h0 = _inputs(qsl[-1], len(qsl) - 1, dtype)
    for n, has in enumerate(md.prefill_has_initial_state.tolist()):
        if not has:
            h0[n] = 0
    plan = md.flashinfer_checkpoint_plan
    if via_layer:
        out, finals, states, exports = _through_layer(layer, md, (q, k, v, g, beta), h0, prefill)
    else:
        kernel = _kernel
        if prefill is not None:
            kernel = functools.partial(
                prefill, output_final_state=True, use_qk_l2norm_in_kernel=False
            )
        out, states = layer.run_prefill_pieces(pieces or plan.pieces, q, k, v, g, beta, h0, kernel)
        finals = states[plan.pieces.finals]
    # The split path: engine step by engine step, each row's chunk ending at its
    # next kept state, the state stored in the cache's dtype in between.
    cuts: dict[int, set[int]] = {n: {qsl[n + 1] - qsl[n]} for n in range(len(qsl) - 1)}
    for e in exports:
        if e["block"]:
            cuts[qsl.index(e["start"] - md.num_decode_tokens)].add(e["offset"])
    split_state: dict[tuple[int, int], torch.Tensor] = {}
    split_out = torch.empty_like(v)
    for n, ends in cuts.items():
        h, start = h0[n : n + 1], 0
        for end in sorted(ends):
            sl = slice(qsl[n] + start, qsl[n] + end)
            o, h = _kernel(
                q=q[:, sl],
                k=k[:, sl],
                v=v[:, sl],
                g=g[:, sl],
                beta=beta[:, sl],
                initial_state=h,
                cu_seqlens=torch.tensor([0, end - start]),
            )
            h = h.to(dtype)
            split_out[:, sl] = o
            split_state[n, end] = h[0]
            start = end
    checks = []
    for e in exports:
        if not e["block"]:
            continue
        n = qsl.index(e["start"] - md.num_decode_tokens)
        a, p = qsl[n], e["offset"]
        inputs = (q, k, v, g, beta)
        _, ref = _row_recurrence(inputs, a, a + p, h0[n], torch.float64)
        got = states[e["row"]]
        checks.append(
            {
                "sequence": n,
                "offset": p,
                "block": e["block"],
                "split_bitwise": bool(torch.equal(got, split_state[n, p])),
                "reference_rel": float((got.double() - ref).abs().max() / ref.abs().max()),
            }
        )
    unsplit = torch.cat(
        [
            _row_recurrence((q, k, v, g, beta), a, b, h0[n], torch.float64)[0]
            for n, (a, b) in enumerate(itertools.pairwise(qsl))
        ]
    )
    return {
        "exports": checks,
        "output_split_bitwise": bool(torch.equal(out, split_out)),
        "output_reference_rel": float(
            (out[0].double() - unsplit).abs().max() / unsplit.abs().max()
        ),
        "finals_split_bitwise": all(
            torch.equal(finals[n], split_state[n, qsl[n + 1] - qsl[n]]) for n in cuts
        ),
        "states_dtype": str(states.dtype),
    }


def _mutations(pieces, total: int) -> dict:  # noqa: ANN001
    """The plan's pieces broken two ways: every later piece starting from its
    sequence's initial state (the chaining dropped), and every piece reading the
    tokens one further on (a cut off by one)."""
    import dataclasses

    return {
        "unchained": dataclasses.replace(pieces, sources=pieces.sources.clamp(max=-1)),
        "shifted": dataclasses.replace(
            pieces, token_indices=(pieces.token_indices + 1).clamp(max=total - 1)
        ),
    }


@pytest.fixture(scope="module")
def plan(release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("hip-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out))
    return json.loads((out / "plan.json").read_text())


def test_the_hip_backend_plans_pieces_not_tails(plan) -> None:  # noqa: ANN001
    """With the grid declared, vLLM's builder on the HIP backend plans the batch's
    exports as pieces: every cut a piece end, no stride, no tail."""
    assert (plan["backend"], plan["plans"], plan["tails"]) == ("hip", True, False)
    cold, resumed = 1, 601  # non-spec starts: the decode row's one token first
    exports = sorted((e["start"], e["offset"], e["block"]) for e in plan["exports"])
    assert [x for x in exports if x[2]] == sorted(
        [
            (cold, 576, 102),  # vLLM's prompt checkpoint
            (cold, 512, 1001),
            (cold, 448, 1002),
            (cold, 500, 1003),
            (resumed, 128, 1011),
            (resumed, 256, 1012),
            (resumed, 196, 1013),
        ]
    )
    pieces = plan["pieces"]
    # COLD cut at 448, 500, 512, 576 (5 pieces); RESUMED at 128, 196, 256 (4);
    # SHORT whole (1). Round r holds the r-th piece of each sequence that has one.
    assert pieces["state_bounds"] == [0, 3, 5, 7, 9, 10]
    assert pieces["sequences"] == [0, 1, 2, 0, 1, 0, 1, 0, 1, 0]
    assert pieces["cu_seqlens"] == [
        *[0, 448, 576, 706],  # 448 | 128 | 130
        *[0, 52, 120],  # 500-448 | 196-128
        *[0, 12, 72],  # 512-500 | 256-196
        *[0, 64, 108],  # 576-512 | 300-256
        *[0, 24],  # 600-576
    ]
    assert pieces["sources"] == [-1, -1, -1, 0, 1, 3, 4, 5, 6, 7]
    assert pieces["finals"] == [9, 8, 2]
    assert pieces["token_bounds"] == [0, 706, 826, 898, 1006, 1030]
    assert plan["num_checkpoints"] == 10


def test_plan_prefill_pieces_literal_layout(plan) -> None:  # noqa: ANN001
    """The planner alone: row 0 runs as a decode; row 1's checkpoint at 64 and
    extras at 32 and 90 cut its 100 tokens into four pieces, row 2's extra at 99
    its 200 into two; an export past the query is refused."""
    rounds, rows, finals = plan["literal"]
    assert rounds == [
        [[0, 0, 32, -1], [1, 0, 99, -1]],
        [[0, 32, 64, 0], [1, 99, 200, 1]],
        [[0, 64, 90, 2]],
        [[0, 90, 100, 4]],
    ]
    # Checkpoint rows (none, 64, none), then the extras 32, 90 and 99 in row order.
    assert rows == [0, 2, 0, 0, 4, 1]
    assert finals == [5, 3]
    assert "exports past its 200 query tokens" in plan["past_the_query"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_export_and_output_is_the_split_paths_bit_for_bit(plan, dtype: str) -> None:  # noqa: ANN001
    """Each exported state equals the state the split path stores at that offset,
    each output token the split path's, also through a bfloat16 cache; both near
    a float64 recurrence over the unsplit row."""
    got = plan["kernels"][dtype]
    assert got["states_dtype"] == f"torch.{dtype}"
    assert len(got["exports"]) == 7
    for check in got["exports"]:
        assert check["split_bitwise"], check
        assert check["reference_rel"] < (1e-5 if dtype == "float32" else 0.02), check
    assert got["output_split_bitwise"] and got["finals_split_bitwise"]
    assert got["output_reference_rel"] < 0.02


def test_the_layer_hands_the_exporter_the_split_paths_states(plan) -> None:  # noqa: ANN001
    """The layer's ``_forward_pieces_prefill`` and ``_export_checkpoints`` on the
    plan (the HIP kernel and vLLM's exporter stood in for): the exporter gets one
    row per export, and the state each row points at is the split path's."""
    got = plan["layer"]
    assert len(got["exports"]) == 7
    assert all(check["split_bitwise"] for check in got["exports"]), got["exports"]
    assert got["output_split_bitwise"] and got["finals_split_bitwise"]


def test_the_pieces_run_in_int32_cu_seqlens(plan) -> None:  # noqa: ANN001
    """Every backend's pieces take int32 ``cu_seqlens``, as each prefill kernel
    takes the batch's ``query_start_loc`` (CuteDSL is compiled for nothing else)."""
    assert plan["cu_seqlens_dtype"] == "torch.int32"
    for backend in METADATA_BACKENDS:
        assert plan["metadata_backends"][backend]["cu_seqlens_dtype"] == "torch.int32"


@pytest.mark.parametrize("backend", METADATA_BACKENDS)
def test_cutedsl_and_aiter_plan_hips_pieces(plan, backend: str) -> None:  # noqa: ANN001
    """Resolving CuteDSL or AITER FlyDSL, the builder plans the batch exactly as on
    HIP: the same pieces, rows and exports, no tails."""
    got = plan["metadata_backends"][backend]
    assert (got["backend"], got["plans"], got["tails"]) == (backend, True, False)
    assert got["same_plan_as_hip"]


def test_each_round_gets_its_own_varlen_metadata(plan) -> None:  # noqa: ANN001
    """CuteDSL's chunk table and AITER's varlen metadata, made per round from that
    round's pieces (HIP's literal rounds: 448|128|130, 52|68, 12|60, 64|44, 24)."""
    lengths = [[448, 128, 130], [52, 68], [12, 60], [64, 44], [24]]
    aiter = plan["metadata_backends"]["aiter_flydsl"]["rounds"]
    assert [r["aiter_seq_lens"] for r in aiter] == lengths
    cutedsl = plan["metadata_backends"]["cutedsl"]["rounds"]
    assert cutedsl[0] == {
        "chunk_offsets": [0, 7, 9, 12],
        "chunk_indices": [[0, i] for i in range(7)] + [[1, 0], [1, 1]] + [[2, i] for i in range(3)],
        "dtypes": ["torch.int32", "torch.int32"],
    }
    assert [r["chunk_offsets"] for r in cutedsl[1:]] == [[0, 1, 3], [0, 1, 2], [0, 1, 2], [0, 1]]


@pytest.mark.parametrize("backend", METADATA_BACKENDS)
def test_a_batch_in_pieces_takes_no_whole_batch_metadata(plan, backend: str) -> None:  # noqa: ANN001
    """The builder makes CuteDSL's chunk table or AITER's varlen metadata for the
    whole prefill batch only where no pieces are planned: a batch in pieces takes
    each round's own, and one without checkpoints the whole batch's as before."""
    got = plan["metadata_backends"][backend]
    assert got["unplanned"]
    assert got["whole_batch_metadata"] == {
        "pieces": [],
        "no checkpoint": {
            "cutedsl": ["chunk_indices", "chunk_offsets"],
            "aiter_flydsl": ["aiter_prefill_metadata"],
        }[backend],
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", METADATA_BACKENDS)
def test_cutedsl_and_aiter_layers_export_the_split_paths_states(plan, backend, dtype) -> None:  # noqa: ANN001
    """vLLM's ``forward_cutedsl`` / ``forward_aiter_flydsl`` under the layer's
    ``_forward_pieces_prefill``: every export the split path's state, output and
    final states the split path's, bit for bit, also through a bfloat16 cache."""
    got = plan["metadata_backends"][backend]["layer"][dtype]
    assert len(got["exports"]) == 7
    for check in got["exports"]:
        assert check["split_bitwise"], check
        assert check["reference_rel"] < (1e-5 if dtype == "float32" else 0.02), check
    assert got["output_split_bitwise"] and got["finals_split_bitwise"]


@pytest.mark.parametrize("backend", METADATA_BACKENDS)
def test_stale_round_metadata_fails(plan, backend: str) -> None:  # noqa: ANN001
    """The first round's metadata reused for every round lays the later rounds'
    rows out wrong: round 1 runs 120 tokens of two sequences, the metadata
    names three (AITER's: 706 tokens), and the kernel reaches past them."""
    stale = plan["metadata_backends"][backend]["stale"]
    assert (
        stale["error"]
        == {
            "cutedsl": "IndexError: list index out of range",
            "aiter_flydsl": "IndexError: the layout's 706 tokens run past the batch's",
        }[backend]
    )


@pytest.mark.parametrize("backend", PIECES_BACKENDS)
def test_the_pieces_plan_at_most_the_cap_of_extra_exports(plan, backend: str) -> None:  # noqa: ANN001
    """24 extra exports offered in one batch in pieces: the builder keeps 16
    (FLASHINFER_GDN_MAX_TAILS, as FlashInfer's tails), vLLM's own states first
    (the boundaries above mid-block starts, then each row's highest: the prompt
    checkpoints its column cannot take), then the rest in row order; vLLM's
    prompt checkpoints in their columns (640) stay checkpoint rows. So the step
    holds R + P + 16 piece states (8 rows, 6 checkpoint rows), not 38."""
    got = plan["capped"][backend]
    assert got["backend"] == backend
    assert len(got["kept"]) <= CAP, got["kept"]
    assert VLLM_OWN.issubset(tuple(pair) for pair in got["kept"])
    assert got["kept"] == [
        *[[r, p] for r in range(3) for p in (448, 512, 576)],
        *[[r, 576] for r in range(3, 6)],
        *[[6, 768], [6, 960], [7, 512], [7, 640]],
    ]
    assert got["offsets"] == [640] * 6 + [0, 0]
    assert got["dropped"] == 24 - CAP
    assert got["num_states"] == len(MANY) + 6 + CAP


@pytest.mark.parametrize("backend", PIECES_BACKENDS)
def test_extra_exports_past_the_cap_are_not_reported(plan, backend: str) -> None:  # noqa: ANN001
    """The runner reports written exactly the extras the builder kept (the others
    are neither export rows nor reported, so the scheduler never keys their
    blocks), and on HIP exactly those the layer hands the exporter, each the
    split path's state bit for bit."""
    got = plan["capped"][backend]
    assert got["reported"] == sorted(got["kept"])
    if backend == "hip":
        assert got["handed"] == got["reported"]
        assert len(got["run"]["exports"]) == 6 + CAP  # checkpoint rows and extras
        assert all(check["split_bitwise"] for check in got["run"]["exports"])
        assert got["run"]["output_split_bitwise"] and got["run"]["finals_split_bitwise"]


@pytest.mark.parametrize("mutant", ["unchained", "shifted"])
def test_a_broken_plan_fails(plan, mutant: str) -> None:  # noqa: ANN001
    """Pieces that do not start from their predecessor's state, or that read the
    wrong tokens, give states and outputs other than the split path's."""
    got = plan["mutants"][mutant]
    assert not got["output_split_bitwise"]
    same = {(c["sequence"], c["offset"]) for c in got["exports"] if c["split_bitwise"]}
    # Unchained, only the first pieces' states (from the initial state) still agree.
    assert same == ({(0, 448), (1, 128)} if mutant == "unchained" else set())


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")
