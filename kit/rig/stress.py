"""Many requests over one shared context at once, every chunk checked against the ledger.

The grid (``kit.rig.regress``) runs one request at a time. Here waves of requests
share one context (random shared lengths, one-token probes and long tails), a
step budget small enough to cut prefills, and new requests arrive while earlier
ones still prefill: the schedules where vLLM has published truncated or stale
Mamba states before (vllm#51113). The real ``Scheduler`` and KV-cache manager
run; ``MambaStateLedger`` knows which token prefix made every state (chunk ends
and internal exports). A request must start every prefill chunk, and its
resume, from the state of exactly its own prefix.

``kit stress [--vllm RELEASE] --tree unpatched|patched`` (``make stress``: both, of the
pinned release) runs seeds on a release's tree, in a child process of its own.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kit.geometry.geometry_model import REGIMES, Geometry

if TYPE_CHECKING:  # the harness imports vLLM: only at run time, after the tree is chosen
    from kit.rig.sched_harness import Violation

CONTEXT_BASE = 100
TAIL_BASE = 20_000  # each request's own tokens: distinct from the context and each other


@dataclass(frozen=True)
class Arrival:
    step: int  # the engine step before which the request is added
    tokens: tuple[int, ...]
    max_tokens: int


def waves(geo: Geometry, seed: int, num_waves: int = 4, per_wave: int = 3) -> list[Arrival]:
    """Random waves over one context: shared lengths on and off the hash and block
    grids, "." probes and long tails, arrivals while earlier requests prefill."""
    rng = random.Random(seed)
    b, h = geo.block, geo.unit
    context = list(range(CONTEXT_BASE, CONTEXT_BASE + rng.randint(2 * b, 4 * b)))
    arrivals, step, serial = [], 0, 0
    for _ in range(num_waves):
        for _ in range(per_wave):
            shape = rng.choice(("hash", "block", "any", "full"))
            if shape == "hash":
                shared = rng.randint(1, len(context) // h) * h
            elif shape == "block":
                shared = min(
                    rng.randint(1, len(context) // b) * b + rng.choice((-h, 0, h)), len(context)
                )
            elif shape == "any":
                shared = rng.randint(h, len(context))
            else:
                shared = len(context)
            tail_len = rng.choice((1, rng.randint(2, 3 * h), rng.randint(b // 2, 2 * b)))
            serial += 1
            tail = list(range(TAIL_BASE + serial * 10_000, TAIL_BASE + serial * 10_000 + tail_len))
            arrivals.append(Arrival(step, tuple(context[:shared] + tail), rng.randint(1, 3)))
        step += rng.randint(1, 4)
    return arrivals


def run_seed(
    model_dir: Path,
    geo: Geometry,
    seed: int,
    *,
    fix: bool = False,
    lookahead_hashes: bool = True,
) -> list[Violation]:
    from kit.rig.sched_harness import SchedulerRig

    rig = SchedulerRig(model_dir, geo, fix=fix, lookahead_hashes=lookahead_hashes)
    return rig.drive(waves(geo, seed))


GEOMETRIES = (
    # Budgets as small as align mode allows (one block) and a little more: prefills
    # are cut, and several requests share each step; and budgets that let a resumed
    # request finish several blocks in one chunk (what makes an internal export valid).
    (64, 64),
    (64, 160),
    (64, 320),
    (384, 384),
    (384, 640),
    (384, 1536),
)


def stress(
    model_dir: Path,
    seeds: range,
    regimes: tuple[str, ...] = REGIMES,
    *,
    fix: bool = False,
    lookahead_hashes: bool = True,
    num_spec: tuple[int, ...] = (0, 1),
) -> dict[str, list[dict]]:
    """Every regime x geometry x k x seed; the violations found, per regime."""
    found: dict[str, list[dict]] = {}
    for regime in regimes:
        found[regime] = []
        for block, budget in GEOMETRIES:
            for k in num_spec:
                geo = Geometry(block, num_spec=k, budget=budget, checkpoints=regime)
                for seed in seeds:
                    for v in run_seed(
                        model_dir, geo, seed, fix=fix, lookahead_hashes=lookahead_hashes
                    ):
                        found[regime].append(
                            {"block": block, "budget": budget, "k": k, "seed": seed, **asdict(v)}
                        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=20, help="seeds per geometry (default 20)")
    parser.add_argument("--regime", choices=REGIMES, action="append", help="default: all")
    parser.add_argument(
        "--tree",
        choices=("unpatched", "patched"),
        default="patched",
        help="the release's tree to run (a patched one with the fix switched on)",
    )
    parser.add_argument(
        "--legacy-hashes", action="store_true", help="legacy hashing (a release with lookahead)"
    )
    parser.add_argument(
        "--vllm",
        metavar="VERSION",
        help="a release from pins.toml, or 'newest' (default: the pinned one)",
    )
    parser.add_argument("--out", type=Path, help="write the violations as JSON to this file")
    # Internal: this process imports the tree to test, told what it is by the flags
    # its parent passes (Tree.child_args).
    parser.add_argument("--in-tree", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fix", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--from-sdist", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    import tempfile

    from kit.vllm_tree import mods, releases, trees

    if not args.in_tree:
        import subprocess

        try:
            tree = releases.tree(releases.resolve(args.vllm), args.tree)
        except (releases.ReleaseError, mods.ModError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return getattr(exc, "exit_code", 2)
        # vLLM imports once per process: every tree runs in a child of its own.
        child = [sys.executable, "-m", "kit.rig.stress", "--in-tree", *tree.child_args()]
        child += ["--seeds", str(args.seeds)]
        child += [arg for regime in args.regime or () for arg in ("--regime", regime)]
        child += ["--legacy-hashes"] if args.legacy_hashes else []
        child += ["--out", str(args.out)] if args.out else []
        return subprocess.run(child, env=tree.env(VLLM_LOGGING_LEVEL="ERROR")).returncode
    trees.prepare(args.from_sdist)

    from kit.weights.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        found = stress(
            write_tiny_model(Path(tmp) / "tiny"),
            range(args.seeds),
            tuple(args.regime or REGIMES),
            fix=args.fix,
            lookahead_hashes=not args.legacy_hashes,
        )
    for regime, violations in found.items():
        print(f"[{regime}] {len(violations)} chunk(s) started from a wrong state")
        for v in violations[:5]:
            print(f"  {v}")
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
