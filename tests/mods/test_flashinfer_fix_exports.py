"""The worker side of the fix's extra Mamba exports on vLLM 0.34.0's FlashInfer GDN
path (mod ``fix-eagle-fine-prefix-exports``), checked on the CPU.

The fix wants more states per prefill row than the prompt checkpoint, each into a
block of its own, from the one forward pass. Everything runs on the release
tree's patched stage, in a subprocess (this file as a script, ``on-tree``): vLLM's
own ``MambaPrefillCheckpointBuilder``, ``GDNAttentionMetadataBuilder`` with
FlashInfer's branch forced (only Hopper and Blackwell GPUs select it; its plan is
host code), and the V2 runner's metadata and report helpers. FlashInfer's
prefill kernel is stood in for by a reference that honours its contract (each
sequence's running state after every N tokens, at ``cu_starts[i] + j``) over a
small sequential GDN-like recurrence, ``S = decay * S + v k^T`` per token. Where
.venv-triton can be had, vLLM's ``MambaPrefillCheckpointExporter`` and its
``store_cache_checkpoints_kernel``, taken from the tree's file, write the blocks
under Triton's interpreter.

Not run here: the layer itself (``_forward_flashinfer_prefill`` calls FlashInfer)
and the V2 runner's ``execute_model``/``sample_tokens`` (a GPU model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods import release_side
from tests.mods.release_side import batch_metadata, on_tree_config, run_interpreted, run_on_tree

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 256  # Mamba block (align mode)
GRID = 64  # FlashInfer's 64-token chunk, the layer's checkpoint grid here
UNIT = GRID  # hash_block_size here: an extra export lies at least this far into its chunk
STATE_LEN = 3  # conv window kept per state (kernel size 4)
WIDTH, HEADS, V_DIM, K_DIM = 5, 2, 3, 4
COLS = 8  # block-table columns

# Rows of the batches: (seq_len, query_len, prefilling). Block IDs 1000+ are the
# extra exports' own blocks; a row's block-table column c holds 100 * row + c + 1.
COLD = (600, 600, True)  # prompt checkpoint at 576, extras at 512, 448 and 500
RESUMED = (1000, 300, True)  # query starts at 700 (off the hash grid): extras only
SHORT = (200, 200, True)  # nothing to export
TAIL = (832, 320, True)  # prompt checkpoint at 768; every export offered is dropped
DECODE = (500, 1, False)
COLD_EXPORTS = [(512, 1001), (448, 1002), (500, 1003), (600, 1004), (0, 1005)]
# 896 is on the absolute 64-token grid, not on the chunk's (700 + 196): a tail.
RESUMED_EXPORTS = [(828, 1011), (956, 1012), (896, 1013)]
# 540 is less than a hash unit into the chunk; 0 is NULL_BLOCK_ID.
TAIL_EXPORTS = [(832, 1031), (512, 1032), (400, 1033), (768, 0), (540, 1034)]
# vLLM's own prompt checkpoints, floor((N - 1) / 64) * 64 where valid.
PROMPT_CHECKPOINTS = {COLD: 576, TAIL: 768}
ROWS = [COLD, RESUMED, SHORT, TAIL]
EXPORTS = {0: COLD_EXPORTS, 1: RESUMED_EXPORTS, 3: TAIL_EXPORTS}
# The same behind a decode row.
SHIFTED = {row + 1: pairs for row, pairs in EXPORTS.items()}


# --------------------------------------------------------------------------
# The release tree's side (``python this_file on-tree MODEL OUT``)
# --------------------------------------------------------------------------


def _on_tree(model_dir: Path, out: Path) -> None:
    from dataclasses import replace

    # All imported before the flag below, which the layer's Triton warm-up
    # helpers do not survive.
    import torch
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointBuilder
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import run_flashinfer_tails
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionBackend,
        GDNAttentionMetadataBuilder,
        GDNFlashInferTails,
        plan_flashinfer_exports,
    )
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, mamba_get_block_table_tensor
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.worker.gpu.attn_utils import (
        build_attn_metadata,
        mamba_checkpoint_exports_written,
    )
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import (
        MambaHybridAttnMetadata,
        _exports_by_group_and_row,
    )
    from vllm.v1.worker.gpu.ubatch_utils import _slice_input_batch
    from vllm.v1.worker.ubatch_utils import UBatchSlice
    from vllm.v1.worker.utils import AttentionGroup

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, GRID, 1, checkpoints="internal-grid"))
    cpu = torch.device("cpu")
    results: dict = {"null_block": NULL_BLOCK_ID}

    def spec(extra: bool = True) -> MambaSpec:
        return MambaSpec(
            block_size=BLOCK,
            shapes=((WIDTH, STATE_LEN), (HEADS, V_DIM, K_DIM)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=GRID,
            prefill_checkpoint_extra_exports=extra,
        )

    def block_table(rows: list) -> torch.Tensor:
        return release_side.block_table(rows, COLS)

    def common(rows: list, exports: dict | None) -> CommonAttentionMetadata:
        return batch_metadata(rows, exports, COLS)

    def gdn_builder(extra: bool = True) -> GDNAttentionMetadataBuilder:
        builder = GDNAttentionMetadataBuilder(spec(extra), ["layer"], config, cpu)
        # Selected on Hopper/Blackwell only; the plan itself is host code.
        builder.gdn_prefill_backend = "flashinfer"
        builder.plan_flashinfer_checkpoints = True
        return builder

    # (a) MambaPrefillCheckpointBuilder: which extra exports it keeps.
    def checkpoint_of(rows: list, exports: dict | None, extra: bool = True) -> dict | None:
        meta = MambaPrefillCheckpointBuilder(config, spec(extra)).build(
            common(rows, exports), list(range(len(rows)))
        )
        if meta is None:
            return None
        return {
            "offsets": meta.offsets,
            "extra_exports": meta.extra_exports,
            "kept": meta.kept_extra_exports,
        }

    results["builder"] = {
        "mixed": checkpoint_of(ROWS, EXPORTS),
        "undeclared": checkpoint_of(ROWS, EXPORTS, extra=False),
        "extras_only": checkpoint_of([RESUMED], {0: RESUMED_EXPORTS}),
        # The chunk's end, and less than a hash unit into it.
        "all_dropped": checkpoint_of([RESUMED], {0: [(1000, 1014), (720, 1015)]}),
    }

    # (b) The FlashInfer plan against the reference kernel.
    def features(row: int, seq_len: int) -> dict:
        gen = torch.Generator().manual_seed(1000 + row)
        return {
            "raw": torch.randn(seq_len, WIDTH, generator=gen, dtype=torch.float64),
            "k": torch.randn(seq_len, HEADS, K_DIM, generator=gen, dtype=torch.float64),
            "v": torch.randn(seq_len, HEADS, V_DIM, generator=gen, dtype=torch.float64),
            "decay": 0.5 + 0.5 * torch.rand(seq_len, HEADS, generator=gen, dtype=torch.float64),
        }

    def step(state: torch.Tensor, f: dict, pos: int) -> torch.Tensor:
        outer = f["v"][pos].unsqueeze(-1) * f["k"][pos].unsqueeze(-2)
        return f["decay"][pos].view(HEADS, 1, 1) * state + outer

    def reference_states(f: dict, seq_len: int) -> list[torch.Tensor]:
        """The state after each number of tokens, one token at a time."""
        states = [torch.zeros(HEADS, V_DIM, K_DIM, dtype=torch.float64)]
        for pos in range(seq_len):
            states.append(step(states[-1], f, pos))
        return states

    def prefill_reference(
        *,
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        use_cp,
    ):
        """FlashInfer's contract for a call that emits nothing: each sequence of
        ``cu_seqlens`` from its initial state; (output, final states). The tails
        take the emitted states' kernel, never the context-parallel one."""
        assert output_final_state and not use_qk_l2norm_in_kernel and use_cp is False
        bounds = cu_seqlens.tolist()
        finals = []
        for i in range(len(bounds) - 1):
            state = initial_state[i].to(torch.float64)
            for pos in range(bounds[i], bounds[i + 1]):
                outer = v[0, pos].unsqueeze(-1) * k[0, pos].unsqueeze(-2)
                state = g[0, pos].view(HEADS, 1, 1) * state + outer
            finals.append(state)
        return None, torch.stack(finals)

    def tail_states(md, plan, prefill_rows, rows, feats, refs, emitted) -> torch.Tensor:
        """The layer's ``run_flashinfer_tails`` on the prefill kernel's tokens,
        with the reference standing in for FlashInfer."""
        has_initial = md.prefill_has_initial_state.tolist()
        spans = [(r, rows[r][0] - rows[r][1], rows[r][0]) for r in prefill_rows]
        k = torch.cat([feats[r]["k"][a:b] for r, a, b in spans]).unsqueeze(0)
        v = torch.cat([feats[r]["v"][a:b] for r, a, b in spans]).unsqueeze(0)
        g = torch.cat([feats[r]["decay"][a:b] for r, a, b in spans]).unsqueeze(0)
        initial = torch.stack(
            [
                refs[r][a] if has_initial[i] else torch.zeros_like(refs[r][0])
                for i, (r, a, _) in enumerate(spans)
            ]
        )
        return run_flashinfer_tails(
            plan.tails, k, k, v, g, g, initial, emitted, prefill=prefill_reference
        )

    def flashinfer_reference(md, plan, prefill_rows, rows, feats, refs) -> torch.Tensor:
        """FlashInfer's contract: each sequence's running state after every N
        tokens, at ``cu_starts[i] + j``; sequences from ``prefill_query_start_loc``,
        each from its initial state."""
        cu_starts = plan.cu_starts.tolist()
        emitted = torch.full(
            (plan.num_checkpoints, HEADS, V_DIM, K_DIM), float("nan"), dtype=torch.float64
        )
        qsl = md.prefill_query_start_loc.tolist()
        has_initial = md.prefill_has_initial_state.tolist()
        for i, row in enumerate(prefill_rows):
            seq_len, query_len, _ = rows[row]
            assert qsl[i + 1] - qsl[i] == query_len
            start = seq_len - query_len
            state = refs[row][start].clone() if has_initial[i] else refs[row][0].clone()
            emitted_here = 0
            for n in range(1, query_len + 1):
                state = step(state, feats[row], start + n - 1)
                if n % plan.every_n_tokens == 0:
                    emitted[cu_starts[i] + emitted_here] = state
                    emitted_here += 1
            assert cu_starts[i] + emitted_here == cu_starts[i + 1]
        assert not emitted.isnan().any(), "the plan reserves a state nobody emits"
        return emitted

    def expected_dests(rows: list, exports: dict | None) -> dict[int, tuple[int, int]]:
        """Block -> (row, position) the batch must write, derived by hand."""
        want: dict[int, tuple[int, int]] = {}
        for row, row_spec in enumerate(rows):
            if row_spec in PROMPT_CHECKPOINTS:
                # The block-table column below the chunk's last block.
                col = -(-row_spec[0] // BLOCK) - 2
                want[100 * row + col + 1] = (row, PROMPT_CHECKPOINTS[row_spec])
        for row, pairs in (exports or {}).items():
            seq_len, query_len, _ = rows[row]
            for position, block in pairs:
                offset = position - (seq_len - query_len)
                if UNIT <= offset < query_len and block != NULL_BLOCK_ID:
                    want[block] = (row, position)
        return want

    def plan_case(rows: list, exports: dict | None, draft_tokens: list[int] | None):
        builder = gdn_builder()
        kwargs = {}
        if draft_tokens is not None:
            kwargs = {
                "num_accepted_tokens": torch.ones(len(rows), dtype=torch.int32),
                "num_decode_draft_tokens_cpu": torch.tensor(draft_tokens, dtype=torch.int32),
            }
        md = builder.build(0, common(rows, exports), **kwargs)
        plan = md.flashinfer_checkpoint_plan
        feats = [features(r, s) for r, (s, _, _) in enumerate(rows)]
        refs = [reference_states(f, s) for f, (s, _, _) in zip(feats, rows, strict=True)]
        # The batch's tokens as the layer sees them: non-spec rows in order.
        spec_rows = (
            set() if draft_tokens is None else {r for r, d in enumerate(draft_tokens) if d >= 0}
        )
        nonspec_rows = [r for r in range(len(rows)) if r not in spec_rows]
        nonspec_raw = torch.cat(
            [feats[r]["raw"][rows[r][0] - rows[r][1] : rows[r][0]] for r in nonspec_rows]
        )
        prefill_rows = nonspec_rows[md.num_decodes :]
        emitted = flashinfer_reference(md, plan, prefill_rows, rows, feats, refs)
        tail_lens: list[int] = []
        if plan.tails is not None:
            # Extras off the stride: their states follow the emitted ones.
            tails = tail_states(md, plan, prefill_rows, rows, feats, refs, emitted)
            emitted = torch.cat([emitted, tails])
            tail_lens = plan.tails.cu_seqlens.diff().tolist()
            # FlashInfer may read the bounds in place: 16-byte aligned.
            assert plan.tails.cu_seqlens.storage_offset() % 2 == 0
        if plan.exports is not None:
            chk, starts = plan.exports, plan.export_query_starts
        else:
            # vLLM's own: checkpoint row i is non-spec row i.
            chk = md.checkpoint
            starts = md.non_spec_query_start_loc[: chk.checkpoint_offsets.numel()]
        want = expected_dests(rows, exports)
        got, early_matches = {}, 0
        expected_blocks = {}
        for e, (offset, dest, start, emitted_row) in enumerate(
            zip(
                chk.checkpoint_offsets.tolist(),
                chk.state_indices.tolist(),
                starts.tolist(),
                plan.rows.tolist(),
                strict=True,
            )
        ):
            if offset < UNIT or dest == NULL_BLOCK_ID:
                continue
            row, position = want.get(dest, (None, None))
            entry = {"export": e, "offset": offset, "row": row, "position": position}
            if row is not None:
                # A wrong plan may point past the emitted states: a failure, not a crash.
                inside = 0 <= emitted_row < len(emitted)
                entry["state_equal"] = inside and bool(
                    torch.allclose(emitted[emitted_row], refs[row][position], rtol=1e-6, atol=1e-5)
                )
                window = nonspec_raw[start + offset - STATE_LEN : start + offset]
                entry["conv_equal"] = bool(
                    torch.equal(window, feats[row]["raw"][position - STATE_LEN : position])
                )
                # A plan one emitted state early must fail the same check.
                if 0 < emitted_row <= len(emitted) and torch.allclose(
                    emitted[emitted_row - 1], refs[row][position], rtol=1e-6, atol=1e-5
                ):
                    early_matches += 1
                # The state (b) checks against the sequential one; the kernel
                # copies it exactly.
                expected_blocks[dest] = (
                    emitted[emitted_row].float() if inside else refs[row][position].float(),
                    feats[row]["raw"][position - STATE_LEN : position].T.float().contiguous(),
                )
            got[dest] = entry
        case = {
            "every_n_tokens": plan.every_n_tokens,
            "num_checkpoints": plan.num_checkpoints,
            "has_export_rows": plan.exports is not None,
            "tail_lens": tail_lens,
            "want": {str(b): list(v) for b, v in sorted(want.items())},
            "got": {str(b): v for b, v in sorted(got.items())},
            "early_matches": early_matches,
            "kept": md.checkpoint.kept_extra_exports,
        }
        kernel_case = {
            "offsets": chk.offsets,
            "checkpoint_offsets": chk.checkpoint_offsets,
            "state_indices": chk.state_indices,
            "starts": starts,
            "rows": plan.rows,
            "emitted": emitted.float(),
            "raw": nonspec_raw.float(),
            "expected": expected_blocks,
        }
        return case, kernel_case, md, builder

    batches = {
        # A decode row first, as the runner orders a non-speculative batch.
        "decode_and_prefills": ([DECODE, *ROWS], SHIFTED, None),
        # Speculative rows first: the prefills are the non-spec rows 2 and 3.
        "spec_decodes_and_prefills": (
            [(400, 2, False), (300, 2, False), COLD, RESUMED],
            {2: COLD_EXPORTS, 3: RESUMED_EXPORTS},
            [1, 1, -1, -1],
        ),
        # Offsets 128, 256 (extras) and 256 (TAIL's checkpoint): N = 128.
        "coarse": ([RESUMED, TAIL], {0: RESUMED_EXPORTS[:2]}, None),
        # No extras: vLLM's own layout, unchanged.
        "no_extras": ([DECODE, *ROWS], None, None),
    }
    results["plan"], kernel_cases = {}, {}
    for name, (rows, exports, drafts) in batches.items():
        case, kernel_case = plan_case(rows, exports, drafts)[:2]
        results["plan"][name] = case
        kernel_cases[name] = kernel_case
    torch.save(
        {"null_block": NULL_BLOCK_ID, "num_blocks": 1100, "cases": kernel_cases},
        out / "kernel_cases.pt",
    )

    # (b') plan_flashinfer_exports alone, with a hash unit below the grid (16
    # against 64): extras less than a grid step into the chunk start from the
    # sequence's initial state, and a batch of such needs nothing emitted.
    def exports_plan(offsets, query_lens, extras, grid=GRID) -> dict:
        every_n, cu_starts, rows_, tails_ = plan_flashinfer_exports(
            offsets, query_lens, extras, grid
        )
        return {"every_n": every_n, "cu_starts": cu_starts, "rows": rows_, "tails": tails_}

    results["exports_plan"] = {
        "initial_only": exports_plan([0], [300], [[16, 48]]),
        "mixed": exports_plan([0, 128], [40, 300], [[], [16, 96, 192, 200]]),
        "decode_row": exports_plan([0, 0], [300], [[], [80]]),
    }
    try:
        plan_flashinfer_exports([0, 0], [300], [[80], []], GRID)
        results["exports_plan"]["decode_with_extras"] = None
    except ValueError as exc:
        results["exports_plan"]["decode_with_extras"] = str(exc)
    # The initial-only case through run_flashinfer_tails: states after 16 and
    # 48 tokens of a sequence resumed at 900.
    f = features(9, 1000)
    refs9 = reference_states(f, 1000)
    plan9 = plan_flashinfer_exports([0], [100], [[16, 48]], GRID)
    index = [900 + i for i in range(16)] + [900 + i for i in range(48)]
    tails9 = GDNFlashInferTails(
        token_indices=torch.tensor([i - 900 for i in index]),
        cu_seqlens=torch.tensor([0, 16, 64]),
        sources=torch.tensor([s for *_, s in plan9[3]]),
        sequences=torch.tensor([q for q, *_ in plan9[3]]),
    )
    got9 = run_flashinfer_tails(
        tails9,
        f["k"][900:].unsqueeze(0),
        f["k"][900:].unsqueeze(0),
        f["v"][900:].unsqueeze(0),
        f["decay"][900:].unsqueeze(0),
        f["decay"][900:].unsqueeze(0),
        refs9[900].unsqueeze(0),
        None,
        prefill=prefill_reference,
    )
    results["exports_plan"]["initial_only_states"] = [
        bool(torch.allclose(got9[0], refs9[916], rtol=1e-6, atol=1e-5)),
        bool(torch.allclose(got9[1], refs9[948], rtol=1e-6, atol=1e-5)),
    ]

    # (c) Copies, splits and re-gathers of the metadata.
    rows_c = [DECODE, *ROWS]
    m = common(rows_c, SHIFTED)
    md, builder = plan_case(rows_c, SHIFTED, None)[2:]
    split: dict = {
        "replace": m.replace(max_query_len=7).mamba_checkpoint_exports,
        "unpadded": m.unpadded(int(m.query_start_loc_cpu[2]), 2).mamba_checkpoint_exports,
    }
    for name, call in (
        ("regather", lambda: md.checkpoint.regather_state_indices(block_table(rows_c))),
        (
            "update_block_table",
            lambda: builder.update_block_table(md, block_table(rows_c), m.slot_mapping),
        ),
    ):
        try:
            call()
            split[name] = None
        except AssertionError as exc:
            split[name] = str(exc)

    # Two Mamba KV cache groups through the V2 runner's metadata path.
    req_ids = ["d", "a", "b", "c", "e"]
    by_request = {
        "a": {0: [(512, 2001), (448, 2002)], 1: [(512, 3001)]},
        "b": {0: [(828, 2011)]},
        "c": {0: [(896, 2021)]},  # past its chunk's end: dropped, not reported
        "x": {0: [(512, 2031)]},  # not in this batch
    }

    def v2_metadata(group_specs: list[MambaSpec], exports: dict | None) -> tuple[dict, list]:
        groups = []
        tables = [block_table(rows_c) + 50 * gid for gid in range(len(group_specs))]
        for gid, group_spec in enumerate(group_specs):
            builder = GDNAttentionMetadataBuilder(group_spec, [f"g{gid}"], config, cpu)
            builder.gdn_prefill_backend = "flashinfer"
            builder.plan_flashinfer_checkpoints = True
            # As on CUDA: a later group re-gathers the first group's metadata,
            # from the aligned state indices the model state computes.
            builder.supports_update_block_table = True
            builder.mamba_aligned_state_indices = mamba_get_block_table_tensor(
                tables[gid], m.seq_lens, group_spec, "align"
            )
            groups.append(
                [
                    AttentionGroup(
                        GDNAttentionBackend,
                        [f"g{gid}"],
                        group_spec,
                        gid,
                        metadata_builders=[builder],
                    )
                ]
            )
        buffers = InputBuffers(8, 2048, cpu)
        batch = InputBatch.make_dummy(len(rows_c), m.num_actual_tokens, buffers)
        batch = replace(batch, req_ids=req_ids, mamba_checkpoint_exports=exports)
        by_group = _exports_by_group_and_row(batch)
        kv_config = KVCacheConfig(
            num_blocks=1100,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"g{g}"], s) for g, s in enumerate(group_specs)],
        )
        metadata = build_attn_metadata(
            attn_groups=groups,
            num_reqs=len(rows_c),
            num_tokens=m.num_actual_tokens,
            query_start_loc_gpu=m.query_start_loc,
            query_start_loc_cpu=m.query_start_loc_cpu,
            max_query_len=m.max_query_len,
            seq_lens=m.seq_lens,
            max_seq_len=m.max_seq_len,
            block_tables=tables,
            slot_mappings=torch.zeros(2, m.num_actual_tokens, dtype=torch.int64),
            kv_cache_config=kv_config,
            seq_lens_cpu_upper_bound=m.seq_lens_cpu_upper_bound,
            model_specific_attn_metadata=MambaHybridAttnMetadata(
                is_prefilling=m.is_prefilling, mamba_checkpoint_exports=by_group
            ),
        )
        return metadata, groups, by_group

    def export_blocks(metadata: dict, layer: str) -> list[int]:
        plan = metadata[layer].flashinfer_checkpoint_plan
        chk = plan.exports if plan.exports is not None else metadata[layer].checkpoint
        return sorted(b for b in chk.state_indices.tolist() if b != NULL_BLOCK_ID)

    metadata, groups, by_group = v2_metadata([spec(), spec()], by_request)
    split["by_group"] = {str(g): {str(r): p for r, p in v.items()} for g, v in by_group.items()}
    split["group_blocks"] = [export_blocks(metadata, "g0"), export_blocks(metadata, "g1")]
    split["written"] = mamba_checkpoint_exports_written(by_request, req_ids, metadata, groups)
    metadata, groups, _ = v2_metadata([spec(), spec(extra=False)], by_request)
    split["written_one_group_undeclared"] = mamba_checkpoint_exports_written(
        by_request, req_ids, metadata, groups
    )
    split["written_without_metadata"] = mamba_checkpoint_exports_written(
        by_request, req_ids, {}, groups
    )
    metadata, _, _ = v2_metadata([spec(), spec()], None)
    split["group_blocks_without_exports"] = [
        export_blocks(metadata, "g0"),
        export_blocks(metadata, "g1"),
    ]

    # Microbatches and PCP do not carry them.
    buffers = InputBuffers(8, 64, cpu)
    batch = InputBatch.make_dummy(2, 10, buffers)
    batch = replace(batch, req_ids=["a", "b"], mamba_checkpoint_exports={"b": {1: [(4, 9)]}})
    sliced = _slice_input_batch(
        batch,
        UBatchSlice(slice(0, 2), slice(0, 6)),
        torch.zeros(9, dtype=torch.int32),
        torch.zeros(8, dtype=torch.int32),
    )
    split["ubatch_slice"] = sliced.mamba_checkpoint_exports
    split["pcp"] = _exports_by_group_and_row(replace(batch, pcp=object()))
    results["split"] = split
    (out / "results.json").write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------
# The .venv-triton side: vLLM's exporter and kernel, from the tree's file
# --------------------------------------------------------------------------

_TRITON_SIDE = r"""
import ast, importlib.util, json, sys, tempfile, types
from pathlib import Path
import torch

checkpoint_py, cases_pt, out = map(Path, sys.argv[1:])
payload = torch.load(cases_pt)
source = checkpoint_py.read_text()
lines = source.splitlines()
pieces = []
for node in ast.parse(source).body:
    if getattr(node, "name", None) in (
        "store_cache_checkpoints_kernel", "MambaPrefillCheckpointExporter"
    ):
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        pieces.append("\n".join(lines[start - 1 : node.end_lineno]))
assert len(pieces) == 2, "checkpoint.py no longer has the exporter and its kernel"
header = (
    "from dataclasses import dataclass\nimport torch\nimport triton\n"
    "import triton.language as tl\n\n"
    f"NULL_BLOCK_ID = {payload['null_block']}\n"
    "MambaPrefillCheckpointMetadata = object  # annotations only\n\n\n"
)
# Triton reads a kernel's source from its file, so the extract is a file.
path = Path(tempfile.mkdtemp()) / "vllm_checkpoint_extract.py"
path.write_text(header + "\n\n\n".join(pieces) + "\n")
spec = importlib.util.spec_from_file_location("vllm_checkpoint_extract", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

results = {}
sentinel = -7.0
for name, case in payload["cases"].items():
    expected = case["expected"]
    state_shape = case["emitted"].shape[1:]
    width, state_len = case["raw"].shape[1], next(iter(expected.values()))[1].shape[1]
    conv_state = torch.full((payload["num_blocks"], width, state_len), sentinel)
    ssm_state = torch.full((payload["num_blocks"], *state_shape), sentinel)
    checkpoint = types.SimpleNamespace(
        checkpoint_offsets=case["checkpoint_offsets"],
        state_indices=case["state_indices"],
        offsets=case["offsets"],
    )
    module.MambaPrefillCheckpointExporter(state_len=state_len).export(
        checkpoint,
        raw_qkv=case["raw"],
        conv_state=conv_state,
        cu_seqlens=case["starts"],
        recurrent_checkpoint=case["emitted"],
        recurrent_state=ssm_state,
        recurrent_rows=case["rows"],
    )
    wrong = [
        block
        for block, (recurrent, conv) in expected.items()
        if not (torch.equal(ssm_state[block], recurrent) and torch.equal(conv_state[block], conv))
    ]
    others = [b for b in range(payload["num_blocks"]) if b not in expected]
    untouched = bool(
        (ssm_state[others] == sentinel).all() and (conv_state[others] == sentinel).all()
    )
    results[name] = {"written": sorted(expected), "wrong": wrong, "others_untouched": untouched}
out.write_text(json.dumps(results))
"""


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_tree(
    release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fix-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out))
    return json.loads((out / "results.json").read_text()), out


def test_the_builder_keeps_exactly_the_interior_extras(on_tree) -> None:
    """(a) Kept: offsets inside the row's query, at least a hash unit into it, at
    any offset (500 and 896 are off the chunk's grid: tails), with a real block;
    reported as (row, position). Dropped: the chunk's end (600, 832), its start
    (0, 512), before it (400), less than a hash unit into it (540), the null block."""
    builder = on_tree[0]["builder"]
    mixed = builder["mixed"]
    assert mixed["offsets"] == [576, 0, 0, 256]
    assert mixed["extra_exports"] == [
        [[512, 1001], [448, 1002], [500, 1003]],
        [[128, 1011], [256, 1012], [196, 1013]],
        [],
        [],
    ]
    assert mixed["kept"] == [[0, 512], [0, 448], [0, 500], [1, 828], [1, 956], [1, 896]]
    # A layer that does not declare extra exports (Mamba2, Triton/FLA GDN) keeps none.
    assert builder["undeclared"] == {
        "offsets": [576, 0, 0, 256],
        "extra_exports": None,
        "kept": None,
    }
    # Metadata for a row with extras and no prompt checkpoint; none when all drop.
    assert builder["extras_only"]["offsets"] == [0]
    assert builder["extras_only"]["kept"] == [[0, 828], [0, 956], [0, 896]]
    assert builder["all_dropped"] is None


@pytest.mark.parametrize(
    "batch", ["decode_and_prefills", "spec_decodes_and_prefills", "coarse", "no_extras"]
)
def test_each_export_gathers_the_sequential_state_at_its_position(on_tree, batch: str) -> None:
    """(b) FlashInfer's plan with extras, the reference kernel emitting every N
    tokens: each export (prompt checkpoints and extras) reads the state equal to
    the one-token-at-a-time state at its position, and its conv window ends
    there, into its own block; a plan one state early fails. An extra off the
    stride reads its tail's state (``run_flashinfer_tails``: fewer than a grid
    step of tokens from the state emitted below it)."""
    case = on_tree[0]["plan"][batch]
    assert case["got"].keys() == case["want"].keys()
    for block, entry in case["got"].items():
        assert [entry["row"], entry["position"]] == case["want"][block]
        assert entry["state_equal"], f"block {block}: not the state at {entry['position']}"
        assert entry["conv_equal"], (
            f"block {block}: conv window does not end at {entry['position']}"
        )
    assert case["early_matches"] == 0
    assert case["has_export_rows"] == (batch != "no_extras")
    assert case["every_n_tokens"] % GRID == 0
    # 500 from 448, 896 (offset 196) from 192.
    with_tails = batch in ("decode_and_prefills", "spec_decodes_and_prefills")
    assert case["tail_lens"] == ([52, 4] if with_tails else [])


def test_extras_off_the_stride_run_short_tails(on_tree) -> None:
    """(b') ``plan_flashinfer_exports`` with a hash unit of 16 against the 64
    grid: an extra on the stride reads its emitted state; one off it a tail from
    the state emitted at the grid step below, or from the sequence's initial
    state (source -1) when that step is its start, so a batch of only such
    emits nothing (N = 0); a decode row cannot carry extras. The initial-state
    tails, run through ``run_flashinfer_tails``, give the sequential states."""
    plan = on_tree[0]["exports_plan"]
    assert plan["initial_only"] == {
        "every_n": 0,
        "cu_starts": [0, 0],
        "rows": [0, 0, 1],
        "tails": [[0, 0, 16, -1], [0, 0, 48, -1]],
    }
    assert plan["mixed"] == {
        "every_n": 64,
        "cu_starts": [0, 0, 4],
        "rows": [0, 1, 4, 5, 2, 6],
        "tails": [[1, 0, 16, -1], [1, 64, 96, 0], [1, 192, 200, 2]],
    }
    assert plan["decode_row"] == {
        "every_n": 64,
        "cu_starts": [0, 4],
        "rows": [0, 0, 4],
        "tails": [[0, 64, 80, 0]],
    }
    assert "has extra exports but no prefill" in plan["decode_with_extras"]
    assert plan["initial_only_states"] == [True, True]


def test_the_plan_strides_by_the_gcd_of_every_offset(on_tree) -> None:
    """(b) One stride for the batch, the gcd of the prompt checkpoints' and the
    extras' offsets (FlashInfer takes one), and sum(query_len // N) states:
    64 with 576, 512, 448, 256, 128; 128 with 128, 256 and 256; vLLM's own
    gcd(576, 256) = 64 without extras."""
    plan = on_tree[0]["plan"]
    assert plan["decode_and_prefills"]["every_n_tokens"] == 64
    assert plan["decode_and_prefills"]["num_checkpoints"] == sum(q // 64 for _, q, _ in ROWS)
    assert plan["spec_decodes_and_prefills"]["every_n_tokens"] == 64
    assert plan["coarse"]["every_n_tokens"] == 128
    assert plan["coarse"]["num_checkpoints"] == 300 // 128 + 320 // 128
    assert plan["no_extras"]["every_n_tokens"] == 64
    assert plan["no_extras"]["kept"] is None


def test_metadata_copies_carry_or_refuse_the_exports(on_tree) -> None:
    """(c) ``replace`` carries the field, ``unpadded`` keeps the rows it keeps;
    metadata with extras cannot be re-gathered for another KV cache group (its
    blocks are the group's own), so the V2 runner builds each group's metadata
    (each group exports into its own blocks, and a group reuses the first one's
    when nothing is exported); a microbatch slice and a PCP batch carry none."""
    split = on_tree[0]["split"]
    assert split["replace"] == {str(r): [list(p) for p in ps] for r, ps in SHIFTED.items()}
    assert split["unpadded"] == {"1": [list(p) for p in COLD_EXPORTS]}
    assert "cannot be re-gathered" in split["regather"]
    assert "cannot be re-gathered" in split["update_block_table"]
    assert split["by_group"] == {
        "0": {"1": [[512, 2001], [448, 2002]], "2": [[828, 2011]], "3": [[896, 2021]]},
        "1": {"1": [[512, 3001]]},
    }
    prompt = [100 * 1 + 1 + 1, 100 * 4 + 2 + 1]  # rows 1 and 4, columns 1 and 2
    g0, g1 = split["group_blocks"]
    assert g0 == sorted([*prompt, 2001, 2002, 2011])
    assert g1 == sorted([*(b + 50 for b in prompt), 3001])
    assert split["group_blocks_without_exports"] == [prompt, [b + 50 for b in prompt]]
    assert split["ubatch_slice"] is None
    assert split["pcp"] is None


def test_the_runner_reports_what_every_group_wrote(on_tree) -> None:
    """The report (``ModelRunnerOutput.mamba_checkpoint_exports_written``): a
    position counts when every group it was planned for kept it. Dropped (896),
    not in the batch ("x"), a group whose layer declares no extras (512 of "a"
    in group 1) and no metadata at all (microbatches) are not written."""
    split = on_tree[0]["split"]
    assert split["written"] == {"a": [448, 512], "b": [828]}
    assert split["written_one_group_undeclared"] == {"a": [448], "b": [828]}
    assert split["written_without_metadata"] == {}


def test_vllms_store_kernel_writes_every_export_into_its_block(
    on_tree, release_tree: trees.Tree, triton_env: Path
) -> None:
    """vLLM's ``MambaPrefillCheckpointExporter`` and ``store_cache_checkpoints_kernel``
    (from the tree's file, under Triton's interpreter) on the plans of (b): every
    export's block holds its state and conv window, and no other block is
    touched (the null block and rows without a checkpoint included)."""
    out = on_tree[1]
    checkpoint_py = release_tree.package / "model_executor/layers/mamba/checkpoint.py"
    result = out / "kernel.json"
    run_interpreted(
        triton_env, _TRITON_SIDE, str(checkpoint_py), str(out / "kernel_cases.pt"), str(result)
    )
    cases = json.loads(result.read_text())
    want = on_tree[0]["plan"]
    for name, case in cases.items():
        assert case["written"] == sorted(int(b) for b in want[name]["want"]), name
        assert case["wrong"] == [], name
        assert case["others_untouched"], name


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")
