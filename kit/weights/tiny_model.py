"""Write the kit's tiny random-weight hybrid model (Qwen3-Next: GDN + full attention + MTP).

``arch="qwen3_5_moe"`` writes the primary model's architecture instead: a
Qwen3.5/3.6-MoE checkpoint (``Qwen3_5MoeForConditionalGeneration``, model type
``qwen3_5_moe``, the text model under ``text_config``, the multimodal wrapper's
weight names ``model.language_model.*`` and native MTP ``mtp.*``) with the
same sizes, no vision weights: it is served with ``--language-model-only``
(``serve_extra_args``), as models.lock serves Qwen3.6.

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
import importlib.util
import json
import os
from collections.abc import Sequence
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


# The same model in Qwen3.5/3.6-MoE form (what Qwen3.6-35B-A3B's config.json
# holds, at the tiny sizes above): every layer MoE, MTP declared as
# ``mtp_num_hidden_layers``, M-RoPE sections (summing to half the rotary
# dimension, 64 * 0.25 / 2 = 8) and the SSM state dtype the checkpoint asks for.
QWEN3_5_TEXT_CONFIG: dict = {
    "model_type": "qwen3_5_moe_text",
    **{
        key: TINY_CONFIG[key]
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "layer_types",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "hidden_act",
            "rms_norm_eps",
            "attention_bias",
            "attention_dropout",
            "initializer_range",
            "max_position_embeddings",
            "vocab_size",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
        )
    },
    "attn_output_gate": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    "mtp_num_hidden_layers": 1,
    "mamba_ssm_dtype": "float32",
}
QWEN3_5_CONFIG: dict = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": QWEN3_5_TEXT_CONFIG,
    # Never built (--language-model-only); vLLM reads its sizes at construction.
    "vision_config": {
        "model_type": "qwen3_5_moe_vision",
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": TINY_CONFIG["hidden_size"],
        "deepstack_visual_indexes": [],
    },
    # Inside the tiny vocabulary, above every token the bench sends (< 4048).
    "vision_start_token_id": 4090,
    "vision_end_token_id": 4091,
    "image_token_id": 4092,
    "video_token_id": 4093,
    "tie_word_embeddings": False,
}

ARCHS = ("qwen3_next", "qwen3_5_moe")
# Each architecture's folder name: under .models/ (``kit tiny-model``, ``kit bench``),
# in a bench bundle (the config) and in the temp dir of ``kit bench --serve-only``.
DIR_NAMES = {"qwen3_next": "tiny-qwen3-next", "qwen3_5_moe": "tiny-qwen3_5-moe"}


def serve_extra_args(arch: str = "qwen3_next") -> list[str]:
    """What a server of ``arch`` needs on top of the CPU default's arguments.

    The Qwen3.5/3.6 wrapper declares a vision tower the tiny checkpoint has no
    weights for; ``--language-model-only`` skips it, as models.lock does for
    Qwen3.6. The MTP method stays ``mtp``: vLLM 0.32.0 turns it into
    ``qwen3_5_mtp`` (``Qwen3_5MoeMTP``) from the model type.
    """
    _check_arch(arch)
    return ["--language-model-only"] if arch == "qwen3_5_moe" else []


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {ARCHS}")


def arch_of(model_dir: Path) -> str | None:
    """The tiny architecture a model folder's ``config.json`` declares (its
    ``model_type``), or None where there is no config or another model type."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in ARCHS else None


# vLLM 0.32.0 cannot import its Qwen3.5 code without torchvision:
# model_executor/models/qwen3_5.py imports qwen3_vl.py, whose line 38 imports
# transformers.models.qwen2_vl.image_processing_qwen2_vl, which (transformers
# 5.19) imports torchvision.transforms.v2 at module level. The kit's CPU venv
# and images have no torchvision (kit/vllm_tree/setup_env.py INCOMPATIBLE: PyPI's build
# needs CUDA torch libraries). A server of the tiny Qwen3.5/3.6 model therefore
# gets this stand-in on its PYTHONPATH: modules with the names transformers and
# vLLM import at module level, attributes that are placeholders, and any call
# raises. Under --language-model-only no image or video is ever processed, so
# nothing calls it; a torchvision of one's own (a CPU build for torch 2.13.0)
# makes it unnecessary, and ``serve_env`` then leaves it out.
VISION_STAND_IN_MODULES = (
    "torchvision",
    "torchvision/io",
    "torchvision/transforms",
    "torchvision/transforms/functional",
    "torchvision/transforms/v2",
    "torchvision/transforms/v2/functional",
)
_STAND_IN_ROOT = '''"""The kit's torchvision stand-in (kit/weights/tiny_model.py).

Imports work; calls raise. Only for serving the tiny Qwen3.5/3.6 model with
--language-model-only, which processes no image or video.
"""

__version__ = "0.0.0+kit.vision.stand.in"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name}: the kit's torchvision stand-in has no vision")

    def __repr__(self):
        return f"<kit stand-in {self._name}>"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{__name__}.{name}")
'''
_STAND_IN_SUB = '''"""Part of the kit's torchvision stand-in (kit/weights/tiny_model.py)."""

from torchvision import _Missing


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"{__name__}.{name}")
'''


def write_vision_stand_in(out_dir: Path) -> Path:
    """Write the torchvision stand-in under ``out_dir``; returns the PYTHONPATH entry."""
    for module in VISION_STAND_IN_MODULES:
        package = out_dir / module
        package.mkdir(parents=True, exist_ok=True)
        text = _STAND_IN_ROOT if module == "torchvision" else _STAND_IN_SUB
        (package / "__init__.py").write_text(text)
    return out_dir


def needs_vision_stand_in(arch: str) -> bool:
    """Whether a server of ``arch`` needs the stand-in: Qwen3.5/3.6 where no
    torchvision is installed (the kit's venv and images)."""
    _check_arch(arch)
    return arch == "qwen3_5_moe" and importlib.util.find_spec("torchvision") is None


def serve_env(arch: str, stand_in_dir: Path, search_path: Sequence[str] = ()) -> dict[str, str]:
    """Extra environment of a server of ``arch`` (for ``kit.bench.serve.Server``'s ``env``).

    ``search_path`` is the server's tree's (``Tree.search_path``): ``Server``'s
    ``env`` replaces the PYTHONPATH the tree sets, so the value here keeps the
    tree first, then the inherited entries, then the stand-in.
    """
    if not needs_vision_stand_in(arch):
        return {}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    stand_in = str(write_vision_stand_in(stand_in_dir))
    return {"PYTHONPATH": os.pathsep.join([*search_path, *inherited, stand_in])}


SEED = 20261202
WEIGHTS = "model.safetensors"


def write_tiny_model(
    out_dir: Path, weights: bool = False, mtp_modules: int = 1, arch: str = "qwen3_next"
) -> Path:
    """Write ``config.json`` (and with ``weights`` the seeded weights) into ``out_dir``.

    ``mtp_modules`` > 1 declares that many NEXTN layers (config only, for the
    scheduler-level suite): vLLM then runs one MTP module per draft position, as
    for Step-3.7-Flash. ``arch="qwen3_5_moe"``: the Qwen3.5/3.6-MoE form
    (``QWEN3_5_CONFIG``), one MTP module.
    """
    _check_arch(arch)
    if mtp_modules > 1 and weights:
        raise ValueError("seeded weights exist for one MTP module only; use weights=False")
    if mtp_modules != 1 and arch != "qwen3_next":
        raise ValueError(f"{arch}: one MTP module only")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "config.json.tmp"
    if arch == "qwen3_next":
        config = dict(TINY_CONFIG, num_nextn_predict_layers=mtp_modules)
    else:
        config = QWEN3_5_CONFIG
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    tmp.replace(out_dir / "config.json")
    if weights:  # ~5 s; rewritten every time so a stale file is never served
        if arch == "qwen3_next":
            _write_weights(out_dir / WEIGHTS)
        else:
            _write_qwen3_5_weights(out_dir / WEIGHTS)
    return out_dir


def _write_weights(path: Path) -> None:
    import torch
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
    _add_mtp_head(state, config, "model.norm.weight")
    _save(state, path)


def _add_mtp_head(state: dict, config, final_norm: str) -> None:
    """The MTP module's own weights: ``mtp.fc`` from its own seeded generator, its
    norms copies of the final norm (the ``mtp.layers.0`` block is already there)."""
    import torch

    hidden = config.hidden_size
    fc = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(SEED))
    state["mtp.fc.weight"] = (fc * config.initializer_range).to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        state[f"mtp.{norm}.weight"] = state[final_norm].clone()


def _write_qwen3_5_weights(path: Path) -> None:
    """The Qwen3.5/3.6-MoE checkpoint: transformers' own text model at the tiny
    sizes (GDN projections unfused, ``in_proj_qkv``/``z``/``b``/``a``, as the
    real checkpoints ship them), renamed into the multimodal wrapper's layout
    (``model.language_model.*``), and the MTP module (``mtp.*``) as for Qwen3-Next:
    a copy of the last full-attention layer, a seeded ``fc``, copied norms."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    text = {k: v for k, v in QWEN3_5_TEXT_CONFIG.items() if k != "model_type"}
    config = Qwen3_5MoeTextConfig(**text)
    torch.manual_seed(SEED)
    state = {}
    for name, tensor in Qwen3_5MoeForCausalLM(config).state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        state[name] = tensor.detach().to(torch.bfloat16).contiguous()
    last = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    prefix = f"model.language_model.layers.{last}."
    for name in [n for n in state if n.startswith(prefix)]:
        state["mtp.layers.0." + name[len(prefix) :]] = state[name].clone()
    _add_mtp_head(state, config, "model.language_model.norm.weight")
    _save(state, path)


def _save(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

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
        default=None,
        help="directory to write config.json into (default: .models/tiny-qwen3-next, "
        "with --arch qwen3_5_moe .models/tiny-qwen3_5-moe)",
    )
    parser.add_argument("--config-only", action="store_true", help="no weights (scheduler tests)")
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        default="qwen3_next",
        help="qwen3_5_moe: the Qwen3.5/3.6-MoE form, served with --language-model-only",
    )
    args = parser.parse_args(argv)
    out = args.out or Path(".models") / DIR_NAMES[args.arch]
    print(write_tiny_model(out, weights=not args.config_only, arch=args.arch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
