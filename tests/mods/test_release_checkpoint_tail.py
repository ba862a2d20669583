"""The kept branch of ``MambaManager._cache_partial_tail_block`` on vLLM 0.34.0's
own trees (tests/regression/test_checkpoint_tail_kept.py has the same on the pinned
trees): a chunk stopped at an off-grid prompt checkpoint loses its end when its own
export is kept at the block boundary below, under the legacy hashing only. The
release as installed (stock) loses it; its unpatched tree, which carries
``fix-mamba-transient-checkpoint-tail``, publishes it.

Here, not in tests/regression: the release tree is built from its sdist on the
host; the images run tests/regression with the network cut off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import releases

pytestmark = pytest.mark.cpu

# The same producer and follow-up on 0.34.0's own tree (its unpatched stage, which
# carries fix-mamba-transient-checkpoint-tail), with the legacy hashing
# (``disable_lookahead_block_hashes``) and with the default lookahead hashes.
_ON_RELEASE = """
import json, sys
from pathlib import Path
import kit.vllm_tree.release_plugin  # noqa: F401
from kit.geometry.geometry_model import Case, Geometry
from kit.rig.sched_harness import MAMBA_GROUP, run_case
model, out = sys.argv[1:]
case = Case(Geometry(384, 16, 1, checkpoints="internal-grid"), 416, 4)
rows = {}
for lookahead in (False, True):
    rig, a, b, bounds = run_case(Path(model), case, lookahead_hashes=lookahead)
    rows["lookahead" if lookahead else "legacy"] = {
        "ends": rig.chunk_ends[a.request_id],
        "exports": rig.exports.get(a.request_id, []),
        "partials": rig.partial_entries_of(a.request_id, MAMBA_GROUP),
        "fa_eagle": bounds.fa_eagle,
        "hit": b.hit,
        "own_prefix": b.resumed_from_own_prefix(),
    }
Path(out).write_text(json.dumps(rows))
"""


def _rows(stage: str, tiny_model_dir: Path, out: Path) -> dict:
    tree = releases.tree("0.34.0", stage)
    cmd = [sys.executable, "-c", _ON_RELEASE, str(tiny_model_dir), str(out)]
    root = Path(__file__).resolve().parents[2]
    subprocess.run(cmd, check=True, env=tree.env(VLLM_LOGGING_LEVEL="ERROR"), cwd=root)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def on_0_34_0(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _rows("unpatched", tiny_model_dir, tmp_path_factory.mktemp("kept-0.34.0") / "r.json")


@pytest.fixture(scope="module")
def on_stock_0_34_0(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _rows("pristine", tiny_model_dir, tmp_path_factory.mktemp("kept-stock") / "r.json")


def test_on_stock_0_34_0_the_loss_needs_the_legacy_hashing(on_stock_0_34_0: dict) -> None:
    """Stock 0.34.0 loses the chunk end under the legacy hashing (the kept export
    384, nothing at 400, B at 384 though attention allows 400). With the default
    lookahead hashes its last cacheable block stop is ``floor((N - 1) / B) * B =
    384``, below the prompt checkpoint 416: the chunk that ends there starts on
    the boundary, has no export, and 416 is published."""
    legacy, lookahead = on_stock_0_34_0["legacy"], on_stock_0_34_0["lookahead"]
    assert legacy["ends"] == [400, 420] and legacy["exports"] == [384]
    assert legacy["partials"] == [] and legacy["fa_eagle"] == 400
    assert legacy["hit"] == 384 and legacy["own_prefix"]
    assert lookahead["ends"] == [384, 416, 420] and lookahead["exports"] == []
    assert lookahead["partials"] == [416] and lookahead["own_prefix"]


def test_on_0_34_0_the_prompt_checkpoint_stop_is_published(on_0_34_0: dict) -> None:
    """With ``fix-mamba-transient-checkpoint-tail`` the kept export 384 is keyed and
    the chunk end 400 published beside it (its own column): B resumes at 400."""
    legacy, lookahead = on_0_34_0["legacy"], on_0_34_0["lookahead"]
    assert legacy["ends"] == [400, 420] and legacy["exports"] == [384]
    assert legacy["partials"] == [400]
    assert legacy["hit"] == legacy["fa_eagle"] == 400 and legacy["own_prefix"]
    assert lookahead["partials"] == [416] and lookahead["own_prefix"]
