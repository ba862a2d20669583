"""The bench's control for cached B (issue 49, ``kit.bench.ttft.control_requests``)
on the real scheduler of the tree under test, at the servers' retention 0: the
control's load leaves the state at the block boundary, the follow-up resumes
there (the geometry model's hit), and prefills its uncached tail in the chunks
the model predicts, the same shape as cached B's at S = 1007 and 2159. Unpatched
and on the split path two: the export column of a chunk that starts on a block
boundary and ends inside the next block is the initial state's
(``is_mamba_prefill_checkpoint_valid``), so vLLM stops at the prompt checkpoint.
Patched on the internal path one: the fix exports that checkpoint into a block
of its own from inside the chunk."""

from __future__ import annotations

import pytest

from kit.geometry.geometry_cases import PROBE_TOKEN
from kit.geometry.geometry_model import (
    Case,
    Geometry,
    boundary_control,
    expected,
    resumed_chunk_ends,
)
from kit.rig.sched_harness import SchedulerRig

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

PATHS = {"internal-1": 8192, "split": 2048}
CONTEXT = list(range(100, 2300))
FRESH = list(range(3000, 3100))  # the follow-ups' own tokens, in no context


def _geometry(rig_lookahead: int, regime: str) -> Geometry:
    return Geometry(
        2048, 16, 1, PATHS[regime], checkpoints=regime, hash_lookahead=rig_lookahead, retention=0
    )


@pytest.mark.parametrize("regime", list(PATHS))
@pytest.mark.parametrize("shared", [1007, 2159])
def test_the_control_resumes_on_the_boundary_in_cached_bs_steps(
    tiny_model_dir, tree_is_patched: bool, regime: str, shared: int
) -> None:
    rig = SchedulerRig(tiny_model_dir, _geometry(0, regime), fix=tree_is_patched, retention=0)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    geo = _geometry(lookahead, regime)
    fix_hit = expected(Case(geo, shared, 1), True, lookahead, 0).hit
    tail = shared + 48 - fix_hit
    control = boundary_control(geo)
    rig.run(CONTEXT[: control.context] + [PROBE_TOKEN])
    follow = CONTEXT[: control.context] + FRESH[: control.prompt_len(tail) - control.context]
    c = rig.run(follow)
    assert c.hit == control.resume == 2048 and c.resumed_from_own_prefix()
    ends = rig.chunk_ends[c.request_id]
    assert tuple(ends) == resumed_chunk_ends(geo, len(follow), 2048, tree_is_patched)
    # The fix exports the prompt checkpoint from inside the chunk where the layer
    # takes internal checkpoints; elsewhere it is a chunk end.
    one_step = tree_is_patched and regime != "split"
    assert len(ends) == (1 if one_step else 2) and ends[-1] == 2048 + tail
    if not lookahead:
        # cached B under the fix, on this scheduler: the same chunk lengths.
        b = SchedulerRig(tiny_model_dir, geo, fix=tree_is_patched, retention=0)
        b.run(CONTEXT[:shared] + [PROBE_TOKEN])
        got = b.run(CONTEXT[:shared] + FRESH[:48])
        if got.hit == fix_hit:  # the unpatched tree resumes cached B at 0 here
            b_ends = b.chunk_ends[got.request_id]
            lengths = [e - s for s, e in zip((fix_hit, *b_ends), b_ends, strict=False)]
            assert lengths == [e - s for s, e in zip((2048, *ends), ends, strict=False)]
