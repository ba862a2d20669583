"""`make upstream-check`: each change in upstream/ as vLLM's maintainers would take it.

``upstream/<name>/`` holds ``fix.patch`` (a git diff against the release's
source root: ``vllm/...`` and the tests it adds under ``tests/...``),
``upstream.toml`` (``mod``: the kit's mod it must equal; ``release``;
``new_tests``: the node ids the patch adds) and ``PR.md``. For each, on a
pristine copy of the release's sdist (``vllm/`` and ``tests/``):

1. ``git apply --check`` of the whole patch;
2. its ``vllm/`` part leaves every file exactly as the kit's mod leaves it (the
   mod engine applied to another pristine copy): one change, two spellings;
3. with only its ``tests/`` part the new tests fail, with the whole patch they pass;
4. vLLM's v1 core suite (kit/vllm_tree/upstream_suite.py) on the patched source
   passes every case the pristine tree passes (``--suite``; the pristine
   outcomes are read from ``--suite-results`` (default
   ``results/upstream-suite/<release>/``, which `make upstream-suite` writes;
   `make test` points it at the run it made under .cache/).

Before any of that, ``form_problems`` reads the folders statically: each PR.md
has the sections and checklist of vLLM's pull-request template, a duplicate-work
section, an AI-assistance statement and a ``Signed-off-by:`` line; no patch's
tests import the kit, use ``SimpleNamespace`` or a private attribute, and a
speculation test builds a ``SpeculativeConfig`` (tests/AGENTS.md); each RFC.md
is at most ``RFC_MAX_WORDS`` words. Any problem is printed (one line each,
naming the file and what to add) and the run stops with exit status 1.

Writes ``results/upstream-check.json`` (``--out``: elsewhere; `make test` writes
under .cache/, `make upstream-check` the committed file); exits 1 when any step
fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kit import bundle, schema
from kit.paths import RESULTS, ROOT, UPSTREAM_SUITE_RESULTS
from kit.vllm_tree import mods, releases, sdists, trees, upstream_suite

UPSTREAM = ROOT / "upstream"
OUT = RESULTS / "upstream-check.json"


class CheckError(RuntimeError):
    pass


# vLLM's .github/PULL_REQUEST_TEMPLATE.md (0.34.0): its sections, in order, and
# the items of its checklist; AGENTS.md adds the rest.
TEMPLATE_SECTIONS = ("Overview", "Claims", "Validation", "Details")
CHECKLIST_SUMMARY = "Pull Request Checklist"
CHECKLIST_ITEMS = (
    "/pr-checklist",
    "AI assistance was used",
    "**Design Fit:**",
    "**Testing and Validation:**",
    "**Code Quality and Style:**",
    "**Pull Request Contents:**",
)
RFC_MAX_WORDS = 1200
_CHECKBOX = re.compile(r"^\s*- \[[ xX]\] (.*)$")
_DUPLICATE_HEADING = re.compile(r"^##+ .*duplicate", re.IGNORECASE | re.MULTILINE)
_ISSUE_REF = re.compile(r"#\d{4,}")
_SIGNED_OFF = re.compile(r"^Signed-off-by: \S.* <\S+>\s*$", re.MULTILINE)
_KIT_IMPORT = re.compile(r"^\s*(?:import|from)\s+kit(?:\.|\s|$)|\bkit\.[A-Za-z_]")
_TESTS_IMPORT = re.compile(r"^\s*(?:import|from)\s+(tests(?:\.\w+)+)")
# tests/AGENTS.md: real objects, no SimpleNamespace stand-ins, no private attributes.
_SIMPLE_NAMESPACE = re.compile(r"\bSimpleNamespace\b")
_PRIVATE_ATTRIBUTE = re.compile(r"\.(?!__\w+__)(_\w+)")
# A test that reaches speculative decoding's scheduling through its resolved values;
# it must build them from the speculative config a server builds.
SPECULATION_SETTINGS = re.compile(
    r"\b(?:num_(?:hash|prefill)_lookahead(?:_tokens)?|use_eagle(?:_block_drop)?|"
    r"num_speculative_tokens|disable_eagle_block_drop)\b"
)
_SPECULATIVE_CONFIG = re.compile(r"\bSpeculativeConfig\(")


def _pr_problems(pr: Path) -> list[str]:
    if not pr.is_file():
        return [f"{pr}: missing; add a PR.md in the form of vLLM's PULL_REQUEST_TEMPLATE.md"]
    text = pr.read_text()
    problems = []
    headings = re.findall(r"^## (.+?)\s*$", text, re.MULTILINE)
    present = [h for h in headings if h in TEMPLATE_SECTIONS]
    for section in TEMPLATE_SECTIONS:
        if section not in headings:
            problems.append(f"{pr}: add the template's '## {section}' section")
    if not problems and present[: len(TEMPLATE_SECTIONS)] != list(TEMPLATE_SECTIONS):
        problems.append(
            f"{pr}: put the sections in the template's order: {', '.join(TEMPLATE_SECTIONS)}"
        )
    body, _, checklist = text.partition(f"<summary> {CHECKLIST_SUMMARY} </summary>")
    if not checklist:
        problems.append(
            f"{pr}: add the template's checklist "
            f"(<details><summary> {CHECKLIST_SUMMARY} </summary> ...)"
        )
    else:
        items = [m.group(1) for m in map(_CHECKBOX.match, checklist.splitlines()) if m]
        for item in CHECKLIST_ITEMS:
            if not any(item in line for line in items):
                problems.append(f"{pr}: add the checklist item '- [ ] {item} ...' of the template")
    duplicate = _DUPLICATE_HEADING.search(body)
    if duplicate is None:
        problems.append(
            f"{pr}: add a duplicate-work section ('## Duplicate-work check') citing the "
            "related upstream pull requests (AGENTS.md)"
        )
    elif not _ISSUE_REF.search(body[duplicate.end() :]):
        problems.append(
            f"{pr}: cite the related upstream pull requests (#NNNNN) in the duplicate-work section"
        )
    if "AI assistance" not in body:
        problems.append(
            f"{pr}: add a statement that AI assistance was used and a human submitter "
            "reviews the change (AGENTS.md)"
        )
    if not _SIGNED_OFF.search(body):
        problems.append(f"{pr}: add a DCO line 'Signed-off-by: <name> <email>' (AGENTS.md)")
    return problems


def _patch_test_problems(patch: Path, kit_tests: Path) -> list[str]:
    """What the added lines of the patch's tests/ files do that vLLM's tests/AGENTS.md
    rules out: reach into the kit (``kit``, or a ``tests.`` module that resolves in
    the kit's own tests/; vLLM's helpers, such as ``tests.v1.core.utils``, do not:
    the kit has no tests/v1), stand objects in with ``SimpleNamespace``, read or set
    a private attribute; and a speculation test (one naming the lookahead, EAGLE
    block drop or draft-token settings) that builds no ``SpeculativeConfig``, so
    tests values no server resolves."""
    if not patch.is_file():
        return [f"{patch}: missing; add the git diff against the release"]
    problems = []
    current = None
    speculation: tuple[int, str] | None = None
    builds_config = False
    for number, line in enumerate(patch.read_text().splitlines(), 1):
        if line.startswith("+++ "):
            current = line[4:].removeprefix("b/")
            continue
        if current is None or not current.startswith("tests/"):
            continue
        if not line.startswith("+"):
            continue
        code = line[1:]
        reason = None
        if _KIT_IMPORT.search(code):
            reason = "imports the kit"
        elif m := _TESTS_IMPORT.match(code):
            parts = m.group(1).split(".")[1:]
            where = kit_tests.joinpath(*parts)
            if where.with_suffix(".py").is_file() or where.is_dir():
                reason = f"imports the kit's tests/{'/'.join(parts)}"
        if reason:
            problems.append(
                f"{patch}:{number}: {current} {reason} ({code.strip()!r}); "
                "use vLLM's own test helpers instead"
            )
        if code.lstrip().startswith("#"):
            continue  # prose may name what the code must not do
        if _SIMPLE_NAMESPACE.search(code):
            problems.append(
                f"{patch}:{number}: {current} stands an object in with SimpleNamespace "
                f"({code.strip()!r}); build the real one (tests/AGENTS.md)"
            )
        if m := _PRIVATE_ATTRIBUTE.search(code):
            problems.append(
                f"{patch}:{number}: {current} uses the private attribute {m.group(1)} "
                f"({code.strip()!r}); test through public behaviour (tests/AGENTS.md)"
            )
        if speculation is None and SPECULATION_SETTINGS.search(code):
            speculation = (number, current)
        builds_config = builds_config or bool(_SPECULATIVE_CONFIG.search(code))
    if speculation is not None and not builds_config:
        number, current = speculation
        problems.append(
            f"{patch}:{number}: {current} tests speculative decoding but builds no "
            "SpeculativeConfig; build the one a server builds (its draft tokens, the "
            "lookahead and block drop it resolves)"
        )
    return problems


def form_problems(root: Path = UPSTREAM, kit_tests: Path = ROOT / "tests") -> list[str]:
    """What each folder under ``root`` lacks, read without running anything: one line
    per problem, naming the file and what to add."""
    problems = []
    for manifest in sorted(root.glob("*/upstream.toml")):
        problems += _pr_problems(manifest.parent / "PR.md")
        problems += _patch_test_problems(manifest.parent / "fix.patch", kit_tests)
    for rfc in sorted(root.glob("*/RFC.md")):
        words = len(rfc.read_text().split())
        if words > RFC_MAX_WORDS:
            problems.append(f"{rfc}: {words} words; cut it to at most {RFC_MAX_WORDS}")
    return problems


@dataclass(frozen=True)
class Change:
    name: str
    folder: Path
    mod: str
    release: str
    new_tests: tuple[str, ...]

    @property
    def patch(self) -> Path:
        return self.folder / "fix.patch"


def changes(root: Path = UPSTREAM) -> list[Change]:
    found = []
    for manifest in sorted(root.glob("*/upstream.toml")):
        try:
            data = tomllib.loads(manifest.read_text())
            found.append(
                Change(
                    manifest.parent.name,
                    manifest.parent,
                    data["mod"],
                    data["release"],
                    tuple(data["new_tests"]),
                )
            )
        except (tomllib.TOMLDecodeError, KeyError) as exc:
            raise CheckError(f"{manifest}: {exc}; it needs mod, release and new_tests") from exc
    return found


def pristine_source(release: str, dest: Path) -> Path:
    """``dest`` with the release's ``vllm/`` and ``tests/`` from its sdist, and what
    vLLM's tests need here (the offline hub cache, an empty pytest.ini)."""
    sdist = sdists.release(release)
    for part in ("vllm", "tests", *upstream_suite.TEST_DATA):
        try:
            sdists.unpack(sdist, release, part, dest)
        except sdists.SdistError:
            if part in ("vllm", "tests"):
                raise
    (dest / "pytest.ini").write_text("[pytest]\n")
    upstream_suite.offline_hub.write(dest / upstream_suite.HUB_HOME)
    return dest


def git_apply(source: Path, patch: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "apply", *args, str(patch)], cwd=source, capture_output=True, text=True
    )


def tree_of(source: Path, release: str, name: str) -> trees.Tree:
    return trees.Tree(
        name,
        source / "vllm",
        extra_paths=(releases.ensure_deps(release),),
        from_sdist=True,  # a source checkout: Python sources only, as an sdist's
    )


def run_tests(source: Path, release: str, node_ids: tuple[str, ...]) -> dict[str, str]:
    """Each node id's outcome (passed / failed / ...) on the source tree."""
    tree = tree_of(source, release, "upstream")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        subprocess.run(
            upstream_suite.pytest_command(tree, source, *node_ids, f"--junitxml={junit}"),
            cwd=source,
            env=upstream_suite.suite_env(tree, source),
            capture_output=True,
            text=True,
        )
        found = upstream_suite.outcomes(junit) if junit.is_file() else {}
    # junit names a case by its module path and name; match them to the node ids.
    by_name = {case.split("::", 1)[1]: outcome for case, outcome in found.items()}
    return {node: by_name.get(node.split("::", 1)[1], "not run") for node in node_ids}


def same_as_mod(change: Change, patched: Path, work: Path) -> list[str]:
    """The files the mod touches that differ between the mod's result and the patch's."""
    by_mod = pristine_source(change.release, work / "by-mod")
    mod = mods.load_mod(change.mod)
    mods.apply(by_mod / "vllm", [mod])
    return [
        rel
        for rel in mod.manifest["files"]
        if (by_mod / "vllm" / rel).read_bytes() != (patched / "vllm" / rel).read_bytes()
    ]


def suite_against_pristine(change: Change, source: Path, suite_results: Path) -> dict:
    """The v1 core suite on the patched source; what pristine passes it must pass (the
    pristine outcomes of an upstream-suite run whose results root is ``suite_results``)."""
    folder = releases.results_dir(suite_results, change.release)
    pristine_junit = folder / "upstream-pristine.xml"
    if not pristine_junit.is_file():
        raise CheckError(
            f"no pristine outcomes for {change.release} ({pristine_junit}); run "
            f"make upstream-suite VLLM={change.release} first (or name the folder of such "
            "a run with --suite-results)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tree = tree_of(source, change.release, "patch")
        proc, _ = upstream_suite.start_suite("patch", source, out, tree)
        upstream_suite.run_suites({"patch": (proc, out / "x")})
        junit = upstream_suite.commit_outputs(out, ["patch"])["patch"]
        results = {
            "unpatched": upstream_suite.outcomes(pristine_junit),
            "patched": upstream_suite.outcomes(junit) if junit.is_file() else {},
        }
    report, verdict, ok = upstream_suite.compare(results)
    return {"ok": ok, "summary": report["summary"], "lost": report["passed_unpatched_not_patched"]}


def check(change: Change, suite: bool, suite_results: Path = UPSTREAM_SUITE_RESULTS) -> dict:
    result: dict = {"mod": change.mod, "release": change.release, "new_tests": change.new_tests}
    with tempfile.TemporaryDirectory(prefix=f"upstream-{change.name}-") as tmp:
        work = Path(tmp)
        source = pristine_source(change.release, work / "source")
        applies = git_apply(source, change.patch, "--check")
        result["applies"] = applies.returncode == 0
        if not result["applies"]:
            result["error"] = applies.stderr.strip()
            return result
        # The tests alone: the new tests must fail on the release as it is.
        git_apply(source, change.patch, "--include=tests/*")
        result["without_fix"] = run_tests(source, change.release, change.new_tests)
        git_apply(source, change.patch, "--include=tests/*", "--reverse")
        git_apply(source, change.patch)
        result["with_fix"] = run_tests(source, change.release, change.new_tests)
        result["differs_from_mod"] = same_as_mod(change, source, work)
        if suite:
            result["suite"] = suite_against_pristine(change, source, suite_results)
    result["ok"] = (
        result["applies"]
        and all(v == "failed" for v in result["without_fix"].values())
        and all(v == "passed" for v in result["with_fix"].values())
        and not result["differs_from_mod"]
        and result.get("suite", {}).get("ok", True)
    )
    return result


def line(name: str, result: dict) -> str:
    if not result["applies"]:
        return f"{name}: FAILED: does not apply: {result.get('error', '')}"
    parts = [
        "applies",
        f"new tests without the fix {sorted(set(result['without_fix'].values()))}",
        f"with it {sorted(set(result['with_fix'].values()))}",
        "vllm/ part = the mod"
        if not result["differs_from_mod"]
        else f"differs from the mod in {result['differs_from_mod']}",
    ]
    if "suite" in result:
        parts.append(f"v1 core suite {result['suite']['summary']['patched']}")
    return f"{name}: {'ok' if result['ok'] else 'FAILED'}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--no-suite", action="store_true", help="skip step 4 (vLLM's v1 core suite per patch)"
    )
    parser.add_argument(
        "--out",
        type=upstream_suite.absolute_path,
        default=OUT,
        help=f"default {OUT.relative_to(ROOT)}",
    )
    parser.add_argument(
        "--suite-results",
        type=upstream_suite.absolute_path,
        default=UPSTREAM_SUITE_RESULTS,
        help="the results root of the upstream-suite run whose pristine outcomes step 4 "
        f"compares against (default {UPSTREAM_SUITE_RESULTS.relative_to(ROOT)})",
    )
    args = parser.parse_args(argv)
    problems = form_problems(UPSTREAM)
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1
    if shutil.which("git") is None:
        print("error: git is not on PATH; install git (it applies the patches)", file=sys.stderr)
        return 2
    try:
        found = changes()
        results = {
            change.name: check(change, not args.no_suite, args.suite_results) for change in found
        }
    except (CheckError, sdists.SdistError, releases.ReleaseError, mods.ModError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"error: no change under {UPSTREAM}", file=sys.stderr)
        return 2
    bundle.write_json(args.out, schema.stamp("upstream-check", {"changes": results}))
    for name, result in results.items():
        print(line(name, result))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
