"""`kit`: one command for every job of the kit, a thin dispatcher over the modules.

``kit <job> [arguments]`` runs that module's ``main`` with the arguments;
``kit <job> --help`` shows the job's own options; ``kit --help`` lists the jobs.
An error the kit raises on purpose (its ``...Error`` classes: bad input, a missing
prerequisite) is printed as one line, ``error: ...``, with the job's exit status
(2 unless the error says otherwise). So is, with exit status 2, an error of the
world around a job, ``error: <what is wrong>; <what to do>``: a file-system error
(a full disk, a read-only checkout, a path that is missing or taken), a file that
is not UTF-8, JSON or TOML, a table or key missing from pins.toml, a network that
cannot be reached, and a results bundle of the wrong shape given to ``kit report``.
Anything else is a bug and keeps its traceback; ``KIT_TRACEBACK=1`` keeps it for
these too.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import socket
import sys
import tomllib
import traceback
import urllib.error
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

# job: (module, one line). Grouped by layer: pins, trees and mods; the
# scheduler-level science; the end-to-end bench; images and the container flow.
JOBS: dict[str, tuple[str, str]] = {
    "setup": ("kit.vllm_tree.setup_env", "create .venv with the pinned CPU vLLM and the two trees"),
    "pins": (
        "kit.vllm_tree.pins",
        "read pins.toml: one pin, an image's build arguments, its sha256",
    ),
    "lock": ("kit.pins.lock", "resolve what pins.toml and the lock files leave open"),
    "trees": ("kit.vllm_tree.trees", "build (or check) the unpatched and patched vLLM trees"),
    "mods": ("kit.vllm_tree.mods", "list, check, apply, revert the mods on a vLLM tree"),
    "mods-drift": ("kit.vllm_tree.mods_drift", "every mod against every known vLLM release"),
    "models": ("kit.weights.models", "models.lock: lock, fetch, verify, export, import weights"),
    "tiny-model": ("kit.weights.tiny_model", "write the tiny Qwen3-Next model (config, weights)"),
    "regress": (
        "kit.rig.regress_cli",
        "the geometry grid on vLLM's real scheduler, every tree of a release",
    ),
    "loss-sweep": ("kit.rig.loss_sweep", "EAGLE-specific loss over seeded random geometries"),
    "upstream-suite": (
        "kit.vllm_tree.upstream_suite",
        "vLLM's own v1 core tests on the pristine, unpatched and patched trees",
    ),
    "upstream-check": (
        "kit.vllm_tree.upstream_check",
        "each upstream/ change applied to pristine vLLM: its tests, the mod, the suite",
    ),
    "kernel-check": ("kit.kernels.check", "the kit's CPU kernels against vLLM's Triton ones"),
    "bench": ("kit.bench.run", "cached follow-up TTFT, unpatched vs patched, one bundle"),
    "turn-cost": ("kit.bench.turn_cost", "where a conversation turn's time goes, both trees"),
    "stress": ("kit.rig.stress", "many requests over one shared context, checked"),
    "regression-figure": (
        "kit.rig.regression_figure",
        "draw the regression grid per path and tree",
    ),
    "nemotron-h": ("kit.rig.nemotron_h", "a tiny Nemotron-H with a real Mamba2 layer's spec"),
    "report": ("kit.bench.report", "render one bundle, or compare two (kit report A B)"),
    "results-index": ("kit.results_index", "write (or --check) results/INDEX.md"),
    "hostcheck": ("kit.images.hostcheck", "check a GB10 or Strix Halo host before a run"),
    "images": ("kit.images.build", "build the kit's images (Docker/BuildKit or buildah)"),
    "buildah-build": ("kit.images.buildah_build", "build the cpu image's stages with buildah"),
    "flow": ("kit.images.orchestrate", "the container flow: host check to results bundle"),
}


def usage() -> str:
    width = max(map(len, JOBS))
    lines = [
        "usage: kit <job> [arguments]   (kit <job> --help: the job's options)",
        "",
        __doc__.strip().splitlines()[0],
        "",
        "jobs:",
    ]
    lines += [f"  {name:{width}s}  {text}" for name, (_, text) in JOBS.items()]
    return "\n".join(lines) + "\n"


def _is_kit_error(exc: BaseException) -> bool:
    """The kit's own errors: RuntimeError subclasses defined in a kit module."""
    return isinstance(exc, RuntimeError) and type(exc).__module__.startswith("kit.")


KIT_DIR = Path(__file__).resolve().parent
# Jobs whose input is a results bundle a person names: there an error of the data's
# shape is the bundle's fault (the schema checks its version and top-level fields,
# not every value), said with the place it was met so a real bug can still be found.
BUNDLE_JOBS = ("report",)
SHAPE_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError)
# Transport errors of the HTTP clients the kit's dependencies use (huggingface_hub:
# httpx; docker: requests), which are not all OSErrors.
NETWORK_MODULES = ("httpx", "httpx2", "httpcore", "requests", "urllib3")
NETWORK_CLASSES = ("TransportError", "ConnectionError", "ConnectError", "Timeout")


def _frames(exc: BaseException) -> list:
    """The traceback's frames, innermost first."""
    return [frame for frame, _ in traceback.walk_tb(exc.__traceback__)][::-1]


def _kit_frame(exc: BaseException):
    """The innermost frame in the kit's own code, or None."""
    for frame in _frames(exc):
        if Path(frame.f_code.co_filename).resolve().is_relative_to(KIT_DIR):
            return frame
    return None


def _where(exc: BaseException) -> str:
    frame = _kit_frame(exc)
    if frame is None:
        return "outside the kit"
    path = Path(frame.f_code.co_filename).resolve().relative_to(KIT_DIR.parent)
    return f"{path}:{frame.f_lineno}"


def _file_read(exc: BaseException) -> Path | None:
    """The file a decode error came from: the innermost frame's Path (pathlib's own
    ``self`` while it reads, or the kit function's ``path``), when there is one."""
    for frame in _frames(exc):
        for name in ("self", "path"):
            value = frame.f_locals.get(name)
            if isinstance(value, Path):
                return value
    return None


def _is_network(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, urllib.error.URLError, TimeoutError, socket.gaierror)):
        return True
    return any(
        cls.__module__.split(".")[0] in NETWORK_MODULES and cls.__name__ in NETWORK_CLASSES
        for cls in type(exc).__mro__
    )


def _network(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return (
            f"{exc.url} answered HTTP {exc.code} {exc.reason}; check the address and "
            "that it serves what the kit asks for"
        )
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    url = None
    with suppress(Exception):  # httpx raises when no request is attached
        url = exc.request.url  # httpx and requests errors carry their request
    where = f" {url}" if url else ""
    return (
        f"cannot reach{where} over the network ({type(exc).__name__}: {reason}); check the "
        "network (connection, proxy, DNS) and the address, or run this where it is reachable"
    )


def _os_error(exc: OSError) -> str:
    from kit import bundle  # standard library and kit.schema only; here, not at start-up

    name = exc.filename if exc.filename is not None else "a file"
    if exc.filename2 is not None:
        name = f"{name} -> {exc.filename2}"
    what = f"{name}: {exc.strerror or exc}"
    code = exc.errno
    if code in bundle.WRITE_LIMITS:  # a full disk, a quota, the file size limit
        todo = bundle.WRITE_LIMITS[code]
    elif code == errno.EROFS:
        todo = "the file system is read-only: run from a writable checkout or write elsewhere"
    elif code in (errno.EACCES, errno.EPERM):
        todo = "check the permissions of that path, or write elsewhere"
    elif code == errno.ENOENT:
        folder = Path(exc.filename).parent if exc.filename is not None else None
        if folder is not None and not folder.exists():
            what = f"{name}: its folder {folder} does not exist"
            todo = f"create it (mkdir -p {folder}) or name another path"
        else:
            todo = "check the path"
    elif code == errno.EEXIST:
        todo = "name a new path, or move the one there away"
    elif code == errno.EISDIR:
        todo = "that is a folder: name a file"
    elif code == errno.ENOTDIR:
        todo = "a part of that path is a file, not a folder: check the path"
    else:
        todo = "check the path and the disk"
    return f"{what}; {todo}"


def explain(exc: BaseException, job: str, argv: list[str]) -> str | None:
    """``<what is wrong>; <what to do>`` for an expected error; None for a bug."""
    if isinstance(exc, UnicodeDecodeError):
        where = _file_read(exc) or "a file the job reads"
        return (
            f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); the file is damaged "
            "or not the kit's: write it again with the job that made it"
        )
    if isinstance(exc, json.JSONDecodeError):
        where = _file_read(exc) or "a file the job reads"
        return (
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "the file is damaged or not the kit's: write it again with the job that made it"
        )
    if isinstance(exc, tomllib.TOMLDecodeError):
        where = _file_read(exc) or "a TOML file the job reads (pins.toml, models.lock)"
        return f"{where}: not valid TOML ({exc}); fix it (git diff shows what changed)"
    if isinstance(exc, KeyError):
        # Raised where the key was looked up (a subscript makes no frame of its own):
        # a function holding the loaded pins as ``pins``, as the kit's readers of
        # pins.toml do, found a table or key missing.
        frames = _frames(exc)
        if frames and isinstance(frames[0].f_locals.get("pins"), dict):
            return (
                f"pins.toml has no {exc}, which {_where(exc)} reads; restore that table or "
                "key (git diff pins.toml shows what changed)"
            )
    if _is_network(exc):
        return _network(exc)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if job in BUNDLE_JOBS and isinstance(exc, SHAPE_ERRORS):
        named = [a for a in argv if not a.startswith("-") and Path(a).is_dir()] or ["the bundle"]
        return (
            f"{', '.join(named)}: not a bench bundle of the shape this kit reads "
            f"({type(exc).__name__}: {exc}, at {_where(exc)}); re-run the bench that wrote it "
            "(KIT_TRACEBACK=1 shows the traceback, if the bundle is one this kit wrote)"
        )
    return None


def run(job: str, argv: list[str]) -> int:
    module_name, _ = JOBS[job]
    main: Callable[[list[str] | None], int | None] = importlib.import_module(module_name).main
    # argparse names the program after argv[0]: make usage lines read "kit <job>".
    saved = sys.argv[0]
    sys.argv[0] = f"kit {job}"
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"kit {job}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _is_kit_error(exc):
            print(f"error: {exc}", file=sys.stderr)
            return int(getattr(exc, "exit_code", 2))
        line = None if os.environ.get("KIT_TRACEBACK") else explain(exc, job, argv)
        if line is None:
            raise
        print("error: " + " ".join(line.split()), file=sys.stderr)
        return 2
    finally:
        sys.argv[0] = saved


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    job, rest = argv[0], argv[1:]
    if job not in JOBS:
        print(f"kit: no job {job!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    return run(job, rest)


if __name__ == "__main__":
    raise SystemExit(main())
