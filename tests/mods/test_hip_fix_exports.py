"""Internal checkpoints on vLLM 0.34.0's HIP GDN path (mod
``fix-eagle-fine-prefix-exports``), checked on the CPU with vLLM's own builder
and layer code.

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
    # The CPU resolves Triton; the builder asks the layer module which backend.
    resolve = layer._resolve_gdn_prefill_backend
    layer._resolve_gdn_prefill_backend = lambda vllm_config: ("auto", "hip")
    try:
        builder = GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
    finally:
        layer._resolve_gdn_prefill_backend = resolve
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
        "pieces": {
            "token_bounds": pieces.token_bounds,
            "state_bounds": pieces.state_bounds,
            "cu_seqlens": pieces.cu_seqlens.tolist(),
            "sources": pieces.sources.tolist(),
            "sequences": pieces.sequences.tolist(),
            "finals": pieces.finals.tolist(),
        },
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
    (out / "plan.json").write_text(json.dumps(result, indent=1))


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


def _through_layer(layer, md, inputs, h0):  # noqa: ANN001, ANN202
    """The layer's own ``_forward_pieces_prefill`` and ``_export_checkpoints`` on
    the plan, the HIP kernel replaced by ``_kernel`` and vLLM's exporter by one
    that records what it is handed: the output, the final states, and per export
    (its start, offset and row) the state it would store."""
    import functools
    from types import SimpleNamespace

    import torch

    def chunk_gated_delta_rule(*, output_final_state, use_qk_l2norm_in_kernel, **kw):  # noqa: ANN001, ANN202
        assert output_final_state and not use_qk_l2norm_in_kernel
        return _kernel(**kw)

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


def _run(layer, md, exports, dtype, pieces=None, via_layer=False) -> dict:  # noqa: ANN001
    """The plan's pieces through ``run_prefill_pieces`` (or the layer's methods
    around it), against the split path."""
    import torch

    qsl = md.prefill_query_start_loc.tolist()
    q, k, v, g, beta, h0 = _inputs(qsl[-1], len(qsl) - 1, dtype)
    for n, has in enumerate(md.prefill_has_initial_state.tolist()):
        if not has:
            h0[n] = 0
    plan = md.flashinfer_checkpoint_plan
    if via_layer:
        out, finals, states, exports = _through_layer(layer, md, (q, k, v, g, beta), h0)
    else:
        out, states = layer.run_prefill_pieces(pieces or plan.pieces, q, k, v, g, beta, h0, _kernel)
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
