"""`make upstream-suite`: vLLM's own scheduler and KV-cache tests against every tree.

The suite is vLLM's whole ``tests/v1/core`` plus the ``tests/v1/worker`` files
that test what the mods change (``SUITE``), from the release's source
distribution (through pip's configured index, sha256 checked): the pinned
release by default, ``--vllm <release>`` (`make upstream-suite VLLM=<release>`)
any release pins.toml names, run against that release's trees
(``kit.vllm_tree.releases.trees_of``). Trees: pristine (the release as installed,
no mod), unpatched (plus the enablement and correctness mods) and patched (plus
the fix). Each tree must pass every case the tree below it passes: unpatched
against pristine, patched against unpatched. Results:
``results/upstream-suite/[<release>/]`` (``releases.results_dir``; ``--results-root``
another root: `make test` writes under .cache/, `make upstream-suite` and
`make record-upstream` write the committed record).

The cases read hub models' configs from an offline cache the kit writes
(kit/vllm_tree/offline_hub.py); every case that cannot run here is excluded by
name with its reason (suite_exclusions.toml), and every case has a wall-clock
limit (kit.vllm_tree.suite_plugin.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

from kit import bundle, schema
from kit.paths import CACHE, UPSTREAM_SUITE_RESULTS
from kit.process_group import WatchedPopen
from kit.vllm_tree import mods, offline_hub, pins, releases, sdists, trees

# vLLM's whole tests/v1/core, and the worker tests of the files the mods change
# (v1/worker/utils.py: the KV block copies; v1/worker/mamba_utils.py: the
# align-mode state copies). A path a release lacks is left out for that release.
SUITE = ("tests/v1/core", "tests/v1/worker/test_utils.py", "tests/v1/worker/test_mamba_utils.py")
EXCLUSIONS = Path(__file__).resolve().parent / "suite_exclusions.toml"
# Inside the unpacked tests: the offline hub cache the cases read configs from.
HUB_HOME = ".kit-hf-home"
# Source folders beyond tests/ that cases read, unpacked where a release has them
# (a release's prompt-hash cases may compare against the Rust client's vectors).
TEST_DATA = ("rust/src/engine-core-client/src/tests",)


class SuiteError(RuntimeError):
    pass


def exclusions(release: str) -> dict[str, str]:
    """The cases excluded on ``release``: node id (or a prefix of one) -> the reason."""
    try:
        table = tomllib.loads(EXCLUSIONS.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SuiteError(f"{EXCLUSIONS.name}: {exc}; restore it from git") from exc
    found = {}
    for entry in table.get("exclude", []):
        if release in entry.get("releases", [release]):
            found |= dict.fromkeys(entry["cases"], entry["reason"])
    return found


def suite_paths(tests_dir: Path) -> list[str]:
    """``SUITE``'s paths this release's tests have."""
    return [path for path in SUITE if (tests_dir / path).exists()]


def _hub_digest() -> str:
    digest = hashlib.sha256()
    for config in sorted(offline_hub.CONFIGS.glob("*.json")):
        digest.update(config.name.encode() + config.read_bytes())
    return digest.hexdigest()


def extract_tests(sdist: Path, version: str | None = None) -> Path:
    """Unpack only ``tests/`` once, with the offline hub cache beside them; a stamp
    names the sdist and the hub configs it came from."""
    version = version or pins.get("vllm.version")
    want = f"{pins.file_sha256(sdist)} hub {_hub_digest()} data {','.join(TEST_DATA)}"
    dest = CACHE / f"vllm-{version}-tests"
    stamp = dest / ".kit-stamp"
    if stamp.is_file() and stamp.read_text() == want:
        return dest
    build = dest.with_name(dest.name + ".building")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    sdists.unpack(sdist, version, "tests", build)
    for data in TEST_DATA:
        # A release without the folder has no case that reads it.
        with contextlib.suppress(sdists.SdistError):
            sdists.unpack(sdist, version, data, build)
    # Our pyproject's strict pytest settings must not apply to upstream's tests.
    (build / "pytest.ini").write_text("[pytest]\n")
    # Written here, not per run: in the images the tests are a read-only mount.
    offline_hub.write(build / HUB_HOME)
    stamp_tmp = build / ".kit-stamp"
    stamp_tmp.write_text(want)
    shutil.rmtree(dest, ignore_errors=True)
    build.replace(dest)
    return dest


def partial(path: Path) -> Path:
    """Where a run writes ``path`` until it finishes: the committed file stays whole
    until the new one replaces it by rename."""
    return path.with_name(f".{path.name}.partial")


class Stopped(BaseException):
    """SIGTERM: stop the pytest runs (their whole process groups) and keep the old logs."""


# Both handled explicitly: Python turns SIGINT into KeyboardInterrupt only when the
# process did not start with SIGINT ignored, and a background job of a shell without
# job control (``cmd &`` in a script, nohup) starts that way.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(signum: int, _frame: object) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signal.Signals(signum).name)


def suite_env(tree: trees.Tree, tests_dir: Path) -> dict[str, str]:
    """The environment of a pytest run of vLLM's tests against ``tree``."""
    env = tree.env(
        PYTHONDONTWRITEBYTECODE="1",  # the tests may sit on a read-only mount
        VLLM_LOGGING_LEVEL="ERROR",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tests_dir / HUB_HOME),
    )
    env["PYTHONPATH"] += os.pathsep + str(tests_dir)
    return env


def pytest_command(tree: trees.Tree, tests_dir: Path, *args: str) -> list[str]:
    """pytest over vLLM's tests with the kit's plugins, upstream's own settings only."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    cmd += ["-c", str(tests_dir / "pytest.ini"), "--rootdir", str(tests_dir)]
    cmd += ["-p", "kit.vllm_tree.suite_plugin"]
    if tree.from_sdist:
        cmd += ["-p", "kit.vllm_tree.release_plugin"]
    return [*cmd, *args]


def start_suite(
    name: str, tests_dir: Path, out_dir: Path, tree: trees.Tree
) -> tuple[WatchedPopen, Path]:
    """Run the suite against one tree, in the background, in its own process group
    (stopped by its watchdog if this process dies first, ``kill -9`` included);
    returns the process and its junit file. Both the junit and the log are written to
    ``partial`` names; ``commit_outputs`` renames them once the run finished."""
    junit = partial(out_dir / f"upstream-{name}.xml")
    deselect = [arg for case in exclusions(tree.release) for arg in ("--kit-exclude", case)]
    cmd = pytest_command(tree, tests_dir, *suite_paths(tests_dir), f"--junitxml={junit}")
    log_path = partial(out_dir / f"upstream-{name}.log")
    log_path.write_text("")
    # Appending, as the watchdog does: neither overwrites the other's lines.
    with log_path.open("a") as log:
        proc = WatchedPopen(
            [*cmd, *deselect],
            watch_log=log_path,
            cwd=tests_dir,
            env=suite_env(tree, tests_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, junit


def run_suites(runs: dict[str, tuple[WatchedPopen, Path]]) -> None:
    """Wait for every run; on SIGTERM or Ctrl-C stop every run's process group (pytest
    and whatever it started) and drop the partial files, then re-raise."""
    previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    try:
        for proc, _ in runs.values():
            proc.wait()
            # Ended by itself: stop whatever pytest left in its group and release
            # the watchdog, which would otherwise do it (and log it) at our exit.
            proc.stop(grace=10)
    except BaseException:
        for proc, junit in runs.values():
            proc.stop(grace=10)
            for path in (junit, junit.with_name(junit.name.replace(".xml.", ".log."))):
                path.unlink(missing_ok=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def commit_outputs(out_dir: Path, names: list[str]) -> dict[str, Path]:
    """The finished runs' junit and log files renamed into place; returns the junits."""
    junits = {}
    for name in names:
        for suffix in ("xml", "log"):
            final = out_dir / f"upstream-{name}.{suffix}"
            if partial(final).is_file():
                os.replace(partial(final), final)
            else:
                final.unlink(missing_ok=True)  # an old file must not pass for this run's
        junits[name] = out_dir / f"upstream-{name}.xml"
    return junits


OUTCOMES = ("passed", "failed", "xfailed", "skipped")


def outcomes(junit: Path) -> dict[str, str]:
    """Each case's outcome in a pytest junit file: one of ``OUTCOMES``."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if kinds & {"failure", "error"}:
            result[name] = "failed"
        elif skipped is not None:
            result[name] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            result[name] = "passed"
    return result


def counts(junit: Path) -> dict[str, int]:
    """How many cases had each outcome; all zero when the file is missing."""
    found = list(outcomes(junit).values()) if junit.is_file() else []
    return {kind: found.count(kind) for kind in OUTCOMES}


def _code_under_test(record: dict) -> tuple:
    mods = sorted((m["name"], m["patch_sha256"]) for m in record.get("mods", []))
    return record.get("vllm_version"), mods


def flow_run_of(under_test: dict[str, trees.Tree]) -> Path | None:
    """The newest container-flow bundle that ran this suite on the same code as these trees."""
    commit = bundle.kit_commit()
    # A changed checkout may differ from what the images were built from.
    if not commit or commit.endswith("-dirty"):
        return None
    for manifest in sorted(bundle.RESULTS.glob(f"*/{bundle.MANIFEST}"), reverse=True):
        run = manifest.parent
        meta = bundle.read_json(manifest)
        if (meta.get("kit_commit"), meta.get("pins_sha256"), meta.get("target")) != (
            commit,
            pins.file_sha256(),
            "cpu",
        ):
            continue
        stages = {stage: bundle.suite_dir(run, stage) for stage in under_test}
        if all(
            (folder / f"upstream-{stage}.xml").is_file()
            and _code_under_test(bundle.read_json(folder / bundle.IMAGE_RECORD))
            == _code_under_test(under_test[stage].mods_record())
            for stage, folder in stages.items()
        ):
            return run
    return None


def absolute_path(text: str) -> Path:
    """A path option as given from the caller's folder: the suites' pytest runs in the
    sdist's test folder, where a relative JUnit path would land somewhere else."""
    return Path(text).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sdist", type=Path, help="use this vllm sdist instead of downloading")
    parser.add_argument(
        "--vllm",
        metavar="RELEASE",
        help="a release from pins.toml, or 'newest' (default: the pinned one)",
    )
    parser.add_argument(
        "--out",
        type=absolute_path,
        help="a folder (default: <--results-root>, a release other than the pinned one in "
        "its <release>/ folder)",
    )
    parser.add_argument(
        "--results-root",
        type=absolute_path,
        default=UPSTREAM_SUITE_RESULTS,
        help="the folder the release's outputs go under (default: results/upstream-suite, "
        "the committed record; make test names one under .cache/ so a test run leaves the "
        "checkout as it was)",
    )
    parser.add_argument(
        "--reuse-flow",
        action="store_true",
        help="read the unpatched and patched outcomes of a container-flow run of this kit "
        "commit whose images carry these trees' vLLM and mods, instead of running them "
        "again (the pristine tree runs here)",
    )
    args = parser.parse_args(argv)
    try:
        version = releases.resolve(args.vllm)
        sdist = sdists.release(version, args.sdist)  # an unknown release was refused first
        tests_dir = extract_tests(sdist, version)
        out_dir = args.out or releases.results_dir(args.results_root, version)
        under_test = releases.trees_of(version)
        excluded = exclusions(version)
    except (SuiteError, sdists.SdistError, releases.ReleaseError, mods.ModError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not any(tree.patched for tree in under_test.values()):
        print(f"error: no fix is made for vLLM {version}; nothing to compare", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    # A container-flow run is of the images' release and mods: flow_run_of compares them.
    modded = {name: tree for name, tree in under_test.items() if not tree.stock}
    flow_run = flow_run_of(modded) if args.reuse_flow else None
    to_run = dict(under_test)
    if flow_run:
        for name in modded:
            for suffix in ("xml", "log"):
                source = bundle.suite_dir(flow_run, name) / f"upstream-{name}.{suffix}"
                shutil.copy(source, partial(out_dir / source.name))
            del to_run[name]
        print(f"unpatched and patched read from {flow_run.name}: its images carry these trees")
    # Every tree at once: two cores, a third run shares them.
    runs = {}
    try:
        for name, tree in to_run.items():
            runs[name] = start_suite(name, tests_dir, out_dir, tree)
        run_suites(runs)
    except (Stopped, KeyboardInterrupt) as exc:
        print(f"stopped ({exc or 'SIGINT'}): every run ended; {out_dir} unchanged", file=sys.stderr)
        return 143 if isinstance(exc, Stopped) else 130
    junits = commit_outputs(out_dir, list(under_test))
    results = {name: outcomes(junit) for name, junit in junits.items()}
    report, verdict, ok = compare(results, excluded)
    report["release"] = version
    report["ran_in"] = {
        name: f"results/{flow_run.name} (the images)" if flow_run and name in modded else "host"
        for name in under_test
    }
    bundle.write_json(out_dir / bundle.UPSTREAM, report)
    print(verdict)
    return 0 if ok else 1


# Each tree must pass every case the tree it is built on passes: each stage against
# the one before it (kit.vllm_tree.releases.STAGES).
BUILT_ON = tuple(zip(releases.STAGES[:-1], releases.STAGES[1:], strict=True))


def compare(
    results: dict[str, dict[str, str]], excluded: dict[str, str] | None = None
) -> tuple[dict, str, bool]:
    """Unpatched must pass every case pristine passes (where pristine ran), patched
    every case unpatched passes; the excluded cases are listed by reason."""
    summary = {
        name: {k: list(r.values()).count(k) for k in OUTCOMES} for name, r in results.items()
    }
    lost = {
        f"passed_{base}_not_{tree}": sorted(
            case
            for case, outcome in results[base].items()
            if outcome == "passed" and results[tree].get(case) != "passed"
        )
        for base, tree in BUILT_ON
        if base in results and tree in results
    }
    reasons: dict[str, list[str]] = {}
    for case, reason in (excluded or {}).items():
        reasons.setdefault(reason, []).append(case)
    # Stamped here: the container flow writes this report too.
    report = schema.stamp("upstream-suite", {}) | {
        "suite": list(SUITE),
        "excluded": reasons,
        "summary": summary,
        **lost,
    }
    lines = [f"{name:10s} {counts}" for name, counts in summary.items()]
    lines += [f"excluded: {len(cases)} ({reason})" for reason, cases in reasons.items()]
    broken = [
        f"{key.replace('_', ' ')}:\n  " + "\n  ".join(cases) for key, cases in lost.items() if cases
    ]
    if broken:
        return report, "\n".join([*lines, *broken]), False
    if summary["unpatched"]["passed"] == 0:
        lines.append("no upstream case passed on the unpatched side; the suite did not run")
        return report, "\n".join(lines), False
    lines.append(
        "every tree passes every case the tree it is built on passes"
        if "pristine" in results
        else "patched passes every case the unpatched passes"
    )
    return report, "\n".join(lines), True


if __name__ == "__main__":
    raise SystemExit(main())
