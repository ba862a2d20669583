"""A conversation's later turn and a sibling of it, on the real scheduler of any release.

The fix keeps a Mamba state one hash unit below a prompt's checkpoint (its
predecessor), where a request sharing the prompt up to its last unit resumes. A
later turn resumed from the last turn's state, and keeps that predecessor (and
its block predecessor) only ``FIX_MIN_GAIN`` or more above where it resumed
(``MAMBA_EAGLE_FIX_MIN_GAIN`` in the fix): closer, the turn pays no chunk end
and declines or adds no in-step export for it, and a sibling resumes no lower
than without the fix (higher where a block boundary holds a state at that
position: the fix's full-attention entry there stays).

``measure`` runs, per block, draft count and message length, a two-turn
conversation and then the sibling, in a rig of their own. ``verdicts`` judges
the patched tree's rows against the unpatched tree's: kept, the state is a
chunk end or an export and the sibling resumes there; left out, the turn's
chunk ends and exports are the unpatched tree's, but where the fix exports the
turn's prompt checkpoint instead of ending a chunk there (fewer chunk ends,
never more); the sibling never resumes lower than without the fix. Used by
``kit.rig.regress`` for every release (``make regress [VLLM=...]``,
``tests/rig/test_releases.py``);
``tests/regression/test_conversation.py`` checks the tree under test the same way.

Always at dense prefix-cache retention (``RETENTION``), whatever retention
``make regress`` runs its grid at: a table at another retention says so above its
later turns (docs/retention.md).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kit.geometry.geometry_model import FIX_MIN_GAIN, UNIT, Geometry, prompt_checkpoint

SYSTEM_LEN = 1000
REPLY_TOKENS = 6
# 2144: the turns stay inside one block, so a turn's final chunk never
# exports (its checkpoint column would lie below its start's) and every regime
# runs the split path. 64 and 32: a long turn's final chunk, and in 32-token
# blocks a short one's too, spans two block columns past its start, so on the
# internal regimes vLLM exports the turn's checkpoint from inside the step,
# and the fix declines that export (0.33.0/0.34.0) or adds its own (0.32.0)
# for each state it keeps; for a state it leaves out it must do neither.
BLOCKS = (2144, 64, 32)
NUM_SPECS = (1, 3)
# 44 tokens put the turn's predecessor (and, in small blocks, its block
# predecessor) less than FIX_MIN_GAIN above its hit, 100 and 200 further.
USER_LENS = (44, 100, 200)
# How far into the turn's last hash unit the sibling shares (where in the unit
# does not matter to the hit; one offset off the unit's ends).
INTO_LAST_UNIT = 7
SIBLING_MESSAGE = 48
# vLLM's prefix_cache_retention_interval the turns run at: None, dense (the rig's
# default), whatever retention the grid beside them runs at.
RETENTION = None


def user_message(turn: int, length: int) -> list[int]:
    return [20_000 + 100 * turn + i for i in range(length)]


def converse(
    rig, system_len: int, turns: int, user_len: int, reply_tokens: int = REPLY_TOKENS
) -> list:
    """``turns`` turns on ``rig`` (a ``SchedulerRig``): each prompt is the last one,
    its reply and a new user message; the turns' ``ResumeRecord``s."""
    prompt = list(range(100, 100 + system_len)) + user_message(0, user_len)
    records = []
    for turn in range(turns):
        record = rig.run(prompt, max_tokens=reply_tokens)
        records.append(record)
        prompt = prompt + list(record.output) + user_message(turn + 1, user_len)
    return records


def predecessor(prompt_len: int, lookahead: int) -> int:
    """The fix's state one unit below the prompt checkpoint (EAGLE/MTP):
    ``floor(N/H)*H - 2H`` with the 0.32.0 hashing (``lookahead`` 0), one unit
    below ``floor((N - L)/H)*H`` with lookahead hashes."""
    if lookahead:
        return (prompt_len - lookahead) // UNIT * UNIT - UNIT
    return prompt_checkpoint(prompt_len, UNIT, eagle=True) - UNIT


def sibling_share(prompt_len: int, lookahead: int, into_last_unit: int) -> int:
    """How much of the turn's prompt a sibling shares so that its full-attention
    match ends at the turn's predecessor, ``into_last_unit`` tokens into that unit."""
    return predecessor(prompt_len, lookahead) + (lookahead or UNIT) + into_last_unit


def measure(model_dir: Path, fix: bool, lookahead_hashes: bool, checkpoints: str) -> list[dict]:
    """Run in a process whose ``vllm`` is the tree under test: one row per block,
    draft count and message length."""
    from kit.rig.sched_harness import SchedulerRig

    rows = []
    for block in BLOCKS:
        for num_spec in NUM_SPECS:
            for user_len in USER_LENS:
                geometry = Geometry(block, UNIT, num_spec, checkpoints=checkpoints)
                rig = SchedulerRig(
                    model_dir,
                    geometry,
                    fix=fix,
                    lookahead_hashes=lookahead_hashes,
                    retention=RETENTION,
                )
                lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
                _, turn = converse(rig, SYSTEM_LEN, turns=2, user_len=user_len)
                n = len(turn.prompt)
                shared = sibling_share(n, lookahead, INTO_LAST_UNIT)
                sibling = rig.run(list(turn.prompt[:shared]) + user_message(9, SIBLING_MESSAGE))
                rows.append(
                    {
                        "block": block,
                        "num_spec": num_spec,
                        "user_len": user_len,
                        "hash_lookahead": lookahead,
                        "turn_hit": turn.hit,
                        "turn_chunk_ends": list(rig.chunk_ends[turn.request_id]),
                        "turn_exports": list(rig.exports.get(turn.request_id, ())),
                        "turn_fix_exports": list(rig.fix_exports.get(turn.request_id, ())),
                        "predecessor": predecessor(n, lookahead),
                        "sibling_hit": sibling.hit,
                        "state_ok": turn.resumed_from_own_prefix()
                        and sibling.resumed_from_own_prefix(),
                    }
                )
    return rows


def _key(row: dict) -> tuple[int, int, int]:
    return row["block"], row["num_spec"], row["user_len"]


def _problems(base: dict, row: dict, kept: bool) -> list[str]:
    """What is wrong with a patched row against its unpatched twin."""
    problems = []
    if not (row["state_ok"] and base["state_ok"]):
        problems.append("stale state")
    if row["turn_hit"] != base["turn_hit"]:
        problems.append("turn hits differ")
    if row["predecessor"] <= row["turn_hit"]:
        problems.append("predecessor not above the turn's hit")
    if kept:
        materialised = row["turn_chunk_ends"] + row["turn_exports"]
        if row["predecessor"] not in materialised:
            problems.append("a kept state was neither a chunk end nor exported")
        if row["sibling_hit"] != row["predecessor"]:
            problems.append("sibling not at the kept state")
        # (Unpatched, a block boundary there holds the same state.)
        if base["sibling_hit"] > row["predecessor"]:
            problems.append("sibling lower than without the fix")
        return problems
    # Left out: the turn and its sibling as without the fix, but for the turn's
    # own prompt checkpoint (one unit above the predecessor), which the fix exports
    # where the layer cannot put it in the block table, and the block boundary
    # above a mid-block resume, which it exports instead of the mid-block stop: no
    # chunk end there, so fewer chunk ends, never more.
    tail = row["predecessor"] + UNIT
    instead = {tail} | {e for e in base["turn_chunk_ends"] if e % row["block"] == 0}
    exported_instead = set(row["turn_fix_exports"]) & instead
    added = set(row["turn_chunk_ends"]) - set(base["turn_chunk_ends"])
    if len(row["turn_chunk_ends"]) > len(base["turn_chunk_ends"]) or (row["predecessor"] in added):
        problems.append("a left-out state cost the turn a chunk end")
    if [e for e in row["turn_exports"] if e not in exported_instead] != base["turn_exports"] or (
        set(row["turn_fix_exports"]) - instead
    ):
        problems.append("a left-out state changed the turn's exports")
    # The fix's full-attention entry stays (a hash): where a block boundary holds
    # a state at the left-out position, the sibling reaches it through that entry.
    if row["sibling_hit"] < base["sibling_hit"]:
        problems.append("sibling lower than without the fix")
    return problems


def verdicts(unpatched: list[dict], patched: list[dict]) -> list[dict]:
    """Each patched row against its unpatched twin: ``verdict`` "ok" or what is wrong;
    ``kept``: whether the fix keeps the turn's predecessor (``FIX_MIN_GAIN`` or more
    above its hit). Kept, the state is materialised and the sibling resumes there;
    left out, the turn's chunk ends and exports are the unpatched tree's; either
    way the sibling resumes no lower than without the fix."""
    twin = {_key(row): row for row in unpatched}
    out = []
    for row in patched:
        base = twin[_key(row)]
        gain = row["predecessor"] - row["turn_hit"]
        kept = gain >= FIX_MIN_GAIN
        out.append(
            {
                **{k: row[k] for k in ("block", "num_spec", "user_len")},
                "kept": kept,
                "gain": gain,
                "chunk_ends_u_p": [len(base["turn_chunk_ends"]), len(row["turn_chunk_ends"])],
                # Engine steps the fix adds to the turn: 0 where the layer exports
                # its states (internal regimes with extra exports).
                "extra_steps": max(0, len(row["turn_chunk_ends"]) - len(base["turn_chunk_ends"])),
                "exports_u_p": [len(base["turn_exports"]), len(row["turn_exports"])],
                "sibling_hit_u_p": [base["sibling_hit"], row["sibling_hit"]],
                "verdict": "; ".join(_problems(base, row, kept)) or "ok",
            }
        )
    return out


def summary(rows: list[dict]) -> dict[str, int]:
    """Verdict counts of ``verdicts``' rows."""
    return dict(Counter(r["verdict"] for r in rows))


def retention_words() -> str:
    """``RETENTION`` as the later-turn table names it."""
    return "dense" if RETENTION is None else f"interval {RETENTION}"


def render(hashing: str, rows: list[dict]) -> list[str]:
    """``verdicts``' rows as a Markdown table under a line naming the ``hashing``."""
    from tabulate import tabulate

    body = [
        [
            r["block"],
            r["num_spec"],
            r["user_len"],
            r["gain"],
            "kept" if r["kept"] else "left out",
            "/".join(map(str, r["chunk_ends_u_p"])),
            "/".join(map(str, r["exports_u_p"])),
            "/".join(map(str, r["sibling_hit_u_p"])),
            r["verdict"],
        ]
        for r in rows
    ]
    headers = ["block", "k", "message", "pred. - hit", "fix state", "chunks u/p"]
    headers += ["in-step exports u/p", "sibling hit u/p", "verdict"]
    return [
        f"Later turns, {hashing}, {retention_words()} retention (kit/rig/later_turns.py): "
        "a turn keeps its predecessor "
        f"only {FIX_MIN_GAIN} or more above its hit, and a sibling resumes there; left "
        "out, the turn takes no chunk end or export for it (fewer chunk ends than "
        "unpatched where the fix exports the turn's prompt checkpoint, never more); the "
        "sibling never resumes lower than unpatched.",
        "",
        tabulate(body, headers=headers, tablefmt="github"),
        "",
    ]
