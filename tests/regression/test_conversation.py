"""Multi-turn consumers of a cached prompt: continuation, exact resend, long conversations.

Release-generic: the rig's geometry carries the tree's own hashing (lookahead
hashes from 0.33.0), so every expectation is the geometry model's for that tree;
``tests/mods/test_release_conversation.py`` runs this file on the newest release's
trees."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kit.geometry.geometry_model import (
    FIX_MIN_GAIN,
    UNIT,
    Geometry,
    next_turn_resume,
    prompt_checkpoint,
)
from kit.rig import later_turns
from kit.rig.later_turns import REPLY_TOKENS, converse, user_message
from kit.rig.sched_harness import (
    FULL_GROUP,
    MAMBA_GROUP,
    SchedulerRig,
    tree_writes_extra_exports,
)

pytestmark = [pytest.mark.cpu, pytest.mark.tree]


def rig_for(
    model_dir, block: int, num_spec: int, fix: bool, checkpoints: str = "split"
) -> SchedulerRig:
    geometry = Geometry(block, UNIT, num_spec, checkpoints=checkpoints)
    rig = SchedulerRig(model_dir, geometry, fix=fix)
    # The tree's hashing, which the model's predictions take: the release's
    # lookahead tokens under EAGLE/MTP, none on the pinned release.
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    rig.geo = replace(geometry, hash_lookahead=lookahead if num_spec else 0)
    return rig


@pytest.mark.parametrize("num_spec", [0, 1, 3])
@pytest.mark.parametrize("user_len", [9, 15, 16])
def test_four_turns(tiny_model_dir, tree_is_patched, num_spec: int, user_len: int) -> None:
    """Each turn appends the reply and a user message; every turn resumes at the last one's tail."""
    # 1000-token system prompt, replies and messages stay inside one 2144 block.
    rig = rig_for(tiny_model_dir, 2144, num_spec, tree_is_patched)
    records = converse(rig, system_len=1000, turns=4, user_len=user_len)
    assert records[0].hit == 0
    for prev, cur in zip(records, records[1:], strict=False):
        assert len(prev.output) == REPLY_TOKENS
        assert cur.prompt[: len(prev.prompt)] == prev.prompt
        assert cur.hit == next_turn_resume(len(prev.prompt), len(prev.output), rig.geo)
        assert cur.resumed_from_own_prefix()


@pytest.mark.parametrize("num_spec", [0, 1, 3])
@pytest.mark.parametrize("checkpoints", ["split", "internal-1"])
def test_a_reply_that_completes_a_block(
    tiny_model_dir, tree_is_patched, num_spec: int, checkpoints: str
) -> None:
    """Turn 1's prompt ends 4 tokens below a 1056 boundary and its reply crosses it:
    without speculation turn 2 resumes at the boundary the decode completed, as it
    does under EAGLE with lookahead hashes; with the pinned release's hashing EAGLE
    resumes at turn 1's checkpoint; as ``next_turn_resume`` says, which the bench
    expects."""
    rig = rig_for(tiny_model_dir, 1056, num_spec, tree_is_patched, checkpoints)
    first, second = converse(rig, system_len=1000, turns=2, user_len=52)
    assert len(first.prompt) + len(first.output) - 1 >= 1056 > len(first.prompt)
    want = next_turn_resume(len(first.prompt), len(first.output), rig.geo)
    assert second.hit == want == (1024 if num_spec and not rig.geo.hash_lookahead else 1056)
    assert second.resumed_from_own_prefix()


@pytest.mark.parametrize("num_spec", [0, 1])
@pytest.mark.parametrize("prompt_len", [1000, 1007, 1023, 1024])
def test_exact_resend(tiny_model_dir, tree_is_patched, num_spec: int, prompt_len: int) -> None:
    """An identical resend reads the producer's tail entries too; the fix must not cost it."""
    rig = rig_for(tiny_model_dir, 2144, num_spec, tree_is_patched)
    prompt = list(range(100, 100 + prompt_len))
    rig.run(prompt)
    resend = rig.run(prompt)
    assert resend.hit == prompt_checkpoint(
        prompt_len, UNIT, eagle=num_spec > 0, lookahead=rig.geo.hash_lookahead
    )
    assert resend.resumed_from_own_prefix()


# Sub-block entries one prompt may register, per group, with the fix (without: 1):
# the tail, its predecessor and the unit below the last block boundary (Mamba).
MAX_PARTIAL_ENTRIES_PER_PROMPT = 3


@pytest.mark.parametrize("num_spec", [1, 3])
@pytest.mark.parametrize("block", [384, 2144])
def test_twenty_turns_bounded_metadata(tiny_model_dir, tree_is_patched, num_spec, block) -> None:
    """Partial entries per prompt stay within a constant however long the conversation grows."""
    rig = rig_for(tiny_model_dir, block, num_spec, tree_is_patched)
    records = converse(rig, system_len=block - 300, turns=20, user_len=31)
    bound = MAX_PARTIAL_ENTRIES_PER_PROMPT if tree_is_patched else 1
    lengths = [len(r.prompt) for r in records]
    assert lengths[0] < block < lengths[-1]  # the conversation crosses a physical block
    for record in records:
        for group in (FULL_GROUP, MAMBA_GROUP):
            assert len(rig.partial_entries_of(record.request_id, group)) <= bound
        assert record.resumed_from_own_prefix()
    for prev, cur in zip(records, records[1:], strict=False):
        assert cur.hit == next_turn_resume(len(prev.prompt), len(prev.output), rig.geo)


@pytest.mark.parametrize("checkpoints", ["split", "internal-1"])
@pytest.mark.parametrize("num_spec", [1, 3])
# Messages long enough that the turn's predecessor lies above where it resumed:
# 40 tokens put it less than FIX_MIN_GAIN above, 100 and 200 further.
@pytest.mark.parametrize("user_len", [40, 100, 200])
@pytest.mark.parametrize("into_last_unit", [0, 7, UNIT - 1])
def test_sibling_of_a_later_turn(
    tiny_model_dir,
    tree_is_patched,
    checkpoints: str,
    num_spec: int,
    user_len: int,
    into_last_unit: int,
) -> None:
    """A request that shares a later turn's prompt up to its last hash unit (the same
    conversation, that turn's message edited at its end, or a context-load probe sent
    as a turn): the fix resumes it one unit below the turn's checkpoint; without the
    fix it falls back to where the turn itself resumed (the last turn's checkpoint),
    so the fix saves it the turn's new tokens less one to two units and their
    sub-unit rest. A turn keeps that state only ``FIX_MIN_GAIN`` or more above where
    it resumed (on both paths): closer, the sibling resumes where the turn did, as
    without the fix."""
    rig = rig_for(tiny_model_dir, 2144, num_spec, tree_is_patched, checkpoints)
    first, turn = converse(rig, system_len=1000, turns=2, user_len=user_len)
    lookahead = rig.geo.hash_lookahead
    predecessor = later_turns.predecessor(len(turn.prompt), lookahead)
    shared = later_turns.sibling_share(len(turn.prompt), lookahead, into_last_unit)
    sibling = rig.run(list(turn.prompt[:shared]) + user_message(9, 48))
    assert turn.hit == next_turn_resume(len(first.prompt), len(first.output), rig.geo)
    assert sibling.resumed_from_own_prefix()
    assert predecessor > turn.hit  # the fix has something to save here
    kept = predecessor - turn.hit >= FIX_MIN_GAIN
    assert kept == (user_len > 40)  # both kinds are tested
    # On the internal path the turn writes it from inside its step where the layer
    # writes several states per row; where it writes one (0.33.0) the fix declines
    # vLLM's export for that prompt and ends a chunk there instead.
    exported = predecessor in rig.fix_exports.get(turn.request_id, ())
    internal = checkpoints != "split" and tree_writes_extra_exports()
    assert exported == (tree_is_patched and kept and internal)
    if tree_is_patched and kept:
        assert sibling.hit == predecessor  # the turn's predecessor state
    else:
        assert sibling.hit == turn.hit
