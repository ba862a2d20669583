"""`kit`: one command for every job of the kit, a thin dispatcher over the modules.

``kit <job> [arguments]`` runs that module's ``main`` with the arguments;
``kit <job> --help`` shows the job's own options; ``kit --help`` lists the jobs.
An error the kit raises on purpose (its ``...Error`` classes: bad input, a missing
prerequisite) is printed as one line, ``error: ...``, with the job's exit status
(2 unless the error says otherwise); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# job: (module, one line). Grouped by layer: pins, trees and mods; the
# scheduler-level science; the end-to-end bench; images and the container flow.
JOBS: dict[str, tuple[str, str]] = {
    "setup": ("kit.vllm_tree.setup_env", "create .venv with the pinned CPU vLLM and the two trees"),
    "pins": (
        "kit.vllm_tree.pins",
        "read pins.toml: one pin, an image's build arguments, its sha256",
    ),
    "lock": ("kit.images.lock", "resolve what pins.toml and the lock files leave open"),
    "trees": ("kit.vllm_tree.trees", "build (or check) the unpatched and patched vLLM trees"),
    "mods": ("kit.vllm_tree.mods", "list, check, apply, revert the mods on a vLLM tree"),
    "mods-drift": ("kit.vllm_tree.mods_drift", "every mod against every known vLLM release"),
    "models": ("kit.weights.models", "models.lock: lock, fetch, verify, export, import weights"),
    "tiny-model": ("kit.weights.tiny_model", "write the tiny Qwen3-Next model (config, weights)"),
    "regress": ("kit.rig.regress_cli", "the geometry grid on vLLM's real scheduler, both trees"),
    "loss-sweep": ("kit.rig.loss_sweep", "EAGLE-specific loss over seeded random geometries"),
    "upstream-suite": (
        "kit.vllm_tree.upstream_suite",
        "vLLM's own prefix-cache tests on both trees",
    ),
    "kernel-check": ("kit.rig.kernel_check", "the kit's CPU kernels against vLLM's Triton ones"),
    "bench": ("kit.bench.run", "cached follow-up TTFT, unpatched vs patched, one bundle"),
    "turn-cost": ("kit.bench.turn_cost", "where a conversation turn's time goes, both trees"),
    "stress": ("kit.rig.stress", "many requests over one shared context, checked"),
    "regression-figure": (
        "kit.rig.regression_figure",
        "draw the regression grid per path and tree",
    ),
    "nemotron-h": ("kit.rig.nemotron_h", "a tiny Nemotron-H with a real Mamba2 layer's spec"),
    "report": ("kit.bench.report", "render one bundle, or compare two (kit report A B)"),
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
    except RuntimeError as exc:
        if not _is_kit_error(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 2))
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
