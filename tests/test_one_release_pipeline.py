"""One release pipeline (issue 37, item 1): adding a vLLM release is one entry in
pins.toml (and, where needed, its mods); nothing in kit/ names a release or compares a
tree's name to decide what to do.

What ``test_no_module_names_a_release_or_decides_by_a_tree_name`` scans: every
``*.py`` file under kit/, parsed with ``ast`` (so comments are not seen), and in it

- every string constant except docstrings (a module's, class's or function's first
  statement) that holds a vLLM release number ``0.<minor>.<patch>`` with a minor of 1
  or more (``RELEASE``): help texts, messages, code in strings and f-string parts
  included; data files (pins.toml, mods/, *.toml, *.json) are not Python and are
  not scanned;
- every comparison (``==``, ``!=``, ``in``, ``not in``, ``is``) one of whose operands
  is, or is a tuple/list/set holding, the string "patched" or "unpatched", or a
  module-level name bound to one of them (``TREE_NAMES``).

Dictionary keys and subscripts (``summary["unpatched"]``), argparse ``choices`` and a
stage passed to a builder are not comparisons and are not flagged: they name a
stage, they do not decide by it. ``ALLOWED`` lists what is left, each with why.

The bench's A/B pair names its servers by side (unpatched, patched), and whether a
server is the one under test is ``kit.bench.plan.carries_fix``: a tree's mods
(``Tree.patched``), or, for a server given by URL, the side the command line
declares (``kit.bench.plan.Side``), never a comparison with the name.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from kit.vllm_tree import pins, releases

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "kit"
RELEASE = re.compile(r"(?<![\w.])0\.[1-9]\d*\.\d+(?![\w.])")
TREE_NAMES = {"patched", "unpatched"}

# (path glob under the repository, the flagged statement's first line or the flagged
# comparison): why it stays. Each entry must still match a site
# (test_every_allowance_is_still_needed), so a mended one is taken out.
ALLOWED: dict[tuple[str, str], str] = {}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _strings(node: ast.AST, names: dict[str, str]) -> list[str]:
    """The string values an operand is or holds (a module-level name: its value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in names:
        return [names[node.id]]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in _strings(e, names)]
    return []


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "..."`` bindings."""
    found = {}
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
        ):
            found |= {t.id: stmt.value.value for t in stmt.targets if isinstance(t, ast.Name)}
    return found


def _statement_of(parents: dict[int, ast.AST], node: ast.AST) -> str:
    """The first line of the innermost statement holding ``node``."""
    while not isinstance(node, ast.stmt) and id(node) in parents:
        node = parents[id(node)]
    return ast.unparse(node).splitlines()[0]


def findings(path: Path) -> list[tuple[str, str, str]]:
    """(kind, statement, detail) for each site in one module."""
    tree = ast.parse(path.read_text())
    docs, names = _docstrings(tree), _module_strings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            for match in RELEASE.findall(node.value):
                found.append(("release", _statement_of(parents, node), match))
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(s in TREE_NAMES for o in operands for s in _strings(o, names)):
                found.append(("tree name", _statement_of(parents, node), ast.unparse(node)))
    return found


def sites() -> list[tuple[str, str, str, str]]:
    return [
        (str(path.relative_to(ROOT)), *site)
        for path in sorted(KIT.rglob("*.py"))
        for site in findings(path)
    ]


def _allowed(rel: str, statement: str, detail: str) -> tuple[str, str] | None:
    for glob, text in ALLOWED:
        if fnmatch.fnmatch(rel, glob) and text in (statement, detail):
            return glob, text
    return None


def test_no_module_names_a_release_or_decides_by_a_tree_name() -> None:
    bad = [
        f"{rel}: {kind} ({detail}) in `{statement}`"
        for rel, kind, statement, detail in sites()
        if _allowed(rel, statement, detail) is None
    ]
    assert not bad, (
        "a release number belongs in pins.toml (releases.known(), releases.newest()), "
        "patched-ness in Tree.patched (from the mods), stock in Tree.stock:\n" + "\n".join(bad)
    )


def test_every_allowance_is_still_needed() -> None:
    used = {_allowed(rel, statement, detail) for rel, _, statement, detail in sites()}
    assert set(ALLOWED) <= used, sorted(set(ALLOWED) - used)


@pytest.mark.parametrize(
    "source,kind",
    [
        ('if tree.name == "patched":\n    pass\n', "tree name"),
        ('STAGE = "unpatched"\nok = stage != STAGE\n', "tree name"),
        ('ok = ("unpatched", x) in measured\n', "tree name"),
        # The forms the bench's A/B pair used before kit.bench.plan.carries_fix.
        ('args = base + (extra if tree == "patched" else [])\n', "tree name"),
        ('hit = expected(case, patched=tree == "patched").hit\n', "tree name"),
        ('extra = fix_flags if plan.serve_only == "patched" else []\n', "tree name"),
        ('if "patched" != side:\n    pass\n', "tree name"),
        ('fix = {t: t in ("patched",) for t in names}\n', "tree name"),
        ('help = "disable lookahead hashes (0.33.0+)"\n', "release"),
        ('"""A docstring may say 0.34.0."""\n# and a comment 0.32.0\nx = 1\n', None),
        ('d = {"patched": 1}\ny = d["unpatched"]\nv = "0.0.0+local"\n', None),
    ],
)
def test_the_scan_sees_what_it_claims(tmp_path: Path, source: str, kind: str | None) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [f[0] for f in findings(path)] == ([kind] if kind else [])


def test_every_release_has_its_trees_from_one_function() -> None:
    """The pinned release is one release among others: the same stages, the same
    function, only where its packages come from differs (pins decide, not a name)."""
    table = pins.release_table()
    assert list(releases.known()) == list(table)
    assert releases.pinned() == next(iter(table))
    for version in table:
        assert releases.stages(version)[: len(releases.STAGES) - 1] == list(releases.STAGES[:-1])
        assert releases.from_sdist(version) == (not pins.has_cpu_wheel(version))
        assert releases.results_dir(ROOT / "r", version) == (
            ROOT / "r" if version == releases.pinned() else ROOT / "r" / version
        )
    assert not releases.from_sdist(releases.pinned())


@pytest.mark.tree
def test_the_pinned_release_s_trees_say_what_they_are() -> None:
    """Stock, unpatched and patched of the pinned release, from the one function: the
    stock tree is the .venv's package, none is from an sdist, and only the patched one
    carries the fix (read from its mods)."""
    of = releases.trees_of(releases.pinned())
    assert list(of) == list(releases.STAGES)
    assert [t.stock for t in of.values()] == [True, False, False]
    assert [t.patched for t in of.values()] == [False, False, True]
    assert not any(t.from_sdist for t in of.values())
    assert {t.release for t in of.values()} == {releases.pinned()}
    assert of[releases.STOCK].child_args() == []
    assert of["patched"].child_args() == ["--fix"]


def test_a_child_is_told_what_it_runs_by_its_arguments(tmp_path: Path) -> None:
    """A tree from an sdist says so on its children's command line (and sets vLLM's
    own platform variable in their environment, for vLLM); nothing in kit/ reads
    that variable back to guess what a process runs."""
    from kit.vllm_tree import trees

    package = tmp_path / "vllm"
    package.mkdir()
    sdist_tree = trees.Tree("unpatched", package, from_sdist=True)
    wheel_tree = trees.Tree("unpatched", package)
    assert sdist_tree.child_args() == [trees.FROM_SDIST_ARG]
    assert wheel_tree.child_args() == []
    assert sdist_tree.env({})["VLLM_TARGET_DEVICE"] == "cpu"
    assert "VLLM_TARGET_DEVICE" not in wheel_tree.env({})
    readers = [
        str(path.relative_to(ROOT))
        for path in sorted(KIT.rglob("*.py"))
        if "VLLM_TARGET_DEVICE" in path.read_text()
    ]
    assert readers == ["kit/vllm_tree/trees.py"], readers
