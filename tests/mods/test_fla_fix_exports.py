"""Internal checkpoints on vLLM 0.34.0's Triton/FLA GDN path (mod
``fix-eagle-fine-prefix-exports``), checked on the CPU with vLLM's real kernels.

Where the GDN prefill runs on Triton (FLA: ROCm without the HIP kernel, CUDA
where FlashInfer is not chosen), stock 0.34.0 declares no internal checkpoint,
so the scheduler ends a chunk at every state it keeps (the split path). FLA's
chunk kernel already holds each sequence's state before every 64-token chunk
(``h``). With the mod the layer declares the same 64-token grid as on
FlashInfer; for a batch that exports, FLA's chunk kernel also stores the
planned states, in float32 from its running state, straight into the layer's
checkpoint workspace (``h`` stays in q's dtype, as stock's: no float32 copy of
it), and the off-grid ones run as short tails, in the same pass.

Two sides, as in ``test_mamba2_fix_exports.py``:

- on the release tree's patched stage (``on-tree``): vLLM's own
  ``GDNAttentionMetadataBuilder`` on its Triton backend (what the CPU resolves)
  plans a batch with a decode row, vLLM's prompt checkpoints and the fix's
  extras, on and off the grid;
- under Triton's interpreter (.venv-triton): vLLM's FLA kernels, from the
  tree's files, run that plan the way the layer does
  (``chunk_gated_delta_rule_with_chunk_states`` into a workspace, then the
  tails through FLA with the plan's chunk metadata). Every export must be bit
  for bit the final state of FLA run over the row's tokens up to it (the float32
  state the split path stores) and near a float64 sequential recurrence; the
  output and final states must be bit for bit stock FLA's, and nothing the
  call allocates may be a float32 ``h``.

Not run here: the layer's forward itself (its conv and projections need
vLLM's custom ops) and the exporter's block writes (``test_flashinfer_fix_exports.py``
runs that kernel on the same plan layout).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods.release_side import (
    batch_metadata,
    export_rows,
    on_tree_config,
    run_interpreted,
    run_on_tree,
)

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 256  # Mamba block (align mode)
GRID = 64  # FLA's chunk, the layer's checkpoint grid with H = 64
# With H = 128 the grid is 128: a tail may span two of FLA's 64-token chunks.
GRIDS = (GRID, 128)
STATE_LEN = 3
COLS = 8
# Rows (seq_len, query_len, prefilling); exports (position, block) per row.
DECODE = (500, 1, False)
COLD = (600, 600, True)  # prompt checkpoint at 576; extras 512, 448 (grid), 500 (tail)
RESUMED = (1000, 300, True)  # query from 700: extras at offsets 128, 256 and 196 (a tail)
SHORT = (130, 130, True)  # one block: no checkpoint, but emitted at the batch stride
ROWS = [DECODE, COLD, RESUMED, SHORT]
EXPORTS = {
    1: [(512, 1001), (448, 1002), (500, 1003)],
    2: [(828, 1011), (956, 1012), (896, 1013)],
}


def _on_tree(model_dir: Path, out: Path) -> None:
    """Each grid's plan as ``plan-<grid>.json``; the literal checks in the 64 one."""
    for grid in GRIDS:
        (out / f"plan-{grid}.json").write_text(json.dumps(_plan(model_dir, grid), indent=1))


def _plan(model_dir: Path, grid: int) -> dict:
    from types import SimpleNamespace

    import torch
    import vllm.v1.attention.backends.gdn_attn as gdn_attn
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionMetadataBuilder,
        fla_chunk_state_sources,
        fla_tail_chunks,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    from kit.geometry.geometry_model import Geometry

    # The grid is lcm(H, 64): H = grid here.
    config = on_tree_config(model_dir, Geometry(BLOCK, grid, 1, checkpoints="internal-grid"))
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((5, STATE_LEN), (2, 4, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=grid,
        prefill_checkpoint_extra_exports=True,
    )
    common = batch_metadata(ROWS, EXPORTS, COLS)
    # The CPU stands in for CUDA: on the CPU platform itself the builder plans
    # pieces instead (test_cpu_fix_exports.py).
    gdn_attn.current_platform = SimpleNamespace(is_cpu=lambda: False)
    builder = GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
    md = builder.build(0, common)
    plan = md.flashinfer_checkpoint_plan
    tails = plan.tails
    exports = export_rows(plan.export_query_starts, plan.exports, plan.rows)
    result = {
        "backend": builder.gdn_prefill_backend,
        "plans": builder.plan_flashinfer_checkpoints,
        "num_decode_tokens": md.num_decode_tokens,
        "every_n_tokens": plan.every_n_tokens,
        "num_checkpoints": plan.num_checkpoints,
        "prefill_query_start_loc": md.prefill_query_start_loc.tolist(),
        "has_initial_state": md.prefill_has_initial_state.tolist(),
        "chunk_indices": md.chunk_indices.tolist(),
        "chunk_offsets": md.chunk_offsets.tolist(),
        "chunk_states": plan.chunk_states.tolist(),
        "exports": exports,
        "tails": {
            "token_indices": tails.token_indices.tolist(),
            "cu_seqlens": tails.cu_seqlens.tolist(),
            "sources": tails.sources.tolist(),
            "sequences": tails.sequences.tolist(),
            "chunk_indices": tails.chunk_indices.tolist(),
            "chunk_offsets": tails.chunk_offsets.tolist(),
        },
        "sources_literal": {
            "every_64": fla_chunk_state_sources(64, [130, 64, 200], 64),
            "every_128": fla_chunk_state_sources(128, [300, 256], 64),
        },
        "tail_chunks_literal": fla_tail_chunks([52, 116, 64, 1], 64),
    }
    if grid != GRID:
        return result
    result["layer_calls"] = _layer_calls(md)
    # KDA on Triton (Kimi-K3 on ROCm) shares this builder with a 64-token grid and
    # no extras: it plans its own checkpoints, not these.
    from dataclasses import replace

    kda_like = replace(spec, prefill_checkpoint_extra_exports=False)
    result["plans_without_extras"] = GDNAttentionMetadataBuilder(
        kda_like, ["layer"], config, torch.device("cpu")
    ).plan_flashinfer_checkpoints
    # Who opts in: on CUDA or ROCm only with the fix switched on and EAGLE/MTP
    # (on a platform that is neither: the CPU's own case is in
    # test_cpu_fix_exports.py).
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as layer

    spec_config = config.speculative_config
    platform = layer.current_platform
    platform.is_cpu = lambda: False
    opts_in = {}
    for cuda_alike, fix, speculative in itertools.product((True, False), repeat=3):
        platform.is_cuda_alike = lambda value=cuda_alike: value
        config.cache_config.enable_mamba_eagle_predecessor_checkpoint = fix
        config.speculative_config = spec_config if speculative else None
        key = f"cuda_alike={cuda_alike} fix={fix} speculative={speculative}"
        opts_in[key] = layer.fix_exports_in_pass(config)
    del platform.is_cuda_alike, platform.is_cpu  # the platform class's own again
    config.speculative_config = spec_config
    result["opts_in"] = opts_in
    try:
        fla_chunk_state_sources(96, [300], 64)
        result["sources_literal"]["off_chunk"] = "accepted"
    except ValueError as exc:
        result["sources_literal"]["off_chunk"] = str(exc)
    return result


def _layer_calls(md) -> dict:
    """The layer's FLA prefill and warm-up on a stub layer, no kernel launched:
    what they hand FLA's chunk call and where its states go."""
    import types

    import torch
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as layer

    plan = md.flashinfer_checkpoint_plan
    heads, dim = 2, 64
    spec = ((plan.num_checkpoints + 4, heads, dim, dim), torch.float32)
    workspace = torch.zeros(spec[0], dtype=spec[1])
    calls: list[dict] = []

    def chunk_call(**kwargs):
        states = kwargs["chunk_states"]
        calls.append(
            {
                "into_workspace": states.data_ptr() == workspace.data_ptr(),
                "rows": states.shape[0],
                "dtype": str(states.dtype),
                "sources": kwargs["chunk_state_sources"].tolist(),
                "keywords": sorted(kwargs),
            }
        )
        n = kwargs["initial_state"].shape[0]
        return torch.zeros_like(kwargs["v"]), torch.zeros(n, heads, dim, dim)

    exported: list[bool] = []

    def export(_md, recurrent, *args, **kwargs):
        exported.append(recurrent.data_ptr() == workspace.data_ptr())

    manager = types.SimpleNamespace(get_simultaneous=lambda *specs: (workspace,))
    saved = (
        layer.fla_chunk_gated_delta_rule_with_chunk_states,
        layer.current_workspace_manager,
        layer.fused_post_conv_prep,
        layer.fla_tail_prefill,
        torch.accelerator.empty_cache,
    )
    layer.fla_chunk_gated_delta_rule_with_chunk_states = chunk_call
    layer.current_workspace_manager = lambda: manager
    stub = types.SimpleNamespace(_checkpoint_buffer_spec=spec, _export_checkpoints=export)
    cls = layer.QwenGatedDeltaNetAttention
    tokens = int(md.prefill_query_start_loc[-1])
    inputs = [torch.zeros(1, tokens, 1, dim)] * 2 + [torch.zeros(1, tokens, heads, dim)]
    inputs += [torch.zeros(1, tokens, heads)] * 2
    rows = md.prefill_query_start_loc.numel() - 1
    caches = {"ssm_state": None, "conv_state": None, "conv_input": None}
    result: dict = {}
    try:
        cls._forward_fla_prefill(stub, *inputs, md, torch.zeros(rows, heads, dim, dim), **caches)
        result["prefill"] = calls[:]
        result["exported_from_workspace"] = exported[:]
        # A plan with more states than the profiled workspace is refused
        # before any kernel writes.
        calls.clear()
        stub._checkpoint_buffer_spec = ((plan.num_checkpoints - 1, heads, dim, dim), torch.float32)
        workspace = torch.zeros(plan.num_checkpoints - 1, heads, dim, dim)
        try:
            cls._forward_fla_prefill(
                stub, *inputs, md, torch.zeros(rows, heads, dim, dim), **caches
            )
            result["short_workspace"] = "accepted"
        except RuntimeError as exc:
            result["short_workspace"] = f"refused: {exc}"
        result["short_workspace_calls"] = len(calls)

        # The warm-up compiles the variant a batch that exports launches.
        calls.clear()
        workspace = torch.zeros(spec[0], dtype=spec[1])
        stub._checkpoint_buffer_spec = spec
        layer.fused_post_conv_prep = lambda **kw: (
            torch.zeros(64, 1, dim),
            torch.zeros(64, 1, dim),
            torch.zeros(64, heads, dim),
            torch.zeros(64, heads),
            torch.zeros(64, heads),
        )
        layer.fla_tail_prefill = lambda **kw: None
        torch.accelerator.empty_cache = lambda: None
        warm = types.SimpleNamespace(
            _prefill_kernels_warmed_up=False,
            gdn_prefill_backend="triton",
            _exports_checkpoints=True,
            _checkpoint_buffer_spec=spec,
            num_k_heads=1,
            num_v_heads=heads,
            tp_size=1,
            head_k_dim=dim,
            head_v_dim=dim,
            A_log=None,
            dt_bias=None,
            prefix="layer",
            get_state_dtype=lambda: (torch.float32, torch.float32),
            chunk_gated_delta_rule=lambda **kw: None,
        )
        cls._warmup_prefill_kernels(warm, torch.zeros(64, 2 * dim + heads * dim), 0)
        result["warmup"] = calls[:]
    finally:
        (
            layer.fla_chunk_gated_delta_rule_with_chunk_states,
            layer.current_workspace_manager,
            layer.fused_post_conv_prep,
            layer.fla_tail_prefill,
            torch.accelerator.empty_cache,
        ) = saved
    return result


# --------------------------------------------------------------------------
# The .venv-triton side: vLLM's FLA kernels on the builder's plan
# --------------------------------------------------------------------------

_TRITON_SIDE = r"""
import json, sys
from pathlib import Path
import torch

kit_dir, tree_root, plan_json, out = map(Path, sys.argv[1:5])
sys.path.insert(0, str(kit_dir / "kernels"))
sys.path.insert(0, str(kit_dir.parent))
import triton_check
from kit.kernels.check import _bf16_normal, _float64_states

chunk = triton_check.load_fla(tree_root)
plan = json.loads(plan_json.read_text())
half = torch.float16 if triton_check.interpreting() else torch.bfloat16
K_HEADS, V_HEADS, D = 1, 2, 64
qsl = plan["prefill_query_start_loc"]
total = qsl[-1]
gen = torch.Generator().manual_seed(34)
q = _bf16_normal(gen, 1, total, K_HEADS, D).to(half)
k = _bf16_normal(gen, 1, total, K_HEADS, D).to(half)
q = torch.nn.functional.normalize(q.float(), dim=-1).to(half)
k = torch.nn.functional.normalize(k.float(), dim=-1).to(half)
v = _bf16_normal(gen, 1, total, V_HEADS, D).to(half)
g = -(torch.rand(1, total, V_HEADS, generator=gen) * 0.4 + 0.01)
beta = torch.rand(1, total, V_HEADS, generator=gen).clamp(0.05).to(half)
h0 = torch.randn(len(qsl) - 1, V_HEADS, D, D, generator=gen) * 0.1
for n, has in enumerate(plan["has_initial_state"]):
    if not has:
        h0[n] = 0
cu = torch.tensor(qsl, dtype=torch.int64)
ci = torch.tensor(plan["chunk_indices"], dtype=torch.int64)
co = torch.tensor(plan["chunk_offsets"], dtype=torch.int64)

# The layer's path: FLA's chunk kernel storing the planned states into a
# workspace (NaN where nothing is written), h as stock's. Every tensor the call
# makes is recorded (a float32 h would be a 5-d float32 one), and h's dtype.
from torch.utils._python_dispatch import TorchDispatchMode

sources = torch.tensor(plan["chunk_states"])
workspace = torch.full((len(sources) + 2, V_HEADS, D, D), float("nan"))
made, h_dtypes = [], []

class Allocations(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                made.append((str(t.dtype), list(t.shape)))
        return out

fwd_h = chunk.chunk_gated_delta_rule_fwd_h
def recording_fwd_h(*args, **kwargs):
    h, v_new, final_state = fwd_h(*args, **kwargs)
    h_dtypes.append(str(h.dtype))
    return h, v_new, final_state

chunk.chunk_gated_delta_rule_fwd_h = recording_fwd_h
with Allocations():
    o, final = chunk.chunk_gated_delta_rule_with_chunk_states(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu,
        chunk_states=workspace[: len(sources)], chunk_state_sources=sources,
        chunk_indices=ci, chunk_offsets=co,
    )
chunk.chunk_gated_delta_rule_fwd_h = fwd_h
emitted = workspace[: len(sources)]
# Stock FLA on the same batch: its output and final states, and (the kernels
# loaded at GDN_RECOMPUTE_SUPPRESS_LEVEL 3) its h in the inputs' dtype.
stock_o, stock_final = chunk.chunk_gated_delta_rule(
    q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
    cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co,
)
_, _, _, _, _, stock_h, _ = chunk.chunk_gated_delta_rule_fwd(
    q=q, k=k, v=v, g=g, beta=beta, scale=D ** -0.5, initial_state=h0,
    output_final_state=True, cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co,
)
on_h = sources >= 0
finals_of = (-1 - sources[~on_h])
# The tails, as run_flashinfer_tails runs them with fla_tail_prefill.
t = {key: torch.tensor(val) for key, val in plan["tails"].items()}
start = h0[t["sequences"]].to(torch.float32)
picked = emitted[t["sources"].clamp(min=0)]
start = torch.where((t["sources"] >= 0).view(-1, 1, 1, 1), picked, start)
index = t["token_indices"]
_, tail_states = chunk.chunk_gated_delta_rule(
    q=q[:, index], k=k[:, index], v=v[:, index], g=g[:, index], beta=beta[:, index],
    initial_state=start, output_final_state=True, cu_seqlens=t["cu_seqlens"],
    chunk_indices=t["chunk_indices"].view(-1, 2), chunk_offsets=t["chunk_offsets"],
)
recurrent = torch.cat([emitted, tail_states])

checks = []
for e in plan["exports"]:
    if e["block"] == 0:
        continue
    n = qsl.index(e["start"] - plan["num_decode_tokens"])
    a, p = qsl[n], e["offset"]
    got = recurrent[e["row"]]
    # What the split path stores: FLA over the row's first p tokens.
    sl = slice(a, a + p)
    _, prefix_final = chunk.chunk_gated_delta_rule(
        q=q[:, sl], k=k[:, sl], v=v[:, sl], g=g[:, sl], beta=beta[:, sl],
        initial_state=h0[n : n + 1], output_final_state=True,
        cu_seqlens=torch.tensor([0, p]),
    )
    ref = _float64_states(
        q[0, sl].float(), k[0, sl].float(), v[0, sl].float(), g[0, sl],
        beta[0, sl].float(), h0[n].transpose(-1, -2).double(), [p],
    )[0].transpose(-1, -2)
    scale = float(ref.abs().max())
    checks.append({
        "sequence": n, "offset": p, "block": e["block"],
        "tail": e["row"] >= plan["num_checkpoints"],
        "split_bitwise": bool(torch.equal(got, prefix_final[0].float())),
        "reference_rel": float((got.double() - ref).abs().max()) / scale,
    })
num_chunks = stock_h.shape[1]
json.dump({
    "exports": checks,
    "output_bitwise": bool(torch.equal(o, stock_o)),
    "final_bitwise": bool(torch.equal(final, stock_final)),
    "h_dtypes": h_dtypes,
    "q_dtype": str(q.dtype),
    "float32_h_made": [
        shape for dtype, shape in made
        if dtype == "torch.float32" and len(shape) == 5 and shape[1] == num_chunks
    ],
    "float32_5d_made": [
        shape for dtype, shape in made if dtype == "torch.float32" and len(shape) == 5
    ],
    # Each state on a chunk rounds to stock's h there; each at an end is the
    # sequence's final state; the workspace past the plan is left alone.
    "rounds_to_stock_h": bool(torch.equal(emitted[on_h].to(half), stock_h[0, sources[on_h]])),
    "finals_bitwise": bool(torch.equal(emitted[~on_h], stock_final[finals_of])),
    "written": bool(not emitted.isnan().any()),
    "rest_untouched": bool(workspace[len(sources):].isnan().all()),
}, open(out, "w"), indent=1)
"""


@pytest.fixture(scope="module")
def plans(
    release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, tuple[dict, Path]]:
    out = tmp_path_factory.mktemp("fla-exports")
    run_on_tree(__file__, release_tree, str(tiny_model_dir), str(out))
    return {
        grid: (json.loads((out / f"plan-{grid}.json").read_text()), out / f"plan-{grid}.json")
        for grid in GRIDS
    }


@pytest.fixture(scope="module")
def plan(plans) -> tuple[dict, Path]:
    return plans[GRID]


def _run_kernels(plan_json: Path, release_tree: trees.Tree, triton_env: Path) -> dict:
    result = plan_json.with_suffix(".kernels.json")
    run_interpreted(
        triton_env,
        _TRITON_SIDE,
        str(ROOT / "kit"),
        str(release_tree.package.parent),
        str(plan_json),
        str(result),
        timeout=900,
    )
    return json.loads(result.read_text())


@pytest.fixture(scope="module", params=GRIDS, ids=lambda grid: f"grid{grid}")
def kernels(request, plans, release_tree: trees.Tree, triton_env: Path) -> dict:
    return _run_kernels(plans[request.param][1], release_tree, triton_env)


@pytest.fixture(scope="module")
def kernels_one_chunk_early(plan, release_tree: trees.Tree, triton_env: Path) -> dict:
    """The same plan with every state taken from h one chunk early."""
    early = dict(plan[0])
    early["chunk_states"] = [s - 1 if s > 0 else s for s in plan[0]["chunk_states"]]
    path = plan[1].with_name("early.json")
    path.write_text(json.dumps(early))
    return _run_kernels(path, release_tree, triton_env)


def test_the_triton_backend_plans_internal_checkpoints(plan) -> None:
    """The CPU resolves the Triton backend: with the grid declared, vLLM's builder
    plans the batch's states (stock 0.34.0 plans only FlashInfer's)."""
    got = plan[0]
    assert (got["backend"], got["plans"]) == ("triton", True)
    assert got["plans_without_extras"] is False
    # One stride for the batch: 64 (500 and 196 are tails from 448 and 192).
    assert got["every_n_tokens"] == 64
    exports = sorted((e["start"], e["offset"], e["block"]) for e in got["exports"])
    # Non-spec starts: the decode row's one token, then COLD, RESUMED, SHORT.
    cold, resumed = 1, 601
    assert [(s, o, b) for s, o, b in exports if b] == sorted(
        [
            (cold, 576, 102),  # vLLM's prompt checkpoint, where its builder puts it
            (cold, 512, 1001),
            (cold, 448, 1002),
            (cold, 500, 1003),
            (resumed, 128, 1011),
            (resumed, 256, 1012),
            (resumed, 196, 1013),
        ]
    )


def test_only_the_fix_with_speculation_opts_in(plan) -> None:
    """In-pass checkpoints on FLA change which states a prefill keeps (vLLM's grid
    checkpoint instead of block-boundary chunk ends), so the layer takes them only
    for the fix: switched on, with EAGLE/MTP, where the prefill runs on a GPU."""
    opts_in = plan[0]["opts_in"]
    assert opts_in.pop("cuda_alike=True fix=True speculative=True") is True
    assert len(opts_in) == 7 and not any(opts_in.values()), opts_in


def test_chunk_state_sources_point_into_h_or_the_final_state(plan) -> None:
    """Literal layouts: h holds sequence n's state after i chunks at
    ``chunk_offsets[n] + i``; a state at the query's end is the final state."""
    lit = plan[0]["sources_literal"]
    # [130, 64, 200]: chunk offsets 0, 3, 4; states after 64 and 128 of the
    # first, the end (64) of the second, after 64, 128 and 192 of the third.
    assert lit["every_64"] == [1, 2, -2, 5, 6, 7]
    # [300, 256] every 128: chunk offsets 0, 5; 128, 256 | 128, then 256 = end.
    assert lit["every_128"] == [2, 4, 7, -2]
    assert "not every 96" in lit["off_chunk"]
    got = plan[0]
    # The batch: COLD (600) chunk 0-9, RESUMED (300) 10-14, SHORT (130) 15-17.
    assert got["chunk_offsets"] == [0, 10, 15, 18]
    assert got["chunk_states"] == (list(range(1, 10)) + list(range(11, 15)) + [16, 17])


def test_the_layer_has_fla_store_the_states_into_the_workspace(plan) -> None:
    """``_forward_fla_prefill`` hands FLA's chunk call the profiled workspace's
    first ``num_checkpoints`` rows and the plan's sources (no float32 ``h``, no
    gather after it), exports from that workspace, and refuses a plan the
    workspace cannot hold before anything is written."""
    calls = plan[0]["layer_calls"]
    (call,) = calls["prefill"]
    assert call["into_workspace"] and call["dtype"] == "torch.float32"
    assert call["rows"] == len(plan[0]["chunk_states"])
    assert call["sources"] == plan[0]["chunk_states"]
    assert "chunk_state_dtype" not in call["keywords"]
    assert calls["exported_from_workspace"] == [True]
    assert calls["short_workspace"].startswith("refused")
    assert calls["short_workspace_calls"] == 0


def test_the_warm_up_compiles_the_storing_variant(plan) -> None:
    """The profile run's warm-up launches the chunk kernel with states to store
    (float32 rows of the workspace): the variant, and autotuner key, a batch
    that exports launches."""
    (call,) = plan[0]["layer_calls"]["warmup"]
    assert call["into_workspace"] and call["dtype"] == "torch.float32"
    assert call["rows"] == 1 and call["sources"] == [-1]


def test_tails_carry_fla_chunk_metadata(plans) -> None:
    """FLA's chunk_indices/chunk_offsets for the tails, from the host: one chunk per
    64 tokens of each (prepare_chunk_indices/prepare_chunk_offsets' layout)."""
    assert plans[GRID][0]["tail_chunks_literal"] == [
        [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0]],
        [0, 1, 3, 4, 5],
    ]
    tails = plans[GRID][0]["tails"]
    assert tails["cu_seqlens"] == [0, 52, 56]  # 500 from 448, 196 from 192
    assert tails["chunk_indices"] == [[0, 0], [1, 0]]
    assert tails["chunk_offsets"] == [0, 1, 2]
    # Grid 128: 448 and 500 from 384, 196 from 128: 64, 116 and 68 tokens, the
    # last two over two chunks each.
    wide = plans[128][0]["tails"]
    assert wide["cu_seqlens"] == [0, 64, 180, 248]
    assert wide["chunk_indices"] == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1]]
    assert wide["chunk_offsets"] == [0, 1, 3, 5]


def test_every_export_is_the_split_paths_state_bit_for_bit(kernels) -> None:
    """The state the layer exports equals FLA's final state over the row's tokens
    up to that position, which the split path would have stored, and agrees with
    a float64 sequential recurrence."""
    checks = kernels["exports"]
    assert len(checks) >= 7
    assert any(c["tail"] for c in checks)
    for c in checks:
        assert c["split_bitwise"], c
        assert c["reference_rel"] < 0.02, c


def test_a_plan_one_chunk_early_fails(kernels_one_chunk_early) -> None:
    """The comparison sees a state taken from the wrong chunk of h, tails included
    (they start from a picked state)."""
    checks = kernels_one_chunk_early["exports"]
    assert not any(c["split_bitwise"] for c in checks)
    assert any(c["reference_rel"] > 0.1 for c in checks)


def test_storing_the_states_changes_nothing_else(kernels) -> None:
    """The chunk kernel's extra stores leave the output and the final states bit
    for bit as stock FLA gives them."""
    assert kernels["output_bitwise"]
    assert kernels["final_bitwise"]


def test_a_batch_that_exports_makes_no_float32_h(kernels) -> None:
    """h stays in q's dtype (stock's, what the profile run makes): the planned
    states go from the kernel's float32 running state straight into the
    workspace, whose rows past the plan it leaves alone. No 5-d float32 tensor
    (a float32 h, [1, NT, H, V, K]) is made by the call."""
    assert kernels["h_dtypes"] == [kernels["q_dtype"]]
    assert kernels["float32_h_made"] == [] and kernels["float32_5d_made"] == []
    assert kernels["written"] and kernels["rest_untouched"]


def test_the_stored_states_are_the_kernels_float32_states(kernels) -> None:
    """Each state stored on a chunk rounds to stock's h at that chunk (the same
    running state, before h's cast), each at a row's end is its final state."""
    assert kernels["rounds_to_stock_h"]
    assert kernels["finals_bitwise"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")
