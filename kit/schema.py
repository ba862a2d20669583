"""Schema name and version of every results file the kit writes, and the readers' check.

Each file is a JSON object whose ``schema`` key is ``{"name": ..., "version": N}``.
A writer stamps it (``stamp``); a reader checks it (``check``) and, for a file an
older or newer kit wrote, says what to do instead of failing on a missing key.
Raise a version when a reader of the old layout would misread the new one.
"""

from __future__ import annotations

from pathlib import Path

KEY = "schema"
VERSIONS = {
    # bench.json: the TTFT run. 2: the checkpoint path ("path", "checkpoints",
    # geometry "checkpoints", every raw.json row's "path"), bootstrap intervals of
    # the ratios, pooled ratios.
    "bench": 2,
    "bench-session": 1,  # session.json: one tree's repetitions on one server alone
    "bench-failed": 1,  # failed.json: why a bench run left no bench.json
    "manifest": 1,  # manifest.json: the container flow
    "regression": 1,  # regression.json: the scheduler-level tables
    # upstream-suite.json: vLLM's own suite per tree (since 2026-12-06 the v1 core
    # suite on pristine, unpatched and patched, with exclusions and release: keys
    # added, none changed, so still version 1).
    "upstream-suite": 1,
    "upstream-check": 1,  # upstream-check.json: each upstream/ change on pristine vLLM
    "mods-drift": 1,  # mods-drift.json: every mod against every release
    "turn-cost": 1,  # turn-cost-<path>.json: where a turn's time goes, per tree and path
    "loss-sweep": 1,  # loss-sweep.json: the geometry model over random geometries
    "kernel-check": 1,  # kernel-check.json: the CPU kernels against vLLM's Triton ones
    "regress-measure": 1,  # one tree's grid measurements (an image's suites/<stage>/regress.json)
    "image-record": 1,  # image.json: what an image stage holds (vLLM, mods, pins)
}


class SchemaError(RuntimeError):
    exit_code = 2


def stamp(name: str, data: dict) -> dict:
    """``data`` with its schema first (a new dict; ``data`` is not changed)."""
    return {KEY: {"name": name, "version": VERSIONS[name]}, **data}


def unstamp(name: str, data: object, path: Path | str) -> dict:
    """``check``, then the content without its schema (for a record that is carried
    into another results file, which has its own)."""
    return {k: v for k, v in check(name, data, path).items() if k != KEY}


def check(name: str, data: object, path: Path | str) -> dict:
    """``data`` if it is a ``name`` file of the version this kit reads, else a
    SchemaError that says what the file is and what to do."""
    want = VERSIONS[name]
    found = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(found, dict) or "name" not in found or "version" not in found:
        raise SchemaError(
            f"{path}: no schema field: written by a kit older than schema versions "
            f"(or not a kit {name} file). Re-run the job that wrote it, or add "
            f'"{KEY}": {{"name": "{name}", "version": 1}} if it has the current layout'
        )
    if found["name"] != name:
        raise SchemaError(f"{path}: a {found['name']!r} file, not {name!r}")
    if found["version"] != want:
        newer = isinstance(found["version"], int) and found["version"] > want
        raise SchemaError(
            f"{path}: {name} schema version {found['version']}, this kit reads {want}: "
            + (
                "update the kit (git pull)"
                if newer
                else "re-run the job with this kit, or read it with the kit commit it records"
            )
        )
    return data
