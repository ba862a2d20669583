"""What the bench's servers are started with: the CPU default's tiny model or a
models.lock entry, the geometry pins the expected hits depend on, the fix's switches."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kit import models, mods

# The CPU default's scheduler budget, pinned so the geometry model can use it.
CPU_BATCHED_TOKENS = 2048
# GPU models: their blocks reach thousands of tokens; the budget must hold one.
LOCKED_BATCHED_TOKENS = 8192
# vLLM's CPU platform stores GDN SSM states in float32 on CPUs with AVX-512 BF16
# and in the model dtype elsewhere; the page size, and with it the block vLLM
# picks (2048 or 1024 tokens), followed the machine. Pinned to float32 (what
# those CPUs pick anyway, and the more precise state), so every machine gets
# 2048-token blocks.
CPU_SSM_CACHE_DTYPE = "float32"
CPU_BLOCK = 2048


SERVED_NAME = "kit-model"


def common_serve_args(unit: int, budget: int) -> list[str]:
    """What every bench server needs, whatever the model and target.

    The step budget is pinned because the expected hits depend on it (a chunk
    the budget cannot finish ends on a block boundary).
    """
    return [
        "--max-num-batched-tokens",
        str(budget),
        "--served-model-name",
        SERVED_NAME,
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--mamba-cache-mode",
        "align",
        "--prefix-match-unit",
        str(unit),
        "--enable-prompt-tokens-details",
    ]


def cpu_serve_args(model_dir: Path, block: int, unit: int, num_spec: int) -> list[str]:
    """The CPU default: the tiny random-weight model, a large block so prefill dominates."""
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--block-size",
        str(block),
        "--gpu-memory-utilization",
        "0.3",
        "--mamba-ssm-cache-dtype",
        CPU_SSM_CACHE_DTYPE,
        *common_serve_args(unit, CPU_BATCHED_TOKENS),
    ]
    if num_spec:
        args += [
            "--speculative-config",
            json.dumps({"method": "mtp", "num_speculative_tokens": num_spec}),
        ]
    return args


def locked_serve_args(key: str, store: Path, unit: int) -> tuple[list[str], int]:
    """A models.lock entry, verified offline first; returns its args and MTP draft count.

    vLLM picks the hybrid block size itself; the bench reads it back from
    ``vllm:cache_config_info`` once the server is up.
    """
    _, entries = models.load()
    (entry,) = models.select(entries, key, None)
    models.verify([entry], store)  # refuses unresolved, missing or partial files
    serve = list(entry.fields.get("serve_args", []))
    num_spec = 0
    if "--speculative-config" in serve:
        spec = json.loads(serve[serve.index("--speculative-config") + 1])
        num_spec = int(spec.get("num_speculative_tokens", 0))
    return [
        "--model",
        str(models.snapshot(store, entry)),
        *serve,
        *common_serve_args(unit, LOCKED_BATCHED_TOKENS),
    ], num_spec


def fix_flags(target: str) -> list[str]:
    """The patched server's switches: those of the mods made for the vLLM this
    process finds (an image may carry a later release than the pinned one)."""
    spec = importlib.util.find_spec("vllm")  # located, not imported: no GPU init
    release = mods.tree_version(Path(spec.origin).parent)[0] if spec and spec.origin else None
    return [m.manifest["enable_flag"] for m in mods.switched_mods(target, release)]
