"""Inside an image build: finish a stage — apply its mods, then write the image record.

Finds the installed vLLM without importing it (an import can initialise a GPU),
applies the mods the target's stage gets with the mod engine (a mod that no
longer applies fails the build here, never the benchmark), and writes
/opt/kit/image.json (the image record): target, stage, vLLM version and commit, the arch list
the image was built for, the mods with their patch hashes, and the pin file hash.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kit import bundle, schema
from kit.paths import ROOT
from kit.vllm_tree import mods, pins, trees


def record(target: str, stage: str) -> dict:
    tree = trees.installed().package
    version, commit = mods.tree_version(tree)
    applied = mods.read_mods_record(tree)["mods"]
    return {
        "target": target,
        "stage": stage,
        "vllm_version": version,
        "vllm_commit": commit or pins.get("vllm.commit_abbrev"),
        "vllm_tree": str(tree),
        "arch": os.environ.get("TORCH_CUDA_ARCH_LIST")
        or os.environ.get("PYTORCH_ROCM_ARCH")
        or "cpu",
        "mods": applied,
        "pins_sha256": pins.file_sha256(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", choices=mods.TARGETS)
    parser.add_argument("--stage", choices=("unpatched", "patched"), required=True)
    parser.add_argument("--out", type=Path, default=ROOT / bundle.IMAGE_RECORD)
    args = parser.parse_args(argv)
    tree = trees.installed().package
    release, _ = mods.tree_version(tree)
    wanted = mods.mods_for_target(args.target, args.stage, release=release)
    for line in mods.apply(tree, wanted):
        print(line)
    data = record(args.target, args.stage)
    if wanted and not data["mods"]:
        parser.exit(1, f"error: {args.stage} stage but no mods recorded beside vllm\n")
    args.out.write_text(json.dumps(schema.stamp("image-record", data), indent=1) + "\n")
    print(json.dumps(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
