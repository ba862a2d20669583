"""Internal checkpoints on vLLM 0.34.0's CPU GDN path (mod
``fix-eagle-fine-prefix-exports``), through vLLM's real CPU op and kernels.

vLLM's CPU GDN op (``cpu_gdn_attention_core``) prefills with a C++ chunk kernel
that keeps no state but the final one, so stock 0.34.0 ends a chunk at every
state the fix keeps (one engine step each). With the mod, the fix switched on,
EAGLE/MTP and Triton present (the x86 CPU platform requires triton-cpu), the
layer declares the Triton path's 64-token grid and the op runs a prefill with
exports in pieces that end at them (``_prefill_recurrence``,
``run_prefill_pieces``), the kernel calls the split path makes, in one step.

Everything runs on the release tree's patched stage in one subprocess, over
the compiled CPU kernels of the kit's pinned vLLM wheel (0.34.0's Python calls
the same ``torch.ops._C`` kernels; no CPU wheel of 0.34.0 exists). A batch with
a decode row, vLLM's prompt checkpoint and the fix's extras runs twice through
vLLM's op on a GDN layer's state, with its metadata from vLLM's
``GDNAttentionMetadataBuilder``: once as planned (one step), once as the split
path runs it (stock metadata, chunks ending at every export, engine step by
engine step). Every exported conv window and recurrent state, every final
state and every output token must be the split path's bit for bit, also in a
batch whose prefills share the step with speculative decodes (the op's other
prefill route). The exporter is vLLM's Triton kernel, which needs triton-cpu
here; a torch stand-in with its contract writes the blocks
(``test_flashinfer_fix_exports.py`` runs vLLM's kernel on the same layout under
Triton's interpreter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods.release_side import batch_metadata, block_table, on_tree_config, run_on_tree
from tests.mods.test_hip_fix_exports import BLOCK, COLD, EXPORTS, GRID, RESUMED, ROWS

pytestmark = pytest.mark.cpu

K_HEADS, V_HEADS, HEAD_DIM = 1, 2, 64  # the CPU chunk kernel takes head_dim 64 or 128
WIDTH = 4  # conv kernel
NUM_SPEC = 1
NUM_SLOTS = 1100  # the export blocks are 1001-1013
COLS = 8
PREFIX = "model.layers.0.linear_attn"
# Speculative decode rows first, then the prefills (the op's subset route).
SPEC_ROWS = [(400, 2, False), (300, 2, False), COLD, RESUMED]
SPEC_EXPORTS = {2: EXPORTS[1], 3: EXPORTS[2]}
BATCHES = {
    "decode_and_prefills": (ROWS, EXPORTS, None),
    "spec_decodes_and_prefills": (SPEC_ROWS, SPEC_EXPORTS, [1, 1, -1, -1]),
}


def compiled_ops() -> Path:
    """The pinned wheel's CPU kernel library, chosen as its platform chooses it."""
    import torch
    import vllm

    if not torch.cpu._is_avx512_supported():
        name = "_C_AVX2.abi3.so"
    elif torch.cpu._is_avx512_bf16_supported():
        name = "_C.abi3.so"
    else:
        name = "_C_AVX512.abi3.so"
    return Path(vllm.__file__).parent / name


def _on_tree(model_dir: Path, out: Path, library: str) -> None:  # noqa: C901 - one scenario
    import torch

    torch.ops.load_library(library)
    from types import SimpleNamespace

    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn_layer
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_cpu
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
    from vllm.v1.kv_cache_interface import MambaSpec

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, GRID, NUM_SPEC, checkpoints="internal-grid"))
    result: dict = {}
    config.cache_config.enable_mamba_eagle_predecessor_checkpoint = True
    # The layer module read HAS_TRITON on import (Triton cannot load a CPU
    # backend here): the gate with and without it.
    result["gate"] = {}
    for name, has_triton in (("triton", True), ("no_triton", False)):
        gdn_layer.HAS_TRITON = has_triton
        result["gate"][name] = gdn_layer.fix_exports_in_pass(config)
    conv_shape, ssm_shape = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, K_HEADS, V_HEADS, HEAD_DIM, HEAD_DIM, WIDTH, NUM_SPEC
    )

    def spec(ssm_dtype, planned: bool) -> MambaSpec:  # noqa: ANN001
        """The layer's spec: as the patched layer declares it, or stock's."""
        grid = {}
        if planned:
            grid = dict(
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=GRID,
                prefill_checkpoint_extra_exports=True,
            )
        return MambaSpec(
            block_size=BLOCK,
            shapes=(conv_shape, ssm_shape),
            dtypes=(torch.bfloat16, ssm_dtype),
            mamba_type="gdn_attention",
            mamba_cache_mode="align",
            num_speculative_blocks=NUM_SPEC,
            **grid,
        )

    class Exporter:
        """``MambaPrefillCheckpointExporter``'s contract in torch: per checkpoint
        row, the conv window ending at its offset and its recurrent state row."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def export(
            self,
            checkpoint,
            *,
            raw_qkv,
            conv_state,
            cu_seqlens,
            recurrent_checkpoint,  # noqa: ANN001
            recurrent_state,
            recurrent_rows,
            token_indices=None,
        ) -> None:  # noqa: ANN001
            assert token_indices is None
            history = WIDTH - 1
            for i, (offset, block, start, row) in enumerate(
                zip(
                    checkpoint.checkpoint_offsets.tolist(),
                    checkpoint.state_indices.tolist(),
                    cu_seqlens.tolist(),
                    recurrent_rows.tolist(),
                    strict=True,
                )
            ):
                if block == NULL_BLOCK_ID or offset <= 0:
                    continue
                end = start + offset
                conv_state[block, :, :history] = raw_qkv[end - history : end].T
                recurrent_state[block].view(-1).copy_(recurrent_checkpoint[row].reshape(-1))
                self.rows.append({"export": i, "start": start, "offset": offset, "block": block})

    class Layer:
        """What the op reads from the GDN layer, with the layer's own methods."""

        rearrange_mixed_qkv = gdn_layer.QwenGatedDeltaNetAttention.rearrange_mixed_qkv
        _export_checkpoints = gdn_layer.QwenGatedDeltaNetAttention._export_checkpoints

        def __init__(self, ssm_dtype) -> None:  # noqa: ANN001
            gen = torch.Generator().manual_seed(34)
            self.prefix, self.tp_size = PREFIX, 1
            self.head_k_dim = self.head_v_dim = HEAD_DIM
            self.key_dim, self.value_dim = HEAD_DIM * K_HEADS, HEAD_DIM * V_HEADS
            self.conv_dim = 2 * self.key_dim + self.value_dim
            self.activation = "silu"
            self.conv1d = torch.nn.Module()
            weight = (torch.randn(self.conv_dim, 1, WIDTH, generator=gen) * 0.5).bfloat16()
            self.conv1d.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.conv1d.bias = None
            # As the loader does: pack the conv weight where the C++ conv runs.
            dispatch_cpu_unquantized_gemm(self.conv1d, remove_weight=False)
            self.A_log = torch.randn(V_HEADS, generator=gen)
            self.dt_bias = torch.randn(V_HEADS, generator=gen).bfloat16()
            self.kv_cache = [
                torch.randn(NUM_SLOTS, *conv_shape, generator=gen).bfloat16(),
                torch.randn(NUM_SLOTS, *ssm_shape, generator=gen).to(ssm_dtype),
            ]
            self._checkpoint_exporter = Exporter()

        def clone(self) -> Layer:
            twin = object.__new__(Layer)
            twin.__dict__.update(self.__dict__)
            twin.kv_cache = [t.clone() for t in self.kv_cache]
            twin._checkpoint_exporter = Exporter()
            return twin

        def state(self, slot: int) -> tuple:
            """The slot's conv history (the columns a resume reads) and recurrent state."""
            conv = gdn_cpu._conv_buffer_view(self)[slot, :, : WIDTH - 1]
            return conv.clone(), self.kv_cache[1][slot].clone()

    def build(rows, exports, drafts, table, ssm_dtype, planned):  # noqa: ANN001, ANN202
        common = batch_metadata(rows, exports, COLS)
        common.block_table_tensor = table
        builder = GDNAttentionMetadataBuilder(
            spec(ssm_dtype, planned), [PREFIX], config, torch.device("cpu")
        )
        kwargs = {}
        if drafts is not None:
            kwargs = {
                "num_accepted_tokens": torch.ones(len(rows), dtype=torch.int32),
                "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32),
            }
        return builder, builder.build(0, common, **kwargs)

    def run(layer, md, feats, rows) -> list:  # noqa: ANN001
        """One call of vLLM's op over ``rows`` (seq_len, query_len, _); each row's output."""
        parts = {
            name: torch.cat([f[name][s - q : s] for f, (s, q, _) in zip(feats, rows, strict=True)])
            for name in ("qkv", "a", "b")
        }
        out = torch.zeros(parts["qkv"].shape[0], V_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        context = SimpleNamespace(no_compile_layers={PREFIX: layer}, attn_metadata={PREFIX: md})
        with override_forward_context(context):
            gdn_cpu.cpu_gdn_attention_core(parts["qkv"], parts["b"], parts["a"], out, PREFIX)
        return list(out.split([q for _, q, _ in rows]))

    def running_slot(md, row: int, rows) -> int:  # noqa: ANN001
        """The slot vLLM's metadata gives prefill ``row``'s running state."""
        prefill_rows = [r for r, (_, q, p) in enumerate(rows) if p]
        return int(md.prefill_state_indices[prefill_rows.index(row)])

    def scenario(name: str, ssm_dtype, pieces_mutant=None) -> dict:  # noqa: ANN001
        rows, exports, drafts = BATCHES[name]
        gen = torch.Generator().manual_seed(7)
        layer = Layer(ssm_dtype)
        feats = [
            {
                "qkv": torch.randn(s, layer.conv_dim, generator=gen).bfloat16(),
                "a": torch.randn(s, V_HEADS, generator=gen).bfloat16(),
                "b": torch.randn(s, V_HEADS, generator=gen).bfloat16(),
            }
            for s, _, _ in rows
        ]
        table = block_table(rows, COLS)
        builder, md = build(rows, exports, drafts, table, ssm_dtype, planned=True)
        plan = md.flashinfer_checkpoint_plan
        if pieces_mutant is not None:
            plan.pieces = pieces_mutant(plan.pieces)
        prefill_rows = [r for r, (_, _, p) in enumerate(rows) if p]
        slots = {r: running_slot(md, r, rows) for r in prefill_rows}
        split = layer.clone()
        internal_outs = run(layer, md, feats, rows)
        written = layer._checkpoint_exporter.rows
        # The split path: stock metadata; each prefill row's chunks end at its
        # exports, engine step by engine step. Its running state stays in the
        # slot the planned step started from (every column of its table names
        # it), so each chunk end's state is that slot after the step.
        non_spec_rows = [r for r in range(len(rows)) if drafts is None or drafts[r] < 0]
        starts = md.non_spec_query_start_loc.tolist()
        cuts = {r: {rows[r][1]} for r in prefill_rows}
        for w in written:
            row = non_spec_rows[starts.index(w["start"])]
            cuts[row].add(w["offset"])
        split_table = table.clone()
        for r, slot in slots.items():
            split_table[r] = slot
        done = {r: 0 for r in prefill_rows}
        split_states, split_outs = {}, {r: [] for r in prefill_rows}
        step_rows = list(range(len(rows)))
        while step_rows:
            batch = []
            for r in step_rows:
                seq, query, prefilling = rows[r]
                if not prefilling:
                    batch.append(rows[r])
                    continue
                end = min(c for c in cuts[r] if c > done[r])
                batch.append((seq - query + end, end - done[r], True))
            step_drafts = None if drafts is None else [drafts[r] for r in step_rows]
            _, step_md = build(batch, None, step_drafts, split_table[step_rows], ssm_dtype, False)
            assert step_md.flashinfer_checkpoint_plan is None
            outs = run(split, step_md, [feats[r] for r in step_rows], batch)
            for r, (_, query, _), o in zip(step_rows, batch, outs, strict=True):
                if r in done:
                    done[r] += query
                    split_outs[r].append(o)
                    split_states[r, done[r]] = split.state(slots[r])
            step_rows = [r for r in prefill_rows if done[r] < rows[r][1]]
        checks = []
        for w in written:
            row = non_spec_rows[starts.index(w["start"])]
            conv, ssm = layer.state(w["block"])
            want_conv, want_ssm = split_states[row, w["offset"]]
            checks.append(
                {
                    "row": row,
                    "offset": w["offset"],
                    "block": w["block"],
                    "conv_bitwise": bool(torch.equal(conv, want_conv)),
                    "ssm_bitwise": bool(torch.equal(ssm, want_ssm)),
                }
            )
        return {
            "backend": builder.gdn_prefill_backend,
            "pieces": plan.pieces is not None,
            "exports": checks,
            "finals_bitwise": {
                str(r): [
                    bool(torch.equal(a, b))
                    for a, b in zip(layer.state(slots[r]), split_states[r, rows[r][1]], strict=True)
                ]
                for r in prefill_rows
            },
            "outputs_bitwise": {
                str(r): bool(torch.equal(internal_outs[r], torch.cat(split_outs[r])))
                for r in prefill_rows
            },
        }

    import dataclasses

    def unchained(pieces):  # noqa: ANN001, ANN202
        return dataclasses.replace(pieces, sources=pieces.sources.clamp(max=-1))

    result["batches"] = {
        f"{name}/{str(dtype).removeprefix('torch.')}": scenario(name, dtype)
        for name in BATCHES
        for dtype in (torch.float32, torch.bfloat16)
    }
    result["unchained"] = scenario("decode_and_prefills", torch.float32, unchained)
    (out / "cpu.json").write_text(json.dumps(result, indent=1))


@pytest.fixture(scope="module")
def cpu_run(release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("cpu-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out), str(compiled_ops()))
    return json.loads((out / "cpu.json").read_text())


def test_the_cpu_takes_the_fix_in_the_pass_only_with_triton(cpu_run) -> None:  # noqa: ANN001
    """The gate: on the CPU with the fix and MTP, in the pass where Triton runs
    the exporter; without Triton (a CPU that takes no draft tokens) not."""
    assert cpu_run["gate"] == {"triton": True, "no_triton": False}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_export_final_and_output_is_the_split_paths(cpu_run, batch: str, dtype: str) -> None:  # noqa: ANN001
    """vLLM's CPU op on the planned batch (pieces, one step) against the same op
    on the split path's steps: each export's conv window and recurrent state, each
    prefill row's final state and output, bit for bit."""
    got = cpu_run["batches"][f"{batch}/{dtype}"]
    assert (got["backend"], got["pieces"]) == ("triton", True)
    # vLLM's prompt checkpoint (COLD at 576) and the six extras.
    assert sorted((c["offset"], c["block"]) for c in got["exports"]) == sorted(
        [(576, 100 * (1 if batch.startswith("decode") else 2) + 2)]
        + [(p - s + q, b) for (s, q, _), row in ((COLD, 1), (RESUMED, 2)) for p, b in EXPORTS[row]]
    )
    for check in got["exports"]:
        assert check["conv_bitwise"] and check["ssm_bitwise"], check
    assert all(all(pair) for pair in got["finals_bitwise"].values()), got["finals_bitwise"]
    assert all(got["outputs_bitwise"].values()), got["outputs_bitwise"]


def test_pieces_not_chained_fail(cpu_run) -> None:  # noqa: ANN001
    """Pieces that start from the row's initial state instead of their
    predecessor's: only the first piece's export still agrees."""
    got = cpu_run["unchained"]
    same = {(c["row"], c["offset"]) for c in got["exports"] if c["ssm_bitwise"]}
    assert same == {(1, 448), (2, 128)}
    assert not all(got["outputs_bitwise"].values())


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR LIBRARY")
