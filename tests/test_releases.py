"""Later vLLM releases from pins.toml [releases]: trees from their sdists, and the table.

Tree-independent, so it runs once, in the patched-tree pass of `make test`. The
table test downloads the newest release's sdist from PyPI once (sha256-checked,
cached in .cache/) and runs the scheduler suite on it in its own processes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from scripts import release_report, releases
from scripts.geometry_model import Case

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module", autouse=True)
def _patched_pass_only() -> None:
    if os.environ.get("KIT_TREE", "patched") != "patched":
        pytest.skip("tree-independent release tests run in the patched pass only")


def _newest() -> str:
    return max(releases.known(), key=lambda v: tuple(int(x) for x in v.split(".")))


def test_every_release_is_pinned_by_url_and_sha256() -> None:
    assert releases.known(), "pins.toml has no [releases]"
    for version, spec in releases.known().items():
        assert spec["sdist_url"].endswith(f"/vllm-{version}.tar.gz"), version
        assert re.fullmatch(r"[0-9a-f]{64}", spec["sdist_sha256"]), version


def test_unknown_release_is_refused_with_what_to_do() -> None:
    with pytest.raises(releases.ReleaseError, match=r"not in pins.toml \[releases\].*sdist_sha256"):
        releases.ensure_tree("0.0.1")


def test_lookahead_ideal() -> None:
    # One lookahead token, nothing dropped: the last boundary B shares with its next token.
    assert release_report.lookahead_ideal(Case(64, 16, 1, 1007, 1), 1) == 992
    assert release_report.lookahead_ideal(Case(64, 16, 1, 1008, 1), 1) == 992
    assert release_report.lookahead_ideal(Case(64, 16, 0, 1008, 1), 0) == 1008


def test_newest_release_table(tmp_path: Path) -> None:
    """The measured picture of the newest release, encoded: legacy hashes behave as
    0.32.0 everywhere; with lookahead hashes the "." probe is fine at S mod H = 7 and
    15 but loses at S mod H = 0 (a block or everything)."""
    version = _newest()
    assert release_report.run(version, quiet=True, out_root=tmp_path) == 0
    report = json.loads((tmp_path / version / "regression.json").read_text())
    assert report["summary"]["unpatched/legacy"] == {"as 0.32.0": 243}
    probes = [r for r in report["rows"] if r["k"] > 0 and r["case"].endswith("-U1")]
    for row in probes:
        verdict = row["unpatched/lookahead"]["verdict"]
        assert verdict == ("loss" if row["S_mod_H"] == 0 else "ok"), (row["case"], verdict)
