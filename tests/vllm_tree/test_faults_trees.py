"""Faults of the pinned vLLM trees: a tree shares no file with the .venv or with the
other tree, and any change to any file of a built tree (an in-place edit, with its
mtime put back or not, a file added or removed) makes its stamp stale, so the tree
is rebuilt instead of used.

A small fake vLLM package in tmp_path stands in for the .venv's (the real trees are
never rebuilt here), and the trees' folder is moved to tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from kit.vllm_tree import mods, trees

pytestmark = pytest.mark.cpu

FILES = {
    "__init__.py": "from vllm._version import __version__\n",
    "_version.py": "__version__ = version = '0.32.0'\n__commit_id__ = commit_id = 'abc'\n",
    "v1/__init__.py": "",
    "v1/core/sched/scheduler.py": "BLOCK = 16\n" * 20,
    "_C.abi3.so": "\0binary kernels\0" * 64,
}


@pytest.fixture()
def source(tmp_path: Path, monkeypatch) -> Path:
    """A fake .venv vllm package; trees land in tmp_path/trees, with no mods."""
    package = tmp_path / "venv" / "vllm"
    for rel, text in FILES.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    monkeypatch.setattr(trees, "TREES", tmp_path / "trees")
    monkeypatch.setattr(trees.mods, "mods_for_target", lambda target, stage, **kw: [])
    return package


def _build(source: Path, name: str = "unpatched") -> Path:
    return trees.ensure_tree(name, "cpu", source)


def _inodes(folder: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_dev, p.stat().st_ino) for p in folder.rglob("*") if p.is_file()}


def _rebuilt(tree: Path, source: Path) -> bool:
    """Builds a tree anew when stale; a probe beside the package survives only when
    the folder was kept."""
    probe = tree.parent / "probe"
    probe.write_text("")
    assert _build(source, tree.parent.name) == tree
    return not probe.exists()


def test_a_tree_shares_no_file_with_the_venv_or_the_other_tree(source: Path) -> None:
    unpatched, patched = _build(source, "unpatched"), _build(source, "patched")
    assert not _inodes(unpatched) & _inodes(source)
    assert not _inodes(patched) & _inodes(source)
    assert not _inodes(unpatched) & _inodes(patched)
    assert (unpatched / "v1/core/sched/scheduler.py").read_text() == FILES[
        "v1/core/sched/scheduler.py"
    ]


def test_an_edit_in_a_tree_reaches_neither_the_venv_nor_the_other_tree(source: Path) -> None:
    unpatched, patched = _build(source, "unpatched"), _build(source, "patched")
    with (unpatched / "v1/core/sched/scheduler.py").open("a") as f:
        f.write("BLOCK = 32\n")
    assert (source / "v1/core/sched/scheduler.py").read_text() == FILES[
        "v1/core/sched/scheduler.py"
    ]
    assert "32" not in (patched / "v1/core/sched/scheduler.py").read_text()


@pytest.mark.parametrize("rel", ["v1/core/sched/scheduler.py", "_C.abi3.so", "_version.py"])
def test_an_in_place_edit_of_any_file_makes_the_tree_stale(source: Path, rel: str) -> None:
    tree = _build(source)
    assert not _rebuilt(tree, source)  # as built: current
    target = tree / rel
    before = target.stat()
    time.sleep(0.05)  # past the filesystem's timestamp tick, as any real edit is
    data = bytearray(target.read_bytes())
    data[1] ^= 1  # same size
    with target.open("r+b") as f:  # in place: same inode
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the mtime put back
    assert target.stat().st_ino == before.st_ino and target.stat().st_size == before.st_size
    assert _rebuilt(tree, source)
    assert (tree / rel).read_text() == FILES[rel]


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_file_added_or_removed_makes_the_tree_stale(source: Path, change: str) -> None:
    tree = _build(source)
    if change == "added":
        (tree / "v1" / "sitecustomize.py").write_text("import os\n")
    else:
        (tree / "v1/core/sched/scheduler.py").unlink()
    assert _rebuilt(tree, source)
    assert not (tree / "v1" / "sitecustomize.py").exists()
    assert (tree / "v1/core/sched/scheduler.py").is_file()


def test_bytecode_and_the_mods_lock_do_not_make_a_tree_stale(source: Path) -> None:
    """Python writes __pycache__ into a tree it imports from, and `kit mods` takes its
    lock file there: neither is a change to the tree."""
    tree = _build(source)
    (tree / "__pycache__").mkdir()
    (tree / "__pycache__" / "_version.cpython-311.pyc").write_bytes(b"pyc")
    (tree / "v1" / "__pycache__").mkdir()
    (tree / "v1" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"pyc")
    (tree / mods.LOCK_NAME).write_text("")
    assert not _rebuilt(tree, source)


def _older_stamp(home: Path, source: Path) -> None:
    """The stamp an older kit wrote: its contents without the file listing."""
    want = trees._wanted_stamp(source, "unpatched", "cpu")
    contents = {"files": {}, "interrupted": False}
    for rel in FILES:  # what it hashed: the files a mod touches
        if rel in trees.package_contents(home)["files"]:
            contents["files"][rel] = trees.pins.file_sha256(home / "vllm" / rel)
    (home / trees.STAMP).write_text(json.dumps({"want": want, "contents": contents}))


def test_a_tree_hard_linked_by_an_older_kit_is_rebuilt(source: Path) -> None:
    """A tree from before the copies (hard links into the .venv, a stamp without the
    file listing) is rebuilt as a copy."""
    home = trees.TREES / "unpatched"
    home.mkdir(parents=True)
    shutil.copytree(source, home / "vllm", copy_function=os.link)
    _older_stamp(home, source)
    tree = home / "vllm"
    assert _inodes(tree) & _inodes(source)
    assert _rebuilt(tree, source)
    assert not _inodes(tree) & _inodes(source)


def test_a_copied_tree_with_an_older_stamp_is_kept(source: Path) -> None:
    """A tree that already shares nothing (a release tree unpacked from its sdist)
    with a stamp from before the file listing takes the listing once instead of a
    rebuild under the processes running from it."""
    home = trees.TREES / "unpatched"
    home.mkdir(parents=True)
    shutil.copytree(source, home / "vllm")
    _older_stamp(home, source)
    tree = home / "vllm"
    assert not _rebuilt(tree, source)
    assert "tree" in json.loads((home / trees.STAMP).read_text())["contents"]
    (tree / "_version.py").write_text("# edited\n")
    assert _rebuilt(tree, source)  # and from then on checks every file
