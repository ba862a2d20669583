import os
from pathlib import Path

import pytest

from kit.vllm_tree import releases, trees
from tests.mods.release_side import RELEASE


@pytest.fixture(scope="module")
def release_tree() -> trees.Tree:
    """The patched tree of the release the worker-side export mod is made for;
    ``KIT_EXPORTS_TREE`` (a ``vllm`` package directory built like it) runs the
    same checks on another build, e.g. a copy being edited."""
    other = os.environ.get("KIT_EXPORTS_TREE")
    if not other:
        return releases.tree(RELEASE, "patched")
    deps = releases.ensure_deps(RELEASE)
    return trees.Tree("patched", Path(other), extra_paths=(deps,), from_sdist=True)
