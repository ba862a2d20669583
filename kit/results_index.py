"""results/INDEX.md: what every committed results bundle and loose results file is.

One table row per bundle folder (``results/<name>/`` and ``results/archive/<name>/``
with a ``bench.json`` or ``manifest.json``): its date, vLLM release, checkpoint
path, the CPU kernels the run recorded, what it shows, and whether a newer
bundle of the same kind replaces it. The bundle README.md names as its headline
is marked. A second table lists the loose results files (``results/*.json``,
the regression tables, the upstream-suite records).

``python -m kit.results_index`` writes the index; ``--check`` exits 1 with one
line when the committed file differs from what the results say now.
Standard library and ``kit.bundle`` only: no vLLM, no measurement.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kit import bundle

INDEX = "INDEX.md"
ARCHIVE = "archive"
# README.md names its headline bundle on one line: Headline: `results/<name>`.
HEADLINE = re.compile(r"Headline[^`\n]*`(results/[^`/]+)/?`")
FOLDER = re.compile(r"^(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})-([a-z0-9_.-]+?)-[0-9a-f]{6}$")


@dataclass(frozen=True)
class Bundle:
    """One bundle folder, as far as the index needs it."""

    rel: str  # results/<name> or results/archive/<name>
    name: str
    date: str
    target: str
    release: str
    path: str
    kernels: str  # "torch AVX512, vllm._C, AMX" or "" when the run did not record them
    library: str  # vLLM's CPU kernel library ("vllm._C_AVX2", ...), "" when not recorded
    arch: str  # the tiny model's architecture, or the models.lock key served
    flow: str  # the container flow's engine ("" for a host run)
    reps: int | None
    shared: tuple[int, ...]
    pairing: str
    step_log: bool
    one_server: bool
    failures: int
    wrong: int | None
    archived: bool

    @property
    def kind(self) -> tuple[str, str, str, str, bool]:
        """Bundles of one kind measure the same thing (the CPU kernels compared apart)."""
        return (self.target, self.release, self.path, self.arch, bool(self.flow))


def _kernels(report: dict) -> tuple[str, str]:
    """The CPU kernels line and vLLM's kernel library, ("", "") where not recorded."""
    found = ((report.get("run") or {}).get("environment") or {}).get("cpu_kernels")
    if not isinstance(found, dict):
        return "", ""
    library = str(found.get("vllm_library", "?"))
    parts = [f"torch {found.get('torch_capability', '?')}", library]
    if found.get("amx"):
        parts.append("AMX")
    return ", ".join(parts), library


def read_bundle(folder: Path, results: Path) -> Bundle | None:
    """A bundle folder's facts, or None when it holds neither bench.json nor manifest.json."""
    report = bundle.read_json(folder / bundle.BENCH)
    manifest = bundle.read_json(folder / bundle.MANIFEST)
    if not report and not manifest:
        return None
    match = FOLDER.match(folder.name)
    date = f"{match[1]}-{match[2]}-{match[3]} {match[4]}:{match[5]}" if match else "not in the name"
    run = report.get("run") or {}
    oracle = (report.get("oracle") or {}).get("verdicts") or {}
    kernels, library = _kernels(report)
    # The tiny model's architecture, or a models.lock key (a GPU target's model).
    model = report.get("model") or {}
    return Bundle(
        rel=folder.relative_to(results.parent).as_posix(),
        name=folder.name,
        date=date,
        target=str(manifest.get("target") or (match[7] if match else "?")),
        release=str(run.get("vllm") or (manifest.get("vllm") or {}).get("version") or "?"),
        path=str(report.get("path") or "?"),
        kernels=kernels,
        library=library,
        arch=str(model.get("arch") or model.get("locked") or "qwen3_next"),
        flow=str(manifest.get("engine") or ("container" if manifest else "")),
        reps=report.get("reps"),
        shared=tuple(report.get("shared") or ()),
        pairing=str(report.get("pairing") or ""),
        step_log=bool(report.get("engine_steps")),
        one_server=bool(report.get("one_server")),
        failures=len(report.get("failures") or ()),
        wrong=oracle.get("wrong"),
        archived=folder.parent.name == ARCHIVE,
    )


def committed(results: Path) -> set[Path] | None:
    """The files under ``results`` that git tracks, or None outside a git checkout.
    The index lists what is committed: a run made here (``make bench``, the CI's
    own runs) stays out of it until it is committed."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--", "."],
        cwd=results,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return None
    return {results / name for name in done.stdout.split("\0") if name}


def _kept(paths: list[Path], tracked: set[Path] | None) -> list[Path]:
    """``paths`` that are (or, for a folder, hold) tracked files."""
    if tracked is None:
        return paths
    folders = {parent for file in tracked for parent in file.parents}
    return [p for p in paths if p in tracked or p in folders]


def find_bundles(results: Path) -> list[Bundle]:
    """Every committed bundle under results/ and results/archive/, oldest first."""
    folders = [p for p in results.iterdir() if p.is_dir()]
    archive = results / ARCHIVE
    if archive.is_dir():
        folders += [p for p in archive.iterdir() if p.is_dir()]
    folders = _kept(folders, committed(results))
    found = [b for b in (read_bundle(f, results) for f in folders) if b is not None]
    return sorted(found, key=lambda b: (b.name, b.rel))


def replacement(item: Bundle, every: list[Bundle]) -> Bundle | None:
    """The newest bundle of the same kind that is newer than ``item``, where their CPU
    kernel libraries are not known to differ (ratios compare only on the same library)."""
    newer = [
        b
        for b in every
        if b.name > item.name
        and b.kind == item.kind
        and (not item.library or b.library == item.library)
    ]
    return newer[-1] if newer else None


def shows(item: Bundle) -> str:
    """One short phrase, from the bundle's own records."""
    parts = []
    if item.flow:
        parts.append(f"container flow ({item.target} image, {item.flow})")
    if item.arch != "qwen3_next":
        parts.append(f"model {item.arch}")
    if item.reps is not None:
        parts.append(f"{item.reps} reps, S {'/'.join(map(str, item.shared))}")
    if item.pairing:
        parts.append(f"{item.pairing} pairing")
    if item.one_server:
        parts.append("one server at a time")
    if item.step_log:
        parts.append("step log")
    if item.reps is not None:
        verdict = "hits as modelled" if item.failures == 0 else f"{item.failures} failures"
        if item.wrong is not None:
            verdict += f", oracle {item.wrong} wrong"
        parts.append(verdict)
    return "; ".join(parts)


def headline(readme: Path) -> str | None:
    """The bundle README.md names as its headline (``results/<name>``), if any."""
    if not readme.is_file():
        return None
    found = HEADLINE.search(readme.read_text())
    return found[1] if found else None


def status(item: Bundle, every: list[Bundle], top: str | None) -> str:
    words = []
    if item.rel == top:
        words.append("**headline** (README.md)")
    newer = replacement(item, every)
    words.append(f"superseded by `{newer.name}`" if newer else "current")
    if item.archived:
        words.append("archived")
    return "; ".join(words)


def loose_files(results: Path) -> list[Path]:
    """The results files outside bundles."""
    found = [p for p in results.glob("*.json")]
    for sub in ("regression", "upstream-suite"):
        if (results / sub).is_dir():
            found += (results / sub).rglob("*.json")
    return sorted(_kept(found, committed(results)))


def describe(path: Path) -> tuple[str, str, str, str]:
    """Kind (schema name), release, path or regime, and what the file holds."""
    data = bundle.read_json(path)
    kind = str((data.get("schema") or {}).get("name") or "?")
    release = str(data.get("vllm_version") or "")
    regime = str(data.get("checkpoints") or data.get("path") or "")
    if kind == "regression":
        trees = (data.get("run") or {}).get("trees") or {}
        release = release or str((trees.get("unpatched") or {}).get("vllm_version") or "?")
        regime = regime or "split"
        losses = data.get("eagle_specific_loss") or {}
        # The first column is the unpatched tree's (stages in order, stock apart).
        unpatched = next(iter(losses.values()), {})
        what = (
            f"geometry grid, every tree; EAGLE-specific loss unpatched "
            f"{unpatched.get('cases', '?')} cases"
        )
    elif kind == "upstream-suite":
        summary = data.get("summary") or {}
        passed = "/".join(str((summary.get(t) or {}).get("passed", "?")) for t in summary)
        release = path.parent.name if path.parent.name[:1].isdigit() else "the pin"
        suite = data.get("suite", "tests/v1/core/prefix_cache")
        suite = ", ".join(suite) if isinstance(suite, list) else suite
        what = f"vLLM's own tests ({suite}), passed {passed} ({'/'.join(summary)})"
    elif kind == "upstream-check":
        changes = data.get("changes") or {}
        ok = sum(1 for c in changes.values() if c.get("ok"))
        what = f"upstream/ changes on pristine vLLM: {ok} of {len(changes)} ok"
    elif kind == "turn-cost":
        what = (
            f"turn-cost, {data.get('mode', '?')}, S {data.get('shared', '?')}, "
            f"{data.get('rounds', '?')} x {data.get('reps_per_round', '?')} reps"
        )
    elif kind == "kernel-check":
        port = data.get("cpu_port") or {}
        release = str(port.get("vllm") or "")
        what = f"CPU kernels vs vLLM's Triton kernels (interpreter); ok {data.get('ok')}"
    elif kind == "loss-sweep":
        trees = data.get("trees") or {}
        counts = {t: v.get("geometries") for t, v in trees.items() if isinstance(v, dict)}
        what = f"EAGLE-specific loss over {max(counts.values(), default='?')} random geometries"
    elif kind == "mods-drift":
        what = f"every mod against {', '.join(data.get('releases') or [])}"
    else:
        what = ""
    return kind, release, regime, what


def render(results: Path = bundle.RESULTS, readme: Path | None = None) -> str:
    readme = readme if readme is not None else results.parent / "README.md"
    every = find_bundles(results)
    top = headline(readme)
    lines = [
        "# Results index",
        "",
        "Generated by `python -m kit.results_index` from the bundles' own records; "
        "`python -m kit.results_index --check` (and `tests/test_docs.py`) fails when it "
        "is stale. A bundle is superseded by the newest later bundle of the same kind "
        "(target, vLLM release, checkpoint path, model, host or container "
        "run) whose CPU kernel library is not known to differ. Archived bundles "
        "(`results/archive/`) are cited by CHANGELOG.md only.",
        "",
        "| bundle | date | vLLM | path | CPU kernels | shows | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for item in every:
        lines.append(
            f"| `{item.rel}` | {item.date} | {item.release} | {item.path} | "
            f"{item.kernels or 'not recorded'} | {shows(item)} | {status(item, every, top)} |"
        )
    lines += [
        "",
        "Loose results files:",
        "",
        "| file | kind | vLLM | path or regime | holds |",
        "|---|---|---|---|---|",
    ]
    for path in loose_files(results):
        kind, release, regime, what = describe(path)
        rel = path.relative_to(results.parent).as_posix()
        cells = [f"`{rel}`", kind, release or "-", regime or "-", what or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when results/INDEX.md is not up to date"
    )
    parser.add_argument("--results", type=Path, default=bundle.RESULTS, help="(%(default)s)")
    args = parser.parse_args(argv)
    target = args.results / INDEX
    text = render(args.results)
    if args.check:
        if not target.is_file() or target.read_text() != text:
            print(
                f"{target.relative_to(args.results.parent)} is stale: "
                "run python -m kit.results_index",
                file=sys.stderr,
            )
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
