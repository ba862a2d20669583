"""k = 3 with three MTP modules (one per draft position) on vLLM's real scheduler.

With multi-module MTP the scheduler never ends a prefill chunk within
``num_prefill_lookahead_tokens`` (= k) of the prompt's end, while align mode
ends a partial chunk on a block boundary. A prompt that ends fewer than k
tokens past a block boundary gets both rules at once: the chunk that should
end on the boundary is shifted back below it, the next step shifts back to the
same place, and prefill stops moving (129 tokens, block 64: stuck at 126).
The harness gives up after 10,000 steps, so a hang fails in bounded time.
"""

from __future__ import annotations

import pytest

from kit.geometry_model import Case, Geometry
from kit.sched_harness import SchedulerRig, run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

LIVELOCK = (
    "vLLM 0.32.0 livelock: align mode's block-boundary chunk end and multi-module "
    "MTP's prefill lookahead cancel out; prefill stops 3 tokens short (mods/README.md)"
)


def _prompt(n: int) -> list[int]:
    return list(range(100, 100 + n))


def test_multi_module_mtp_is_what_runs(tiny_multi_mtp_dir) -> None:
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    assert rig.vllm_config.speculative_config.use_multi_module_mtp()
    assert rig.vllm_config.num_prefill_lookahead_tokens == 3


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=LIVELOCK)
@pytest.mark.parametrize("length", [129, 130, 193])
def test_prompt_just_past_a_block_boundary_finishes(tiny_multi_mtp_dir, length: int) -> None:
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    rig.run(_prompt(length))


@pytest.mark.parametrize("length", [128, 131, 200])
def test_other_prompts_finish(tiny_multi_mtp_dir, length: int) -> None:
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    record = rig.run(_prompt(length))
    assert rig.chunk_ends[record.request_id][-1] == length


@pytest.mark.parametrize(
    "case",
    [Case(Geometry(64, 16, 3), s, u) for s in (160, 167, 175) for u in (1, 20)]
    + [Case(Geometry(384, 16, 3), s, u) for s in (160, 543) for u in (1, 20)],
    ids=lambda c: f"B{c.block}-S{c.shared}-U{c.tail}",
)
def test_follow_up_never_resumes_from_a_stale_state(
    tiny_multi_mtp_dir, tree_is_patched: bool, case: Case
) -> None:
    """Where A and B both finish: B resumes on a hash boundary, at most the ideal, from
    a state made by exactly its first ``hit`` tokens."""
    _, _, b, _ = run_case(tiny_multi_mtp_dir, case, fix=tree_is_patched)
    assert b.hit % case.unit == 0 and b.hit <= case.ideal
    assert b.resumed_from_own_prefix()
