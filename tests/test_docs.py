"""The documentation holds: a short README whose headline numbers are the named
bundle's, no lab-note residue in it, every results/ and docs/ path it and the
docs name exists, every relative link resolves, results/INDEX.md is current,
and the licence is there. No network, no vLLM."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kit import results_index

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
TOPICS = ("methodology", "results", "fix-cost", "architecture", "containers", "defects")
# Every Markdown file whose paths and links are checked.
DOCUMENTS = [README, ROOT / "CHANGELOG.md", *DOCS, *sorted((ROOT / "mods").rglob("README.md"))]
MAX_README_BYTES = 16 * 1024

# A commit-like token: 7 or more lowercase hex characters with a letter and a digit
# (a results folder's date is digits only; its 6-hex id is too short).
HEX = re.compile(
    r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,}(?![0-9A-Za-z_])"
)
RUN_LABEL = re.compile(r"\bruns? (?:\d+|[A-H](?:-[A-H])?)\b")
CI_TIME = re.compile(r"\bCI\b[^\n]{0,120}?\bin \d[\d,.]*\s?(?:s|min|minutes)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# A results/ or docs/ path written from the repository root (not part of a longer path).
ROOT_PATH = re.compile(r"(?<![\w./<>-])((?:results|docs)/[\w./-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
RATIO = re.compile(r"(\d+\.\d+) \[(\d+\.\d+)-(\d+\.\d+)\]")


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def same(shown: str, value: float) -> bool:
    """``shown`` is ``value`` rounded to as many places as it shows."""
    places = len(shown.split(".")[1]) if "." in shown else 0
    return f"{value:.{places}f}" == shown


def test_the_readme_is_short() -> None:
    size = README.stat().st_size
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; the limit is {MAX_README_BYTES}"


def test_the_readme_keeps_the_commands_ci_and_users_run() -> None:
    readme = text(README)
    assert "make test" in readme and "make bench" in readme


def test_the_readme_has_no_lab_note_residue() -> None:
    readme = text(README)
    assert not HEX.findall(readme), f"commit-like tokens: {HEX.findall(readme)}"
    assert not RUN_LABEL.findall(readme), f"run labels: {RUN_LABEL.findall(readme)}"
    assert not CI_TIME.search(readme), f"a CI timing: {CI_TIME.search(readme)}"
    assert not DATE.findall(readme), f"dated history: {DATE.findall(readme)}"
    assert not re.search(r"\bthe cut\b", readme, re.I)


def test_the_residue_checks_can_fail() -> None:
    assert HEX.search("measured at 8b82299 after") and not HEX.search("results/20261205-130931")
    assert RUN_LABEL.search("as in run 7") and RUN_LABEL.search("runs A-H")
    assert CI_TIME.search("the CI of that commit passed in 2,278 s")


def test_every_document_the_readme_promises_exists() -> None:
    for topic in TOPICS:
        assert (ROOT / "docs" / f"{topic}.md").is_file(), topic
    assert (ROOT / "CHANGELOG.md").is_file()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_and_docs_path_exists(document: Path) -> None:
    missing = []
    source = text(document)
    for match in ROOT_PATH.finditer(source):
        following = source[match.end() : match.end() + 1]
        if following in ("<", "[", "*", "{"):
            continue  # a pattern such as results/<date>-cpu-<id>/, not a path
        path = match.group(1).rstrip(".,")
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{document.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for target in LINK.findall(text(document)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (document.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: broken links {broken}"


def headline_rows() -> dict[str, list[str]]:
    rows = {}
    for line in text(README).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4:
            rows[cells[0]] = cells[1:]
    return rows


def check_bar(cell: str, median: float, upper: float) -> None:
    """The bar cell's verdict, as the methodology reads it, from the bundle's numbers:
    "met" when the interval's upper end is at or below the bar, else "missed" with the
    median beside it; never a softer word."""
    bar_text, verdict = cell.split(":", 1)
    check_verdict(cell, verdict, upper <= float(bar_text), median)


def check_verdict(cell: str, verdict: str, met: bool, median: float) -> None:
    """ "met" where the bar is met, else "missed (median x.xx)" with the bundle's median."""
    verdict = verdict.strip()
    if met:
        assert verdict == "met", cell
        return
    missed = re.fullmatch(r"missed \(median (\d\.\d\d)\)", verdict)
    assert missed, cell
    assert same(missed[1], median), (cell, median)


def check_control_bar(cell: str, median: float, upper: float) -> None:
    """The control's two-part bar (``ttft_stats.CONTROL_BAR``): "met" when the median
    and the interval's upper end are both at or below theirs, else "missed" with the
    median beside it."""
    from kit.bench.ttft_stats import CONTROL_BAR

    bars, verdict = cell.split(":", 1)
    assert bars.strip() == f"{CONTROL_BAR['median']:.2f} / {CONTROL_BAR['upper']:.2f}", cell
    met = median <= CONTROL_BAR["median"] and upper <= CONTROL_BAR["upper"]
    check_verdict(cell, verdict, met, median)


@pytest.mark.parametrize(
    "check,cell,median,upper,right",
    [
        (check_bar, "0.40: met", 0.35, 0.40, True),
        (check_bar, "0.40: missed (median 0.35)", 0.35, 0.53, True),
        (check_bar, "0.40: met", 0.35, 0.53, False),
        (check_bar, "0.40: median yes, interval no", 0.35, 0.53, False),
        (check_bar, "0.40: missed (median 0.36)", 0.35, 0.53, False),
        (check_control_bar, "1.20 / 1.35: met", 1.10, 1.30, True),
        (check_control_bar, "1.20 / 1.35: missed (median 1.25)", 1.25, 1.30, True),
        (check_control_bar, "1.20 / 1.35: missed (median 1.10)", 1.10, 1.40, True),
        (check_control_bar, "1.20 / 1.35: met", 1.25, 1.30, False),
        (check_control_bar, "1.20 / 1.35: met", 1.10, 1.40, False),
        (check_control_bar, "1.20: met", 1.10, 1.30, False),
    ],
)
def test_the_verdict_checks_can_fail(check, cell, median, upper, right) -> None:  # noqa: ANN001
    if right:
        check(cell, median, upper)
    else:
        with pytest.raises(AssertionError):
            check(cell, median, upper)


def test_the_readme_headline_is_the_named_bundle() -> None:
    named = results_index.headline(README)
    assert named, "README.md names no headline bundle (Headline: `results/<name>`)"
    folder = ROOT / named
    report = json.loads((folder / "bench.json").read_text())
    raw = json.loads((folder / "raw.json").read_text())
    rows = headline_rows()

    hits = re.fullmatch(r"(\d+) of (\d+) requests", rows["hits equal to the geometry model's"][0])
    assert hits, rows["hits equal to the geometry model's"]
    assert (int(hits[1]), int(hits[2])) == (sum(r["hit_ok"] for r in raw), len(raw))

    assert rows["hits equal to the geometry model's"][2] == (
        "all: met" if hits[1] == hits[2] else "all: missed"
    )

    verdicts = report["oracle"]["verdicts"]
    shown = rows["oracle same / tie / wrong"][0]
    assert shown == f"{verdicts['same']} / {verdicts['tie']} / {verdicts['wrong']}"
    assert rows["oracle same / tie / wrong"][2] == (
        "0 wrong: met" if verdicts["wrong"] == 0 else "0 wrong: missed"
    )

    cached = {s["S"]: s for s in report["summary"] if s["kind"] == "cached_B"}
    for size in (1007, 2159):
        times, ratio, bar = rows[f"cached B, S = {size}"]
        row = cached[size]
        before, after = re.fullmatch(r"(\d+\.\d+) → (\d+\.\d+) ms", times).groups()
        assert same(before, row["unpatched"]["median_ms"]), (size, before)
        assert same(after, row["patched"]["median_ms"]), (size, after)
        stats = row["ratio_patched_unpatched"]
        median, low, high = RATIO.fullmatch(ratio).groups()
        assert same(median, stats["median"]) and same(low, stats["ci95"][0])
        assert same(high, stats["ci95"][1]), (size, ratio)
        check_bar(bar, stats["median"], stats["ci95"][1])

    # Cached B against its control on the patched server, per S and pooled, where the
    # headline bundle has the control (bundles from before it do not).
    from kit.bench.ttft_stats import control_pooled

    if any(s.get("ratio_control") for s in report["summary"]):
        lines = {
            **{
                f"cached B / control, S = {size}": cached[size]["ratio_control"]
                for size in (1007, 2159)
            },
            "cached B / control, pooled": control_pooled(report["summary"]),
        }
        for label, line in lines.items():
            _, ratio, bar = rows[label]
            stats = line["patched"]
            median, low, high = RATIO.fullmatch(ratio).groups()
            assert same(median, stats["median"]) and same(low, stats["ci95"][0]), label
            assert same(high, stats["ci95"][1]), label
            check_control_bar(bar, stats["median"], stats["ci95"][1])

    pooled = {p["group"]: p for p in report["pooled_ratios"]}
    for label, group in (
        ("later turns 2-4, pooled", "turn2-turn4"),
        ("cold A, pooled", "cold_A"),
        ("cold B, pooled", "cold_B"),
    ):
        _, ratio, bar = rows[label]
        stats = pooled[group]
        median, low, high = RATIO.fullmatch(ratio).groups()
        assert same(median, stats["median"]) and same(low, stats["ci95"][0]), label
        assert same(high, stats["ci95"][1]), label
        check_bar(bar, stats["median"], stats["ci95"][1])

    # Every request kind pooled over S against the 1.10 bar, read on the widest
    # interval; the prose names the largest median.
    kinds = [
        p for p in report["pooled_ratios"] if len(p["kinds"]) == 1 and p["group"] != "cached_B"
    ]
    widest = max(kinds, key=lambda p: p["ci95"][1])
    label = next(k for k in rows if k.startswith("every request kind, pooled (widest: "))
    assert label.endswith(f"{widest['group'].replace('_', ' ').replace('turn', 'turn ')})")
    _, ratio, bar = rows[label]
    median, low, high = RATIO.fullmatch(ratio).groups()
    assert same(median, widest["median"]) and same(high, widest["ci95"][1]), label
    assert bar.startswith("1.10:")
    check_bar(bar, widest["median"], widest["ci95"][1])
    shown_median = re.search(r"median at or below\s+(\d\.\d\d)", text(README))
    assert shown_median and same(shown_median[1], max(p["median"] for p in kinds))


def test_the_readme_headline_was_made_by_the_committed_mods() -> None:
    """A headline made before a mod changed measures code nobody can check out: each
    tree of the named bundle must carry exactly the mods, by patch hash, that tree
    gets today on the bundle's release."""
    from kit.vllm_tree import mods

    named = results_index.headline(README)
    run = json.loads((ROOT / named / "bench.json").read_text())["run"]
    for tree, record in run["trees"].items():
        release = record["vllm_version"]
        ran = sorted((m["name"], m["patch_sha256"]) for m in record["mods"])
        today = sorted(
            (m.name, m.patch_sha256)
            for m in mods.mods_for_target(run.get("target", "cpu"), tree, release=release)
        )
        stale = sorted({name for name, _ in set(ran) ^ set(today)})
        assert not stale, (
            f"{named}: the {tree} tree ran {', '.join(stale)} other than the committed "
            f"mod(s) of vLLM {release}: re-run make bench and name the new bundle in README.md"
        )


def test_the_results_index_is_current() -> None:
    index = ROOT / "results" / results_index.INDEX
    assert index.is_file(), "results/INDEX.md is missing: run python -m kit.results_index"
    assert index.read_text() == results_index.render(), (
        "results/INDEX.md is stale: run python -m kit.results_index"
    )


def test_the_index_marks_the_headline_and_archived_bundles() -> None:
    rendered = results_index.render()
    named = results_index.headline(README)
    assert f"| `{named}` |" in rendered
    headline_line = next(line for line in rendered.splitlines() if f"| `{named}` |" in line)
    assert "**headline**" in headline_line
    archive = ROOT / "results" / results_index.ARCHIVE
    for folder in sorted(archive.iterdir()) if archive.is_dir() else []:
        line = next(x for x in rendered.splitlines() if f"`results/archive/{folder.name}`" in x)
        assert "archived" in line


def test_the_index_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "20260101-000000-cpu-abcdef").mkdir(parents=True)
    (results / "20260101-000000-cpu-abcdef" / "bench.json").write_text(
        json.dumps({"schema": {"name": "bench", "version": 2}, "path": "split", "reps": 1})
    )
    assert results_index.main(["--results", str(results)]) == 0
    assert results_index.main(["--check", "--results", str(results)]) == 0
    (results / "INDEX.md").write_text("stale\n")
    assert results_index.main(["--check", "--results", str(results)]) == 1


def test_the_licence_is_apache_2() -> None:
    licence = ROOT / "LICENSE"
    assert licence.is_file()
    head = licence.read_text()[:200]
    assert "Apache License" in head and "Version 2.0" in head


SUITE_ROW = re.compile(
    r"^\| (\d+\.\d+\.\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| `(results/[^`]+)` \|$",
    re.M,
)


def test_the_readme_suite_counts_are_the_results_files() -> None:
    """The README's table of vLLM's own suite per release and tree equals the
    upstream-suite.json it names."""
    rows = SUITE_ROW.findall(text(README))
    assert {row[0] for row in rows} >= {"0.32.0", "0.34.0"}, rows
    for release, stock, unpatched, patched, failed, excluded, path in rows:
        report = json.loads((ROOT / path).read_text())
        summary = report["summary"]
        assert report.get("release", release) == release, path
        shown = (int(stock), int(unpatched), int(patched))
        assert shown == tuple(summary[t]["passed"] for t in ("pristine", "unpatched", "patched"))
        assert int(failed) == max(s["failed"] for s in summary.values()), path
        assert int(excluded) == sum(len(cases) for cases in report["excluded"].values()), path


def test_the_readme_counts_the_mods_each_tree_gets() -> None:
    """The README's mod counts and the mods it says separate the trees are the
    manifests' (cpu target), per release."""
    from kit.vllm_tree import mods

    readme = text(README)
    counts = re.search(r"on the CPU: (\d+) mods on 0\.32\.0, (\d+) on 0\.34\.0", readme)
    assert counts, "README.md no longer counts the unpatched tree's mods"
    for release, shown in (("0.32.0", counts[1]), ("0.34.0", counts[2])):
        assert int(shown) == len(mods.mods_for_target("cpu", "unpatched", release=release))
    named = {
        "0.32.0": {"fix-eagle-fine-prefix"},
        "0.33.0": {"fix-eagle-fine-prefix-lookahead"},
        "0.34.0": {"fix-eagle-fine-prefix-lookahead", "fix-eagle-fine-prefix-exports"},
    }
    for release, fixes in named.items():
        for name in fixes:
            assert f"`{name}`" in readme
        only = {m.name for m in mods.mods_for_target("cpu", "patched", release=release)} - {
            m.name for m in mods.mods_for_target("cpu", "unpatched", release=release)
        }
        assert only == fixes, (release, only)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_a_section_finds_it(document: Path) -> None:
    """A link to #section (in the document or another) names a heading that exists, as
    GitHub makes its anchors."""

    def anchors(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", text(path), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    broken = []
    for target in LINK.findall(text(document)):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        path, _, anchor = target.partition("#")
        where = (document.parent / path) if path else document
        if where.suffix == ".md" and where.is_file() and anchor not in anchors(where):
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)}: links to missing sections {broken}"
