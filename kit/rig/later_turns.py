"""A conversation's later turn and a sibling of it, on the real scheduler of any release.

The fix keeps a Mamba state one hash unit below a prompt's checkpoint (its
predecessor), where a request sharing the prompt up to its last unit resumes. A
later turn resumed from the last turn's state, and keeps that predecessor only
``FIX_MIN_GAIN`` or more above where it resumed (``MAMBA_EAGLE_FIX_MIN_GAIN`` in
the fix): closer, a sibling resumes where the turn did, as without the fix, and
the turn pays no chunk end (split path) or export (internal path) for it.

``measure`` runs, per draft count, message length and how far into the turn's
last unit the sibling shares: a two-turn conversation, then the sibling, in a
rig of its own. ``verdicts`` judges one tree's rows against the other's: the
turn's hit equal on both, the sibling's hit the predecessor (patched, kept) or
the turn's hit (otherwise), and the turn's chunk ends equal on both trees
wherever the fix left its state out. Used by ``kit.rig.regress`` on every
release (``make regress VLLM=...``); the pinned release's tests check the same
in ``tests/regression/test_conversation.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kit.geometry.geometry_model import FIX_MIN_GAIN, UNIT, Geometry

SYSTEM_LEN = 1000
# Replies and messages stay inside one block: the turn resumes mid-block.
BLOCK = 2144
REPLY_TOKENS = 6
NUM_SPECS = (1, 3)
# 40 tokens put the turn's predecessor less than FIX_MIN_GAIN above its hit,
# 100 and 200 further.
USER_LENS = (40, 100, 200)
INTO_LAST_UNIT = (0, UNIT - 1)
SIBLING_MESSAGE = 48


def user_message(turn: int, length: int) -> list[int]:
    return [20_000 + 100 * turn + i for i in range(length)]


def converse(rig, system_len: int, turns: int, user_len: int) -> list:
    """``turns`` turns on ``rig`` (a ``SchedulerRig``): each prompt is the last one,
    its reply and a new user message; the turns' ``ResumeRecord``s."""
    prompt = list(range(100, 100 + system_len)) + user_message(0, user_len)
    records = []
    for turn in range(turns):
        record = rig.run(prompt, max_tokens=REPLY_TOKENS)
        records.append(record)
        prompt = prompt + list(record.output) + user_message(turn + 1, user_len)
    return records


def predecessor(prompt_len: int, lookahead: int) -> int:
    """The fix's state one unit below the prompt checkpoint (EAGLE/MTP):
    ``floor(N/H)*H - 2H`` with the 0.32.0 hashing (``lookahead`` 0), one unit
    below ``floor((N - L)/H)*H`` with lookahead hashes."""
    if lookahead:
        return (prompt_len - lookahead) // UNIT * UNIT - UNIT
    return prompt_len // UNIT * UNIT - 2 * UNIT


def sibling_share(prompt_len: int, lookahead: int, into_last_unit: int) -> int:
    """How much of the turn's prompt a sibling shares so that its full-attention
    match ends at the turn's predecessor, ``into_last_unit`` tokens into that unit."""
    return predecessor(prompt_len, lookahead) + (lookahead or UNIT) + into_last_unit


def measure(model_dir: Path, fix: bool, lookahead_hashes: bool, checkpoints: str) -> list[dict]:
    """Run in a process whose ``vllm`` is the tree under test: one row per draft
    count, message length and sibling share."""
    from kit.rig.sched_harness import SchedulerRig

    rows = []
    for num_spec in NUM_SPECS:
        for user_len in USER_LENS:
            for into in INTO_LAST_UNIT:
                geometry = Geometry(BLOCK, UNIT, num_spec, checkpoints=checkpoints)
                rig = SchedulerRig(model_dir, geometry, fix=fix, lookahead_hashes=lookahead_hashes)
                lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
                _, turn = converse(rig, SYSTEM_LEN, turns=2, user_len=user_len)
                n = len(turn.prompt)
                shared = sibling_share(n, lookahead, into)
                sibling = rig.run(list(turn.prompt[:shared]) + user_message(9, SIBLING_MESSAGE))
                rows.append(
                    {
                        "num_spec": num_spec,
                        "user_len": user_len,
                        "into_last_unit": into,
                        "hash_lookahead": lookahead,
                        "turn_hit": turn.hit,
                        "turn_chunk_ends": list(rig.chunk_ends[turn.request_id]),
                        "turn_fix_exports": list(rig.fix_exports.get(turn.request_id, ())),
                        "predecessor": predecessor(n, lookahead),
                        "sibling_hit": sibling.hit,
                        "state_ok": turn.resumed_from_own_prefix()
                        and sibling.resumed_from_own_prefix(),
                    }
                )
    return rows


def _key(row: dict) -> tuple[int, int, int]:
    return row["num_spec"], row["user_len"], row["into_last_unit"]


def verdicts(unpatched: list[dict], patched: list[dict]) -> list[dict]:
    """Each patched row against its unpatched twin: ``verdict`` "ok" or what is wrong;
    ``kept``: whether the fix keeps the turn's predecessor (``FIX_MIN_GAIN`` or more
    above its hit)."""
    twin = {_key(row): row for row in unpatched}
    out = []
    for row in patched:
        base = twin[_key(row)]
        gain = row["predecessor"] - row["turn_hit"]
        kept = gain >= FIX_MIN_GAIN
        problems = []
        if not (row["state_ok"] and base["state_ok"]):
            problems.append("stale state")
        if row["turn_hit"] != base["turn_hit"]:
            problems.append("turn hits differ")
        if gain <= 0:
            problems.append("predecessor not above the turn's hit")
        if base["sibling_hit"] != base["turn_hit"]:
            problems.append("unpatched sibling not at the turn's hit")
        if row["sibling_hit"] != (row["predecessor"] if kept else row["turn_hit"]):
            problems.append("patched sibling not where the fix puts it")
        if not kept and row["turn_chunk_ends"] != base["turn_chunk_ends"]:
            problems.append("a left-out state cost the turn a chunk end")
        if not kept and row["turn_fix_exports"]:
            problems.append("a left-out state was exported")
        out.append(
            {
                **{k: row[k] for k in ("num_spec", "user_len", "into_last_unit")},
                "kept": kept,
                "gain": gain,
                "chunk_ends_u_p": [len(base["turn_chunk_ends"]), len(row["turn_chunk_ends"])],
                "sibling_hit_u_p": [base["sibling_hit"], row["sibling_hit"]],
                "verdict": "; ".join(problems) or "ok",
            }
        )
    return out


def summary(rows: list[dict]) -> dict[str, int]:
    """Verdict counts of ``verdicts``' rows."""
    return dict(Counter(r["verdict"] for r in rows))


def render(hashing: str, rows: list[dict]) -> list[str]:
    """``verdicts``' rows as a Markdown table under a line naming the ``hashing``."""
    from tabulate import tabulate

    body = [
        [
            r["num_spec"],
            r["user_len"],
            r["into_last_unit"],
            r["gain"],
            "kept" if r["kept"] else "left out",
            "/".join(map(str, r["chunk_ends_u_p"])),
            "/".join(map(str, r["sibling_hit_u_p"])),
            r["verdict"],
        ]
        for r in rows
    ]
    headers = ["k", "message", "into unit", "pred. - hit", "fix state", "chunks u/p"]
    headers += ["sibling hit u/p", "verdict"]
    return [
        f"Later turns, {hashing} (kit/rig/later_turns.py): a turn keeps its predecessor "
        f"only {FIX_MIN_GAIN} or more above its hit; left out, the turn's chunks equal "
        "the unpatched tree's and a sibling resumes at the turn's hit.",
        "",
        tabulate(body, headers=headers, tablefmt="github"),
        "",
    ]
