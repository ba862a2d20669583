"""The newest release's mods leave vLLM's files as vLLM's own formatter writes them.

vLLM's pre-commit runs ``ruff format`` at a line length of 88; a change its
maintainers could take is not rewritten by it. Every Python file a mod changes
in the newest release's trees (the unpatched and patched stages: the upstream
fixes and the fix itself) must pass ``ruff format --check`` wherever the
pristine release's file does. Ruff runs isolated from the kit's own settings,
at vLLM's line length. The pinned release's fix (``fix-eagle-fine-prefix``) is
left out: its line is the newest release's.
"""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import releases

pytestmark = pytest.mark.cpu

VLLM_LINE_LENGTH = 88  # vLLM's pyproject.toml, [tool.ruff]


def unformatted(paths: list[Path]) -> set[str]:
    """The files among ``paths`` that ``ruff format`` would rewrite (one call each:
    the exit status says it, whatever the wording of ruff's report)."""
    found = set()
    for path in paths:
        cmd = [sys.executable, "-m", "ruff", "format", "--isolated", "--check"]
        cmd += [f"--line-length={VLLM_LINE_LENGTH}", str(path)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        assert run.returncode in (0, 1), run.stderr
        if run.returncode:
            found.add(str(path))
    return found


def changed_files(pristine: Path, tree: Path) -> list[str]:
    """Python files of ``tree`` that differ from (or are not in) ``pristine``."""
    return sorted(
        str(path.relative_to(tree))
        for path in tree.rglob("*.py")
        if not (pristine / path.relative_to(tree)).exists()
        or not filecmp.cmp(path, pristine / path.relative_to(tree), shallow=False)
    )


@pytest.mark.parametrize("stage", ["unpatched", "patched"])
def test_the_newest_releases_mods_are_formatted_as_vllm_formats(stage: str) -> None:
    version = releases.newest()
    pristine = releases.ensure_tree(version, "pristine")
    tree = releases.ensure_tree(version, stage)
    changed = changed_files(pristine, tree)
    assert changed, f"the {stage} tree of {version} changes no file"
    before = unformatted([pristine / f for f in changed if (pristine / f).exists()])
    after = unformatted([tree / f for f in changed])
    rewritten = {str(Path(p).relative_to(tree)) for p in after}
    already = {str(Path(p).relative_to(pristine)) for p in before}
    assert rewritten <= already, sorted(rewritten - already)


def test_a_long_line_is_found(tmp_path: Path) -> None:
    """The check itself: a line past vLLM's 88 columns is one ruff rewrites."""
    long = tmp_path / "long.py"
    long.write_text("x = [" + ", ".join(["'abcdefgh'"] * 10) + "]\n")
    short = tmp_path / "short.py"
    short.write_text("x = 1\n")
    assert unformatted([long, short]) == {str(long)}
