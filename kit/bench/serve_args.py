"""What the bench's servers are started with: the CPU default's tiny model or a
models.lock entry, the geometry pins the expected hits depend on, the checkpoint
path (its environment and step budget), the fix's switches."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from kit.vllm_tree import mods
from kit.weights import models

# The CPU default's scheduler budget on the split path, pinned so the geometry
# model can use it.
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
# The tokens past the target's range the tiny model's drafter reads (vLLM's
# num_prefill_lookahead_tokens): one, its MTP head being a single module. A release
# that hashes blocks with lookahead tokens hashes with as many (hash_lookahead).
TINY_DRAFTER_LOOKAHEAD = 1


SERVED_NAME = "kit-model"

# How the CPU default's GDN layers materialise a state at the prompt checkpoint
# (``kit bench --checkpoints``, ``kit turn-cost --checkpoints``):
# "internal": the layer exports it from inside the forward pass
# (mods/cpu-gdn-prefill-checkpoint, switched on in both servers' environment),
# under a budget above every bench prompt, so a prompt of up to 8192 tokens is
# one chunk and its final chunk can span the checkpoint's block column (the
# geometry model's "internal-1" regime: alignment 1);
# "split": the scheduler ends a prefill chunk there (the variable absent, the
# 2048-token budget: with 2048-token blocks no final chunk spans two block
# columns, so the export is never reached).
CHECKPOINT_ENV = "VLLM_CPU_GDN_PREFILL_CHECKPOINT"  # the mod's opt_in_env
INTERNAL_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class CheckpointPath:
    """One checkpoint path of the CPU default: its name (``--checkpoints``), the
    servers' step budget (``--max-num-batched-tokens``), what it adds to the servers'
    environment, and its geometry regime (``Geometry.checkpoints``,
    kit/geometry/geometry_model.py REGIMES)."""

    name: str
    budget: int
    env: Mapping[str, str] = field(hash=False)
    regime: str


# The two paths, by name.
PATHS: dict[str, CheckpointPath] = {
    "internal": CheckpointPath(
        "internal", INTERNAL_BATCHED_TOKENS, MappingProxyType({CHECKPOINT_ENV: "1"}), "internal-1"
    ),
    "split": CheckpointPath("split", CPU_BATCHED_TOKENS, MappingProxyType({}), "split"),
}
CHECKPOINT_PATHS = tuple(PATHS)
DEFAULT_CHECKPOINTS = "internal"


def path_by_regime(regime: str) -> CheckpointPath:
    """The path whose servers ran a geometry's checkpoint regime: split, or internal
    for the internal-* regimes."""
    return PATHS["split" if regime == "split" else "internal"]


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


def cpu_serve_args(
    model_dir: Path, block: int, unit: int, num_spec: int, budget: int = CPU_BATCHED_TOKENS
) -> list[str]:
    """The CPU default: the tiny random-weight model, a large block so prefill dominates;
    ``budget``: the step budget of the checkpoint path (``CheckpointPath.budget``)."""
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
        *common_serve_args(unit, budget),
    ]
    if num_spec:
        args += [
            "--speculative-config",
            json.dumps({"method": "mtp", "num_speculative_tokens": num_spec}),
        ]
    return args


def locked_serve_args(
    key: str, store: Path, unit: int, budget: int = LOCKED_BATCHED_TOKENS
) -> tuple[list[str], int, int]:
    """A models.lock entry, verified offline first; returns its args, MTP draft count
    and hash lookahead (``hash_lookahead``, from the entry's ``drafter_lookahead``).

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
    args = ["--model", str(models.snapshot(store, entry)), *serve, *common_serve_args(unit, budget)]
    drafter = entry.fields.get("drafter_lookahead")
    valid = isinstance(drafter, int) and not isinstance(drafter, bool) and drafter >= 0
    lookahead = hash_lookahead(args, num_spec, drafter if valid else -1)
    if lookahead < 0:
        raise models.VerifyError(
            f"models.lock entry {key}: this vLLM hashes blocks with the drafter's "
            f"lookahead, and the entry declares no valid drafter_lookahead ({drafter!r}); "
            "set it to the tokens its drafter reads ahead (1 for one MTP module or an "
            "EAGLE head)"
        )
    return args, num_spec, lookahead


def installed_vllm() -> Path | None:
    """The vLLM package this process finds, located, not imported (no GPU init); an
    image may carry a later release than the pinned one."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent if spec and spec.origin else None


def client_release() -> str | None:
    """The release of the vLLM this process finds (None: none): the one whose
    hashing the bench's expected hits follow (``hash_lookahead``)."""
    package = installed_vllm()
    return mods.tree_version(package)[0] if package else None


def fix_flags(target: str, release: str | None = None) -> list[str]:
    """The patched server's switches: those of the mods made for ``release`` (default:
    the vLLM this process finds)."""
    release = release or client_release()
    return [m.manifest["enable_flag"] for m in mods.switched_mods(target, release)]


def hashes_with_lookahead(package: Path | None) -> bool:
    """Whether a vLLM package hashes prefix-cache blocks with lookahead tokens under
    speculative decoding (``VllmConfig.num_hash_lookahead_tokens``; 0.32.0 does not),
    read from its source."""
    source = package / "config" / "vllm.py" if package else None
    return bool(source and source.is_file() and "num_hash_lookahead_tokens" in source.read_text())


def hash_lookahead(
    args: list[str], num_spec: int, drafter_lookahead: int, package: Path | None = None
) -> int:
    """vLLM's ``num_hash_lookahead_tokens`` for servers started with ``args`` by the
    vLLM ``package`` (default: the one this process finds): the drafter's lookahead
    where that release hashes with it, under speculative decoding, unless the
    speculative config turns it off."""
    if not num_spec or not hashes_with_lookahead(package or installed_vllm()):
        return 0
    spec = {}
    if "--speculative-config" in args:
        spec = json.loads(args[args.index("--speculative-config") + 1])
    if spec.get("disable_eagle_block_drop"):
        # Neither hashing the geometry model knows: no lookahead, and no EAGLE drop.
        raise models.VerifyError(
            "--speculative-config disables EAGLE's block drop, which the bench's "
            "expected hits cannot describe; remove disable_eagle_block_drop"
        )
    if spec.get("disable_lookahead_block_hashes"):
        return 0
    return drafter_lookahead
