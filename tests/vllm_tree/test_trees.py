"""kit.vllm_tree.trees: one Tree value per vLLM tree, and folders rebuilt whole or not at all."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.vllm_tree import mods, trees

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cpu


def test_a_folder_is_rebuilt_only_when_its_stamp_changes(tmp_path: Path) -> None:
    home = tmp_path / "tree"
    calls = []

    def fill(build: Path) -> None:
        calls.append(build.name)
        (build / "vllm").mkdir()

    trees.stamped_folder(home, {"v": 1}, fill, "vllm")
    trees.stamped_folder(home, {"v": 1}, fill, "vllm")
    assert len(calls) == 1
    trees.stamped_folder(home, {"v": 2}, fill, "vllm")
    assert len(calls) == 2
    assert (home / "vllm").is_dir() and not list(tmp_path.glob(".*building*"))


def test_a_failed_build_leaves_the_previous_folder(tmp_path: Path) -> None:
    home = tmp_path / "tree"
    trees.stamped_folder(home, {"v": 1}, lambda b: (b / "vllm").mkdir(), "vllm")

    def broken(build: Path) -> None:
        (build / "vllm").mkdir()
        raise RuntimeError("the sdist is not there")

    with pytest.raises(RuntimeError, match="sdist"):
        trees.stamped_folder(home, {"v": 2}, broken, "vllm")
    assert (home / "vllm").is_dir()
    assert trees.stamped_folder(home, {"v": 1}, broken, "vllm") == home  # still current
    assert not list(tmp_path.glob(".*building*"))


def test_each_pinned_tree_knows_whether_it_carries_the_fix() -> None:
    assert trees.pinned("patched").patched
    assert not trees.pinned("unpatched").patched
    assert set(trees.pinned("unpatched").mods) < set(trees.pinned("patched").mods)


def test_a_subprocess_imports_exactly_the_tree(tmp_path: Path) -> None:
    tree = trees.pinned("unpatched")
    done = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
        env=tree.env(),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert done.stdout.strip() == str(tree.package / "__init__.py")
    assert tree.env(PYTHONPATH="x")["PYTHONPATH"] == "x"  # an explicit value wins


def test_an_unknown_selection_names_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(trees.SELECT_ENV, "fixed")
    with pytest.raises(trees.mods.ModError, match="unpatched, patched, installed"):
        trees.select()


SLOW_BUILDER = """
import sys, time
from pathlib import Path
from kit.vllm_tree import trees
home, marks = Path(sys.argv[1]), Path(sys.argv[2])

def fill(build):
    (marks / f"fill-{sys.argv[3]}").write_text("")
    (build / "vllm").mkdir()
    (build / "vllm" / "first").write_text("1")
    while not (marks / "go").exists():  # held open until the test lets it finish
        time.sleep(0.05)
    (build / "vllm" / "last").write_text("1")

trees.stamped_folder(home, {"v": 1}, fill, "vllm")
print(sorted(p.name for p in (home / "vllm").iterdir()))
"""


def test_two_builds_at_once_make_one_whole_folder(tmp_path: Path) -> None:
    home, marks = tmp_path / "tree", tmp_path / "marks"
    marks.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SLOW_BUILDER, str(home), str(marks), str(i)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    while not list(marks.glob("fill-*")):
        assert all(p.poll() is None for p in procs)
        time.sleep(0.05)
    (marks / "go").write_text("")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["['first', 'last']\n"] * 2  # neither saw a partial folder
    assert len(list(marks.glob("fill-*"))) == 1  # the second found it built
    assert not list(tmp_path.glob(".*building*"))


def test_a_tree_that_took_the_fix_by_hand_is_rebuilt(tmp_path: Path) -> None:
    home = tmp_path / "unpatched"
    builds = []

    def fill(build: Path) -> None:
        builds.append(build)
        trees._copy_package(trees.venv_vllm(), build / "vllm")

    fix = mods.load_mod("fix-eagle-fine-prefix")
    trees.stamped_folder(home, {"v": 1}, fill, "vllm")
    mods.apply(home / "vllm", [fix])  # carries the fix now, under an "unpatched" stamp
    trees.stamped_folder(home, {"v": 1}, fill, "vllm")
    assert len(builds) == 2
    assert mods.state(fix, home / "vllm") is mods.State.APPLIES
