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

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    block: int  # B_phys
    unit: int  # H
    num_spec: int  # k; 0 = no speculative decoding
    shared: int  # S
    tail: int  # U, the producer's unique tail
    budget: int = 8192  # tokens one step may schedule (max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.budget < self.block:
            raise ValueError(
                f"token budget {self.budget} is smaller than the block {self.block}: "
                "align mode cannot end a partial chunk on a block boundary; raise "
                "max_num_batched_tokens"
            )

    @property
    def eagle(self) -> bool:
        return self.num_spec > 0

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


def _checkpoints(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, int, int]:
    """(last block checkpoint, tail checkpoint, predecessor checkpoint) for A."""
    n, b, h = case.producer_len, case.block, case.unit
    if case.eagle and lookahead:
        limit = _proof_limit(case, lookahead)
        tail = limit // h * h
        return limit // b * b, tail, max(tail - h, 0) if patched else 0
    if case.eagle:
        last_block = max(n // b * b - b, 0)
        tail = max(n // h * h - h, 0)
        pred = max(tail - h, 0) if patched else 0
    else:
        last_block = (n - 1) // b * b
        tail = (n - 1) // h * h
        pred = 0
    return last_block, tail, pred


def producer_chunk_ends(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, ...]:
    n, b = case.producer_len, case.block
    last_block, tail, pred = _checkpoints(case, patched, lookahead)
    stops = [last_block]
    stops += [p for p in (tail,) if last_block < p < n]
    if lookahead:
        # The lookahead fix also stops inside the block below a block-aligned checkpoint.
        stops += [p for p in (pred,) if last_block - b < p < n]
    else:
        stops += [p for p in (pred,) if last_block < p < n]
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
    n, b, h = case.producer_len, case.block, case.unit
    if case.eagle and lookahead:
        # A unit is hashed only once its lookahead tokens exist.
        tail = _proof_limit(case, lookahead) // h * h
    else:
        tail = (n if case.eagle else n - 1) // h * h
    wanted = [tail] + ([tail - h] if case.eagle and patched else [])
    return tuple(p for p in wanted if p > 0 and p % b)


def expected(case: Case, patched: bool, lookahead: int = 0) -> Expected:
    """``lookahead``: tokens each hash covers past its unit (0: the 0.32.0 hashing)."""
    b, h, s = case.block, case.unit, case.shared
    lookahead = lookahead if case.eagle else 0
    ends = producer_chunk_ends(case, patched, lookahead)
    _, tail, pred = _checkpoints(case, patched, lookahead)
    mamba_partials = tuple(p for p in (tail, pred) if p in ends and p % b)
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
