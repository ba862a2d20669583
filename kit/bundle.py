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
- ``logs/``, and the tiny model's config in ``tiny-qwen3-next/`` (``kit bench --arch
  qwen3_5_moe``: ``tiny-qwen3_5-moe/``);
- ``environment/``: ``pip-freeze.txt`` of the environment that ran the bench
  (and ``collect-env.txt``, vLLM's report, when it could be made).

A bench that failed or was interrupted writes ``failed.json`` (why) instead of
``bench.json``, and a folder the kit named itself is renamed ``<name>-failed``:
no reader takes it for a bundle.

Every JSON results file carries its schema (``kit.schema``): ``load`` checks it.

Every module that writes or reads these names goes through here.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from kit import schema
from kit.paths import RESULTS, ROOT

BENCH = "bench.json"
RAW = "raw.json"
BENCH_MD = "bench.md"
PLOT = "ttft.png"
FIGURES = {
    "ttft.png": "TTFT per repetition, both trees, with the ratio's median and 95 % interval",
    "cached-tokens.png": "cached tokens resumed vs S per tree, the model's prediction, ideal",
}
FAILED = "failed.json"
ENVIRONMENT = "environment"
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


def write_text(path: Path, text: str) -> Path:
    """Written beside and renamed: a reader never sees half a file, and a write that
    fails (a full disk, the file size limit, Ctrl-C) leaves the old file and no
    ``.tmp`` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, data: object, indent: int | None = 1) -> Path:
    """``write_text`` of the JSON document."""
    return write_text(path, json.dumps(data, indent=indent) + "\n")


# Errors a write meets that the user fixes outside the kit. Python ignores SIGXFSZ,
# so a write past the file size limit (ulimit -f) is an OSError EFBIG, not a kill.
WRITE_LIMITS = {
    errno.ENOSPC: "free space on that disk (df -h) or write elsewhere (--out)",
    errno.EDQUOT: "free space within your disk quota (quota -s) or write elsewhere (--out)",
    errno.EFBIG: "the file size limit stopped the write: raise it (ulimit -f unlimited) "
    "or write elsewhere (--out)",
}


def write_problem(exc: OSError) -> str | None:
    """``<path>: <what>; <what to do>`` for a write stopped by a full disk, a quota or
    the file size limit; None for any other error."""
    todo = WRITE_LIMITS.get(exc.errno) if isinstance(exc, OSError) else None
    if todo is None:
        return None
    return f"{exc.filename or 'a file'}: {exc.strerror or exc}; {todo}"


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
    write_text(bundle / BENCH_MD, markdown)
    from kit import plot

    plot.bench_figures(report, rows, bundle)
    # Last: bench.json is what makes the folder a bundle.
    write_json(bundle / BENCH, schema.stamp("bench", report))


def redraw(bundle: Path) -> list[Path]:
    """Draw a bundle's figures again from its own bench.json and raw.json (figures of
    an older kit; nothing measured changes)."""
    report = load(bundle)
    rows = _strict_json(bundle / RAW) if (bundle / RAW).is_file() else None
    if not isinstance(rows, list):
        raise BundleError(f"{bundle}: no {RAW} with the requests; the figures need it")
    from kit import plot

    return plot.bench_figures(report, rows, bundle)


def write_failed(bundle: Path, reason: str, status: str) -> Path:
    """Why a bench run left no bench.json (status: failed | interrupted)."""
    return write_json(
        bundle / FAILED,
        schema.stamp("bench-failed", {"status": status, "reason": reason, "at": _now()}),
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_environment(bundle: Path, python: str = sys.executable) -> dict:
    """``pip freeze`` of the environment that ran (and vLLM's collect-env where it
    runs in a minute); returns what the bench record notes about them."""
    folder = bundle / ENVIRONMENT
    folder.mkdir(parents=True, exist_ok=True)
    noted = {}
    for name, cmd, timeout in (
        ("pip-freeze.txt", [python, "-m", "pip", "freeze", "--all"], 120),
        ("collect-env.txt", [python, "-m", "vllm.collect_env"], 60),
    ):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            noted[name] = f"not recorded: {exc}"
            continue
        if done.returncode == 0:
            (folder / name).write_text(done.stdout)
            noted[name] = f"{ENVIRONMENT}/{name}"
        else:
            noted[name] = f"not recorded: exit {done.returncode}: {done.stderr.strip()[-200:]}"
    noted["cpu_kernels"] = cpu_kernels(python)
    return noted


# What the vector ISA decides on an x86 CPU: torch's kernels, and which of the
# CPU wheel's three libraries vLLM imports (vllm/platforms/cpu.py import_kernels).
# vLLM's CPU GDN chunk kernel without AVX-512 runs ~50x slower (the kit's build
# machines, measured: 12 ms for a 56-token prefill per layer against 0.25 ms), so
# every TTFT in a bundle depends on it. Where the CPU has AMX tiles, the kernel's
# source says it updates states with AMX BF16 (through torch's brgemm, which picks
# the path at run time): recorded so bundles from such CPUs can be told apart.
CPU_KERNELS_PROBE = """
import json, platform, torch
cpu = torch.cpu
avx512 = cpu._is_avx512_supported()
lib = ("_C" if cpu._is_avx512_bf16_supported() else "_C_AVX512") if avx512 else "_C_AVX2"
x86 = platform.machine() in ("x86_64", "AMD64")
print(json.dumps({"torch_capability": torch.backends.cpu.get_cpu_capability(),
                  "vllm_library": f"vllm.{lib}" if x86 else "vllm._C",
                  "amx": x86 and getattr(cpu, "_is_amx_tile_supported", bool)()}))
"""


def cpu_kernels(python: str = sys.executable) -> dict | str:
    """The CPU kernels ``python``'s torch and vLLM use here (``CPU_KERNELS_PROBE``),
    or why that is not known."""
    try:
        done = subprocess.run(
            [python, "-c", CPU_KERNELS_PROBE], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not recorded: {exc}"
    if done.returncode != 0:
        return f"not recorded: exit {done.returncode}: {done.stderr.strip()[-200:]}"
    return json.loads(done.stdout)


def load(bundle: Path) -> dict:
    """A bundle's bench.json, with the container flow's manifest under ``manifest``,
    both checked against the schema this kit reads."""
    path = bundle / BENCH
    if not path.is_file():
        failed = bundle / FAILED
        if failed.is_file():
            why = read_json(failed)
            raise BundleError(
                f"{bundle}: that bench run {why.get('status', 'failed')} "
                f"({why.get('reason', 'no reason recorded')}); it wrote no {BENCH}. "
                f"Its logs are in {bundle / LOGS}"
            )
        raise BundleError(
            f"{bundle}: no {BENCH}; pass a folder written by 'make bench' or 'make bench-<target>'"
        )
    try:
        report = schema.check("bench", _strict_json(path), path)
        manifest = bundle / MANIFEST
        report["manifest"] = (
            schema.check("manifest", _strict_json(manifest), manifest)
            if manifest.is_file()
            else None
        )
    except schema.SchemaError as exc:
        raise BundleError(str(exc)) from exc
    missing = [k for k in ("summary", "geometry", "run", "reps", "oracle") if k not in report]
    if missing or not report.get("summary"):
        raise BundleError(
            f"{path}: incomplete bench record (missing or empty: "
            f"{', '.join(missing) or 'summary'}); re-run the bench"
        )
    return report


def existing_bundle(folder: Path) -> bool:
    """Whether a folder already holds a bench run's results (a bench must not write into it)."""
    return any((folder / name).exists() for name in (BENCH, RAW, FAILED))


def write_manifest(bundle: Path, data: dict) -> Path:
    return write_json(bundle / MANIFEST, schema.stamp("manifest", data))


def suite_dir(bundle: Path, stage: str) -> Path:
    return bundle / SUITES / stage


def write_regression(out_dir: Path, table: dict, markdown: str) -> Path:
    """``regression.json`` and ``regression.md``: `make regress`, the release tables, and
    the container flow's comparison of the two images all write them here."""
    write_json(out_dir / "regression.json", schema.stamp("regression", table))
    write_text(out_dir / "regression.md", markdown)
    return out_dir / "regression.json"
