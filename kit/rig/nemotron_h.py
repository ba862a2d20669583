"""A tiny Nemotron-H (Mamba2 + attention + MTP) on vLLM's real scheduler, with the
Mamba2 layer's own KV-cache spec.

The grid's ``internal-1`` regime declares what Mamba2 layers declare. Here the
spec comes from a real ``MambaMixer2`` built from a tiny Nemotron-H config (its
``get_kv_cache_spec``: one prefill checkpoint block, alignment 1, Mamba2's state
shapes), and the MTP drafter config is the one vLLM derives for Nemotron-H
(``nemotron_h_mtp``). Every grid case of blocks 64 and 384 with k = 0 and 1
then runs on the real scheduler with that spec, against the geometry model's
``internal-1`` prediction. Building the layer needs vLLM's (single-rank)
distributed state, so ``python -m kit.rig.nemotron_h`` runs it in a process of its
own on the tree it is given (``--tree``, else ``KIT_TREE``, else patched): unpatched,
patched, installed (the images' own) or ``<release>/<stage>`` for any release's tree
(``kit.vllm_tree.releases.select``, as the tests' ``KIT_TREE`` takes it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

TINY = {
    "vocab_size": 6000,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "hybrid_override_pattern": "M*M*",  # Mamba2, attention, Mamba2, attention
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_d_conv": 4,
    "expand": 1,
    "num_nextn_predict_layers": 1,
    "mtp_layers_block_type": ["full_attention"],
    "max_position_embeddings": 65536,
}


def write_config(out_dir: Path) -> Path:
    """The tiny Nemotron-H config (no weights: the scheduler needs none)."""
    from transformers import NemotronHConfig

    config = NemotronHConfig(**TINY)
    config.architectures = ["NemotronHForCausalLM"]
    config.save_pretrained(out_dir)
    return out_dir


def mamba2_spec(vllm_config):
    """The KV-cache spec a real MambaMixer2 layer of this config declares."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    hf = vllm_config.model_config.hf_config
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(vllm_config):
        # One rank, gloo, a file rendezvous: no network, nothing left behind.
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp}/rendezvous",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        layer = MambaMixer2(
            hidden_size=hf.hidden_size,
            ssm_state_size=hf.ssm_state_size,
            conv_kernel_size=hf.conv_kernel,
            intermediate_size=hf.mamba_num_heads * hf.mamba_head_dim,
            use_conv_bias=hf.use_conv_bias,
            use_bias=hf.use_bias,
            n_groups=hf.n_groups,
            num_heads=hf.mamba_num_heads,
            head_dim=hf.mamba_head_dim,
            rms_norm_eps=hf.layer_norm_epsilon,
            activation=hf.mamba_hidden_act,
            model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config,
            prefix="model.layers.0.mixer",
        )
        return layer.get_kv_cache_spec(vllm_config)


def check(fix: bool) -> dict:
    """Every grid case of blocks 64 and 384, k = 0 and 1, with the real Mamba2 spec."""
    from kit.geometry.geometry_cases import all_cases
    from kit.geometry.geometry_model import expected
    from kit.rig.sched_harness import build_vllm_config, run_case, tree_exports_block_boundary

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "tiny-nemotron-h")
        cases = [
            (cid, c)
            for cid, c in all_cases("internal-1")
            if c.block in (64, 384) and c.num_spec in (0, 1)
        ]
        # A speculative geometry, so the config also carries the MTP drafter vLLM derives.
        first = replace(cases[0][1].geometry, num_spec=1)
        vllm_config = build_vllm_config(model_dir, first, fix)
        drafter = vllm_config.speculative_config.draft_model_config.hf_config.model_type
        vllm_config.cache_config.mamba_block_size = first.block
        spec = mamba2_spec(vllm_config)
        rows, differ = 0, []
        boundary = tree_exports_block_boundary()
        for cid, case in cases:
            # Each case's block and draft count; the rest is the layer's own spec.
            layer = replace(spec, block_size=case.block, num_speculative_blocks=case.num_spec)
            rig, a, b, _ = run_case(model_dir, case, fix=fix, mamba_spec=layer)
            # As the layer declares: Mamba2 writes the fix's states in the pass where
            # the tree's worker patch makes it (fix-eagle-fine-prefix-exports); else
            # it writes the prompt checkpoint only and the fix declines the export.
            extra = bool(getattr(layer, "prefill_checkpoint_extra_exports", False))
            model_case = replace(
                case,
                geometry=replace(
                    case.geometry,
                    layer_extra_exports=extra,
                    fix_exports_block_boundary=boundary,
                ),
            )
            lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
            want = expected(model_case, patched=fix, lookahead=lookahead)
            got = (tuple(rig.chunk_ends[a.request_id]), b.hit, b.resumed_from_own_prefix())
            if got != (want.chunk_ends, want.hit, True):
                differ.append({"case": cid, "got": got, "model": [want.chunk_ends, want.hit]})
            rows += 1
    return {
        "drafter": drafter,
        "spec": {
            "num_prefill_checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
            "prefill_checkpoint_alignment": spec.prefill_checkpoint_alignment,
            "prefill_checkpoint_extra_exports": bool(
                getattr(spec, "prefill_checkpoint_extra_exports", False)
            ),
            "mamba_type": str(spec.mamba_type.name),
            "shapes": [list(s) for s in spec.shapes],
        },
        "cases": rows,
        "differ": differ,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tree",
        metavar="TREE",
        help="the vLLM tree: unpatched, patched, installed (the images' own) or "
        "<release>/<stage>, a release in pins.toml (default: KIT_TREE, else patched)",
    )
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    from kit.vllm_tree import mods, releases, sdists, trees

    try:
        tree = releases.select(args.tree)
        tree.activate()
    except (releases.ReleaseError, mods.ModError, sdists.SdistError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # A release's tree from its sdist runs on vLLM's CPU platform with the release plugin.
    trees.prepare(tree.from_sdist)
    # A patched tree (any release's, or an image's) runs with the fix switched on.
    result = check(fix=tree.patched)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 1 if result["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
