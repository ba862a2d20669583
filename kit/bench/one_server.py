"""One server at a time: the two trees in alternating blocks of repetitions.

Where two servers of the model do not fit the box together (the BF16 Qwen3.6-35B-A3B
on a 128 GB Strix Halo), each tree runs alone: the repetitions are cut into blocks,
and the trees take the blocks in A B B A order (unpatched, patched, patched,
unpatched, ...), so a slow drift of the box over the run cancels out of the
patched/unpatched ratios as it does in the interleaved run. Two blocks of one tree
that follow each other share a server: R repetitions in blocks of b take
ceil(R / b) + 1 server starts.

Every repetition is self-contained (fresh context token ids, its own cold
requests, its own prefix-cache reset), and each server starts with an empty cache
and its own warm-up, so a repetition measures on a server of its own the same
thing it measures in the interleaved run; the ratios still pair the same
repetition, S and request kind.

Started here (``kit bench --one-server``), the bench runs the sessions itself. In
the container flow each session is a server container plus a client run with
``--session TREE:REPS`` that writes a session record; ``--merge-sessions`` makes the
bundle from the records.
"""

from __future__ import annotations

import json
from pathlib import Path

from kit import schema
from kit.vllm_tree.trees import TREE_NAMES as TREES

# No import of the measuring modules: the container flow imports this on a GPU host
# whose light .venv has neither vLLM nor the HTTP client's dependencies.


class SessionError(RuntimeError):
    """Session records that do not make one run (missing, overlapping, inconsistent)."""


SESSION_FILE = "session.json"
DEFAULT_BLOCK_REPS = 2


def sessions(reps: int, block: int) -> list[tuple[str, tuple[int, ...]]]:
    """The server sessions in order: (tree, repetitions), A B B A over the blocks."""
    if reps < 1 or block < 1:
        raise ValueError(f"repetitions ({reps}) and block size ({block}) must be >= 1")
    blocks = [tuple(range(i, min(i + block, reps))) for i in range(0, reps, block)]
    merged: list[tuple[str, tuple[int, ...]]] = []
    for index, reps_of_block in enumerate(blocks):
        for tree in TREES if index % 2 == 0 else TREES[::-1]:
            if merged and merged[-1][0] == tree:
                merged[-1] = (tree, merged[-1][1] + reps_of_block)
            else:
                merged.append((tree, reps_of_block))
    return merged


def parse_session(text: str, reps: int) -> tuple[str, tuple[int, ...]]:
    """``TREE:R1,R2,...`` (``--session``), checked against the run's repetitions."""
    tree, _, listed = text.partition(":")
    if tree not in TREES or not listed:
        raise ValueError(f"--session {text!r}: write TREE:REPS, e.g. patched:0,1")
    try:
        chosen = tuple(int(r) for r in listed.split(","))
    except ValueError:
        raise ValueError(f"--session {text!r}: repetitions are integers, e.g. 0,1") from None
    bad = [r for r in chosen if not 0 <= r < reps]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"--session {text!r}: each repetition once, from 0 to {reps - 1} (--reps {reps})"
        )
    return tree, chosen


def record(
    tree: str,
    reps: tuple[int, ...],
    shared: list[int],
    reported: dict,
    rows: list[dict],
    server: dict,
) -> dict:
    return schema.stamp(
        "bench-session",
        {
            "tree": tree,
            "reps": list(reps),
            "shared": shared,
            "reported_geometry": reported,
            "server": server,
            "rows": rows,
        },
    )


def write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SESSION_FILE
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return path


def read(folders: list[Path]) -> list[dict]:
    records = []
    for folder in folders:
        path = folder / SESSION_FILE if folder.is_dir() else folder
        if not path.is_file():
            raise SessionError(f"{path}: no session record (a session that did not finish?)")
        records.append(schema.check("bench-session", json.loads(path.read_text()), path))
    return records


def merge(records: list[dict], reps: int, shared: list[int]) -> tuple[list[dict], dict]:
    """Every session's rows, once each tree has every repetition exactly once and
    every server reported the same cache geometry; returns (rows, that geometry)."""
    if not records:
        raise SessionError("no session records to merge")
    covered: dict[str, list[int]] = {tree: [] for tree in TREES}
    for data in records:
        if data["shared"] != shared:
            raise SessionError(f"a session measured S = {data['shared']}, this run {shared}")
        covered[data["tree"]] += data["reps"]
    want = list(range(reps))
    wrong = {tree: sorted(got) for tree, got in covered.items() if sorted(got) != want}
    if wrong:
        raise SessionError(
            f"the sessions cover repetitions {wrong}, each tree needs {want} once each"
        )
    geometries = {json.dumps(d["reported_geometry"], sort_keys=True) for d in records}
    if len(geometries) != 1:
        raise SessionError(f"the servers' cache geometry differs between sessions: {geometries}")
    rows = [row for data in records for row in data["rows"]]
    rows.sort(key=lambda r: (r["rep"], r["S"], TREES.index(r["tree"])))
    return rows, records[0]["reported_geometry"]


def schedule_record(block: int, plan: list[tuple[str, tuple[int, ...]]]) -> dict:
    """What bench.json says about a one-server run."""
    return {
        "block_reps": block,
        "order": "A B B A over blocks; consecutive blocks of one tree share a server",
        "sessions": [{"tree": tree, "reps": list(reps)} for tree, reps in plan],
    }
