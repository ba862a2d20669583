"""Inside one image: the kit's regression suite, the geometry measurements, vLLM's prefix suite.

The orchestrator (``kit.images.orchestrate``) runs this once in the unpatched and
once in the patched image, with the network cut off, and compares the two
sides on the host. Writes into ``--out``:

- ``regression-suite.xml`` / ``.log``: ``pytest tests/regression`` against the
  installed vLLM (in the unpatched image the cases that encode the regression
  are strict xfails, so both sides exit 0 when the fix behaves);
- ``regress.json``: every geometry measured (``kit.rig.regress_cli measure``), the
  patched side with the fix's switch on;
- ``upstream-<stage>.xml`` / ``.log``: vLLM's ``tests/v1/core/prefix_cache``
  from the pinned sdist, when ``--upstream-tests`` names the unpacked tests;
- ``image.json``: the image's record of vLLM, mods and pins (``kit.images.image_stage``).

Prints each step's exit status as JSON; exits 1 when the kit's own steps failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kit import bundle
from kit.paths import ROOT
from kit.process_group import run_watched
from kit.vllm_tree import trees, upstream_suite
from kit.weights.tiny_model import write_tiny_model

ENV = {"PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}


def _run(cmd: list[str], log: Path) -> int:
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        # Watched: the suite's whole process group dies with this runner.
        return run_watched(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **ENV)
        ).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=("unpatched", "patched"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="a writable folder")
    parser.add_argument(
        "--upstream-tests", type=Path, help="vLLM's unpacked tests/ (from the pinned sdist)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # The image's record of its mods first: the host judges every measurement by
    # it, also when the suites are stopped before they end.
    record = ROOT / bundle.IMAGE_RECORD
    if record.is_file():
        shutil.copy(record, args.out / bundle.IMAGE_RECORD)
    status: dict[str, int] = {}
    py = sys.executable
    status["regression_suite"] = _run(
        [
            py,
            "-m",
            "pytest",
            "tests/regression",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={args.out / 'regression-suite.xml'}",
        ],
        args.out / "regression-suite.log",
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny")
        measure = [py, "-m", "kit.rig.regress_cli", "measure", "--model-dir", str(model)]
        measure += ["--out", str(args.out / "regress.json")]
        # What the image's vllm is, from its mods (image_stage recorded them): the
        # patched image's measurement runs with the fix's switch on.
        measure += trees.installed().child_args()
        status["regress_measure"] = _run(measure, args.out / "regress.log")
    if args.upstream_tests:
        proc, _ = upstream_suite.start_suite(
            args.stage, args.upstream_tests, args.out, trees.installed()
        )
        # pytest exits 1 on any failed case; the host compares the sides case by case.
        status["upstream_suite"] = proc.wait()
        upstream_suite.commit_outputs(args.out, [args.stage])
    print(json.dumps(status))
    failed = {k: v for k, v in status.items() if k != "upstream_suite" and v != 0}
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
