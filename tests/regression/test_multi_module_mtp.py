"""k = 3 with three MTP modules (one per draft position) on vLLM's real scheduler.

With multi-module MTP the scheduler never ends a prefill chunk within
``num_prefill_lookahead_tokens`` (= k) of the prompt's end, while align mode
ends a partial chunk on a block boundary. A prompt that ends fewer than k
tokens past a block boundary gets both rules at once: the chunk that should
end on the boundary is shifted back below it, the next step shifts back to the
same place, and prefill stops moving (129 tokens, block 64: stuck at 126). Both trees carry
``fix-mtp-prefill-lookahead-progress``, which keeps the boundary; the harness
gives up after 10,000 steps, so a hang fails in bounded time.
"""

from __future__ import annotations

import pytest

from kit.geometry.geometry_model import Case, Geometry
from kit.rig.sched_harness import SchedulerRig, run_case

pytestmark = [pytest.mark.cpu, pytest.mark.tree]


def _prompt(n: int) -> list[int]:
    return list(range(100, 100 + n))


def test_multi_module_mtp_is_what_runs(tiny_multi_mtp_dir) -> None:
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    assert rig.vllm_config.speculative_config.use_multi_module_mtp()
    assert rig.vllm_config.num_prefill_lookahead_tokens == 3


@pytest.mark.parametrize("length", [129, 130, 193])
def test_prompt_just_past_a_block_boundary_finishes(tiny_multi_mtp_dir, length: int) -> None:
    """The livelock vLLM 0.32.0-0.34.0 have without the mod: the chunk ends on the
    boundary (its Mamba state kept), then the tail."""
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    record = rig.run(_prompt(length))
    ends = rig.chunk_ends[record.request_id]
    boundary = length // 64 * 64
    assert ends[-2:] == [boundary, length]


@pytest.mark.parametrize("length", [129, 130])
def test_the_livelock_without_the_mod(tiny_multi_mtp_dir, monkeypatch, length: int) -> None:
    """The unmodified rule (shift back whatever the chunk end) still hangs: the
    harness's step limit turns the hang into an error."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def unmodified(self, request, num_computed_tokens, num_new_tokens):
        remaining = request.num_tokens - num_computed_tokens - num_new_tokens
        if 0 < remaining < self.num_prefill_lookahead:
            num_new_tokens -= self.num_prefill_lookahead - remaining
        return max(num_new_tokens, 0)

    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", unmodified)
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    with pytest.raises(RuntimeError, match="did not finish"):
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
