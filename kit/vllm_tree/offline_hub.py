"""An offline model-hub cache holding only the configs vLLM's own core tests read.

vLLM's ``tests/v1/core`` build a ``ModelConfig`` for a handful of hub models
(``facebook/opt-125m`` in the scheduler tests' helper, ``Qwen/Qwen3-0.6B`` as
``ModelConfig``'s default, a few multimodal ones for the encoder-cache cases).
They read the model's ``config.json`` only; no weight is loaded. Our machines
cannot reach the hub, so the suite runs with ``HF_HUB_OFFLINE=1`` and ``HF_HOME``
pointing at a cache made here from the configs in ``hub_configs/`` (the models'
published configuration values). A test that needs more than the config (a
tokenizer, a processor, weights) still fails, and the suite excludes it by name
with that reason (kit/vllm_tree/upstream_suite.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "hub_configs"
# Any fixed 40-hex name: the cache's refs/main points at it, so an offline lookup
# of the default revision finds the snapshot.
REVISION = "0" * 40


def models() -> list[str]:
    """The hub ids this cache holds, e.g. ``facebook/opt-125m``."""
    return sorted(p.stem.replace("--", "/", 1) for p in CONFIGS.glob("*.json"))


def write(home: Path) -> Path:
    """``home`` as an ``HF_HOME`` whose hub cache holds each model's config.json;
    rebuilt from scratch each time (a few small files). Returns ``home``."""
    hub = home / "hub"
    shutil.rmtree(hub, ignore_errors=True)
    for config in sorted(CONFIGS.glob("*.json")):
        repo = hub / f"models--{config.stem}"
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True)
        shutil.copyfile(config, snapshot / "config.json")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(REVISION)
    return home
