import pytest

from kit.vllm_tree import releases, trees
from tests.mods.release_side import RELEASE


@pytest.fixture(scope="module")
def release_tree() -> trees.Tree:
    """The patched tree of the release the worker-side export mod is made for."""
    return releases.tree(RELEASE, "patched")
