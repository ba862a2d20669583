"""`make upstream-check`'s static form checks (kit/vllm_tree/upstream_check.py,
``form_problems``): the committed upstream/ folders pass, and a doctored copy of
them fails with one line per problem naming the file and what to add. The
patches' tests follow vLLM's tests/AGENTS.md: no kit import, no SimpleNamespace,
no private attribute, and a speculation test builds a SpeculativeConfig."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kit.paths import ROOT
from kit.vllm_tree import upstream_check

pytestmark = pytest.mark.cpu

PRS = sorted(p.parent.name for p in upstream_check.UPSTREAM.glob("*/upstream.toml"))


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    dest = tmp_path / "upstream"
    shutil.copytree(upstream_check.UPSTREAM, dest)
    return dest


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_the_committed_folders_pass() -> None:
    assert PRS, "no pull request under upstream/"
    assert upstream_check.form_problems() == []


def test_the_committed_copy_passes(copy: Path) -> None:
    """The doctored cases below start from a copy that passes as it is."""
    assert upstream_check.form_problems(copy) == []


@pytest.mark.parametrize("section", upstream_check.TEMPLATE_SECTIONS)
def test_a_missing_template_section_is_named(copy: Path, section: str) -> None:
    pr = copy / PRS[0] / "PR.md"
    _edit(pr, f"## {section}\n", "## Something else\n")
    assert upstream_check.form_problems(copy) == [
        f"{pr}: add the template's '## {section}' section"
    ]


def test_sections_out_of_order_are_named(copy: Path) -> None:
    pr = copy / PRS[0] / "PR.md"
    _edit(pr, "## Overview\n", "## Overview moved\n")
    _edit(pr, "## Details\n", "## Details\n\n## Overview\n")
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: put the sections in the template's order")


def test_a_missing_checklist_is_named(copy: Path) -> None:
    pr = copy / PRS[0] / "PR.md"
    text = pr.read_text()
    pr.write_text(text[: text.index("<details>")])
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: add the template's checklist")


def test_a_missing_checklist_item_is_named(copy: Path) -> None:
    pr = copy / PRS[-1] / "PR.md"
    lines = [line for line in pr.read_text().splitlines() if "**Design Fit:**" not in line]
    pr.write_text("\n".join(lines) + "\n")
    assert upstream_check.form_problems(copy) == [
        f"{pr}: add the checklist item '- [ ] **Design Fit:** ...' of the template"
    ]


def test_a_missing_duplicate_work_section_is_named(copy: Path) -> None:
    pr = copy / PRS[1] / "PR.md"
    _edit(pr, "## Duplicate-work check\n", "## Notes\n")
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: add a duplicate-work section")


def test_a_duplicate_work_section_without_references_is_named(copy: Path) -> None:
    pr = copy / PRS[1] / "PR.md"
    text = pr.read_text()
    start = text.index("## Duplicate-work check")
    end = text.index("## AI assistance")
    pr.write_text(text[:start] + "## Duplicate-work check\n\nNone found.\n\n" + text[end:])
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: cite the related upstream pull requests")


def test_a_missing_ai_statement_is_named(copy: Path) -> None:
    pr = copy / PRS[0] / "PR.md"
    body, sep, checklist = pr.read_text().partition("---\n\n<details>")
    pr.write_text(body.replace("AI assistance", "help") + sep + checklist)
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: add a statement that AI assistance was used")


def test_the_checklist_box_alone_is_no_ai_statement(copy: Path) -> None:
    """The template's own checkbox names AI assistance; the body must say it too."""
    pr = copy / PRS[0] / "PR.md"
    body, sep, checklist = pr.read_text().partition("---\n\n<details>")
    assert "AI assistance" in checklist
    pr.write_text(body.replace("AI assistance", "help") + sep + checklist)
    assert any("AI assistance" in p for p in upstream_check.form_problems(copy))


def test_a_missing_sign_off_is_named(copy: Path) -> None:
    pr = copy / PRS[2] / "PR.md"
    _edit(pr, "Signed-off-by: <name> <email>\n", "")
    assert upstream_check.form_problems(copy) == [
        f"{pr}: add a DCO line 'Signed-off-by: <name> <email>' (AGENTS.md)"
    ]


def test_a_missing_pr_is_named(copy: Path) -> None:
    pr = copy / PRS[0] / "PR.md"
    pr.unlink()
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{pr}: missing")


@pytest.mark.parametrize(
    "line",
    [
        "+from kit.vllm_tree import trees",
        "+import kit",
        "+    assert kit.paths.ROOT",
        "+from tests.regression import conftest",
        "+from tests.vllm_tree.test_upstream_form import PRS",
    ],
)
def test_a_patch_test_importing_the_kit_is_named(copy: Path, line: str) -> None:
    patch = copy / PRS[0] / "fix.patch"
    text = patch.read_text()
    # An added line inside the first hunk of the patch's tests/ part.
    first_hunk = text.index("\n+", text.index("+++ b/tests/"))
    patch.write_text(text[: first_hunk + 1] + line + "\n" + text[first_hunk + 1 :])
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{patch}:")
    assert "imports" in problem and "use vLLM's own test helpers" in problem


def test_vllm_test_helpers_and_the_vllm_part_are_not_the_kit(copy: Path) -> None:
    """``tests.v1.core.utils`` is vLLM's; a ``kit.`` line outside tests/ is not a test."""
    patch = copy / PRS[0] / "fix.patch"
    text = patch.read_text()
    first_hunk = text.index("\n+", text.index("+++ b/tests/"))
    text = (
        text[: first_hunk + 1]
        + "+from tests.v1.core.utils import create_requests\n"
        + text[first_hunk + 1 :]
    )
    vllm_hunk = text.index("\n+", text.index("+++ b/vllm/"))
    text = text[: vllm_hunk + 1] + "+# see kit.vllm_tree\n" + text[vllm_hunk + 1 :]
    patch.write_text(text)
    assert upstream_check.form_problems(copy) == []
    assert not (ROOT / "tests" / "v1").exists(), "the kit's tests/ must not shadow vLLM's tests/v1"


def _add_test_line(patch: Path, line: str) -> None:
    """``line`` added inside the first hunk of the patch's tests/ part."""
    text = patch.read_text()
    first_hunk = text.index("\n+", text.index("+++ b/tests/"))
    patch.write_text(text[: first_hunk + 1] + line + "\n" + text[first_hunk + 1 :])


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("+    scheduler = SimpleNamespace(block_size=16)", "SimpleNamespace"),
        ("+from types import SimpleNamespace", "SimpleNamespace"),
        ("+    assert manager._checkpoints[req.request_id] == (64, 0)", "_checkpoints"),
        ("+    n = Scheduler._mamba_block_aligned_split(stub, request, 8)", "_mamba_block"),
    ],
)
@pytest.mark.parametrize("pr", PRS)
def test_a_stub_or_private_attribute_in_a_patch_test_is_named(
    copy: Path, pr: str, line: str, named: str
) -> None:
    patch = copy / pr / "fix.patch"
    _add_test_line(patch, line)
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{patch}:") and named in problem
    assert "tests/AGENTS.md" in problem


def test_dunders_helpers_and_the_vllm_part_are_not_private_attributes(copy: Path) -> None:
    """A module-level ``_helper(...)`` call, a dunder, a comment that names what
    the test avoids and vLLM's own code are fine."""
    patch = copy / PRS[0] / "fix.patch"
    _add_test_line(patch, "+    assert _split(request, 8) == type(request).__name__")
    _add_test_line(patch, "+    # a real Scheduler, not a SimpleNamespace reaching obj._state")
    text = patch.read_text()
    vllm_hunk = text.index("\n+", text.index("+++ b/vllm/"))
    patch.write_text(
        text[: vllm_hunk + 1]
        + "+        self._private = SimpleNamespace()\n"
        + text[vllm_hunk + 1 :]
    )
    assert upstream_check.form_problems(copy) == []


@pytest.mark.parametrize("pr", PRS)
def test_every_speculation_test_builds_a_speculative_config(pr: str) -> None:
    """The committed patches: each names the server's speculative settings and
    builds them from a ``SpeculativeConfig`` (guarded by ``form_problems`` too)."""
    tests, _, _ = (
        (upstream_check.UPSTREAM / pr / "fix.patch").read_text().partition("diff --git a/vllm/")
    )
    tests = "\n".join(line for line in tests.splitlines() if line.startswith("+"))
    assert "SpeculativeConfig(" in tests
    assert "num_speculative_tokens=" in tests


@pytest.mark.parametrize("pr", PRS)
def test_a_speculation_test_without_a_speculative_config_is_named(copy: Path, pr: str) -> None:
    """Set by hand (``num_prefill_lookahead = 3``, ``use_eagle=True``), the lookahead
    and block drop are values no server resolves: the patch must build them."""
    patch = copy / pr / "fix.patch"
    tests, sep, vllm_part = patch.read_text().partition("diff --git a/vllm/")
    assert "SpeculativeConfig(" in tests
    patch.write_text(tests.replace("SpeculativeConfig(", "make_config(") + sep + vllm_part)
    (problem,) = upstream_check.form_problems(copy)
    assert problem.startswith(f"{patch}:")
    assert "builds no SpeculativeConfig" in problem


def test_a_test_without_speculation_needs_no_speculative_config(copy: Path) -> None:
    patch = copy / PRS[0] / "fix.patch"
    tests, sep, vllm_part = patch.read_text().partition("diff --git a/vllm/")
    kept = [
        line
        for line in tests.splitlines()
        if not (line.startswith("+") and upstream_check.SPECULATION_SETTINGS.search(line))
    ]
    patch.write_text(
        "\n".join(kept).replace("SpeculativeConfig(", "make_config(") + "\n" + sep + vllm_part
    )
    assert upstream_check.form_problems(copy) == []


def test_an_rfc_over_the_word_limit_is_named(copy: Path) -> None:
    rfc = copy / "eagle-fine-prefix" / "RFC.md"
    words = len(rfc.read_text().split())
    assert words <= upstream_check.RFC_MAX_WORDS
    rfc.write_text(rfc.read_text() + " padding" * (upstream_check.RFC_MAX_WORDS - words + 1))
    assert upstream_check.form_problems(copy) == [
        f"{rfc}: {upstream_check.RFC_MAX_WORDS + 1} words; cut it to at most "
        f"{upstream_check.RFC_MAX_WORDS}"
    ]


def test_main_stops_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A form problem ends the run with status 1 before any patch is applied."""
    _edit(copy / PRS[0] / "PR.md", "Signed-off-by: <name> <email>\n", "")
    monkeypatch.setattr(upstream_check, "UPSTREAM", copy)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("upstream-check ran a step despite a form problem")

    monkeypatch.setattr(upstream_check, "changes", never)
    monkeypatch.setattr(upstream_check, "check", never)
    assert upstream_check.main(["--no-suite", "--out", str(copy / "out.json")]) == 1
    err = capsys.readouterr().err
    assert "Signed-off-by" in err and str(copy / PRS[0] / "PR.md") in err
    assert not (copy / "out.json").exists()
