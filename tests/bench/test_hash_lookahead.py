"""The bench's servers hash blocks as their vLLM does: with the drafter's lookahead
tokens on a release that has lookahead hashes (0.33.0 on), with none on the pinned
0.32.0; the expected hits follow (``Geometry.hash_lookahead``). Read from the
releases' own source trees, not imported."""

from __future__ import annotations

import json
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
    with pytest.raises(models.VerifyError, match="m: .*declares no drafter_lookahead; add it"):
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
