"""Write the kit's tiny random-weight hybrid model (Qwen3-Next: GDN + full attention + MTP).

The config is shipped; the weights are made here from a fixed seed (torch's
CPU generator, so every run and every image writes the same bytes; the bench
records their sha256). Nothing is downloaded and no weights are shipped.

Why not vLLM's ``load_format="dummy"``: it fills every weight from
U(-1e-3, 1e-3), and the model then answers the same token whatever the
context, so comparing a cached answer with a cold one could never fail.
With the usual initialisation (normal, std 0.02) the answer depends on the
context and therefore on the restored Mamba state. The MTP layer (``mtp.*``,
the names vLLM's Qwen3-Next MTP loader reads) starts as a copy of the last
full-attention layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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


SEED = 20261202
WEIGHTS = "model.safetensors"


def write_tiny_model(out_dir: Path, weights: bool = False, mtp_modules: int = 1) -> Path:
    """Write ``config.json`` (and with ``weights`` the seeded weights) into ``out_dir``.

    ``mtp_modules`` > 1 declares that many NEXTN layers (config only, for the
    scheduler-level suite): vLLM then runs one MTP module per draft position, as
    for Step-3.7-Flash.
    """
    if mtp_modules > 1 and weights:
        raise ValueError("seeded weights exist for one MTP module only; use weights=False")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "config.json.tmp"
    config = dict(TINY_CONFIG, num_nextn_predict_layers=mtp_modules)
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    tmp.replace(out_dir / "config.json")
    if weights:  # ~5 s; rewritten every time so a stale file is never served
        _write_weights(out_dir / WEIGHTS)
    return out_dir


def _write_weights(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**{k: v for k, v in TINY_CONFIG.items() if k != "architectures"})
    torch.manual_seed(SEED)
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in Qwen3NextForCausalLM(config).state_dict().items()
    }
    last = f"model.layers.{config.num_hidden_layers - 1}."
    for name in [n for n in state if n.startswith(last)]:
        state["mtp.layers.0." + name[len(last) :]] = state[name].clone()
    hidden = config.hidden_size
    fc = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(SEED))
    state["mtp.fc.weight"] = (fc * config.initializer_range).to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        state[f"mtp.{norm}.weight"] = state["model.norm.weight"].clone()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    # safetensors writes 0600; the images' servers (uid 10001) read this file
    # through a read-only mount, and the weights are no secret.
    tmp.chmod(0o644)
    tmp.replace(path)  # a reader never sees half a file


def weights_sha256(model_dir: Path) -> str | None:
    path = model_dir / WEIGHTS
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(".models/tiny-qwen3-next"),
        help="directory to write config.json into (default: %(default)s)",
    )
    parser.add_argument("--config-only", action="store_true", help="no weights (scheduler tests)")
    args = parser.parse_args(argv)
    print(write_tiny_model(args.out, weights=not args.config_only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
