"""The geometries the suite runs: every combination the regression issue names."""

from __future__ import annotations

from tests.regression.geometry_model import Case

UNIT = 16
BLOCKS = (64, 384, 2144)
NUM_SPEC = (0, 1, 3)
RESIDUES = (0, 7, UNIT - 1)
# One-token context-load probe, and tails just past one and two hash units.
TAILS = (1, UNIT + 4, 2 * UNIT + 8)


def anchors(block: int) -> dict[str, int]:
    """Where S sits against the physical block grid (before adding S mod H)."""
    return {"inside": 10 * UNIT, "boundary": block, "beyond": block + 10 * UNIT}


def all_cases() -> list[tuple[str, Case]]:
    out = []
    for block in BLOCKS:
        for where, anchor in anchors(block).items():
            for r in RESIDUES:
                for k in NUM_SPEC:
                    for tail in TAILS:
                        case = Case(block, UNIT, k, anchor + r, tail)
                        out.append((f"B{block}-{where}-S{case.shared}-r{r}-k{k}-U{tail}", case))
    return out
