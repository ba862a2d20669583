"""The bench's servers hash blocks as their vLLM does: with the drafter's lookahead
tokens on a release that has lookahead hashes (0.33.0 on), with none on the pinned
0.32.0; the expected hits follow (``Geometry.hash_lookahead``). Read from the
releases' own source trees, not imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.bench import serve_args
from kit.vllm_tree import releases, trees
from kit.weights import models

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

NEWEST = "0.34.0"


@pytest.fixture(scope="module")
def newest() -> Path:
    return releases.tree(NEWEST, "patched").package


def mtp(k: int, **extra: object) -> list[str]:
    return [
        "--speculative-config",
        json.dumps({"method": "mtp", "num_speculative_tokens": k, **extra}),
    ]


def test_only_releases_with_lookahead_hashes_say_so(newest: Path) -> None:
    assert serve_args.hashes_with_lookahead(newest)
    assert not serve_args.hashes_with_lookahead(trees.pinned("unpatched").package)
    assert not serve_args.hashes_with_lookahead(None)


def test_the_servers_hash_lookahead(monkeypatch, newest: Path) -> None:
    monkeypatch.setattr(serve_args, "installed_vllm", lambda: newest)
    assert serve_args.hash_lookahead(mtp(3), 3, 1) == 1
    # Without speculation, or with the lookahead hashes turned off, vLLM hashes as 0.32.0.
    assert serve_args.hash_lookahead([], 0, 1) == 0
    assert serve_args.hash_lookahead(mtp(3, disable_lookahead_block_hashes=True), 3, 1) == 0
    # Without EAGLE's block drop vLLM hashes neither way the geometry model knows.
    with pytest.raises(models.VerifyError, match="disable_eagle_block_drop"):
        serve_args.hash_lookahead(mtp(3, disable_eagle_block_drop=True), 3, 1)
    monkeypatch.setattr(serve_args, "installed_vllm", lambda: trees.pinned("unpatched").package)
    assert serve_args.hash_lookahead(mtp(3), 3, 1) == 0


def test_a_locked_model_without_a_drafter_lookahead_is_refused(
    monkeypatch, newest: Path, tmp_path: Path
) -> None:
    """On a release with lookahead hashes the bench cannot know its expected hits
    without the entry's drafter_lookahead: one line, naming the entry and the fix."""
    entry = models.Entry("m", "org/m", "unresolved", ["gb10"], True, {"serve_args": mtp(3)})
    monkeypatch.setattr(serve_args.models, "load", lambda: ({}, [entry]))
    monkeypatch.setattr(serve_args.models, "verify", lambda entries, store: None)
    monkeypatch.setattr(serve_args.models, "snapshot", lambda store, e: tmp_path)
    monkeypatch.setattr(serve_args, "installed_vllm", lambda: newest)
    with pytest.raises(models.VerifyError, match="m: .*declares no valid drafter_lookahead"):
        serve_args.locked_serve_args("m", tmp_path, 16)
    entry.fields["drafter_lookahead"] = True  # TOML's true is no token count
    with pytest.raises(models.VerifyError, match="no valid drafter_lookahead"):
        serve_args.locked_serve_args("m", tmp_path, 16)
    entry.fields["drafter_lookahead"] = 1
    args, num_spec, lookahead = serve_args.locked_serve_args("m", tmp_path, 16)
    assert (num_spec, lookahead) == (3, 1) and args[:2] == ["--model", str(tmp_path)]


def test_every_enabled_speculative_entry_declares_its_drafter_lookahead() -> None:
    _, entries = models.load()
    for entry in entries:
        serve = entry.fields.get("serve_args", [])
        if entry.enabled and "--speculative-config" in serve:
            assert isinstance(entry.fields.get("drafter_lookahead"), int), entry.key


# On a release tree: vLLM's real scheduler (kit.rig) runs the bench's pair and a
# four-turn conversation, for one and three MTP tokens in every checkpoint regime;
# each hit, and what the bench would expect of it, as JSON. 2048-token blocks, as the
# CPU default's, where no reply completes a block; and 1056-token blocks with contexts
# whose first reply does (S = 1001-1008: turn 1's prompt 1049-1056), or does not, and
# the bench's S, where cached B depends on the regime (S = 2048: regime_fit).
_ON_TREE = r"""
import json, sys
from pathlib import Path
import vllm.triton_utils
vllm.triton_utils.HAS_TRITON = True  # 0.34.0 on x86 wants triton-cpu; no kernel runs
from kit.bench import ttft
from kit.geometry.geometry_model import (
    REGIMES, Geometry, expected, next_turn_resume, prompt_checkpoint,
)
from kit.rig.later_turns import converse
from kit.rig.sched_harness import SchedulerRig

model, fix = Path(sys.argv[1]), sys.argv[2] == "1"
rows, lookaheads = [], set()
CONTEXTS = {2048: (1004, 1007, 2048, 2159), 1056: (900, 1000, 1001, 1004, 1008, 2048, 2159)}
for num_spec in (1, 3):
    for regime in REGIMES:
        for block, shared in ((b, s) for b, ss in CONTEXTS.items() for s in ss):
            where = f"k={num_spec} {regime} block={block} S={shared}"
            plain = Geometry(block, 16, num_spec, checkpoints=regime)
            rig = SchedulerRig(model, plain, fix=fix)
            lookahead = rig.vllm_config.num_hash_lookahead_tokens
            lookaheads.add(lookahead)
            geo = Geometry(block, 16, num_spec, checkpoints=regime, hash_lookahead=lookahead)
            context = list(range(100, 100 + shared))
            rig.run(context + [ttft.PROBE_TOKEN])
            b = context + [4000 + i for i in range(ttft.TURN_LEN)]
            case = ttft.bench_case(geo, shared)
            want = expected(case, patched=fix, lookahead=lookahead).hit
            rows.append({"what": f"cached B {where}", "hit": rig.run(b).hit, "want": want})
            resend = prompt_checkpoint(len(b), 16, True, lookahead)
            rows.append({"what": f"resent B {where}", "hit": rig.run(b).hit, "want": resend})
            records = converse(
                SchedulerRig(model, plain, fix=fix),
                shared,
                turns=4,
                user_len=ttft.TURN_LEN,
                reply_tokens=ttft.REPLY_TOKENS,
            )
            for n, (prev, cur) in enumerate(zip(records, records[1:])):
                want = next_turn_resume(len(prev.prompt), len(prev.output), geo)
                crosses = want > prompt_checkpoint(len(prev.prompt), 16, True, lookahead)
                rows.append(
                    {"what": f"turn {n + 2} {where}", "hit": cur.hit, "want": want,
                     "crosses": crosses}
                )
print(json.dumps({"lookaheads": sorted(lookaheads), "rows": rows}))
"""


@pytest.mark.parametrize("stage", ["unpatched", "patched"])
def test_the_expected_hits_are_the_newest_schedulers(stage: str, tiny_model_dir: Path) -> None:
    """On the newest release's trees, vLLM's real scheduler and KV-cache manager give
    the bench's pair and later turns the hits the bench expects of lookahead hashes,
    with one and three draft tokens (the tiny model's single MTP module reads one
    token ahead either way), in every checkpoint regime."""
    tree = releases.tree(NEWEST, stage)
    run = subprocess.run(
        [sys.executable, "-c", _ON_TREE, str(tiny_model_dir), "1" if stage == "patched" else "0"],
        env=tree.env(VLLM_LOGGING_LEVEL="ERROR"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["lookaheads"] == [1]
    assert len(got["rows"]) == 2 * 3 * 11 * 5
    # Turn 2 of S = 1001, 1004 and 1008 in 1056-token blocks: its reply completes 1056.
    assert sum(row.get("crosses", False) for row in got["rows"]) == 2 * 3 * 3
    wrong = [row for row in got["rows"] if row["hit"] != row["want"]]
    assert wrong == [], wrong
