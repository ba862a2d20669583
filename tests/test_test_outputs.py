"""`make test` leaves a clean checkout clean: what it runs writes under .cache/ (ignored),
never into results/, whose committed record the targets named for it write
(make upstream-suite, upstream-check, record-upstream); and a pytest session that
rewrites a committed results file fails (tests/results_guard.py, tests/conftest.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import results_guard

from kit import paths
from kit.vllm_tree import upstream_check

pytestmark = pytest.mark.cpu

# The options through which the upstream runners write (or read a run they compare with).
OUTPUT_OPTIONS = ("--out", "--results-root", "--suite-results")


def _make_n(target: str) -> list[list[str]]:
    """The commands ``make -n <target>`` prints, one word list per command line."""
    env = {k: v for k, v in os.environ.items() if k not in ("TESTS", "MAKEFLAGS")}
    out = subprocess.run(
        ["make", "-n", target], cwd=paths.ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    return [shlex.split(line) for line in out.replace("\\\n", " ").splitlines() if line.strip()]


def _options(words: list[str]) -> dict[str, str]:
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w in OUTPUT_OPTIONS}


def test_make_test_writes_the_upstream_suites_under_cache_only() -> None:
    runners = [
        words
        for words in _make_n("test")
        if any(w in ("kit.vllm_tree.upstream_suite", "kit.vllm_tree.upstream_check") for w in words)
    ]
    assert len(runners) == 3, runners
    for words in runners:
        options = _options(words)
        # Without an output option a runner writes its default: the committed record.
        need = (
            {"--out", "--suite-results"}
            if "kit.vllm_tree.upstream_check" in words
            else {"--results-root"}
        )
        assert need <= set(options), (words, options)
        assert all(v.startswith(".cache/") for v in options.values()), options
    assert not [w for words in _make_n("test") for w in words if w.startswith("results/")]


def test_record_upstream_writes_the_committed_record() -> None:
    """The committed record is written by a target of its own, at the defaults."""
    runners = [
        w for w in _make_n("record-upstream") if "upstream-suite" in w or "upstream-check" in w
    ]
    assert len(runners) == 3 and not [o for w in runners for o in _options(w)], runners


def test_upstream_check_reads_pristine_outcomes_from_the_run_it_is_told(tmp_path: Path) -> None:
    change = upstream_check.changes()[0]
    with pytest.raises(upstream_check.CheckError) as caught:
        upstream_check.suite_against_pristine(change, tmp_path / "source", tmp_path / "suite")
    assert str(tmp_path / "suite") in str(caught.value)
    assert "--suite-results" in str(caught.value)


def test_the_results_guard_names_a_rewritten_or_removed_committed_file(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    for name in ("kept.json", "rewritten.json", "removed.json"):
        (tmp_path / "results" / name).write_text("{}\n")
    (tmp_path / "results" / "untracked.json").write_text("{}\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "add", "results/kept.json", "results/rewritten.json", "results/removed.json"],
        cwd=tmp_path,
        check=True,
    )
    before = results_guard.committed(tmp_path)
    assert set(before) == {f"results/{n}" for n in ("kept.json", "rewritten.json", "removed.json")}
    (tmp_path / "results" / "rewritten.json").write_text('{"new": 1}\n')
    (tmp_path / "results" / "removed.json").unlink()
    (tmp_path / "results" / "untracked.json").write_text("changed\n")
    after = results_guard.committed(tmp_path)
    touched = results_guard.changed(before, after)
    assert touched == ["results/removed.json", "results/rewritten.json"]


def test_a_relative_results_root_is_the_callers(tmp_path: Path, monkeypatch) -> None:
    """make test passes .cache/... relative to the checkout; the suites' pytest runs in
    the sdist's test folder, so the runner must resolve it where it was called (it once
    wrote the JUnit files there and read them here: FileNotFoundError)."""
    from kit.vllm_tree import releases, sdists, upstream_suite

    seen: list[Path] = []

    def results_dir(root: Path, version: str) -> Path:
        seen.append(root)
        raise OSError("stop here")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(releases, "resolve", lambda release: "0.32.0")
    monkeypatch.setattr(sdists, "release", lambda version, explicit=None: tmp_path)
    monkeypatch.setattr(upstream_suite, "extract_tests", lambda sdist, version: tmp_path)
    monkeypatch.setattr(releases, "results_dir", results_dir)
    assert upstream_suite.main(["--results-root", ".cache/test-results/upstream-suite"]) == 2
    assert seen == [tmp_path / ".cache/test-results/upstream-suite"]
    # upstream_check's options, read off its parser as its main builds it.
    import argparse

    actions: list = []

    def capture(parser, args=None, namespace=None):
        actions.extend(parser._actions)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        upstream_check.main([])
    for option in ("--out", "--suite-results"):
        action = next(a for a in actions if option in a.option_strings)
        assert action.type("x/y.json") == tmp_path / "x/y.json", option
