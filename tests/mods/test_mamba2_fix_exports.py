"""The fix's extra Mamba exports on vLLM 0.34.0's Mamba2 path (Nemotron-H's
``MambaMixer2``, mod ``fix-eagle-fine-prefix-exports``), checked on the CPU.

Mamba2 exports vLLM's prompt checkpoint from inside the prefill: its metadata
builder ends an SSD chunk exactly on it and the layer copies that chunk's state
(``varlen_states``) and the conv window into the checkpoint's block. With the
fix the layer declares ``prefill_checkpoint_extra_exports`` and does the same
for every extra export the scheduler plans (each a cut point of its row, each
into a block of its own), so the fix's states cost no engine step.

Everything vLLM-side runs on the release tree's patched stage, in a subprocess
(this file as a script, ``on-tree``): the layer's declared spec, the real
``Mamba2AttentionMetadataBuilder`` (chunk layout, export rows, kept exports) and
the V2 runner's report. Under Triton's interpreter (.venv-triton), vLLM's own
SSD scan ``mamba_chunk_scan_combined_varlen`` (loaded from the tree's files as
``kit/kernels/triton_check.py`` loads it) runs on the builder's layout, and
vLLM's ``MambaPrefillCheckpointExporter`` and ``store_cache_checkpoints_kernel``
(from the tree's ``checkpoint.py``) write the blocks as the layer calls them;
the states are compared with a sequential float64 SSM and with the scan run
over each export's prefix alone.

Not run here: the layer's forward itself (``conv_ssm_forward`` needs vLLM's
custom ops; it hands the builder's export rows, starts and chunk indices to the
exporter, as the kernel step below does), anything end to end.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods import release_side
from tests.mods.release_side import (
    RELEASE,
    batch_metadata,
    on_tree_config,
    run_interpreted,
    run_on_tree,
)

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64  # Mamba block (align mode)
HASH = 16  # hash block / prefix unit: the prompt checkpoint's grid
CHUNK = 32  # the SSD scan's chunk size
CONV_KERNEL = 4  # conv window kept per state: 3 tokens
HEADS, HEAD_DIM, D_STATE, GROUPS = 2, 4, 4, 1
COLS = 4  # block-table columns

# Rows of the batch: (seq_len, query_len, prefilling). A row's block-table column
# c holds 100 * row + c + 1; block IDs 1000+ are the extra exports' own blocks.
DECODE = (50, 1, False)
COLD = (100, 100, True)  # prompt checkpoint at 96, extras at 80 and 48
SHORT = (40, 40, True)  # no prompt checkpoint (one block): an extra only, at 16
RESUMED = (150, 65, True)  # query from 85, off the chunk grid: extras at 128, 112
PLAIN = (20, 20, True)  # nothing to export
ROWS = [DECODE, COLD, SHORT, RESUMED, PLAIN]
# Dropped by the checkpoint builder: 2 (less than a hash unit into the query, so
# not a whole conv window), 100 (the query's end: the running state), 85 (the
# query's start); nothing for PLAIN.
EXPORTS = {
    1: [(80, 1001), (48, 1002), (2, 1003), (100, 1004)],
    2: [(16, 1011)],
    3: [(128, 1021), (112, 1022), (85, 1023)],
}
KEPT = [[1, 80], [1, 48], [2, 16], [3, 128], [3, 112]]

# The prefill rows' layout with the extras (tokens into the prefill batch):
# COLD [0, 100) cut at 48, 80 and 96; SHORT [100, 140) cut at 16; RESUMED
# [140, 205), absolute 85..150, cut at 112 and 128; PLAIN [205, 225).
CU_CHUNKS = [0, 32, 48, 64, 80, 96, 100, 116, 132, 140, 151, 167, 183, 205, 225]
SEQ_IDX = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
LAST_CHUNKS = [5, 8, 12, 13]
# One per prefill row (the prompt checkpoint's chunk, 0 for none), then one per
# extra export in export-row order: 80, 48 (COLD), 16 (SHORT), 128, 112 (RESUMED).
CHUNK_IDX = [4, 0, 0, 0, 3, 1, 6, 11, 10]
# vLLM's layout without extras: only the prompt checkpoint's cut (96).
CU_CHUNKS_PLAIN = [0, 32, 64, 96, 100, 132, 140, 151, 183, 205, 225]
SEQ_IDX_PLAIN = [0, 0, 0, 0, 1, 1, 2, 2, 2, 3]
LAST_CHUNKS_PLAIN = [3, 5, 8, 9]
CHUNK_IDX_PLAIN = [2, 0, 0, 0]


# --------------------------------------------------------------------------
# The release tree's side (``python this_file on-tree MODEL OUT``)
# --------------------------------------------------------------------------


def _on_tree(model_dir: Path, out: Path) -> None:
    from dataclasses import replace

    import torch
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mamba2_attn import (
        Mamba2AttentionBackend,
        Mamba2AttentionMetadataBuilder,
    )
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
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
    from vllm.v1.worker.utils import AttentionGroup

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, HASH, 0))
    config.cache_config.mamba_block_size = BLOCK
    # Nemotron-H's config names the SSD chunk ``chunk_size``.
    config.model_config.hf_text_config.chunk_size = CHUNK
    cpu = torch.device("cpu")
    results: dict = {"null_block": NULL_BLOCK_ID}

    class Layer(MambaMixer2):
        """MambaMixer2's own ``get_kv_cache_spec`` on small state shapes."""

        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.conv_kernel_size = CONV_KERNEL

        def get_state_shape(self):
            return MambaStateShapeCalculator.mamba2_state_shape(
                tp_world_size=1,
                intermediate_size=HEADS * HEAD_DIM,
                n_groups=GROUPS,
                num_heads=HEADS,
                head_dim=HEAD_DIM,
                state_size=D_STATE,
                conv_kernel=CONV_KERNEL,
            )

        def get_state_dtype(self):
            return (torch.float32, torch.float32)

    spec = Layer().get_kv_cache_spec(config)
    assert isinstance(spec, MambaSpec)
    results["spec"] = {
        "alignment": spec.prefill_checkpoint_alignment,
        "checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
        "extra_exports": getattr(spec, "prefill_checkpoint_extra_exports", None),
        "conv_window": getattr(spec, "prefill_checkpoint_conv_window", None),
    }
    # The same layer as the tree had it before the fix's Mamba2 exports.
    undeclared = replace(spec, prefill_checkpoint_extra_exports=False)

    def block_table() -> torch.Tensor:
        return release_side.block_table(ROWS, COLS)

    def common(exports: dict | None) -> CommonAttentionMetadata:
        return batch_metadata(ROWS, exports, COLS)

    def as_list(t: torch.Tensor | None) -> list | None:
        return None if t is None else t.tolist()

    # (a) The chunk layout, as vLLM's builder lays it out.
    def layout(layer_spec: MambaSpec, exports: dict | None) -> tuple[dict, object]:
        builder = Mamba2AttentionMetadataBuilder(layer_spec, ["layer"], config, cpu)
        md = builder.build(0, common(exports))
        meta = md.checkpoint_meta
        export_rows = getattr(md, "checkpoint_export_rows", None)
        starts = getattr(md, "checkpoint_export_query_starts", None)
        case = {
            "num_decodes": md.num_decodes,
            "cu_chunks": as_list(md.cu_chunk_seqlen_p),
            "seq_idx": as_list(md.seq_idx_p),
            "last_chunks": as_list(md.last_chunk_indices_p),
            "chunk_idx": as_list(md.checkpoint_chunk_idx),
            "offsets": None if meta is None else meta.offsets,
            "extra_exports": None if meta is None else meta.extra_exports,
            "kept": None if meta is None else meta.kept_extra_exports,
            "export_offsets": None if export_rows is None else export_rows.offsets,
            "export_blocks": None if export_rows is None else as_list(export_rows.state_indices),
            "export_starts": as_list(starts),
        }
        return case, md

    results["layout"], kernel_inputs = {}, {}
    for name, (layer_spec, exports) in {
        "extras": (spec, EXPORTS),
        "no_extras": (spec, None),
        "undeclared": (undeclared, EXPORTS),
    }.items():
        case, md = layout(layer_spec, exports)
        results["layout"][name] = case
        # What the layer hands the exporter: the export rows with extras, else
        # vLLM's own checkpoint rows at the prefill rows' starts.
        rows = getattr(md, "checkpoint_export_rows", None)
        starts = getattr(md, "checkpoint_export_query_starts", None)
        if rows is None and md.checkpoint_meta is not None:
            rows, starts = md.checkpoint_meta, md.query_start_loc_p[:-1]
        kernel_inputs[name] = {
            "cu_seqlens": md.query_start_loc_p,
            "cu_chunks": md.cu_chunk_seqlen_p,
            "seq_idx": md.seq_idx_p,
            "last_chunks": md.last_chunk_indices_p,
            "chunk_idx": md.checkpoint_chunk_idx,
            "checkpoint_offsets": None if rows is None else rows.checkpoint_offsets,
            "state_indices": None if rows is None else rows.state_indices,
            "offsets": None if rows is None else rows.offsets,
            "starts": starts,
        }

    # The segment split itself, on rows the builder does not make: an extra on
    # the prompt checkpoint (the same chunk end), one on the chunk grid, one row
    # resumed off the grid with extras and no checkpoint, one with nothing.
    direct = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata

    def direct_case(computed: list[int], lens: list[int], ckpts, extras) -> list:
        qsl = torch.tensor([0, *itertools.accumulate(lens)])
        args = (CHUNK, len(lens), torch.tensor(computed), qsl, ckpts)
        try:
            return list(direct(*args) if extras is None else direct(*args, extras))
        except TypeError as exc:
            return [f"TypeError: {exc}"]

    results["direct"] = {
        "shared_and_on_grid": direct_case([0], [80], [40], [[40, 64, 20]]),
        "resumed_and_plain": direct_case([70, 0], [50, 20], [0, 0], [[10, 26], []]),
        "plain": direct_case([70, 0], [50, 20], None, None),
    }

    # (c) The V2 runner's report for a Mamba2 group.
    req_ids = ["d", "cold", "short", "resumed", "plain"]
    by_request = {
        "cold": EXPORTS[1],
        "short": EXPORTS[2],
        "resumed": EXPORTS[3],
        "x": [(64, 1031)],  # not in this batch
    }

    def report(group_specs: list[MambaSpec]) -> dict:
        m = common(None)
        groups = []
        tables = [block_table() + 50 * gid for gid in range(len(group_specs))]
        for gid, group_spec in enumerate(group_specs):
            builder = Mamba2AttentionMetadataBuilder(group_spec, [f"g{gid}"], config, cpu)
            groups.append(
                [
                    AttentionGroup(
                        Mamba2AttentionBackend,
                        [f"g{gid}"],
                        group_spec,
                        gid,
                        metadata_builders=[builder],
                    )
                ]
            )
        # Each group is planned the same positions, into blocks of its own.
        exports = {
            req: {
                gid: [(position, block + 500 * gid) for position, block in pairs]
                for gid in range(len(group_specs))
            }
            for req, pairs in by_request.items()
        }
        buffers = InputBuffers(8, 512, cpu)
        batch = InputBatch.make_dummy(len(ROWS), m.num_actual_tokens, buffers)
        batch = replace(batch, req_ids=req_ids, mamba_checkpoint_exports=exports)
        kv_config = KVCacheConfig(
            num_blocks=1100,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"g{g}"], s) for g, s in enumerate(group_specs)],
        )
        metadata = build_attn_metadata(
            attn_groups=groups,
            num_reqs=len(ROWS),
            num_tokens=m.num_actual_tokens,
            query_start_loc_gpu=m.query_start_loc,
            query_start_loc_cpu=m.query_start_loc_cpu,
            max_query_len=m.max_query_len,
            seq_lens=m.seq_lens,
            max_seq_len=m.max_seq_len,
            block_tables=tables,
            slot_mappings=torch.zeros(len(group_specs), m.num_actual_tokens, dtype=torch.int64),
            kv_cache_config=kv_config,
            seq_lens_cpu_upper_bound=m.seq_lens_cpu_upper_bound,
            model_specific_attn_metadata=MambaHybridAttnMetadata(
                is_prefilling=m.is_prefilling,
                mamba_checkpoint_exports=_exports_by_group_and_row(batch),
            ),
        )
        blocks = []
        for gid in range(len(group_specs)):
            rows = getattr(metadata[f"g{gid}"], "checkpoint_export_rows", None)
            blocks.append(
                []
                if rows is None
                else sorted(b for b in rows.state_indices.tolist() if b != NULL_BLOCK_ID)
            )
        return {
            "written": mamba_checkpoint_exports_written(exports, req_ids, metadata, groups),
            "blocks": blocks,
        }

    results["report"] = {
        "one_group": report([spec]),
        "two_groups": report([spec, spec]),
        "second_undeclared": report([spec, undeclared]),
    }

    torch.save(
        {"null_block": NULL_BLOCK_ID, "num_blocks": 1100, "cases": kernel_inputs},
        out / "kernel_inputs.pt",
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))


# --------------------------------------------------------------------------
# The .venv-triton side: vLLM's SSD scan and exporter, from the tree's files
# --------------------------------------------------------------------------

_TRITON_SIDE = r"""
import ast, importlib.util, json, sys, tempfile, types
from pathlib import Path
import torch
import torch.nn.functional as F

kit_kernels, tree_root, inputs_pt, out = map(Path, sys.argv[1:5])
chunk_size, conv_kernel, heads, head_dim, d_state, groups = map(int, sys.argv[5:11])
rows = json.loads(sys.argv[11])  # (seq_len, query_len) of each prefill row
sys.path.insert(0, str(kit_kernels))
import triton_check

work = Path(tempfile.mkdtemp())
combined = triton_check.load_ssd(tree_root, work)

# vLLM's exporter and its kernel, extracted from the tree's checkpoint.py.
checkpoint_py = tree_root / "vllm/model_executor/layers/mamba/checkpoint.py"
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
payload = torch.load(inputs_pt)
header = (
    "from dataclasses import dataclass\nimport torch\nimport triton\n"
    "import triton.language as tl\n\n"
    f"NULL_BLOCK_ID = {payload['null_block']}\n"
    "MambaPrefillCheckpointMetadata = object  # annotations only\n\n\n"
)
path = work / "vllm_checkpoint_extract.py"
path.write_text(header + "\n\n\n".join(pieces) + "\n")
spec = importlib.util.spec_from_file_location("vllm_checkpoint_extract", path)
exporter_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exporter_module)

# Each row's whole sequence, and the state after every number of its tokens by a
# sequential float64 SSM (dt softplus with dt_bias, as MambaMixer2 calls the scan).
gen = torch.Generator().manual_seed(7)
A = -(0.5 + torch.rand(heads, generator=gen))
D = torch.randn(heads, generator=gen)
dt_bias = 0.5 * torch.randn(heads, generator=gen)
conv_dim = heads * head_dim + 2 * groups * d_state
feats, refs = [], []
for seq_len, _ in rows:
    f = {
        "x": torch.randn(seq_len, heads, head_dim, generator=gen),
        "dt": torch.randn(seq_len, heads, generator=gen),
        "B": torch.randn(seq_len, groups, d_state, generator=gen),
        "C": torch.randn(seq_len, groups, d_state, generator=gen),
        "raw": torch.randn(seq_len, conv_dim, generator=gen),
    }
    feats.append(f)
    state = torch.zeros(heads, head_dim, d_state, dtype=torch.float64)
    states = [state]
    group_of = torch.arange(heads) // (heads // groups)
    for p in range(seq_len):
        dt = F.softplus(f["dt"][p].double() + dt_bias.double())
        b = f["B"][p].double()[group_of]
        state = torch.exp(dt * A.double()).view(heads, 1, 1) * state + (
            dt.view(heads, 1, 1) * f["x"][p].double().unsqueeze(-1) * b.unsqueeze(1)
        )
        states.append(state)
    refs.append(states)


def scan(spans, cu_chunks, seq_idx, last_chunks, initial):
    # vLLM's scan on the rows' spans [start, end) (absolute positions).
    x, dt, b, c = (
        torch.cat([feats[r][k][s:e] for r, s, e in spans]) for k in ("x", "dt", "B", "C")
    )
    cu = [0]
    for _, s, e in spans:
        cu.append(cu[-1] + e - s)
    out_y = torch.empty(x.shape)
    return combined.mamba_chunk_scan_combined_varlen(
        x, dt, A, b, c,
        chunk_size=chunk_size,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_chunk_seqlens=torch.as_tensor(cu_chunks, dtype=torch.int32),
        last_chunk_indices=torch.as_tensor(last_chunks, dtype=torch.int32),
        seq_idx=torch.as_tensor(seq_idx, dtype=torch.int32),
        out=out_y, D=D, z=None, dt_bias=dt_bias,
        initial_states=initial, dt_softplus=True, dt_limit=(0.0, float("inf")),
        return_intermediate_states=True, state_dtype=torch.float32,
    ), out_y


def initial_of(spans):
    # vLLM zeroes the rows without a prior state (torch.where in the layer).
    return torch.stack([refs[r][s].float() for r, s, _ in spans])


def diff(a, b):
    return float((a.double() - b.double()).abs().max())


spans = [(r, seq_len - q, seq_len) for r, (seq_len, q) in enumerate(rows)]
results = {}
finals = {}
sentinel = -7.0
for name, case in payload["cases"].items():
    states, y = scan(
        spans, case["cu_chunks"], case["seq_idx"], case["last_chunks"], initial_of(spans)
    )
    finals[name] = (states[case["last_chunks"].long()], y)
    result = {
        "final_vs_reference": max(
            diff(states[case["last_chunks"][r].item()], refs[r][seq_len])
            for r, (seq_len, _) in enumerate(rows)
        )
    }
    if case["checkpoint_offsets"] is not None:
        # The layer's exporter call: its export rows, their starts, each row's chunk.
        raw = torch.cat([feats[r]["raw"][s:e] for r, s, e in spans])
        state_len = conv_kernel - 1
        conv_state = torch.full((payload["num_blocks"], conv_dim, state_len), sentinel)
        ssm_state = torch.full((payload["num_blocks"], heads, head_dim, d_state), sentinel)
        checkpoint = types.SimpleNamespace(
            checkpoint_offsets=case["checkpoint_offsets"],
            state_indices=case["state_indices"],
            offsets=case["offsets"],
        )
        exporter_module.MambaPrefillCheckpointExporter(state_len=state_len).export(
            checkpoint,
            raw_qkv=raw,
            conv_state=conv_state,
            cu_seqlens=case["starts"],
            recurrent_checkpoint=states,
            recurrent_state=ssm_state,
            recurrent_rows=case["chunk_idx"],
        )
        exports, written = [], set()
        cu_rows = case["cu_seqlens"].tolist()
        for e, (offset, block, start, chunk) in enumerate(zip(
            case["checkpoint_offsets"].tolist(), case["state_indices"].tolist(),
            case["starts"].tolist(), case["chunk_idx"].tolist(), strict=True,
        )):
            if offset <= 0 or block == payload["null_block"]:
                continue
            row = cu_rows.index(start)
            seq_len, q = rows[row]
            position = seq_len - q + offset
            # The scan over the row's prefix alone, vLLM's layout for it.
            alone_spans = [(row, seq_len - q, position)]
            cu, pos, seq = [0], seq_len - q, []
            while pos < position:
                pos = min((pos // chunk_size + 1) * chunk_size, position)
                cu.append(pos - (seq_len - q))
                seq.append(0)
            alone, _ = scan(alone_spans, cu, seq, [len(seq) - 1], initial_of(alone_spans))
            written.add(block)
            exports.append({
                "export": e,
                "row": row,
                "position": position,
                "block": block,
                # The chunk the layer reads ends exactly on the export.
                "chunk_end": case["cu_chunks"][chunk + 1].item() - start,
                "block_vs_reference": diff(ssm_state[block], refs[row][position]),
                # The chunk before (one chunk early): far off, so the check discerns.
                "previous_chunk_vs_reference": diff(states[chunk - 1], refs[row][position]),
                "block_vs_prefix_alone": diff(ssm_state[block], alone[-1]),
                "block_is_chunk_state": bool(torch.equal(ssm_state[block], states[chunk])),
                "conv_window": bool(torch.equal(
                    conv_state[block],
                    feats[row]["raw"][position - state_len : position].T.contiguous(),
                )),
            })
        others = [b for b in range(payload["num_blocks"]) if b not in written]
        result["exports"] = exports
        result["others_untouched"] = bool(
            (ssm_state[others] == sentinel).all() and (conv_state[others] == sentinel).all()
        )
    results[name] = result
# The extras leave every row's final state and output as they were (up to the
# scan's float32 rounding over different chunk ends).
results["final_extras_vs_plain"] = diff(finals["extras"][0], finals["no_extras"][0])
results["y_extras_vs_plain"] = diff(finals["extras"][1], finals["no_extras"][1])
out.write_text(json.dumps(results, indent=1))
"""


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_tree(
    release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("mamba2-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out))
    return json.loads((out / "results.json").read_text()), out


@pytest.fixture(scope="module")
def kernels(on_tree, release_tree: trees.Tree, triton_env: Path) -> dict:
    out = on_tree[1]
    result = out / "kernels.json"
    prefill_rows = [[s, q] for s, q, prefilling in ROWS if prefilling]
    run_interpreted(
        triton_env,
        _TRITON_SIDE,
        str(ROOT / "kit/kernels"),
        str(release_tree.package.parent),
        str(out / "kernel_inputs.pt"),
        str(result),
        *map(str, (CHUNK, CONV_KERNEL, HEADS, HEAD_DIM, D_STATE, GROUPS)),
        json.dumps(prefill_rows),
    )
    return json.loads(result.read_text())


def test_mamba2_declares_extra_exports(on_tree) -> None:
    """MambaMixer2's spec: vLLM's alignment-1 internal checkpoint, and now the
    fix's extra exports beside it."""
    assert on_tree[0]["spec"] == {
        "alignment": 1,
        "checkpoint_blocks": 1,
        "extra_exports": True,
        # No export closer to its row's start than its conv window.
        "conv_window": CONV_KERNEL - 1,
    }


def test_chunk_layout_cuts_at_every_export(on_tree) -> None:
    """(a) The builder ends an SSD chunk on the prompt checkpoint and on every kept
    extra, and keeps chunk ends on multiples of the chunk size in absolute
    positions in each segment (RESUMED starts at 85: 85..96, 96..112 | 112..128 |
    128..150). The chunk indices: one per prefill row, then one per extra in
    export-row order. The export rows: the prefill rows, then each extra with its
    own block, at its row's start. Without extras planned, or for a layer that
    does not declare them: vLLM's own layout (the prompt checkpoint's cut only),
    no export rows, nothing kept."""
    case = on_tree[0]["layout"]["extras"]
    assert case["num_decodes"] == 1
    assert case["offsets"] == [96, 0, 0, 0]
    assert case["extra_exports"] == [
        [[80, 1001], [48, 1002]],
        [[16, 1011]],
        [[43, 1021], [27, 1022]],
        [],
    ]
    assert case["kept"] == KEPT
    assert case["cu_chunks"] == CU_CHUNKS
    assert case["seq_idx"] == SEQ_IDX
    assert case["last_chunks"] == LAST_CHUNKS
    assert case["chunk_idx"] == CHUNK_IDX
    prompt_block = 100 * 1 + 0 + 1  # COLD, column cdiv(100, 64) - 2 = 0
    assert case["export_offsets"] == [96, 0, 0, 0, 80, 48, 16, 43, 27]
    null = on_tree[0]["null_block"]
    assert case["export_blocks"] == [prompt_block, null, null, null, 1001, 1002, 1011, 1021, 1022]
    assert case["export_starts"] == [0, 100, 140, 205, 0, 0, 100, 140, 140]
    for name in ("no_extras", "undeclared"):
        case = on_tree[0]["layout"][name]
        assert case["cu_chunks"] == CU_CHUNKS_PLAIN, name
        assert case["seq_idx"] == SEQ_IDX_PLAIN, name
        assert case["last_chunks"] == LAST_CHUNKS_PLAIN, name
        assert case["chunk_idx"] == CHUNK_IDX_PLAIN, name
        assert case["offsets"] == [96, 0, 0, 0], name
        assert case["extra_exports"] is None and case["kept"] is None, name
        assert case["export_offsets"] is None and case["export_starts"] is None, name


def test_the_segment_split(on_tree) -> None:
    """(a) ``_compute_chunk_metadata`` itself: an extra on the prompt checkpoint
    reads the same chunk end (40 -> chunk 2), one on the chunk grid (64) adds no
    chunk, one off it splits its chunk (20); a row resumed off the grid (70..120)
    with extras only (80, 96) and a row with nothing (20 tokens); the same rows
    without extras."""
    direct = on_tree[0]["direct"]
    # [0,20) | [20,32) [32,40) | [40,64) | [64,80)
    assert direct["shared_and_on_grid"] == [[0, 20, 32, 40, 64, 80], [0] * 5, [4], [2, 2, 3, 0]]
    # row 0 from 70: [70,80) | [80,96) | [96,120); row 1: [0,20)
    assert direct["resumed_and_plain"] == [
        [0, 10, 26, 50, 70],
        [0, 0, 0, 1],
        [2, 3],
        [-1, -1, 0, 1],
    ]
    # row 0 from 70: [70,96) [96,120); row 1: [0,20)
    assert direct["plain"] == [[0, 26, 50, 70], [0, 0, 1], [1, 2], [-1, -1]]


def test_each_export_is_the_state_at_its_position(kernels) -> None:
    """(b) vLLM's SSD scan (Triton interpreter) on the builder's layout, and vLLM's
    exporter called as the layer calls it: every export's block (the prompt
    checkpoint's and each extra's) holds the state at its position (the
    sequential float64 SSM's, and the scan's over the row's prefix alone) and the
    conv window ending there; the chunk it reads ends exactly on it; no other
    block is touched (the dropped exports' 1003, 1004, 1023 included)."""
    case = kernels["extras"]
    got = sorted((e["block"], e["position"]) for e in case["exports"])
    assert got == [(101, 96), (1001, 80), (1002, 48), (1011, 16), (1021, 128), (1022, 112)]
    for e in case["exports"]:
        where = f"block {e['block']} (position {e['position']})"
        assert e["chunk_end"] == e["position"] - (ROWS[e["row"] + 1][0] - ROWS[e["row"] + 1][1])
        assert e["block_is_chunk_state"], where
        assert e["block_vs_reference"] < 1e-4, where
        assert e["previous_chunk_vs_reference"] > 1e-2, where
        assert e["block_vs_prefix_alone"] < 1e-5, where
        assert e["conv_window"], where
    assert case["others_untouched"]
    assert case["final_vs_reference"] < 1e-4


def test_extras_leave_the_final_states_as_they_were(kernels) -> None:
    """(b) The extra chunk ends change no row's final state nor any output (up to
    float32 rounding over different chunk ends), and vLLM's own layout still
    exports the prompt checkpoint alone."""
    # The comparison is of the layout with the extra cuts (15 chunks, not 11).
    assert len(kernels["extras"]["exports"]) == 6
    assert kernels["final_extras_vs_plain"] < 1e-5
    assert kernels["y_extras_vs_plain"] < 1e-4
    plain = kernels["no_extras"]
    assert [(e["block"], e["position"]) for e in plain["exports"]] == [(101, 96)]
    assert plain["exports"][0]["block_vs_reference"] < 1e-4
    assert plain["others_untouched"]


def test_the_runner_reports_what_mamba2_wrote(on_tree) -> None:
    """(c) ``mamba_checkpoint_exports_written`` for Mamba2 groups (metadata field
    ``checkpoint_meta``): exactly the kept extras, each group into its own blocks;
    not the dropped ones (2, 100, 85), not a request outside the batch, and not a
    position a group whose layer declares no extras did not write."""
    report = on_tree[0]["report"]
    written = {"cold": [48, 80], "short": [16], "resumed": [112, 128]}
    assert report["one_group"]["written"] == written
    assert report["two_groups"]["written"] == written
    assert report["second_undeclared"]["written"] == {}
    extras = [1001, 1002, 1011, 1021, 1022]
    assert report["one_group"]["blocks"] == [[101, *extras]]
    assert report["two_groups"]["blocks"] == [[101, *extras], [151, *(b + 500 for b in extras)]]
    assert report["second_undeclared"]["blocks"] == [[101, *extras], []]


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")


def test_nemotron_h_keeps_the_fix_states_at_no_step_on_the_real_spec(tmp_path: Path) -> None:
    """The scheduler end, with the real ``MambaMixer2``'s declared spec (extras
    included): ``kit.rig.nemotron_h`` on this release's patched tree runs the 108
    Nemotron-H grid cases (blocks 64 and 384, k = 0 and 1, lookahead hashes), and
    every chunk end and hit is the geometry model's for a layer that writes the
    fix's states in the pass; for those cases the model gives the patched tree
    the unpatched tree's chunk ends or fewer (a prompt checkpoint the layer
    cannot put in the block table is exported, not a chunk end), so the fix adds
    no engine step."""
    from kit.geometry.geometry_cases import all_cases
    from kit.geometry.geometry_model import producer_chunk_ends
    from tests.regression.test_nemotron_h import run_nemotron_h

    result = run_nemotron_h(tmp_path, "--tree", f"{RELEASE}/patched")
    assert result["spec"]["prefill_checkpoint_extra_exports"] is True
    assert result["cases"] == 108 and result["differ"] == []
    for _, case in all_cases("internal-1"):
        if case.block in (64, 384) and case.num_spec in (0, 1):
            for lookahead in (0, 1):
                plain = producer_chunk_ends(case, False, lookahead)
                fixed = producer_chunk_ends(case, True, lookahead)
                assert set(fixed) <= set(plain) and fixed[-1] == plain[-1], case
