"""The geometries the regression suite and `make regress` run, and their prompts."""

from __future__ import annotations

from kit.geometry.geometry_model import UNIT, Case, Geometry

BLOCKS = (64, 384, 2144)
NUM_SPEC = (0, 1, 3)
RESIDUES = (0, 7, UNIT - 1)
# One-token context-load probe, and tails just past one and two hash units.
TAILS = (1, UNIT + 4, 2 * UNIT + 8)


def anchors(block: int) -> dict[str, int]:
    """Where S sits against the physical block grid (before adding S mod H)."""
    return {"inside": 10 * UNIT, "boundary": block, "beyond": block + 10 * UNIT}


def all_cases(checkpoints: str = "split") -> list[tuple[str, Case]]:
    """The grid; ``checkpoints``: the regime (``geometry_model.REGIMES``) every case runs in.
    Case ids are the same in every regime."""
    out = []
    for block in BLOCKS:
        for where, anchor in anchors(block).items():
            for r in RESIDUES:
                for k in NUM_SPEC:
                    for tail in TAILS:
                        case = Case(
                            Geometry(block, UNIT, k, checkpoints=checkpoints), anchor + r, tail
                        )
                        out.append((f"B{block}-{where}-S{case.shared}-r{r}-k{k}-U{tail}", case))
    return out


CONTEXT_BASE = 100  # token ids of the shared context: 100, 101, ...
PROBE_TOKEN = 13  # the "." of a context-load probe


def producer_tail(length: int) -> list[int]:
    """A's unique tail: the probe token, then the rest of a longer probe."""
    return ([PROBE_TOKEN] + list(range(3001, 3000 + length)))[:length]


def follow_up_turn(length: int) -> list[int]:
    """B's own tokens after what it shares with A."""
    return list(range(5000, 5000 + length))


def prompts(case: Case) -> tuple[list[int], list[int]]:
    """Producer A (context + probe tail) and follow-up B (context + a different turn)."""
    context = list(range(CONTEXT_BASE, CONTEXT_BASE + case.shared))
    return context + producer_tail(case.tail), context + follow_up_turn(case.follow_up)
