"""Internal-checkpoint states are published only after the step that writes them.

Issue 34 item 2. A Mamba state exported from inside the forward pass (vLLM's
own prompt checkpoint, and on the patched 0.32.0 tree the fix's extra exports,
``MambaSpec.prefill_checkpoint_extra_exports``) should get its prefix-cache key
only once the step that writes it has been processed (``update_from_output``),
its blocks should go back to the pool through the scheduler's deferred frees,
and the scheduler's and the manager's bounds for which exports exist should
agree. What the trees do today (docs/publish-after-write.md):

- The key is set at allocation: ``KVCacheManager.allocate_slots`` ends with
  ``coordinator.cache_blocks``, where ``MambaManager.cache_blocks`` keys the
  extra exports (``_key_exports``) and re-keys vLLM's checkpoint column
  (``_cache_partial_tail_block``) before the worker has seen the step.
- Only same-step hits are fenced (``MambaManager.cached_blocks_this_step``,
  cleared by ``new_step_starts`` at the next ``schedule()``). With overlapping
  steps (async scheduling, pipeline parallel) the next ``schedule()`` runs
  before the writing step's ``update_from_output``, and a new request is
  admitted on the block.
- The worker reports nothing back (``ModelRunnerOutput`` has no field for the
  exports), so a step that did not write an export leaves its key.
- The extra exports a request held since its previous step are freed at its
  next allocation (``MambaManager._allocate_exports``) straight into the block
  pool, not through ``Scheduler.deferred_frees``; at the request's end they
  are (``pop_blocks_for_free``).
- For a preempted request that replays its outputs, ``_mamba_block_aligned_split``
  counts the fix's states as exports of a chunk that ends past the prompt
  (``prefill_end = max(num_prompt_tokens, num_tokens - 1)``), while
  ``MambaManager.plan_checkpoint_exports`` plans none there
  (``query_end <= num_prompt_tokens``): neither a chunk end nor an export.

Each unsafe behaviour is a strict expected failure on a tree without the fence
(0.32.0), and passes on one with it: 0.34.0's patched tree
(``fix-eagle-fine-prefix-lookahead`` keys the fix's exports in
``Scheduler.update_from_output`` from ``ModelRunnerOutput.mamba_checkpoint_exports_written``;
run there by tests/mods/test_release_publish_after_write.py). vLLM's own prompt
checkpoint is keyed at allocation on every release: its cases stay expected
failures until vLLM fences it.
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm.v1.outputs import ModelRunnerOutput

import kit.rig.sched_harness as harness
from kit.geometry.geometry_model import Geometry
from kit.rig.sched_harness import MAMBA_GROUP, SchedulerRig

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

# The tree keys the fix's exports only once reported written.
FENCED = "mamba_checkpoint_exports_written" in {
    f.name for f in dataclasses.fields(ModelRunnerOutput)
}
# From 0.33.0 EAGLE/MTP prompts are hashed with lookahead block hashes (no drop).
LOOKAHEAD = "num_hash_lookahead_tokens" in harness.VllmConfig.__dataclass_fields__

# internal-1 (the layer exports at any offset), 64-token blocks, 16-token
# prefix unit, MTP k=1. A 200-token prompt prefills in one chunk; that chunk
# exports vLLM's own prompt checkpoint (legacy hashes: 176, tail 192 less
# EAGLE's unit; lookahead hashes: 192) and, with the fix, the predecessor state
# one unit below it (160; 176) into a block of its own.
GEO = Geometry(64, 16, 1, checkpoints="internal-1")
PROMPT = list(range(100, 300))
OWN = 192 if LOOKAHEAD else 176
FIX = OWN - GEO.unit
# A follow-up resumes at p when its full-attention match ends there: with legacy
# hashes it shares the prompt up to p + H and a bit (EAGLE drops one unit), with
# lookahead hashes up to a bit past p (the key of p's unit covers the next token).
FOLLOW_UP_TAIL = list(range(9000, 9040))


def unfenced(reason: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=reason)]


def kinds(reason: str) -> list:
    """Both kinds of export. vLLM's own checkpoint is keyed at allocation on every
    release; the fix's only on a tree without the fence."""
    own = unfenced(f"vLLM's own prompt checkpoint: {reason}")
    fix = [] if FENCED else unfenced(reason)
    return [
        pytest.param(OWN, id="vllm-checkpoint", marks=own),
        pytest.param(FIX, id="fix-export", marks=fix),
    ]


KINDS = [pytest.param(OWN, id="vllm-checkpoint"), pytest.param(FIX, id="fix-export")]

# vLLM's AsyncScheduler: the engine calls schedule() for the next step before
# update_from_output for the one in flight.
ASYNC = "vllm.v1.core.sched.async_scheduler"


def follow_up(position: int) -> list[int]:
    return PROMPT[: position + (0 if LOOKAHEAD else GEO.unit) + 4] + FOLLOW_UP_TAIL


def make_rig(tiny_model_dir, patched: bool, *, overlapping: bool = False, geo=GEO):
    if not overlapping:
        return SchedulerRig(tiny_model_dir, geo, fix=patched)
    import importlib

    async_scheduler = importlib.import_module(ASYNC).AsyncScheduler
    plain = harness.Scheduler
    harness.Scheduler = async_scheduler
    try:
        return SchedulerRig(tiny_model_dir, geo, fix=patched)
    finally:
        harness.Scheduler = plain


def needs(position: int, patched: bool) -> None:
    if position == FIX and not patched:
        pytest.skip("the unpatched tree keeps no extra exports (fix-eagle-fine-prefix)")


class Step:
    """One scheduled step: what the worker writes and what it samples."""

    def __init__(self, rig: SchedulerRig) -> None:
        self.rig = rig
        self.out = rig.scheduler.schedule()
        rig.ledger.apply_copies(self.out.kv_cache_block_copies)
        self.rows = [
            (
                rig.scheduler.requests[req_id],
                n,
                rig.manager.get_block_ids(req_id)[MAMBA_GROUP],
            )
            for req_id, n in self.out.num_scheduled_tokens.items()
        ]
        # (request, block id, position) of every state exported from inside the step.
        self.exports = rig.exporter.exports(
            self.rows, getattr(self.out, "mamba_checkpoint_exports", None)
        )
        self.sampled = [
            [rig.reply_token(req)] if req.num_computed_tokens >= req.num_tokens else []
            for req, _, _ in self.rows
        ]

    def fix_positions(self, request) -> list[int]:
        """The fix's exports the scheduler planned for ``request`` in this step."""
        planned = getattr(self.out, "mamba_checkpoint_exports", None) or {}
        return [p for p, _ in planned.get(request.request_id, {}).get(MAMBA_GROUP, ())]

    def written(self, dropped: tuple[int, ...] = ()) -> dict[str, list[int]]:
        """What a worker reports written: every export it wrote (``forward``)."""
        out: dict[str, list[int]] = {}
        for req, _, position in self.exports:
            if position not in dropped:
                out.setdefault(req.request_id, []).append(position)
        return out

    def export_block(self, position: int) -> int:
        (block_id,) = {b for _, b, p in self.exports if p == position}
        return block_id

    def forward(self, dropped: tuple[int, ...] = ()) -> None:
        """The worker's writes; ``dropped``: exports it did not write."""
        for req, block_id, position in self.exports:
            if position not in dropped:
                self.rig.ledger.record_export(req, block_id, position)
        for req, _, mamba_ids in self.rows:
            self.rig.ledger.record_step(req, mamba_ids, req.num_computed_tokens)

    def finish(self, written: dict[str, list[int]] | None = None) -> None:
        """``update_from_output``; ``written``: request ID -> positions the worker
        reports written, through the field a fence gives ``ModelRunnerOutput``
        (docs/publish-after-write.md proposes ``mamba_checkpoint_exports_written``;
        any field naming exports is filled). Today there is none, so nothing can
        be reported."""
        self.rig._written = []
        output = self.rig._runner_output(self.out, self.sampled)
        if written is not None:
            for f in dataclasses.fields(output):
                if "export" in f.name:
                    setattr(output, f.name, written)
        self.rig.scheduler.update_from_output(self.out, output)

    def admitted_at(self, request) -> int | None:
        for new in self.out.scheduled_new_reqs:
            if new.req_id == request.request_id:
                return new.num_computed_tokens
        return None


def key_of(rig: SchedulerRig, block_id: int):
    return rig.manager.block_pool.blocks[block_id].block_hash


@pytest.mark.parametrize("position", KINDS)
def test_the_follow_up_resumes_at_the_written_state(
    tiny_model_dir, tree_is_patched: bool, position: int
) -> None:
    """Control: once the producer's step is processed, the follow-up resumes at the
    exported state, made by exactly its own prefix."""
    needs(position, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched)
    a = rig.run(PROMPT)
    assert position in rig.exports[a.request_id]
    b = rig.run(follow_up(position))
    assert b.hit == position and b.resumed_from_own_prefix()


@pytest.mark.parametrize("position", KINDS)
def test_a_same_step_admission_cannot_hit(
    tiny_model_dir, tree_is_patched: bool, position: int
) -> None:
    """Safe today: a request admitted in the producer's own step cannot resume at a
    state that step writes. The key exists (set at allocation), but
    ``MambaManager.get_num_blocks_to_allocate`` refuses a hit whose last Mamba
    block was keyed this step (``cached_blocks_this_step``, which ``_key_exports``
    and ``_cache_partial_tail_block`` fill), so B waits for the next step."""
    needs(position, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched)
    a = rig.make_request(PROMPT)
    b = rig.make_request(follow_up(position))
    rig.scheduler.add_request(a)
    rig.scheduler.add_request(b)
    step = Step(rig)
    assert step.admitted_at(a) == 0 and step.export_block(position)
    admitted = step.admitted_at(b)
    assert admitted is None or admitted < position
    step.forward()
    step.finish(written=step.written())
    if admitted is None:
        nxt = Step(rig)
        assert nxt.admitted_at(b) == position


@pytest.mark.parametrize(
    "position",
    kinds(
        "keyed at allocation: KVCacheManager.allocate_slots -> coordinator.cache_blocks "
        "-> MambaManager.cache_blocks (_key_exports for the fix's exports, "
        "_cache_partial_tail_block for vLLM's checkpoint) runs inside schedule(), "
        "before the worker has run the step"
    ),
)
def test_no_key_before_the_writing_step_is_processed(
    tiny_model_dir, tree_is_patched: bool, position: int
) -> None:
    needs(position, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched)
    rig.scheduler.add_request(rig.make_request(PROMPT))
    step = Step(rig)
    block_id = step.export_block(position)
    assert key_of(rig, block_id) is None
    step.forward()
    step.finish(written=step.written())
    assert rig.manager.block_pool.blocks[block_id].block_hash_num_tokens == position


@pytest.mark.parametrize(
    "position",
    kinds(
        "only same-step hits are fenced (MambaManager.cached_blocks_this_step, "
        "cleared by new_step_starts at the next schedule()); with overlapping steps "
        "(AsyncScheduler, pipeline parallel) the next schedule() runs before "
        "update_from_output of the writing step and admits B on the keyed block"
    ),
)
def test_the_next_step_cannot_hit_before_the_write_is_processed(
    tiny_model_dir, tree_is_patched: bool, position: int
) -> None:
    needs(position, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched, overlapping=True)
    a = rig.make_request(PROMPT, max_tokens=3)
    rig.scheduler.add_request(a)
    first = Step(rig)
    assert first.export_block(position)
    b = rig.make_request(follow_up(position))
    rig.scheduler.add_request(b)
    # Step 2 is scheduled while step 1 is in flight.
    second = Step(rig)
    admitted = second.admitted_at(b)
    assert admitted is None or admitted < position, admitted


@pytest.mark.parametrize(
    "position",
    kinds(
        "the worker reports no exports back (ModelRunnerOutput has no field for "
        "them) and the key was set at allocation, so a step that did not write the "
        "export leaves its key and a follow-up resumes from a state nobody wrote"
    ),
)
def test_a_dropped_export_leaves_no_key(
    tiny_model_dir, tree_is_patched: bool, position: int
) -> None:
    needs(position, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched)
    rig.scheduler.add_request(rig.make_request(PROMPT))
    step = Step(rig)
    block_id = step.export_block(position)
    step.forward(dropped=(position,))
    written: dict[str, list[int]] = {}
    for req, _, p in step.exports:
        if p != position:
            written.setdefault(req.request_id, []).append(p)
    step.finish(written=written)
    b = rig.run(follow_up(position))
    assert b.resumed_from_own_prefix(), (b.hit, b.state_prefix and len(b.state_prefix))
    assert key_of(rig, block_id) is None or (
        rig.manager.block_pool.blocks[block_id].block_hash_num_tokens != position
    )


def test_export_blocks_outlive_an_aborted_producer_step(tiny_model_dir, tree_is_patched) -> None:
    """At the request's end the export blocks stay out of the pool until the writing
    step is processed, as under a KV-consumer connector with overlapping steps
    (``defer_block_free``): without the fence through the scheduler's deferred
    frees (``MambaManager.pop_blocks_for_free`` lists them), with it because the
    pending export, not the request, holds them."""
    needs(FIX, tree_is_patched)
    from vllm.v1.request import RequestStatus

    rig = make_rig(tiny_model_dir, tree_is_patched, overlapping=True)
    rig.scheduler.defer_block_free = True
    a = rig.make_request(PROMPT, max_tokens=3)
    rig.scheduler.add_request(a)
    step = Step(rig)
    block = rig.manager.block_pool.blocks[step.export_block(FIX)]
    rig.scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert block.ref_cnt > 0
    assert FENCED or any(block in blocks for _, blocks in rig.scheduler.deferred_frees)
    step.forward()
    step.finish(written=step.written())
    assert block.ref_cnt == 0


@pytest.mark.xfail(
    not FENCED,
    strict=True,
    reason="MambaManager._allocate_exports frees the blocks the previous step "
    "exported into at the request's next allocation with block_pool.free_blocks, "
    "not through Scheduler.deferred_frees: under overlapping steps that is before "
    "the writing step is processed",
)
def test_export_blocks_released_at_the_next_allocation_are_deferred(
    tiny_model_dir, tree_is_patched
) -> None:
    needs(FIX, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched, overlapping=True)
    rig.scheduler.defer_block_free = True
    a = rig.make_request(PROMPT, max_tokens=3)
    rig.scheduler.add_request(a)
    first = Step(rig)
    block = rig.manager.block_pool.blocks[first.export_block(FIX)]
    # Step 2 (A's first decode) is scheduled while step 1 is in flight.
    second = Step(rig)
    assert a.request_id in second.out.num_scheduled_tokens
    assert block.ref_cnt > 0 or any(block in blocks for _, blocks in rig.scheduler.deferred_frees)


# A preempted request replays its outputs in one chunk [0, 351) past its
# 311-token prompt; cold, the prompt exports the fix's states (legacy hashes:
# 240 and 272; lookahead hashes: 240 and 288, and where the tree exports it the
# last block boundary's, 256, keyed as its block's hash).
REPLAY_GEO = Geometry(128, 16, 1, checkpoints="internal-1")
REPLAY_PROMPT = list(range(100, 411))


def test_a_replayed_prompt_keeps_the_fix_states(tiny_model_dir, tree_is_patched) -> None:
    """The scheduler and the manager agree on a replayed prompt's exports: the
    scheduler takes the fix's states as exports of a chunk up to ``prefill_end``
    (past the prompt), so the manager plans them for any chunk that starts inside
    the prompt (0.32.0's planned none past the prompt: the states were lost)."""
    needs(FIX, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched, geo=REPLAY_GEO)
    a = rig.make_request(REPLAY_PROMPT, max_tokens=60)
    rig.scheduler.add_request(a)
    fix_states: set[int] = set()
    while a.num_output_tokens < 40:
        step = Step(rig)
        fix_states |= set(step.fix_positions(a))
        step.forward()
        step.finish(written=step.written())
    cold = set(rig.keyed_positions_of(a.request_id, MAMBA_GROUP))
    assert fix_states and fix_states <= cold
    assert LOOKAHEAD or fix_states == {240, 272}
    rig.partial_entries.clear()
    rig.scheduler.reset_prefix_cache(reset_running_requests=True)
    first = True
    while first or a.num_computed_tokens < a.num_tokens - 1:
        step = Step(rig)
        step.forward()
        step.finish(written=step.written())
        first = False
    replayed = set(rig.keyed_positions_of(a.request_id, MAMBA_GROUP))
    assert fix_states <= replayed, sorted(replayed)


@pytest.mark.skipif(not FENCED, reason="no pending exports: the tree keys them at allocation")
@pytest.mark.parametrize("running", ["preempted", "aborted"])
def test_a_reset_with_exports_in_flight_succeeds_and_keys_nothing(
    tiny_model_dir, tree_is_patched, running: str
) -> None:
    """A prefix-cache reset (weights reloaded, sleep, ``/reset_prefix_cache``) while a
    step with exports is in flight (AsyncScheduler, pipeline parallel) succeeds as
    it does without the fix: the pending exports, released once the step is
    processed, are not in use for it. What that step reports written afterwards
    was computed before the reset and gets no key."""
    needs(FIX, tree_is_patched)
    from vllm.v1.request import RequestStatus

    rig = make_rig(tiny_model_dir, tree_is_patched, overlapping=True)
    a = rig.make_request(PROMPT, max_tokens=3)
    rig.scheduler.add_request(a)
    step = Step(rig)
    block = rig.manager.block_pool.blocks[step.export_block(FIX)]
    if running == "aborted":
        rig.scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert rig.scheduler.reset_prefix_cache(reset_running_requests=running == "preempted")
    step.forward()
    step.finish(written=step.written())
    assert block.block_hash is None and block.ref_cnt == 0
    if not a.is_finished():
        rig.scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    b = rig.run(follow_up(FIX))
    assert b.hit < FIX and b.resumed_from_own_prefix(), b.hit


@pytest.mark.skipif(not FENCED, reason="no report: the tree keys exports at allocation")
def test_a_runner_that_does_not_report_falls_back_to_chunk_ends(
    tiny_model_dir, tree_is_patched
) -> None:
    """A model runner that never fills ``mamba_checkpoint_exports_written`` (None;
    one that reports gives a dict, empty when nothing was written): vLLM's
    standalone CPU runner, an out-of-tree runner. Nothing it exports could ever be
    keyed, so its first such step turns the exports off: from then on the fix's
    states are chunk ends (the split path), as for a layer that writes one state
    per row, and a follow-up resumes at them."""
    needs(FIX, tree_is_patched)
    rig = make_rig(tiny_model_dir, tree_is_patched)
    rig.written_fix_exports = lambda out: None
    a = rig.make_request(PROMPT)
    rig.scheduler.add_request(a)
    step = Step(rig)
    assert step.fix_positions(a) == [FIX]
    step.forward()
    step.finish()
    other = list(range(5000, 5200))
    b = rig.run(other)
    assert not rig.fix_exports.get(b.request_id) and FIX in rig.chunk_ends[b.request_id]
    tail = 0 if LOOKAHEAD else GEO.unit
    c = rig.run(other[: FIX + tail + 4] + FOLLOW_UP_TAIL)
    assert c.hit == FIX and c.resumed_from_own_prefix(), c.hit
