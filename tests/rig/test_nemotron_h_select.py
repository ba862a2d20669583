"""``kit nemotron-h`` takes the tree the way the other rig entry points and the tests'
``KIT_TREE`` do (``kit.vllm_tree.releases.select``): unpatched, patched, installed or
``<release>/<stage>``; a bad one is refused in one line, exit 2, before vLLM is
imported. No vLLM runs here: the grid itself is tests/regression/test_nemotron_h.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.rig import nemotron_h
from kit.vllm_tree import releases, trees

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    "tree,says",
    [
        ("stock", "use one of unpatched, patched, installed"),
        ("9.9.9/patched", "9.9.9 is not in pins.toml"),
        ("{newest}/bogus", "unknown stage 'bogus'"),
        ("/patched", "write <release>/<stage>"),
        ("{newest}/", "write <release>/<stage>"),
        ("{newest}/patched/x", "write <release>/<stage>"),
    ],
)
def test_a_bad_tree_is_refused_in_one_line(tree: str, says: str, capsys, monkeypatch) -> None:
    monkeypatch.delenv(trees.SELECT_ENV, raising=False)
    tree = tree.format(newest=releases.newest())
    assert nemotron_h.main(["--tree", tree]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert says in err


def test_a_bad_kit_tree_is_named_as_such(capsys, monkeypatch) -> None:
    monkeypatch.setenv(trees.SELECT_ENV, "nope/")
    assert nemotron_h.main([]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {trees.SELECT_ENV}='nope/': write <release>/<stage>, a release of " + (
        f"{', '.join(releases.known())} and a stage of {', '.join(releases.STAGES)}\n"
    )


@pytest.mark.parametrize("from_env", [False, True])
def test_a_release_and_stage_selects_that_tree(from_env: bool, tmp_path: Path, monkeypatch) -> None:
    """``<release>/<stage>`` (or ``KIT_TREE``) reaches ``releases.tree``; the tree is
    activated, prepared as its package needs, and run with the fix where its mods
    carry it."""
    wanted = f"{releases.newest()}/patched"
    package = tmp_path / "vllm"
    package.mkdir()
    made = trees.Tree("patched", package, from_sdist=True)
    asked, done = [], {}
    monkeypatch.setattr(releases, "tree", lambda v, s: asked.append((v, s)) or made)
    monkeypatch.setattr(trees.Tree, "activate", lambda self: done.setdefault("active", self))
    monkeypatch.setattr(trees.Tree, "patched", property(lambda self: True))
    monkeypatch.setattr(trees, "prepare", lambda from_sdist: done.setdefault("sdist", from_sdist))

    def check(fix: bool) -> dict:
        done["fix"] = fix
        return {"drafter": "", "spec": {}, "cases": 0, "differ": []}

    monkeypatch.setattr(nemotron_h, "check", check)
    if from_env:
        monkeypatch.setenv(trees.SELECT_ENV, wanted)
        argv = []
    else:
        monkeypatch.delenv(trees.SELECT_ENV, raising=False)
        argv = ["--tree", wanted]
    assert nemotron_h.main(argv) == 0
    assert asked == [(releases.newest(), "patched")]
    assert done == {"active": made, "sdist": True, "fix": True}
