"""Internal checkpoints through XPU's fused SYCL GDN op on vLLM 0.34.0 (mod
``fix-eagle-fine-prefix-exports``), checked on the CPU with vLLM's own builder
and op wrapper.

XPU's default GDN route is one op from vllm-xpu-kernels (``_xpu_C::gdn_attention``)
that runs the convolution and the recurrence and writes both caches, for the
decodes, speculative decodes and prefills of a step at once. It keeps a row's
state only in its cache slot, so stock 0.34.0 ends a chunk at every state the
fix keeps (one engine step each). With the mod, the fix switched on and
EAGLE/MTP, vLLM's ``_gdn_attention_core_xpu_impl`` runs such a step as the
split path's steps in one call (``run_fused_prefill_pieces``): the decodes and
speculative decodes as a batch without prefills, then each round of pieces as
a batch of prefills alone, each export copied from its row's slot into its own
block before the next round overwrites it.

Everything runs on the release tree's patched stage, in one subprocess: vLLM's
``GDNAttentionMetadataBuilder`` resolving the SYCL backend plans the batches of
``test_cpu_fix_exports.py`` (a decode row, or speculative decodes, beside
prefills with vLLM's prompt checkpoints and the fix's extras), and vLLM's op
wrapper runs them once as planned and once as the split path's engine steps,
with stock metadata, on the same caches. The fused op itself needs an Intel
GPU; here a stand-in keeps its contract on the CPU (its metadata as the
wrapper passes it, int32 indices, rows in their cache slots, the active tokens
only). Every export's convolution window and recurrent state, every final
state, and every output and gate token must be the split path's bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods.release_side import (
    batch_metadata,
    block_table,
    draft_kwargs,
    export_rows,
    exports_by_row,
    on_tree_config,
    run_on_tree,
    slot_table,
    split_steps,
)
from tests.mods.test_cpu_fix_exports import BATCHES, COLS, NUM_SLOTS, NUM_SPEC
from tests.mods.test_hip_fix_exports import BLOCK, GRID

pytestmark = pytest.mark.cpu

PREFIX = "model.layers.0.linear_attn"
K_HEADS, V_HEADS, DIM = 1, 2, 8
CONV = 4  # the convolution's width: a state keeps its last three inputs
QKV = 2 * K_HEADS * DIM + V_HEADS * DIM  # the convolved channels


def _stand_in(calls: list):  # noqa: ANN202 - the op, on the tree
    """``_xpu_C::gdn_attention``'s contract in torch (one layout of its own for the
    projections: q, k, v, z per token; b, a per token). Per row of each active
    group, from the row's cache slot (a prefill without initial state from
    zeros): the causal convolution and SiLU, the gated delta rule over the
    normalised q and k, the outputs and gates at the row's tokens, and the
    row's last inputs and state written back to its slot in the cache's dtype.
    A speculative row starts from its accepted token's slot and writes one slot
    per token. Tokens past ``num_actual_tokens`` are refused, as the op narrows
    to them. Each call is recorded in ``calls``."""
    import torch

    def run_row(x, ab, conv, h, weights, bias, a_log, dt_bias):  # noqa: ANN001, ANN202
        mixed, gate = x[:, :QKV].float(), x[:, QKV:]
        window = torch.cat([conv.float().T, mixed])
        tokens = x.shape[0]
        conv_out = sum(window[i : i + tokens] * weights[:, i].float() for i in range(CONV))
        conv_out = torch.nn.functional.silu(conv_out + bias.float())
        q, k, v = conv_out.split([K_HEADS * DIM, K_HEADS * DIM, V_HEADS * DIM], dim=-1)
        q = torch.nn.functional.normalize(q.view(tokens, K_HEADS, DIM), dim=-1)
        k = torch.nn.functional.normalize(k.view(tokens, K_HEADS, DIM), dim=-1)
        q = q.repeat_interleave(V_HEADS // K_HEADS, dim=1)
        k = k.repeat_interleave(V_HEADS // K_HEADS, dim=1)
        v = v.view(tokens, V_HEADS, DIM)
        b, a = ab.float().split(V_HEADS, dim=-1)
        beta = torch.sigmoid(b)
        g = -a_log.float().exp() * torch.nn.functional.softplus(a + dt_bias.float())
        out = []
        for t in range(tokens):
            h = h * torch.exp(g[t]).view(-1, 1, 1)
            kv = torch.einsum("hvk,hk->hv", h, k[t])
            h = h + torch.einsum("hv,hk->hvk", beta[t].view(-1, 1) * (v[t] - kv), k[t])
            out.append(torch.einsum("hvk,hk->hv", h, q[t]) * DIM**-0.5)
        return torch.stack(out), gate.reshape(tokens, V_HEADS, DIM), window[-(CONV - 1) :].T, h

    def gdn_attention(core_attn_out, z, qkvz, ba, *heads, **kw) -> None:  # noqa: ANN001, ANN003
        assert heads == (K_HEADS, V_HEADS, DIM, DIM)
        assert kw["activation"] == "silu" and kw["tp_size"] == 1
        conv_state, ssm_state = kw["conv_state"], kw["ssm_state"]
        weights = (kw["conv_weights"], kw["conv_bias"], kw["A_log"], kw["dt_bias"])
        active = kw["num_actual_tokens"]
        calls.append(
            {name: kw[name] for name in ("num_prefills", "num_decodes", "num_spec_decodes")}
            | {"tokens": active}
        )

        def at(tokens: list[int]) -> list[int]:
            if any(t >= active for t in tokens):
                raise IndexError(f"token {max(tokens)} past the {active} active ones")
            return tokens

        def ints(name: str):  # noqa: ANN202
            tensor = kw[name]
            if tensor.dtype != torch.int32:
                raise TypeError(f"{name} must be int32, not {tensor.dtype}")
            return tensor.tolist()

        def write(tokens, out, gate) -> None:  # noqa: ANN001
            core_attn_out[tokens] = out.to(core_attn_out.dtype)
            z[tokens] = gate.to(z.dtype)

        non_spec = kw["num_prefills"] + kw["num_decodes"]
        if non_spec:
            bounds = ints("non_spec_query_start_loc")
            assert len(bounds) == non_spec + 1
            index = ints("non_spec_token_indx") if kw["non_spec_token_indx"] is not None else None
            slots = ints("non_spec_state_indices_tensor")
            has = kw["has_initial_state"]
            for n in range(non_spec):
                span = range(bounds[n], bounds[n + 1])
                tokens = at([index[i] for i in span] if index is not None else list(span))
                slot = slots[n]
                fresh = has is not None and not bool(has[n])
                conv = torch.zeros_like(conv_state[slot]) if fresh else conv_state[slot]
                h = torch.zeros_like(ssm_state[slot]) if fresh else ssm_state[slot]
                out, gate, conv, h = run_row(qkvz[tokens], ba[tokens], conv, h.float(), *weights)
                write(tokens, out, gate)
                conv_state[slot] = conv.to(conv_state.dtype)
                ssm_state[slot] = h.to(ssm_state.dtype)
        if kw["num_spec_decodes"]:
            bounds = ints("spec_query_start_loc")
            index, slots = ints("spec_token_indx"), ints("spec_state_indices_tensor")
            accepted = ints("num_accepted_tokens")
            for n in range(kw["num_spec_decodes"]):
                tokens = at(index[bounds[n] : bounds[n + 1]])
                source = slots[n][accepted[n] - 1]
                conv, h = conv_state[source], ssm_state[source].float()
                for t, token in enumerate(tokens):
                    out, gate, conv, h = run_row(qkvz[[token]], ba[[token]], conv, h, *weights)
                    write([token], out, gate)
                    conv_state[slots[n][t]] = conv.to(conv_state.dtype)
                    ssm_state[slots[n][t]] = h.to(ssm_state.dtype)

    return gdn_attention


def _import_xpu_ops():  # noqa: ANN202
    """``vllm._xpu_ops`` on the CPU: the two vllm-xpu-kernels modules it imports
    at the top, for kernels nothing here calls, are empty stand-ins."""
    import types

    for name, attr in (
        ("vllm_xpu_kernels.flash_attn_interface", "flash_attn_varlen_func"),
        ("vllm_xpu_kernels.rotary", "apply_rotary_emb"),
    ):
        sys.modules.setdefault("vllm_xpu_kernels", types.ModuleType("vllm_xpu_kernels"))
        module = sys.modules[name] = types.ModuleType(name)
        setattr(module, attr, None)
    import vllm._xpu_ops as xpu_ops

    return xpu_ops


def _on_tree(model_dir: Path, out: Path) -> None:  # noqa: C901 - one scenario
    import dataclasses
    from types import SimpleNamespace

    import torch
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn_layer
    from vllm.forward_context import override_forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from kit.geometry.geometry_model import Geometry

    xpu_ops = _import_xpu_ops()
    calls: list[dict] = []
    torch.ops._xpu_C.gdn_attention = _stand_in(calls)
    config = on_tree_config(model_dir, Geometry(BLOCK, GRID, NUM_SPEC, checkpoints="internal-grid"))
    planned_spec = MambaSpec(
        block_size=BLOCK,
        shapes=((QKV, CONV - 1), (V_HEADS, DIM, DIM)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
        # A speculative row's slot per draft token, as the layer's spec declares.
        num_speculative_blocks=NUM_SPEC,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=GRID,
        prefill_checkpoint_extra_exports=True,
    )
    stock_spec = dataclasses.replace(
        planned_spec,
        num_prefill_checkpoint_blocks=0,
        prefill_checkpoint_alignment=None,
        prefill_checkpoint_extra_exports=False,
    )
    gen = torch.Generator().manual_seed(34)
    layer = SimpleNamespace(
        prefix=PREFIX,
        num_k_heads=K_HEADS,
        num_v_heads=V_HEADS,
        head_k_dim=DIM,
        head_v_dim=DIM,
        tp_size=1,
        activation="silu",
        gqa_interleaved_layout=False,
        conv1d=SimpleNamespace(
            weight=(torch.randn(QKV, 1, CONV, generator=gen) * 0.5).bfloat16(),
            bias=(torch.randn(QKV, generator=gen) * 0.1).bfloat16(),
        ),
        A_log=torch.logspace(-2.3, -0.5, V_HEADS).log(),
        dt_bias=torch.randn(V_HEADS, generator=gen) * 0.1,
    )

    def build(rows, exports, drafts, table, spec):  # noqa: ANN001, ANN202
        common = batch_metadata(rows, exports, COLS)
        common.block_table_tensor = table
        resolve = gdn_layer._resolve_gdn_prefill_backend
        # The CPU resolves Triton; the builder asks the layer module which backend.
        gdn_layer._resolve_gdn_prefill_backend = lambda vllm_config: ("auto", "sycl")
        try:
            builder = GDNAttentionMetadataBuilder(spec, [PREFIX], config, torch.device("cpu"))
        finally:
            gdn_layer._resolve_gdn_prefill_backend = resolve
        return builder, builder.build(0, common, **draft_kwargs(drafts))

    def run(md, inputs, rows) -> tuple:  # noqa: ANN001
        """vLLM's op wrapper over ``rows`` (seq_len, query_len, _); each row's
        output and gate."""
        qkvz = torch.cat([x[s - q : s] for x, (s, q, _) in zip(inputs[0], rows, strict=True)])
        ba = torch.cat([x[s - q : s] for x, (s, q, _) in zip(inputs[1], rows, strict=True)])
        out = torch.zeros(qkvz.shape[0], V_HEADS, DIM, dtype=torch.bfloat16)
        z = torch.zeros_like(out)
        context = SimpleNamespace(no_compile_layers={PREFIX: layer}, attn_metadata={PREFIX: md})
        with override_forward_context(context), torch.no_grad():
            xpu_ops._gdn_attention_core_xpu_impl(out, z, qkvz, ba, PREFIX)
        split = [q for _, q, _ in rows]
        return list(out.split(split)), list(z.split(split))

    def state(slot: int) -> tuple:
        return layer.kv_cache[0][slot].clone(), layer.kv_cache[1][slot].clone()

    def scenario(name: str, mutant=None) -> dict:  # noqa: ANN001
        rows, exports, drafts = BATCHES[name]
        gen = torch.Generator().manual_seed(7)
        inputs = (
            [torch.randn(s, QKV + V_HEADS * DIM, generator=gen).bfloat16() for s, _, _ in rows],
            [torch.randn(s, 2 * V_HEADS, generator=gen).bfloat16() for s, _, _ in rows],
        )
        layer.kv_cache = [
            (torch.randn(NUM_SLOTS, *shape, generator=gen) * 0.1).to(dtype)
            for shape, dtype in zip(planned_spec.shapes, planned_spec.dtypes, strict=True)
        ]
        initial = [t.clone() for t in layer.kv_cache]
        table = block_table(rows, COLS)
        builder, md = build(rows, exports, drafts, table, planned_spec)
        plan = md.flashinfer_checkpoint_plan
        if mutant is not None:
            plan.pieces = mutant(plan.pieces)
        prefill_rows = [r for r, (_, _, p) in enumerate(rows) if p]
        slots = dict(zip(prefill_rows, md.prefill_state_indices.tolist(), strict=True))
        non_spec_rows = [r for r in range(len(rows)) if drafts is None or drafts[r] < 0]
        starts = md.non_spec_query_start_loc.tolist()
        if plan.exports is not None:
            written = export_rows(plan.export_query_starts, plan.exports, plan.rows)
        else:
            written = export_rows(
                md.non_spec_query_start_loc[: md.checkpoint.checkpoint_offsets.numel()],
                md.checkpoint,
                plan.rows,
            )
        written = [w for w in written if w["offset"] > 0]
        calls.clear()
        planned_outs = run(md, inputs, rows)
        planned_calls = list(calls)
        planned = {
            "exports": {
                (r, offset): state(block)
                for r, offset, block in exports_by_row(written, non_spec_rows, starts)
            },
            "finals": {r: state(slot) for r, slot in slots.items()},
        }
        # The split path on the same caches, as in test_cpu_fix_exports.py.
        layer.kv_cache = initial
        split_table = slot_table(table, slots)
        split_states = {}
        split_outs = {r: ([], []) for r in range(len(rows))}
        for step_rows, batch, ends in split_steps(rows, planned["exports"]):
            step_drafts = None if drafts is None else [drafts[r] for r in step_rows]
            _, step_md = build(batch, None, step_drafts, split_table[step_rows], stock_spec)
            assert step_md.flashinfer_checkpoint_plan is None
            step_inputs = tuple([x[r] for r in step_rows] for x in inputs)
            outs, gates = run(step_md, step_inputs, batch)
            for i, r in enumerate(step_rows):
                split_outs[r][0].append(outs[i])
                split_outs[r][1].append(gates[i])
            for r, end in ends.items():
                split_states[r, end] = state(slots[r])

        def same(a, b) -> bool:  # noqa: ANN001
            return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

        return {
            "backend": builder.gdn_prefill_backend,
            "pieces": plan.pieces is not None,
            "planned_calls": planned_calls,
            "exports": [
                {
                    "row": row,
                    "offset": offset,
                    "conv_bitwise": torch.equal(got[0], split_states[row, offset][0]),
                    "ssm_bitwise": torch.equal(got[1], split_states[row, offset][1]),
                }
                for (row, offset), got in planned["exports"].items()
            ],
            "finals_bitwise": {
                str(r): same(planned["finals"][r], split_states[r, rows[r][1]])
                for r in prefill_rows
            },
            "outputs_bitwise": {
                str(r): torch.equal(planned_outs[0][r], torch.cat(split_outs[r][0]))
                and torch.equal(planned_outs[1][r], torch.cat(split_outs[r][1]))
                for r in range(len(rows))
            },
        }

    def copied_last(pieces):  # noqa: ANN001, ANN202
        # Every export copied after the last round, when the slots hold the
        # rows' final states.
        bounds = pieces.export_bounds
        return dataclasses.replace(pieces, export_bounds=[0] * (len(bounds) - 1) + bounds[-1:])

    result = {name: scenario(name) for name in BATCHES}
    result["copied_last"] = scenario("decode_and_prefills", copied_last)
    (out / "xpu.json").write_text(json.dumps(result, indent=1))


@pytest.fixture(scope="module")
def xpu_run(release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("xpu-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out))
    return json.loads((out / "xpu.json").read_text())


@pytest.mark.parametrize("batch", BATCHES)
def test_every_export_final_and_output_is_the_split_paths(xpu_run, batch: str) -> None:  # noqa: ANN001
    """vLLM's builder resolving the SYCL backend plans pieces, and vLLM's op
    wrapper runs them in one call: every export's convolution window and
    recurrent state, every final state, and every row's output and gate (decodes
    and speculative decodes included) are the split path's bit for bit."""
    got = xpu_run[batch]
    assert (got["backend"], got["pieces"]) == ("sycl", True)
    assert got["exports"], "the batch exported nothing"
    for check in got["exports"]:
        assert check["conv_bitwise"] and check["ssm_bitwise"], check
    assert all(got["finals_bitwise"].values()), got["finals_bitwise"]
    assert all(got["outputs_bitwise"].values()), got["outputs_bitwise"]


def test_the_step_runs_its_decodes_then_one_call_per_round(xpu_run) -> None:  # noqa: ANN001
    """The planned step: the decode row as a batch of its own, then the pieces of
    ``test_hip_fix_exports.py``'s literal plan (COLD cut at 448, 500, 512, 576;
    RESUMED at 128, 196, 256; SHORT whole), one round per call, prefills only;
    with speculative decodes, those first, beside no prefill."""
    assert xpu_run["decode_and_prefills"]["planned_calls"] == [
        {"num_prefills": 0, "num_decodes": 1, "num_spec_decodes": 0, "tokens": 1},
        {"num_prefills": 3, "num_decodes": 0, "num_spec_decodes": 0, "tokens": 706},
        {"num_prefills": 2, "num_decodes": 0, "num_spec_decodes": 0, "tokens": 120},
        {"num_prefills": 2, "num_decodes": 0, "num_spec_decodes": 0, "tokens": 72},
        {"num_prefills": 2, "num_decodes": 0, "num_spec_decodes": 0, "tokens": 108},
        {"num_prefills": 1, "num_decodes": 0, "num_spec_decodes": 0, "tokens": 24},
    ]
    spec = xpu_run["spec_decodes_and_prefills"]["planned_calls"]
    assert spec[0] == {"num_prefills": 0, "num_decodes": 0, "num_spec_decodes": 2, "tokens": 904}
    assert all(call["num_spec_decodes"] == call["num_decodes"] == 0 for call in spec[1:])


def test_exports_copied_after_the_last_round_fail(xpu_run) -> None:  # noqa: ANN001
    """The op leaves a piece's state only in its row's slot: copied after the
    last round instead of its own, every export holds its row's final state (no
    export here ends a row), not the split path's, while the outputs stay right."""
    got = xpu_run["copied_last"]
    assert len(got["exports"]) == 7
    for check in got["exports"]:
        assert not (check["conv_bitwise"] or check["ssm_bitwise"]), check
    assert all(got["outputs_bitwise"].values())


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")
