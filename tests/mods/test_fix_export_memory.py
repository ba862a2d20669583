"""Memory of the fix's extra states on vLLM 0.34.0's FlashInfer/FLA GDN path
(mod ``fix-eagle-fine-prefix-exports``), checked on the CPU.

The emitted states and the tails' states share the layer's checkpoint workspace,
which the profile run sizes (``_checkpoint_buffer_spec``). With H = 48 the grid is
lcm(48, 64) = 192, so a tail spans up to 191 tokens, and a batch of many rows with
exports off the grid has more tails than the workspace has room for. The builder
must cap them (left out: not reported, so never keyed), and ``_export_checkpoints``
must never allocate a buffer past the workspace (the old ``torch.cat`` fallback).

``KIT_EXPORTS_TREE`` (a ``vllm`` package directory built like the release's patched
tree) runs the same checks on another build, e.g. one from an older mod.patch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import releases, trees
from tests.mods.release_side import RELEASE, batch_metadata, on_tree_config, run_on_tree

pytestmark = pytest.mark.cpu

UNIT = 48  # H: the grid is lcm(48, 64) = 192
GRID = 192
BLOCK = 384
BUDGET = 8192  # max_num_batched_tokens
WIDTH, HEADS, V_DIM, K_DIM = 5, 2, 3, 4
STATE_LEN = 3
COLS = 4
# 20 prefill rows of 400 tokens, each with two exports off the grid: 100 (a tail
# of 100 tokens from the initial state) and 380 (188 tokens from the state at 192).
NUM_ROWS = 20
ROWS = [(400, 400, True)] * NUM_ROWS
EXPORTS = {r: [(100, 2000 + 2 * r), (380, 2001 + 2 * r)] for r in range(NUM_ROWS)}


def _on_tree(model_dir: Path, out: Path) -> None:
    import types

    import torch
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as layer_mod
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from kit.geometry.geometry_model import Geometry

    config = on_tree_config(model_dir, Geometry(BLOCK, UNIT, 1, checkpoints="internal-grid"))
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((WIDTH, STATE_LEN), (HEADS, V_DIM, K_DIM)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=GRID,
        prefill_checkpoint_extra_exports=True,
        prefill_checkpoint_conv_window=STATE_LEN,
    )
    builder = GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
    builder.gdn_prefill_backend = "flashinfer"  # Hopper/Blackwell only; host code
    builder.plan_flashinfer_checkpoints = True
    md = builder.build(0, batch_metadata(ROWS, EXPORTS, COLS))
    plan = md.flashinfer_checkpoint_plan
    num_tails = 0 if plan.tails is None else plan.tails.sources.numel()
    tail_lens = [] if plan.tails is None else plan.tails.cu_seqlens.diff().tolist()

    # The layer's workspace, as its own spec sizes it for this geometry.
    layer_mod.get_mamba_prefill_checkpoint_grid = lambda _config: GRID
    stub = types.SimpleNamespace(
        _max_num_batched_tokens=BUDGET,
        vllm_config=config,
        num_v_heads=HEADS,
        tp_size=1,
        head_v_dim=V_DIM,
        head_k_dim=K_DIM,
    )
    cls = layer_mod.QwenGatedDeltaNetAttention
    (shape, dtype) = cls._checkpoint_buffer_spec.func(stub)

    # _export_checkpoints on that workspace: the tails' states must land in it
    # (data_ptr identity), with no torch.cat nor any buffer past it.
    tokens = sum(q for _, q, _ in ROWS)
    seen: list[tuple[int, int]] = []

    class Recorder:
        def export(self, checkpoint, *, recurrent_checkpoint, **_):
            seen.append((recurrent_checkpoint.data_ptr(), recurrent_checkpoint.shape[0]))

    def tail_prefill(*, q, initial_state, cu_seqlens, **_):
        return None, torch.ones(cu_seqlens.numel() - 1, *initial_state.shape[1:])

    def export(rows: int) -> dict:
        workspace = torch.zeros(rows, *shape[1:], dtype=dtype)
        seen.clear()
        cats = []
        real_cat = torch.cat

        def counting_cat(*args, **kwargs):
            cats.append(1)
            return real_cat(*args, **kwargs)

        torch.cat = counting_cat
        try:
            cls._export_checkpoints(
                types.SimpleNamespace(_checkpoint_exporter=Recorder()),
                md,
                workspace,
                tuple(torch.zeros(1, tokens, HEADS, d) for d in (K_DIM, K_DIM, V_DIM))
                + (torch.zeros(1, tokens, HEADS), torch.zeros(1, tokens, HEADS)),
                torch.zeros(NUM_ROWS, HEADS, V_DIM, K_DIM),
                ssm_state=torch.zeros(1),
                conv_state=torch.zeros(1),
                conv_input=torch.zeros(tokens, WIDTH),
                prefill=tail_prefill,
            )
            outcome = "exported"
        except RuntimeError as exc:
            outcome = f"refused: {exc}"
        finally:
            torch.cat = real_cat
        same = bool(seen) and seen[0][0] == workspace.data_ptr()
        return {"outcome": outcome, "same_buffer": same, "cats": len(cats)}

    kept = md.checkpoint.kept_extra_exports or []
    results = {
        "workspace_rows": shape[0],
        "num_checkpoints": plan.num_checkpoints,
        "num_tails": num_tails,
        "tail_lens": tail_lens,
        "kept": [list(p) for p in kept],
        "export_rows": plan.exports.checkpoint_offsets.numel(),
        "num_prompt_checkpoints": len(md.checkpoint.offsets),
        "dropped": getattr(builder, "num_dropped_tail_exports", None),
        "max_tails": getattr(
            sys.modules["vllm.v1.attention.backends.gdn_attn"], "FLASHINFER_GDN_MAX_TAILS", None
        ),
        "full": export(shape[0]),
        # One row short of what the plan needs: refused, never a new buffer.
        "short": export(plan.num_checkpoints + num_tails - 1),
    }
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:2] == ["on-tree"]:
    _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    sys.exit(0)


@pytest.fixture(scope="module")
def tree() -> trees.Tree:
    other = os.environ.get("KIT_EXPORTS_TREE")
    if not other:
        return releases.tree(RELEASE, "patched")
    deps = releases.ensure_deps(RELEASE)
    return trees.Tree("patched", Path(other), extra_paths=(deps,), from_sdist=True)


@pytest.fixture(scope="module")
def on_tree(tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fix-export-memory")
    run_on_tree(__file__, tree, str(tiny_model_dir), str(out))
    return json.loads((out / "results.json").read_text())


def test_h48_tails_stay_within_the_profiled_workspace(on_tree: dict) -> None:
    """Emitted and tail states together fit the workspace the profile run sizes;
    each tail is shorter than the grid (191 tokens at most with H = 48), and the
    batch's tails are at most FLASHINFER_GDN_MAX_TAILS."""
    r = on_tree
    assert r["num_checkpoints"] + r["num_tails"] <= r["workspace_rows"], r
    assert r["max_tails"] is not None, "the tree caps no tails"
    assert 0 < r["num_tails"] <= r["max_tails"]
    assert all(0 < n < GRID for n in r["tail_lens"]) and max(r["tail_lens"]) == 188


def test_tails_left_out_are_counted_and_not_reported(on_tree: dict) -> None:
    """40 tails offered, the cap kept: the rest are neither export rows nor in the
    report (so the scheduler never keys their blocks), and the builder counts them."""
    r = on_tree
    assert r["dropped"] == 2 * NUM_ROWS - r["num_tails"]
    assert len(r["kept"]) == r["num_tails"]
    assert r["export_rows"] == r["num_prompt_checkpoints"] + len(r["kept"])
    # Each row's highest tail first (its prompt checkpoint where it has one), in
    # row order: the first rows keep 380, the later ones nothing.
    assert r["kept"][:2] == [[0, 380], [1, 380]]


def test_exports_on_a_full_workspace_allocate_nothing_new(on_tree: dict) -> None:
    """The exporter reads the tails' states from the workspace itself (same
    data_ptr, no torch.cat); a plan that would not fit is refused, not concatenated."""
    full, short = on_tree["full"], on_tree["short"]
    assert full == {"outcome": "exported", "same_buffer": True, "cats": 0}
    assert short["outcome"].startswith("refused") and short["cats"] == 0
