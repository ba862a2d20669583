"""Where a follow-up should resume, derived from the geometry alone.

An independent model of vLLM 0.32.0's documented prefix-cache rules for one
producer A (N = S + U tokens) followed by B (S shared tokens), under a
scheduler token budget per step (vLLM's ``max_num_batched_tokens``). It does
not import vLLM: the suite compares the real scheduler against these numbers.

From 0.33.0, EAGLE/MTP prompts get lookahead block hashes by default: the key of
each H-token unit also covers the next L tokens (L = 1 for EAGLE and MTP), and
nothing is dropped. ``lookahead=L`` selects those rules; ``lookahead=0`` is the
0.32.0 hashing, which later releases keep under ``disable_lookahead_block_hashes``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The prefix_match_unit H the kit measures at unless a geometry says otherwise.
UNIT = 16


@dataclass(frozen=True)
class Geometry:
    """A hybrid cache as the scheduler sees it: the one description every part of the
    kit uses (the model, the scheduler rig, the bench)."""

    block: int  # B_phys, tokens per physical block (Mamba state spacing in align mode)
    unit: int = UNIT  # H, prefix_match_unit
    num_spec: int = 0  # k draft tokens; 0 = no speculative decoding
    budget: int = 8192  # tokens one step may schedule (max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.block % self.unit:
            raise ValueError(
                f"block {self.block} is not divisible by prefix_match_unit {self.unit}; "
                "vLLM requires it"
            )
        if self.budget < self.block:
            raise ValueError(
                f"token budget {self.budget} is smaller than the block {self.block}: "
                "align mode cannot end a partial chunk on a block boundary; raise "
                "max_num_batched_tokens"
            )

    @property
    def eagle(self) -> bool:
        return self.num_spec > 0


@dataclass(frozen=True)
class Case:
    """Producer A (S shared tokens + a tail of U), then follow-up B over the same S."""

    geometry: Geometry
    shared: int  # S
    tail: int  # U, the producer's unique tail
    # B's own tokens after S. The model does not read it: B's length never caps
    # its match below the shared boundary (tests/regression/test_follow_up_shapes.py).
    follow_up: int = 48

    def __post_init__(self) -> None:
        if self.follow_up < 1:
            raise ValueError(
                f"follow-up of {self.follow_up} tokens: B must add at least one token "
                "after the shared prefix, or it is a resend of A's prefix"
            )

    @property
    def block(self) -> int:
        return self.geometry.block

    @property
    def unit(self) -> int:
        return self.geometry.unit

    @property
    def num_spec(self) -> int:
        return self.geometry.num_spec

    @property
    def budget(self) -> int:
        return self.geometry.budget

    @property
    def eagle(self) -> bool:
        return self.geometry.eagle

    def without_speculation(self) -> Case:
        """The same A and B on the same cache, drafting off: the baseline for EAGLE's cost."""
        return replace(self, geometry=replace(self.geometry, num_spec=0))

    @property
    def producer_len(self) -> int:
        return self.shared + self.tail

    @property
    def ideal(self) -> int:
        """Best possible resume: the last shared hash boundary, less EAGLE's unit."""
        base = self.shared // self.unit * self.unit
        return max(base - self.unit, 0) if self.eagle else base

    @property
    def heuristic_covers(self) -> bool:
        """The predecessor-hash formula: U < 2H - (S mod H) (EAGLE), U <= H - (S mod H) (none)."""
        r = self.shared % self.unit
        if self.eagle:
            return self.tail < 2 * self.unit - r
        return self.tail <= self.unit - r


def lookahead_ideal(case: Case, lookahead: int) -> int:
    """The best resume when each hash also covers ``lookahead`` tokens and nothing
    is dropped (``lookahead=0``: the 0.32.0 ideal)."""
    if not case.eagle or not lookahead:
        return case.ideal
    return max(case.shared - lookahead, 0) // case.unit * case.unit


def prompt_checkpoint(prompt_len: int, unit: int, eagle: bool) -> int:
    """Where a resend of a prompt, or a continuation of it, resumes.

    EAGLE: full attention holds ``floor(N/H)*H`` and drops one unit, to where the
    Mamba checkpoint is. Without EAGLE the last token is recomputed:
    ``floor((N-1)/H)*H``.
    """
    if eagle:
        return max(prompt_len // unit * unit - unit, 0)
    return (prompt_len - 1) // unit * unit


@dataclass(frozen=True)
class Expected:
    chunk_ends: tuple[int, ...]
    fa_match: int
    fa_eagle: int
    hit: int
    fa_partials: tuple[int, ...]
    mamba_partials: tuple[int, ...]


def _proof_limit(case: Case, lookahead: int) -> int:
    """Tokens of A a stored position may cover: the last one (or the L it hashes
    past a boundary) is left for the follow-up to prove."""
    return case.producer_len - max(1, lookahead)


@dataclass(frozen=True)
class Checkpoints:
    """Positions where A's prefill ends a chunk and keeps a Mamba state."""

    last_block: int  # the last block-aligned checkpoint
    tail: int  # the prompt checkpoint
    pred: int  # patched: one unit below the prompt checkpoint
    block_pred: int  # patched: one unit below the last block boundary A crosses

    def extra(self) -> tuple[int, ...]:
        """The patched positions, which may lie inside the block below ``last_block``."""
        return tuple(p for p in (self.pred, self.block_pred) if p)


def _checkpoints(case: Case, patched: bool, lookahead: int = 0) -> Checkpoints:
    n, b, h = case.producer_len, case.block, case.unit
    if not case.eagle:
        return Checkpoints((n - 1) // b * b, (n - 1) // h * h, 0, 0)
    if lookahead:
        limit = _proof_limit(case, lookahead)
        last_block, tail, crossed = limit // b * b, limit // h * h, limit // b * b
    else:
        # EAGLE drops a whole block below the last one A fills.
        last_block, tail = max(n // b * b - b, 0), max(n // h * h - h, 0)
        # The last block boundary a follow-up that diverges inside A can share.
        crossed = (n - 1) // b * b
    if not patched:
        return Checkpoints(last_block, tail, 0, 0)
    # The EAGLE rewind turns a match on the boundary into a resume one unit below.
    block_pred = crossed - h if crossed and h < b else 0
    return Checkpoints(last_block, tail, max(tail - h, 0), block_pred)


def producer_chunk_ends(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, ...]:
    n, b = case.producer_len, case.block
    cp = _checkpoints(case, patched, lookahead)
    stops = [cp.last_block]
    stops += [p for p in (cp.tail,) if cp.last_block < p < n]
    # The fix's stops may lie inside the block below the last block checkpoint.
    stops += [p for p in cp.extra() if cp.last_block - b < p < n]
    ends, start = [], 0
    while start < n:
        inside = [s for s in stops if start < s < n]
        if start % b:
            next_boundary = (start // b + 1) * b
            if next_boundary < n:
                inside.append(next_boundary)
        end = min(inside, default=n)
        if end - start > case.budget:
            # Align mode cuts a chunk the budget cannot finish at a block boundary.
            end = (start + case.budget) // b * b
        ends.append(end)
        start = end
    return tuple(ends)


def fa_partials(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, ...]:
    n, h = case.producer_len, case.unit
    cp = _checkpoints(case, patched, lookahead)
    # EAGLE keeps the unit its drop removes; with lookahead hashes a unit is
    # hashed only once its lookahead tokens exist (the Mamba tail itself).
    tail = n // h * h if case.eagle and not lookahead else cp.tail
    wanted = [tail]
    if case.eagle and patched:
        wanted.append(tail - case.unit)
        if lookahead:
            # No drop: B proves the boundary below the block it shares only
            # through an entry there.
            wanted.append(cp.block_pred)
    return tuple(sorted({p for p in wanted if p > 0 and p % case.block}))


def expected(case: Case, patched: bool, lookahead: int = 0) -> Expected:
    """``lookahead``: tokens each hash covers past its unit (0: the 0.32.0 hashing)."""
    b, h, s = case.block, case.unit, case.shared
    lookahead = lookahead if case.eagle else 0
    ends = producer_chunk_ends(case, patched, lookahead)
    cp = _checkpoints(case, patched, lookahead)
    mamba_partials = tuple(sorted({p for p in (cp.tail, *cp.extra()) if p in ends and p % b}))
    # Mamba states A leaves behind: block-aligned chunk ends and its checkpoints.
    states = {e for e in ends if e % b == 0 and e < case.producer_len} | set(mamba_partials)
    # B's keys match while their lookahead tokens are shared too.
    base = lookahead_ideal(case, lookahead) if lookahead else s // h * h
    block_floor = max(s - lookahead, 0) // b * b
    fa_entries = fa_partials(case, patched, lookahead)
    partial = [p for p in fa_entries if block_floor < p <= base]
    fa = max(partial, default=block_floor)
    # Lookahead hashes prove the boundary token: no EAGLE drop.
    fa_eagle = max(fa - h, 0) if case.eagle and fa and not lookahead else fa
    hit = max((p for p in states if p <= fa_eagle), default=0)
    return Expected(ends, fa, fa_eagle, hit, fa_entries, mamba_partials)
