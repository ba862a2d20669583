"""The internal-checkpoint regimes on the real scheduler: the geometry model is exact.

Every grid case in ``internal-1`` (Mamba2-like: the layer exports the prompt
checkpoint from inside the forward pass at any offset) and ``internal-grid``
(FlashInfer-GDN-like: offsets on lcm(H, 64)): A's chunk ends, the Mamba
partial entries A publishes, B's resume, and B's state (made by exactly B's
own prefix, in the kit's ledger, which records exported states as well as
chunk-end states). The split regime is ``test_geometry.py``.
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import Case, Geometry, expected, producer_prefill
from kit.rig.sched_harness import run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

INTERNAL = [
    pytest.param(case, id=f"{regime}-{case_id}")
    for regime in ("internal-1", "internal-grid")
    for case_id, case in all_cases(regime)
]


@pytest.mark.parametrize("case", INTERNAL)
def test_internal_regime_matches_the_model(
    tiny_model_dir, tree_is_patched: bool, case: Case
) -> None:
    want = expected(case, patched=tree_is_patched)
    rig, a, b, bounds = run_case(tiny_model_dir, case, fix=tree_is_patched)
    assert rig.chunk_ends[a.request_id] == list(want.chunk_ends)
    assert tuple(rig.partial_entries_of(a.request_id, 1)) == want.mamba_partials
    assert b.hit == bounds.hit == want.hit
    assert b.resumed_from_own_prefix()


def test_the_final_chunk_exports_instead_of_stopping(tiny_model_dir) -> None:
    """A prompt two blocks long prefills in one chunk and B resumes from the export."""
    case = Case(Geometry(64, 16, 1, checkpoints="internal-1"), 167, 1)
    prefill = producer_prefill(case, patched=False)
    assert prefill.ends == (168,) and prefill.kept_exports == (144,)
    rig, a, b, _ = run_case(tiny_model_dir, case)
    assert rig.chunk_ends[a.request_id] == [168]
    assert b.hit == 144 and b.resumed_from_own_prefix()


def test_an_off_grid_tail_stop_is_published(tiny_model_dir) -> None:
    """internal-grid: the prompt checkpoint 2320 is off the 64-token grid, so the
    scheduler stops there, while the manager reserves the chunk's own transient
    export (2304) and drops it. vLLM then published neither;
    fix-mamba-transient-checkpoint-tail (both trees) publishes 2320 as the split
    path does."""
    grid = Case(Geometry(2144, 16, 1, checkpoints="internal-grid"), 2304, 40)
    split = Case(Geometry(2144, 16, 1), 2304, 40)
    assert producer_prefill(grid, patched=False).ends == (2320, 2344)
    rig, a, _, _ = run_case(tiny_model_dir, grid)
    assert rig.chunk_ends[a.request_id] == [2320, 2344]
    assert rig.partial_entries_of(a.request_id, 1) == [2320]
    assert expected(grid, patched=False).mamba_partials == (2320,)
    assert expected(split, patched=False).mamba_partials == (2320,)
