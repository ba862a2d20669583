"""Write the kit's tiny random-weight hybrid model (Qwen3-Next: GDN + full attention + MTP).

Only a config is written: vLLM runs it with ``load_format="dummy"`` and token-id
prompts, so nothing is downloaded and no weights are shipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Sized so that a prefill of a few thousand tokens costs visibly more than a
# scheduler step on two CPU cores, while the whole model stays in a few MB.
TINY_CONFIG: dict = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "linear_conv_kernel_dim": 4,
    # vLLM's CPU GDN kernel only takes the real model's head size.
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 65536,
    "vocab_size": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
}


def write_tiny_model(out_dir: Path) -> Path:
    """Write ``config.json`` into ``out_dir`` (created) and return the directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(TINY_CONFIG, indent=1, sort_keys=True) + "\n")
    tmp.replace(out_dir / "config.json")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(".models/tiny-qwen3-next"),
        help="directory to write config.json into (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    print(write_tiny_model(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
