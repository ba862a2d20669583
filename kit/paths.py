"""The repository's paths, in one place: its root and the files and folders more than one
module derives from it. The bottom of the kit's layers: it imports nothing of the kit.

A folder one module alone uses is named there, from ``ROOT`` or a name below.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / "kit"  # the kit's own source

PINS_FILE = ROOT / "pins.toml"  # the one source of versions
MODELS_LOCK = ROOT / "models.lock"  # the model store's entries
LOCKS = ROOT / "locks"  # the hash locks (make lock-deps)
IMAGES_DIR = ROOT / "images"  # images/<target>/Dockerfile
WHEELHOUSE = ROOT / "wheelhouse"  # wheels the images' builds COPY (may stay empty)

VENV = ROOT / ".venv"  # the kit's environment, with the pinned CPU vLLM (make setup)
TREES_DIR = ROOT / ".trees"  # the vLLM trees: .trees/<name>/vllm, .trees/releases/...
MODELS_DIR = ROOT / ".models"  # the tiny seeded models and the model store's default
CACHE = ROOT / ".cache"  # downloads, tools, build and compile caches, run locks

RESULTS = ROOT / "results"  # results bundles and files
REGRESSION_RESULTS = RESULTS / "regression"  # make regress, per release below it
UPSTREAM_SUITE_RESULTS = RESULTS / "upstream-suite"  # make upstream-suite, per release
