"""The results bundle: one folder per run, its layout, its writers and its readers.

``results/<date>-<label>-<id>/`` (label: ``cpu``, a models.lock key, or the
container flow's target) holds:

- ``bench.json`` (``BENCH``): the TTFT run: geometry, summary, oracle, failures,
  and ``run`` (host, pins, the trees or images the servers ran, commands);
  ``raw.json`` every request; ``bench.md`` and ``ttft.png`` its rendering;
- ``manifest.json`` (``MANIFEST``, container flow only): images, suites, model,
  kit commit and sources;
- ``suites/<stage>/`` (container flow): what ran inside each image, with the
  image's own record ``image.json``; ``regression/regression.{json,md}`` and
  ``upstream-suite.json`` compare the two stages;
- ``logs/``, and the tiny model's config in ``tiny-qwen3-next/``.

Every module that writes or reads these names goes through here.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"

BENCH = "bench.json"
RAW = "raw.json"
BENCH_MD = "bench.md"
PLOT = "ttft.png"
MANIFEST = "manifest.json"
SUITES = "suites"
IMAGE_RECORD = "image.json"
REGRESSION = "regression"
UPSTREAM = "upstream-suite.json"
LOGS = "logs"
TINY_MODEL = "tiny-qwen3-next"


class BundleError(RuntimeError):
    exit_code = 2


def new_path(label: str, root: Path = RESULTS) -> Path:
    """A fresh bundle folder name (not created): date, label, random id."""
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{os.urandom(3).hex()}"


def kit_commit() -> str:
    """The kit's git commit, ``-dirty`` when its source has changes ('' outside git).

    ``results/`` is left out of the check: a run writes its own bundle there
    before it asks, and measurements are not source."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", f":!{RESULTS.name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ""
    return head + ("-dirty" if head and dirty else "")


def host_record() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kit_commit": kit_commit(),
    }


def write_json(path: Path, data: object, indent: int | None = 1) -> Path:
    """Written beside and renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> dict:
    """A JSON document the run may not have produced: {} when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _strict_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from exc


def write_bench(bundle: Path, report: dict, rows: list[dict], markdown: str) -> None:
    write_json(bundle / RAW, rows, indent=None)
    write_json(bundle / BENCH, report)
    (bundle / BENCH_MD).write_text(markdown)
    try:
        from kit.plot import ttft_plot

        ttft_plot(report["summary"], bundle / PLOT)
    except ImportError:  # matplotlib is optional
        pass


def load(bundle: Path) -> dict:
    """A bundle's bench.json, with the container flow's manifest under ``manifest``."""
    path = bundle / BENCH
    if not path.is_file():
        raise BundleError(
            f"{bundle}: no {BENCH}; pass a folder written by 'make bench' or 'make bench-<target>'"
        )
    report = _strict_json(path)
    manifest = bundle / MANIFEST
    report["manifest"] = _strict_json(manifest) if manifest.is_file() else None
    return report


def write_manifest(bundle: Path, data: dict) -> Path:
    return write_json(bundle / MANIFEST, data)


def suite_dir(bundle: Path, stage: str) -> Path:
    return bundle / SUITES / stage


def write_regression(out_dir: Path, table: dict, markdown: str) -> Path:
    """``regression.json`` and ``regression.md``: `make regress`, the release tables, and
    the container flow's comparison of the two images all write them here."""
    write_json(out_dir / "regression.json", table)
    (out_dir / "regression.md").write_text(markdown)
    return out_dir / "regression.json"
