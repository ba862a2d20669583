"""kit.trees: one Tree value per vLLM tree, and folders that are rebuilt whole or not at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kit import trees

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
    assert (home / "vllm").is_dir() and not list(tmp_path.glob(".*.building"))


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
    assert not list(tmp_path.glob(".*.building"))


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
