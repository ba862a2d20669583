"""Internal checkpoints on vLLM 0.34.0's CPU GDN path (mod
``fix-eagle-fine-prefix-exports``), through vLLM's real layer, op and kernels.

vLLM's CPU GDN op (``cpu_gdn_attention_core``) prefills with a C++ chunk kernel
that keeps no state but the final one, so stock 0.34.0 ends a chunk at every
state the fix keeps (one engine step each). With the mod, the fix switched on,
EAGLE/MTP and Triton present (the x86 CPU platform requires triton-cpu), the
layer declares the Triton path's 64-token grid and the op runs a prefill with
exports in pieces that end at them (``_prefill_recurrence``,
``run_prefill_pieces``), the kernel calls the split path makes, in one step.

Everything runs on the release tree's patched stage in one subprocess, over
the compiled CPU kernels of the kit's pinned vLLM wheel (0.34.0's Python calls
the same ``torch.ops._C`` kernels; no CPU wheel of 0.34.0 exists). vLLM's
``QwenGatedDeltaNetAttention``, built for the tiny model on the CPU with seeded
weights, declares its grid only for the fix with Triton; its forward runs a
batch with a decode row, vLLM's prompt checkpoint and the fix's extras twice,
its metadata from vLLM's ``GDNAttentionMetadataBuilder``: once as planned (one
step), once as the split path runs it on the same caches (stock metadata,
chunks ending at every export, engine step by engine step). Every exported conv
window and recurrent state, every final state and every output token must be
the split path's bit for bit, also in a batch whose prefills share the step
with speculative decodes (the op's other prefill route). The exporter is
vLLM's Triton kernel, which needs triton-cpu; here a torch stand-in with its
contract writes the blocks (``test_flashinfer_fix_exports.py`` runs vLLM's
kernel on the same layout under Triton's interpreter).
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
    exports_by_row,
    on_tree_config,
    run_on_tree,
    slot_table,
    split_steps,
)
from tests.mods.test_hip_fix_exports import BLOCK, COLD, EXPORTS, GRID, RESUMED, ROWS

pytestmark = pytest.mark.cpu

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
    # Without the fix's extras the step still runs in pieces: vLLM's own prompt
    # checkpoint is in the pass on the grid (the exporter's rows are vLLM's).
    "prompt_checkpoint_only": (ROWS, None, None),
}


def compiled_ops() -> Path:
    """The pinned wheel's CPU kernel library: the one its own platform loads
    (``CpuPlatform.import_kernels`` picks it by the CPU's instruction sets), read
    back from the libraries this process has mapped."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    mapped = _mapped_compiled_ops()
    assert len(mapped) == 1, mapped
    return mapped.pop()


def _mapped_compiled_ops() -> set[Path]:
    """The vLLM CPU kernel libraries this process has loaded."""
    return {
        Path(line.split()[-1])
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(".so") and "/vllm/_C" in line
    }


def _layer(gdn_layer, config, seed: int, prefix: str = PREFIX):  # noqa: ANN001, ANN202
    """vLLM's Qwen3-Next GDN layer for the tiny model's config, built as the loader
    builds it (bfloat16) with seeded weights, then processed as after loading (the
    CPU packs the conv weight where its C++ conv runs)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        layer = gdn_layer.QwenGatedDeltaNetAttention(
            config.model_config.hf_text_config,
            vllm_config=config,
            prefix=prefix,
            gqa_interleaved_layout=True,
        )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        # Decay rates from 0.5 % to 30 % per token over the heads: a state
        # remembers hundreds of tokens in some heads, as a trained model's does
        # (seeded weights alone forget within a few dozen).
        rates = torch.logspace(-2.3, -0.5, layer.A_log.numel())
        layer.A_log.copy_(rates.log().to(layer.A_log.dtype))
    for module in layer.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return layer


def _on_tree(model_dir: Path, out: Path, library: str) -> None:  # noqa: C901 - one scenario
    import torch

    # The layer module before HAS_TRITON is set: with it, its Triton imports fail here.
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn_layer  # noqa: I001

    # The release's trees carry the pinned wheel's compiled ops where a mod asks for
    # them (mods/cpu-triton-interpreter: the same file), and importing the layer has
    # then loaded them already: a second registration of the _C namespace aborts.
    if not _mapped_compiled_ops():
        torch.ops.load_library(library)
    import itertools
    from dataclasses import replace
    from types import SimpleNamespace

    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_cpu
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.forward_context import override_forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, GRID, NUM_SPEC, checkpoints="internal-grid"))
    config.model_config.dtype = torch.bfloat16  # the CPU GDN kernels' only dtype
    with set_current_vllm_config(config):
        # One rank: the layer's linear layers ask for their tensor-parallel group.
        init_distributed_environment(1, 0, f"file://{out / 'rendezvous'}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    result: dict = {}

    # Who takes the grid: the layer's own condition, as the CPU resolves its
    # backend ("triton"), and as a GPU platform resolves another (HIP on ROCm,
    # CuteDSL on CUDA, AITER FlyDSL on ROCm, Triton or the fused SYCL op on XPU).
    probes = itertools.count(1)

    def alignment(
        fix: bool, has_triton: bool, backend: str | None = None, platform_is: str = "cuda_alike"
    ) -> int | None:
        config.cache_config.enable_mamba_eagle_predecessor_checkpoint = fix
        gdn_layer.HAS_TRITON = has_triton
        resolve, platform = gdn_layer._resolve_gdn_prefill_backend, gdn_layer.current_platform
        if backend:
            gdn_layer._resolve_gdn_prefill_backend = lambda vllm_config: ("auto", backend)
            setattr(platform, f"is_{platform_is}", lambda: True)
        try:
            # Each layer registers under its own name (one layer index each).
            probe = f"model.layers.{next(probes)}.linear_attn"
            return _layer(gdn_layer, config, 0, probe)._checkpoint_alignment
        finally:
            # Out of the model's layers again: vLLM takes in-pass checkpoints only
            # where every Mamba layer declares them.
            del config.compilation_config.static_forward_context[probe]
            gdn_layer._resolve_gdn_prefill_backend = resolve
            if backend:
                delattr(platform, f"is_{platform_is}")

    result["alignment"] = {
        "cpu": alignment(True, True),
        "cpu, fix off": alignment(False, True),
        "cpu without triton": alignment(True, False),
        "hip": alignment(True, True, "hip"),
        "hip, fix off": alignment(False, True, "hip"),
        "cutedsl": alignment(True, True, "cutedsl"),
        "aiter_flydsl": alignment(True, True, "aiter_flydsl"),
        "aiter_flydsl, fix off": alignment(False, True, "aiter_flydsl"),
        # Without the CPU's own clause (HAS_TRITON off), XPU's alone decides.
        "xpu triton": alignment(True, False, "triton", "xpu"),
        "xpu sycl": alignment(True, False, "sycl", "xpu"),
        "xpu sycl, fix off": alignment(False, False, "sycl", "xpu"),
    }
    config.cache_config.enable_mamba_eagle_predecessor_checkpoint = True
    gdn_layer.HAS_TRITON = True
    layer = _layer(gdn_layer, config, 34)
    planned_spec = layer.get_kv_cache_spec(config)
    stock_spec = replace(
        planned_spec,
        num_prefill_checkpoint_blocks=0,
        prefill_checkpoint_alignment=None,
        prefill_checkpoint_extra_exports=False,
    )
    result["spec"] = {
        "alignment": planned_spec.prefill_checkpoint_alignment,
        "extra_exports": planned_spec.prefill_checkpoint_extra_exports,
        "ssm_dtype": str(planned_spec.dtypes[1]),
    }
    hidden = config.model_config.hf_text_config.hidden_size

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
            recurrent_checkpoint,
            recurrent_state,
            recurrent_rows,
            token_indices=None,
        ) -> None:  # noqa: ANN001 - tensors, on the tree
            assert token_indices is None
            history = layer.conv_kernel_size - 1
            for offset, block, start, row in zip(
                checkpoint.checkpoint_offsets.tolist(),
                checkpoint.state_indices.tolist(),
                # The kernel reads each row's start: cu_seqlens may go on past them.
                cu_seqlens.tolist()[: checkpoint.checkpoint_offsets.numel()],
                recurrent_rows.tolist(),
                strict=True,
            ):
                if block == NULL_BLOCK_ID or offset <= 0:
                    continue
                end = start + offset
                conv_state[block, :, :history] = raw_qkv[end - history : end].T
                recurrent_state[block].view(-1).copy_(recurrent_checkpoint[row].reshape(-1))
                self.rows.append({"start": start, "offset": offset, "block": block})

    def state(slot: int) -> tuple:
        """A slot's conv history (the columns a resume reads) and recurrent state."""
        conv = gdn_cpu._conv_buffer_view(layer)[slot, :, : layer.conv_kernel_size - 1]
        return conv.clone(), layer.kv_cache[1][slot].clone()

    def build(rows, exports, drafts, table, spec):  # noqa: ANN001, ANN202
        common = batch_metadata(rows, exports, COLS)
        common.block_table_tensor = table
        builder = GDNAttentionMetadataBuilder(spec, [PREFIX], config, torch.device("cpu"))
        return builder, builder.build(0, common, **draft_kwargs(drafts))

    def run(md, feats, rows) -> list:  # noqa: ANN001
        """The layer's forward over ``rows`` (seq_len, query_len, _); each row's output."""
        h = torch.cat([f[s - q : s] for f, (s, q, _) in zip(feats, rows, strict=True)])
        context = SimpleNamespace(no_compile_layers={PREFIX: layer}, attn_metadata={PREFIX: md})
        with override_forward_context(context), torch.no_grad():
            out = layer(h)
        return list(out.split([q for _, q, _ in rows]))

    def scenario(name: str, pieces_mutant=None) -> dict:  # noqa: ANN001
        rows, exports, drafts = BATCHES[name]
        gen = torch.Generator().manual_seed(7)
        feats = [torch.randn(s, hidden, generator=gen).bfloat16() for s, _, _ in rows]
        layer.kv_cache = [
            torch.randn(NUM_SLOTS, *shape, generator=gen).to(dtype)
            for shape, dtype in zip(planned_spec.shapes, planned_spec.dtypes, strict=True)
        ]
        initial = [t.clone() for t in layer.kv_cache]
        table = block_table(rows, COLS)
        builder, md = build(rows, exports, drafts, table, planned_spec)
        plan = md.flashinfer_checkpoint_plan
        if pieces_mutant is not None:
            plan.pieces = pieces_mutant(plan.pieces)
        prefill_rows = [r for r, (_, _, p) in enumerate(rows) if p]
        slots = dict(zip(prefill_rows, md.prefill_state_indices.tolist(), strict=True))
        layer._checkpoint_exporter = Exporter()
        planned_outs = run(md, feats, rows)
        written = layer._checkpoint_exporter.rows
        non_spec_rows = [r for r in range(len(rows)) if drafts is None or drafts[r] < 0]
        starts = md.non_spec_query_start_loc.tolist()
        planned = {
            "exports": {
                (r, offset): state(block)
                for r, offset, block in exports_by_row(written, non_spec_rows, starts)
            },
            "finals": {r: state(slot) for r, slot in slots.items()},
        }
        # The split path on the same caches as before the step: stock metadata,
        # each prefill row's chunks ending at its exports, engine step by engine
        # step, its running state in the slot the planned step used.
        layer.kv_cache = initial
        split_table = slot_table(table, slots)
        split_states, split_outs = {}, {r: [] for r in prefill_rows}
        for step_rows, batch, ends in split_steps(rows, planned["exports"]):
            step_drafts = None if drafts is None else [drafts[r] for r in step_rows]
            _, step_md = build(batch, None, step_drafts, split_table[step_rows], stock_spec)
            assert step_md.flashinfer_checkpoint_plan is None
            outs = run(step_md, [feats[r] for r in step_rows], batch)
            for r, o in zip(step_rows, outs, strict=True):
                if r in ends:
                    split_outs[r].append(o)
                    split_states[r, ends[r]] = state(slots[r])

        def same(a, b) -> bool:  # noqa: ANN001
            return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

        return {
            "backend": builder.gdn_prefill_backend,
            "pieces": plan.pieces is not None,
            "exports": [
                {
                    "row": row,
                    "offset": offset,
                    "block": w["block"],
                    "conv_bitwise": torch.equal(got[0], split_states[row, offset][0]),
                    "ssm_bitwise": torch.equal(got[1], split_states[row, offset][1]),
                }
                for ((row, offset), got), w in zip(planned["exports"].items(), written, strict=True)
            ],
            "finals_bitwise": {
                str(r): same(planned["finals"][r], split_states[r, rows[r][1]])
                for r in prefill_rows
            },
            "outputs_bitwise": {
                str(r): torch.equal(planned_outs[r], torch.cat(split_outs[r])) for r in prefill_rows
            },
        }

    def unchained(pieces):  # noqa: ANN001, ANN202
        return replace(pieces, sources=pieces.sources.clamp(max=-1))

    result["batches"] = {name: scenario(name) for name in BATCHES}
    result["unchained"] = scenario("decode_and_prefills", unchained)
    # vLLM's C++ causal conv: with speculation the op takes it only on AMX (or Arm
    # BF16) CPUs; it runs on any AVX-512 BF16 one, so the same batches once more
    # through it, where this CPU can.
    result["native_conv"] = None
    if torch.cpu._is_avx512_bf16_supported():
        calls = []
        conv = gdn_cpu._causal_conv1d_fwd_cpu
        gdn_cpu._causal_conv1d_fwd_cpu = lambda **kw: calls.append(1) or conv(**kw)
        torch.cpu._is_amx_tile_supported = lambda: True
        result["native_conv"] = {name: scenario(name) for name in BATCHES}
        result["native_conv_calls"] = len(calls)
    (out / "cpu.json").write_text(json.dumps(result, indent=1))


@pytest.fixture(scope="module")
def cpu_run(release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("cpu-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out), str(compiled_ops()))
    return json.loads((out / "cpu.json").read_text())


def test_the_layer_takes_the_grid_only_for_the_fix_where_it_can_export(cpu_run) -> None:  # noqa: ANN001
    """vLLM's layer, built on the CPU: the 64-token grid (and the fix's extra exports
    in its spec) with the fix switched on and MTP, where Triton runs the exporter;
    not with the fix off, nor on a CPU without Triton (which takes no draft
    tokens). The same condition names HIP's, CuteDSL's and AITER FlyDSL's
    backends and XPU's two routes, Triton and the fused SYCL op."""
    assert cpu_run["alignment"] == {
        "cpu": GRID,
        "cpu, fix off": None,
        "cpu without triton": None,
        "hip": GRID,
        "hip, fix off": None,
        "cutedsl": GRID,
        "aiter_flydsl": GRID,
        "aiter_flydsl, fix off": None,
        "xpu triton": GRID,
        "xpu sycl": GRID,
        "xpu sycl, fix off": None,
    }
    assert cpu_run["spec"] == {
        "alignment": GRID,
        "extra_exports": True,
        "ssm_dtype": "torch.float32",
    }


@pytest.mark.parametrize("conv", ["torch", "c++"])
@pytest.mark.parametrize("batch", BATCHES)
def test_every_export_final_and_output_is_the_split_paths(cpu_run, batch: str, conv: str) -> None:  # noqa: ANN001
    """vLLM's layer on the CPU, the planned batch (pieces, one step) against the
    split path's steps on the same caches: each export's conv window and recurrent
    state, each prefill row's final state and the layer's output, bit for bit;
    through vLLM's torch conv and its C++ one."""
    if conv == "c++":
        if cpu_run["native_conv"] is None:
            pytest.skip("vLLM's C++ conv needs AVX-512 BF16, which this CPU lacks")
        assert cpu_run["native_conv_calls"] > 0
        got = cpu_run["native_conv"][batch]
    else:
        got = cpu_run["batches"][batch]
    assert (got["backend"], got["pieces"]) == ("triton", True)
    # vLLM's prompt checkpoint (COLD at 576, in the block below its last: column 1
    # of COLD's row) and the six extras, each in its own block.
    rows, exports, _ = BATCHES[batch]
    extras = {} if exports is None else EXPORTS
    want = [(576, 100 * rows.index(COLD) + 2)]
    want += [
        (p - s + q, b)
        for (s, q, _), row in ((COLD, 1), (RESUMED, 2))
        for p, b in extras.get(row, [])
    ]
    assert sorted((c["offset"], c["block"]) for c in got["exports"]) == sorted(want)
    for check in got["exports"]:
        assert check["conv_bitwise"] and check["ssm_bitwise"], check
    assert all(got["finals_bitwise"].values()), got["finals_bitwise"]
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
