"""How the worker-side mod tests of the newest release run their two halves: a
script on the release tree's patched stage (vLLM's own code, no kernel), and a
script under Triton's interpreter in .venv-triton (vLLM's kernels from the tree's
files). Shared by the FlashInfer, FLA and Mamba2 export tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kit.vllm_tree import trees

ROOT = Path(__file__).resolve().parents[2]
# The release fix-eagle-fine-prefix-exports is made for (its mod.toml).
RELEASE = "0.34.0"


def run_on_tree(script: str, tree: trees.Tree, *args: str, timeout: int = 600) -> None:
    """``python script on-tree ARGS`` with the tree's environment; fails with its stderr."""
    cmd = [sys.executable, script, "on-tree", *args]
    env = tree.env(VLLM_LOGGING_LEVEL="ERROR")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]


def suite_outcomes(suite: str, tree: str, report: Path, timeout: int = 900) -> dict[str, str]:
    """Test name -> passed | failed | skipped | xfailed, for the kit's ``suite`` run
    on ``tree`` (``KIT_TREE``, e.g. ``0.34.0/patched``); its JUnit report at ``report``."""
    from kit.vllm_tree.upstream_suite import outcomes

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite]
    cmd += [f"--junitxml={report}"]
    env = {**os.environ, "KIT_TREE": tree}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert report.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    # One file: the test's name without its module's.
    return {case.split("::")[-1]: outcome for case, outcome in outcomes(report).items()}


def run_interpreted(triton_env: Path, code: str, *args: str, timeout: int = 600) -> None:
    """``code`` in .venv-triton under Triton's interpreter, nothing of the kit's
    .venv or trees on its path; fails with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}
    cmd = [str(triton_env), "-c", code, *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]


def on_tree_config(model_dir: Path, geometry: Any) -> Any:
    """On the tree: vLLM's config for the tiny model at ``geometry``, its hash block
    resolved to the geometry's unit as the engine does when it sizes the KV cache."""
    import vllm.triton_utils

    # 0.34.0 refuses an x86 CPU config without Triton; nothing on-tree runs a kernel.
    vllm.triton_utils.HAS_TRITON = True
    from kit.rig.sched_harness import build_vllm_config

    config = build_vllm_config(model_dir, geometry)
    config.cache_config.hash_block_size = geometry.unit
    config.cache_config.cache_hit_alignment_tokens = geometry.unit
    return config


# Rows of a batch: (seq_len, query_len, prefilling).
Row = tuple[int, int, bool]


def split_steps(
    rows: list[Row], exported: Iterable[tuple[int, int]]
) -> list[tuple[list[int], list[Row], dict[int, int]]]:
    """The split path's engine steps over a batch of ``rows``: each prefill row runs
    chunk by chunk, a chunk ending at each of its ``exported`` (row, offset into
    its query) and at its query's end; the other rows run in the first step only.
    Per step: the batch rows it runs, each one's row in that step's batch (seq_len
    at the chunk's end, chunk length, prefilling), and where each prefill row's
    chunk ends."""
    cuts = {r: {query} for r, (_, query, prefilling) in enumerate(rows) if prefilling}
    for r, offset in exported:
        cuts[r].add(offset)
    done = dict.fromkeys(cuts, 0)
    steps = []
    step_rows = list(range(len(rows)))
    while step_rows:
        batch: list[Row] = []
        for r in step_rows:
            seq, query, prefilling = rows[r]
            end = min(c for c in cuts[r] if c > done[r]) if prefilling else query
            batch.append((seq - query + end, end - done[r], True) if prefilling else rows[r])
        ends = {}
        for r, (_, query, _) in zip(step_rows, batch, strict=True):
            if r in done:
                done[r] += query
                ends[r] = done[r]
        steps.append((step_rows, batch, ends))
        step_rows = [r for r in cuts if done[r] < rows[r][1]]
    return steps


def draft_kwargs(drafts: list[int] | None) -> dict:
    """On the tree: what ``GDNAttentionMetadataBuilder.build`` takes for a batch
    whose rows have these draft tokens (-1: not a speculative decode), every
    speculative row's one token accepted; nothing without speculation."""
    import torch

    if drafts is None:
        return {}
    return {
        "num_accepted_tokens": torch.ones(len(drafts), dtype=torch.int32),
        "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32),
    }


def exports_by_row(
    written: list[dict], non_spec_rows: list[int], starts: list[int]
) -> list[tuple[int, int, int]]:
    """Each written export (``export_rows``' dicts, or an exporter's record of them)
    as (batch row, offset, block), its row found by its start among the non-spec
    rows' ``starts``."""
    return [(non_spec_rows[starts.index(w["start"])], w["offset"], w["block"]) for w in written]


def slot_table(table: Any, slots: dict[int, int]) -> Any:
    """On the tree: ``table`` with every column of each row in ``slots`` naming that
    slot, so that a split step's running state stays in the slot the planned step
    used and each chunk end's state is that slot after the step."""
    split = table.clone()
    for r, slot in slots.items():
        split[r] = slot
    return split


def block_table(rows: list[Row], cols: int) -> Any:
    """On the tree: row r's blocks are 100 * r + 1, +2, ... (``cols`` of them), so
    every block a test sees names its row."""
    import torch

    columns = torch.arange(cols, dtype=torch.int32)
    return torch.stack([100 * r + columns + 1 for r in range(len(rows))])


def batch_metadata(rows: list[Row], exports: dict | None, cols: int) -> Any:
    """On the tree: vLLM's ``CommonAttentionMetadata`` for a batch of ``rows`` with
    the fix's ``exports`` (row -> [(position, block)]), what a metadata builder gets."""
    import itertools

    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *itertools.accumulate(q for _, q, _ in rows)], dtype=torch.int32)
    seqs = torch.tensor([s for s, _, _ in rows], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seqs,
        num_reqs=len(rows),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q for _, q, _ in rows),
        max_seq_len=int(seqs.max()),
        block_table_tensor=block_table(rows, cols),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seqs.clone(),
        is_prefilling=torch.tensor([p for _, _, p in rows]),
        mamba_checkpoint_exports=exports,
    )


def export_rows(starts: Any, checkpoint: Any, rows: Any) -> list[dict]:
    """On the tree: one dict per export row the exporter gets (its start in the
    non-spec tokens, offset, block, and its state's row among the written ones),
    from a plan's ``export_query_starts``, ``exports`` and ``rows``."""
    return [
        {"start": s, "offset": o, "block": b, "row": r}
        for s, o, b, r in zip(
            starts.tolist(),
            checkpoint.checkpoint_offsets.tolist(),
            checkpoint.state_indices.tolist(),
            rows.tolist(),
            strict=True,
        )
    ]
