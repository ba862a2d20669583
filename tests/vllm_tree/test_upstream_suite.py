"""The v1 core suite's own data: every excluded name still names a case of the
releases it is excluded on, the offline hub cache holds each config the cases
read, and the comparison fails a tree that loses a case the tree below passes."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest

from kit.vllm_tree import (
    offline_hub,
    releases,
    sdists,
    suite_plugin,
    upstream_suite,
)

RELEASES = list(releases.known())


def test_the_hub_cache_holds_each_config(tmp_path: Path) -> None:
    home = offline_hub.write(tmp_path / "hf")
    for model in offline_hub.models():
        repo = home / "hub" / f"models--{model.replace('/', '--')}"
        revision = (repo / "refs" / "main").read_text()
        config = json.loads((repo / "snapshots" / revision / "config.json").read_text())
        assert config["architectures"] and config["model_type"], model


def test_every_exclusion_has_a_reason_and_the_releases_are_known() -> None:
    for release in RELEASES:
        for case, reason in upstream_suite.exclusions(release).items():
            assert case.startswith(("tests/v1/core/", "tests/v1/worker/")), case
            assert len(reason) > 20, case
    assert upstream_suite.exclusions("0.0.0")  # an entry without releases holds everywhere


def collected(release: str) -> list[str]:
    """Node ids of the suite files an exclusion names, as the release's tests have them."""
    tests_dir = upstream_suite.extract_tests(sdists.release(release), release)
    tree = releases.tree(release, "unpatched")
    files = sorted(
        {
            case.split("::")[0]
            for case in upstream_suite.exclusions(release)
            if (tests_dir / case.split("::")[0]).exists()
        }
    )
    return subprocess.run(
        upstream_suite.pytest_command(tree, tests_dir, "--collect-only", *files),
        cwd=tests_dir,
        capture_output=True,
        text=True,
        env=upstream_suite.suite_env(tree, tests_dir),
    ).stdout.splitlines()


def test_each_excluded_name_is_a_case_of_a_release_it_names() -> None:
    """A name that matches nothing in any of its releases (renamed or removed
    upstream) must go, not linger."""
    try:
        listed = {release: collected(release) for release in RELEASES}
    except sdists.SdistError as exc:
        pytest.skip(f"no sdist here: {exc}")
    table = tomllib.loads(upstream_suite.EXCLUSIONS.read_text())
    stale = [
        case
        for entry in table["exclude"]
        for case in entry["cases"]
        if not any(
            suite_plugin.excluded(line, {case})
            for release in entry.get("releases", RELEASES)
            for line in listed[release]
        )
    ]
    assert not stale, f"excluded but a case of none of its releases: {stale}"


def test_an_exclusion_names_one_test_not_every_test_it_begins() -> None:
    names = {"t.py::test_bind", "t.py::test_c[1]"}
    assert suite_plugin.excluded("t.py::test_bind", names)
    assert suite_plugin.excluded("t.py::test_bind[a-b]", names)
    assert not suite_plugin.excluded("t.py::test_bind_more", names)
    assert suite_plugin.excluded("t.py::test_c[1]", names)
    assert not suite_plugin.excluded("t.py::test_c[2]", names)


def test_a_tree_that_loses_a_case_fails() -> None:
    results = {
        "pristine": {"t::a": "passed", "t::b": "passed"},
        "unpatched": {"t::a": "passed", "t::b": "failed"},
        "patched": {"t::a": "passed", "t::b": "failed"},
    }
    report, verdict, ok = upstream_suite.compare(results, {"t::c": "needs a GPU here"})
    assert not ok and report["passed_pristine_not_unpatched"] == ["t::b"]
    assert report["passed_unpatched_not_patched"] == []
    assert report["excluded"] == {"needs a GPU here": ["t::c"]}
    results["unpatched"]["t::b"] = "passed"
    assert not upstream_suite.compare(results)[2]  # patched lost t::b
    results["patched"]["t::b"] = "passed"
    assert upstream_suite.compare(results)[2]
