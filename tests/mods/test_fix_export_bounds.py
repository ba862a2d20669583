"""Where the fix's extra Mamba exports may land, on vLLM 0.34.0's patched tree
(``fix-eagle-fine-prefix-lookahead``'s plan, ``fix-eagle-fine-prefix-exports``'
checkpoint builder and exporter).

An exported state carries the conv window of the ``conv_kernel - 1`` tokens before
it, taken from the row's own tokens: an export less than that far into its row
cannot be written. With a hash unit H below the window (H = 2, kernel 4) the
plan once kept such an export and only the exporter's ``assert`` stood between it
and a recurrent state keyed without its window (``python -O``). The rule is now
``offset >= max(H, conv_kernel - 1)`` in the scheduler's plan (a closer state is
a chunk end) and in the builder (never written nor reported), and the exporter
refuses one with an exception, also under ``-O``.

The checks run on the release tree in a subprocess (this file as a script,
``on-tree``, under ``python -O``), no kernel launched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import trees
from tests.mods.release_side import ROOT, batch_metadata, on_tree_config

pytestmark = pytest.mark.cpu

BLOCK = 64
UNIT = 2  # H: below the conv window
CONV_WINDOW = 3  # kernel 4
PROMPT = 200


def _on_tree(model_dir: Path, out: Path) -> None:
    import torch
    from vllm.model_executor.layers.mamba.checkpoint import (
        MambaPrefillCheckpointBuilder,
        MambaPrefillCheckpointExporter,
        MambaPrefillCheckpointMetadata,
    )
    from vllm.v1.kv_cache_interface import MambaSpec, get_mamba_eagle_fix_exports

    from kit.geometry.geometry_model import Geometry

    results: dict = {}
    # The scheduler's and the manager's plan: the fix's states of a cold prompt,
    # then a chunk that starts H below the lowest of them.
    cold = get_mamba_eagle_fix_exports(0, PROMPT, PROMPT, BLOCK, UNIT, False, 1, 1)
    low = min(cold)
    start = low - UNIT
    results["cold"] = list(cold)
    results["low"] = low
    results["planned_h_only"] = list(
        get_mamba_eagle_fix_exports(start, PROMPT, PROMPT, BLOCK, UNIT, False, 1, 1)
    )
    try:
        results["planned"] = list(
            get_mamba_eagle_fix_exports(
                start, PROMPT, PROMPT, BLOCK, UNIT, False, 1, 1, conv_window=CONV_WINDOW
            )
        )
    except TypeError as exc:  # a plan that knows no conv window
        results["planned"] = str(exc)

    # The worker's checkpoint builder: one prefill row from ``start``, exports
    # offered H and H + 1 tokens into it.
    config = on_tree_config(model_dir, Geometry(BLOCK, UNIT, 1, checkpoints="internal-1"))
    window = (
        {"prefill_checkpoint_conv_window": CONV_WINDOW}
        if "prefill_checkpoint_conv_window" in MambaSpec.__dataclass_fields__
        else {}
    )
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((5, CONV_WINDOW), (2, 3, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
        prefill_checkpoint_extra_exports=True,
        **window,
    )
    row = (PROMPT, PROMPT - start, True)
    exports = {0: [(start + UNIT, 1001), (start + UNIT + 1, 1002)]}
    meta = MambaPrefillCheckpointBuilder(config, spec).build(batch_metadata([row], exports, 8), [0])
    results["kept"] = None if meta is None else meta.kept_extra_exports
    results["extra_exports"] = None if meta is None else meta.extra_exports
    results["start"] = start

    # The exporter: a row whose checkpoint lies inside its conv window.
    checkpoint = MambaPrefillCheckpointMetadata(
        torch.tensor([UNIT], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
        offsets=[UNIT],
    )
    try:
        MambaPrefillCheckpointExporter(state_len=CONV_WINDOW).export(
            checkpoint,
            raw_qkv=torch.zeros(8, 5),
            conv_state=torch.zeros(8, 5, CONV_WINDOW),
            cu_seqlens=torch.tensor([0], dtype=torch.int32),
        )
        results["exporter"] = "exported"
    except ValueError as exc:
        results["exporter"] = f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001 - anything else went on to the kernel
        results["exporter"] = f"went on: {type(exc).__name__}"
    (out / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def on_tree(
    release_tree: trees.Tree, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    out = tmp_path_factory.mktemp("export-bounds")
    # -O: no check may rest on an assert.
    cmd = [sys.executable, "-O", __file__, "on-tree", str(tiny_model_dir), str(out)]
    env = release_tree.env(VLLM_LOGGING_LEVEL="ERROR")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def test_the_plan_makes_an_export_inside_the_conv_window_a_chunk_end(on_tree) -> None:
    """H = 2, kernel 4: the lowest fix state, H into the chunk, is kept by the
    hash-unit rule alone, and not as an export once the conv window counts (the
    scheduler then ends a chunk there); the others stay exports."""
    low = on_tree["low"]
    assert low in on_tree["planned_h_only"]
    assert on_tree["planned"] == [p for p in on_tree["planned_h_only"] if p != low]


def test_the_builder_neither_writes_nor_reports_one_inside_the_conv_window(on_tree) -> None:
    start = on_tree["start"]
    assert on_tree["extra_exports"] == [[[UNIT + 1, 1002]]]
    assert on_tree["kept"] == [[0, start + UNIT + 1]]


def test_the_exporter_refuses_a_checkpoint_inside_the_conv_window(on_tree) -> None:
    assert on_tree["exporter"].startswith("refused"), on_tree["exporter"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["on-tree"]:
        _on_tree(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} on-tree MODEL_DIR OUT_DIR")
