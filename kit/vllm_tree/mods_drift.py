"""`make mods-drift`: every mod against every vLLM release the kit knows.

For each mod and each release pins.toml names: does
its patch apply to the release's pristine package, is it already applied (the
release took the change), or does it drift? And, where the kit has a check for
it, is it still needed there (the bug reproduces without the mod)?
Writes ``results/mods-drift.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kit import bundle, schema
from kit.paths import RESULTS, ROOT
from kit.vllm_tree import mods, releases, trees
from kit.vllm_tree.kv_copy_check import CHECK

# Whether the bug a mod fixes reproduces on a pristine package: code run in a
# process whose vllm is that package, told what it runs by its arguments
# (``Tree.child_args``); its last line is JSON, true = reproduces.
_COW_CHECK = CHECK + "print(json.dumps(not all(f == 1.0 for f in equal)))\n"
# The context-load probe where the release's hashing loses: S mod H = H - 1
# with legacy hashing (0.32.0), S mod H = 0 with lookahead hashes (0.33.0 on).
_PROBE_CHECK = """
import json, sys, tempfile
from pathlib import Path
from kit.vllm_tree import trees
trees.prepare(trees.FROM_SDIST_ARG in sys.argv[1:])
from kit.geometry.geometry_model import Case, Geometry, lookahead_ideal
from kit.rig.sched_harness import run_case
from kit.weights.tiny_model import write_tiny_model
model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
lost = []
for shared in (64, 79):
    case = Case(Geometry(64, num_spec=1), shared, 1)
    rig, _, b, _ = run_case(model, case)
    lookahead = getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0)
    lost.append(b.hit < lookahead_ideal(case, lookahead))
print(json.dumps(any(lost)))
"""
NEEDED_CHECKS = {
    "fix-cow-aliased-kv-copy": _COW_CHECK,
    "fix-eagle-fine-prefix": _PROBE_CHECK,
    "fix-eagle-fine-prefix-lookahead": _PROBE_CHECK,
}


def _needed(mod: str, tree: trees.Tree) -> str:
    if mod not in NEEDED_CHECKS:
        return "no check"
    done = subprocess.run(
        [sys.executable, "-c", NEEDED_CHECKS[mod], *tree.child_args()],
        capture_output=True,
        text=True,
        env=tree.env(),
        cwd=ROOT,
    )
    if done.returncode != 0:
        return "check failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return "needed" if json.loads(done.stdout.strip().splitlines()[-1]) else "not needed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS / "mods-drift.json")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    versions = list(releases.known())
    table, rows = [], []
    # Both eagle mods share one check: run each check once per release.
    verdicts: dict[tuple[str, str], str] = {}
    for name in mods.available():
        mod = mods.load_mod(name)
        line = [name, ", ".join(mod.releases)]
        for version in versions:
            tree = releases.tree(version, releases.STOCK)
            state = mods.state(mod, tree.package).value
            key = (NEEDED_CHECKS.get(name, ""), version)
            if key not in verdicts:
                verdicts[key] = _needed(name, tree)
            needed = verdicts[key]
            rows.append({"mod": name, "release": version, "state": state, "needed": needed})
            line.append(f"{state}; {needed}")
        table.append(line)
    record = {"releases": versions, "rows": rows}
    bundle.write_json(args.out, schema.stamp("mods-drift", record))
    print(tabulate(table, headers=["mod", "made for", *versions]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
