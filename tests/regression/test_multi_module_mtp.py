"""k = 3 with three MTP modules (one per draft position) on vLLM's real scheduler.

With multi-module MTP the scheduler never ends a prefill chunk within
``num_prefill_lookahead_tokens`` (= k) of the prompt's end, while align mode
ends a partial chunk on a block boundary. A prompt that ends fewer than k
tokens past a block boundary gets both rules at once: the chunk that should
end on the boundary is shifted back below it, the next step shifts back to the
same place, and prefill stops moving (129 tokens, block 64: stuck at 126). Any
stop 1..k-1 tokens before the end does the same (the prompt checkpoint, a token
cap below k; see below). Both trees carry ``fix-mtp-prefill-lookahead-progress``,
which keeps the boundary and never shifts a chunk that starts within k of the
end; the harness gives up after 10,000 steps, so a hang fails in bounded time.
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


# The whole class: any mandatory chunk stop within k tokens of the prefill end.
# The rule shifted a chunk ending there back to k tokens before the end; a stop
# that ends every chunk from there short of the end again left nothing to
# schedule, forever. The mod keeps a block boundary and any chunk that starts
# within k of the end. Not hanging, from the code: the Mamba block boundaries
# (``last_cache_position``, the next boundary; the case above), the EAGLE
# predecessor stops of fix-eagle-fine-prefix (a hash unit or more below the
# checkpoint, so at least H + 1 > k before the end), the prompt checkpoint with
# EAGLE's block drop (H or more before the end) or with lookahead hashes (k or
# more before the end), a block-floored junction (from a start within k of the
# end it is the start itself), and a budget of k or more (the last k fit).


def _unmodified(self, request, num_computed_tokens, num_new_tokens):
    remaining = request.num_tokens - num_computed_tokens - num_new_tokens
    if 0 < remaining < self.num_prefill_lookahead:
        num_new_tokens -= self.num_prefill_lookahead - remaining
    return max(num_new_tokens, 0)


def _without_block_drop(monkeypatch) -> None:
    """``disable_eagle_block_drop``: the prompt checkpoint becomes
    ``floor((N - 1) / H) * H``, 1..k-1 tokens before the end for N = 16m + 1, 16m + 2."""
    import functools

    from vllm.config import SpeculativeConfig

    import kit.rig.sched_harness as harness

    monkeypatch.setattr(
        harness,
        "SpeculativeConfig",
        functools.partial(SpeculativeConfig, disable_eagle_block_drop=True),
    )


@pytest.mark.parametrize("length", [145, 146, 161, 178])
def test_prompt_checkpoint_just_before_the_end_finishes(
    tiny_multi_mtp_dir, monkeypatch, length: int
) -> None:
    """The prompt checkpoint stop (align mode's hash-aligned tail state) 1..k-1
    tokens before the end: 145 tokens hung at 142 (tail 144). Now the chunk from
    142 ends on the checkpoint (its state kept), then the tail."""
    _without_block_drop(monkeypatch)
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    assert not rig.scheduler.use_eagle_block_drop
    record = rig.run(_prompt(length))
    tail = (length - 1) // 16 * 16
    assert rig.chunk_ends[record.request_id][-2:] == [tail, length]


@pytest.mark.parametrize("length", [145, 162])
def test_prompt_checkpoint_livelock_without_the_mod(
    tiny_multi_mtp_dir, monkeypatch, length: int
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    _without_block_drop(monkeypatch)
    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", _unmodified)
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    with pytest.raises(RuntimeError, match="did not finish"):
        rig.run(_prompt(length))


def _two_prefills_under_a_cap(model_dir, monkeypatch, cap: int) -> list:
    """Two requests with ``long_prefill_token_threshold`` = cap < k: every chunk is
    shorter than k, so the one starting k tokens before the end ends inside them
    again. Returns the requests after 300 steps."""
    import functools

    from vllm.config import SchedulerConfig

    import kit.rig.sched_harness as harness

    monkeypatch.setattr(
        harness,
        "SchedulerConfig",
        functools.partial(SchedulerConfig, long_prefill_token_threshold=cap),
    )
    rig = SchedulerRig(model_dir, Geometry(64, 16, 3))
    requests = [
        rig.make_request(_prompt(20), 400),
        rig.make_request(list(range(5000, 5129)), 1),
    ]
    for request in requests:
        rig.scheduler.add_request(request)
    for _ in range(300):
        if requests[1].is_finished():
            break
        out = rig.scheduler.schedule()
        rig.ledger.apply_copies(out.kv_cache_block_copies)
        rig.record_writes(out)
        sampled = []
        for req_id in out.num_scheduled_tokens:
            req = rig.scheduler.requests[req_id]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([rig.reply_token(req)] if done else [])
        rig.scheduler.update_from_output(out, rig._runner_output(out, sampled))
    return requests


@pytest.mark.parametrize("cap", [1, 2])
def test_token_cap_below_k_finishes(tiny_multi_mtp_dir, monkeypatch, cap: int) -> None:
    """A token cap (long_prefill_token_threshold) below k: both prefills finish."""
    requests = _two_prefills_under_a_cap(tiny_multi_mtp_dir, monkeypatch, cap)
    assert all(r.num_output_tokens > 0 for r in requests)
    assert requests[1].is_finished()


@pytest.mark.parametrize("cap", [1, 2])
def test_token_cap_livelock_without_the_mod(tiny_multi_mtp_dir, monkeypatch, cap: int) -> None:
    """The unmodified rule: the 20-token prompt sticks at 17 (= 20 - k) with no
    output, so two requests stay eligible and the cap never lifts."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", _unmodified)
    requests = _two_prefills_under_a_cap(tiny_multi_mtp_dir, monkeypatch, cap)
    assert requests[0].num_output_tokens == 0
    assert requests[0].num_computed_tokens == 17


def _boundary_only(self, request, num_computed_tokens, num_new_tokens):
    """The mod's first version: only a chunk ending on a block boundary is kept."""
    remaining = request.num_tokens - num_computed_tokens - num_new_tokens
    if 0 < remaining < self.num_prefill_lookahead:
        end = num_computed_tokens + num_new_tokens
        if self.need_mamba_block_aligned_split and end % self.cache_config.block_size == 0:
            return num_new_tokens
        num_new_tokens -= self.num_prefill_lookahead - remaining
    return max(num_new_tokens, 0)


def test_prompt_checkpoint_hangs_under_the_boundary_only_rule(
    tiny_multi_mtp_dir, monkeypatch
) -> None:
    """Keying on block boundaries alone is not enough: 145 tokens still hang at 142."""
    from vllm.v1.core.sched.scheduler import Scheduler

    _without_block_drop(monkeypatch)
    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", _boundary_only)
    rig = SchedulerRig(tiny_multi_mtp_dir, Geometry(64, 16, 3))
    with pytest.raises(RuntimeError, match="did not finish"):
        rig.run(_prompt(145))


def _chunk_ends_or_none(model_dir, length: int) -> list[int] | None:
    """The prompt's chunk ends on a fresh rig, None where its prefill never ends."""
    rig = SchedulerRig(model_dir, Geometry(64, 16, 3))
    try:
        record = rig.run(_prompt(length))
    except RuntimeError as exc:
        if "did not finish" not in str(exc):
            raise
        return None
    return rig.chunk_ends[record.request_id]


@pytest.mark.parametrize(
    ("server_default", "period"),
    [(True, 64), (False, 16)],
    ids=["server-default", "disable_eagle_block_drop"],
)
def test_the_kept_chunk_changes_only_prompts_that_hung(
    tiny_multi_mtp_dir, monkeypatch, server_default: bool, period: int
) -> None:
    """What the trailing MTP modules see changes only where vLLM never finished.

    The mod relaxes the rule that keeps k known prompt tokens after a chunk for
    the trailing modules. Over 80 prompt lengths, each scheduled alone on the
    real scheduler, with and without the mod: wherever the unmodified rule
    finishes, the chunks are the same; a chunk ends fewer than k tokens before
    the end exactly where it hung, 1 or 2
    tokens past a block boundary at the server's settings (every 64) and past a
    hash boundary without the EAGLE block drop (every 16)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not server_default:
        _without_block_drop(monkeypatch)
    kept = {n: _chunk_ends_or_none(tiny_multi_mtp_dir, n) for n in range(120, 200)}
    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", _unmodified)
    shifted = {n: _chunk_ends_or_none(tiny_multi_mtp_dir, n) for n in kept}

    assert all(ends is not None for ends in kept.values())
    short = {n for n, ends in kept.items() if len(ends) > 1 and n - ends[-2] < 3}
    hung = {n for n, ends in shifted.items() if ends is None}
    assert short == hung == {n for n in kept if n % period in (1, 2)}
    assert all(kept[n] == ends for n, ends in shifted.items() if ends is not None)
