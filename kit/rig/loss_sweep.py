"""`make loss-sweep`: the EAGLE-specific loss over seeded random geometries, from the
geometry model alone (no vLLM), unpatched vs patched, both hashings.

Geometries: H in {16, 32}; B_phys in {64, 128, 384, 2144}; S below 5 blocks; a
producer tail U below 3 blocks; a step budget of 8192, B_phys or 2 B_phys
tokens; one draft token. The model is checked against vLLM's real scheduler on
the grid and on a sample of these (tests/regression/test_random_geometries.py).

Reports, per tree and hashing, how many geometries lose tokens to speculation
alone, how many of those had a prefill that fit in one step, and how many lie
in the class the fix leaves (the server without speculation resumes on a block
boundary below the last one inside A, where a step-budget cut left a state).
Writes ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from kit import schema
from kit.geometry.geometry_model import Case, Geometry, expected
from kit.paths import RESULTS
from kit.rig.regress import eagle_specific_loss

BLOCKS = (64, 128, 384, 2144)
UNITS = (16, 32)


def random_cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    out: list[Case] = []
    while len(out) < count:
        block, unit = rng.choice(BLOCKS), rng.choice(UNITS)
        shared, tail = rng.randrange(1, 5 * block), rng.randrange(1, 3 * block)
        budget = max(rng.choice((8192, block, 2 * block)), block)
        out.append(Case(Geometry(block, unit, 1, budget=budget), shared, tail))
    return out


def earlier_block_state(case: Case, plain_hit: int, chunk_ends: tuple[int, ...]) -> bool:
    """The server without speculation resumes on a block-aligned chunk end of A
    below A's last block boundary (a state a step-budget cut left)."""
    last_inside = (case.producer_len - 1) // case.block * case.block
    return plain_hit % case.block == 0 and 0 < plain_hit < last_inside and plain_hit in chunk_ends


def sweep(cases: list[Case]) -> dict[str, dict[str, int]]:
    out = {}
    for patched in (False, True):
        for lookahead in (0, 1):
            losing = one_step = in_class = 0
            for case in cases:
                plain = expected(case.without_speculation(), patched).hit
                want = expected(case, patched, lookahead)
                if eagle_specific_loss(case, want.hit, plain, lookahead) <= 0:
                    continue
                losing += 1
                one_step += case.budget >= case.producer_len
                in_class += earlier_block_state(case, plain, want.chunk_ends)
            tree = "patched" if patched else "unpatched"
            key = f"{tree}/{'lookahead' if lookahead else 'legacy'}"
            out[key] = {
                "geometries": len(cases),
                "one_step_prefills": sum(c.budget >= c.producer_len for c in cases),
                "lose_to_speculation": losing,
                "of_which_one_step_prefill": one_step,
                "of_which_at_a_budget_cut_block_state": in_class,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20_000, help="geometries (%(default)s)")
    parser.add_argument("--seed", type=int, default=20261203, help="(%(default)s)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "loss-sweep.json", help="(%(default)s)"
    )
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    report = schema.stamp(
        "loss-sweep", {"seed": args.seed, "trees": sweep(random_cases(args.count, args.seed))}
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for key, row in report["trees"].items():
        print(f"{key:20s} {row}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
