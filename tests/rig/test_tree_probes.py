"""The rigs read two facts off the tree under test rather than off its release
number (kit/rig/sched_harness.py): whether its checkpoint builder writes the fix's
extra states, and whether its fix also exports the last block boundary. Here the
second, asked of a stand-in export rule, so that the answer is the rule's and a
rule the geometry model cannot describe is refused."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu]


def _rule(exports_boundary_in: set[int]):  # noqa: ANN202
    """An export rule with the release's positional signature that exports the last
    cacheable block boundary for the block sizes given, and nothing else."""

    def rule(start, end, n, block, unit, drop, alignment, *rest, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        boundary = (n - 1) // block * block
        return (boundary,) if block in exports_boundary_in and start < boundary < end else ()

    return rule


@pytest.mark.parametrize(
    ("blocks", "answer"),
    [(set(), False), ({64, 384, 528, 2144}, True), ({384}, "refused")],
)
def test_the_boundary_probe_asks_the_trees_rule(monkeypatch, blocks, answer) -> None:  # noqa: ANN001
    from vllm.v1 import kv_cache_interface

    from kit.rig.sched_harness import tree_exports_block_boundary

    monkeypatch.setattr(
        kv_cache_interface, "get_mamba_eagle_fix_exports", _rule(blocks), raising=False
    )
    if answer == "refused":
        with pytest.raises(RuntimeError, match="for some prompts only"):
            tree_exports_block_boundary()
    else:
        assert tree_exports_block_boundary() is answer


def test_a_tree_without_the_rule_exports_no_boundary(monkeypatch) -> None:  # noqa: ANN001
    from vllm.v1 import kv_cache_interface

    from kit.rig.sched_harness import tree_exports_block_boundary

    monkeypatch.delattr(kv_cache_interface, "get_mamba_eagle_fix_exports", raising=False)
    assert tree_exports_block_boundary() is False
