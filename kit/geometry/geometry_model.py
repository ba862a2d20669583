"""Where a follow-up should resume, derived from the geometry alone.

An independent model of vLLM 0.32.0's documented prefix-cache rules for one
producer A (N = S + U tokens) followed by B (S shared tokens), under a
scheduler token budget per step (vLLM's ``max_num_batched_tokens``). It does
not import vLLM: the suite compares the real scheduler against these numbers.

From 0.33.0, EAGLE/MTP prompts get lookahead block hashes by default: the key of
each H-token unit also covers the next L tokens (L = 1 for EAGLE and one MTP
module, k for k chained MTP modules), and
nothing is dropped. ``lookahead=L`` selects those rules; ``lookahead=0`` is the
0.32.0 hashing, which later releases keep under ``disable_lookahead_block_hashes``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm
from typing import NamedTuple

# The prefix_match_unit H the kit measures at unless a geometry says otherwise.
UNIT = 16

# How a Mamba/GDN state reaches a prefix-cache boundary (``Geometry.checkpoints``):
# "split": the scheduler ends a prefill chunk there (every GDN backend before
# 0.34.0's FlashInfer one; 0.34.0's others without the fix's exports);
# "internal-1": the layer exports it from inside the forward pass at any offset
# (Mamba2's ``mamba_mixer2.py``: alignment 1); "internal-grid": the same on a
# grid (0.34.0's Qwen GDN on FlashInfer, and on Triton/FLA, HIP, CuteDSL, AITER
# FlyDSL, XPU's SYCL op and the CPU with fix-eagle-fine-prefix-exports:
# alignment lcm(H, 64), ``get_mamba_prefill_checkpoint_grid``).
REGIMES = ("split", "internal-1", "internal-grid")
# FlashInfer's GDN prefill exports states every 64 tokens.
FLASHINFER_GDN_CHUNK = 64
# The fix (``MAMBA_EAGLE_FIX_MIN_GAIN``, every release): a prompt that resumed
# from a cache hit keeps none of the fix's states less than this many tokens
# above the hit, which stays cached; a follow-up that needed one resumes at the
# hit (under one chunk of the GDN chunk kernels, recomputed once, against an
# export or an engine step that every such prompt would pay).
FIX_MIN_GAIN = 64


@dataclass(frozen=True)
class Geometry:
    """A hybrid cache as the scheduler sees it: the one description every part of the
    kit uses (the model, the scheduler rig, the bench)."""

    block: int  # B_phys, tokens per physical block (Mamba state spacing in align mode)
    unit: int = UNIT  # H, prefix_match_unit
    num_spec: int = 0  # k draft tokens; 0 = no speculative decoding
    budget: int = 8192  # tokens one step may schedule (max_num_batched_tokens)
    checkpoints: str = "split"  # one of REGIMES: how the layer materialises a state
    # Internal regimes: the layer writes more states per row than the prompt
    # checkpoint (our CPU GDN path; on 0.34.0 with fix-eagle-fine-prefix-exports,
    # Mamba2 and FlashInfer GDN), so the fix's states are exports; a layer that
    # writes one (stock Mamba2, KDA) makes the fix decline the export instead.
    layer_extra_exports: bool = True
    # The patched tree also exports the last cacheable block boundary where a chunk
    # runs past it (0.34.0's lookahead port): the state the split path's chunk end
    # keeps there, which a chunk the layer exports from would otherwise not keep.
    # The scheduler rigs read it off the tree; the bench's pair never depends on it.
    fix_exports_block_boundary: bool = False
    # The tokens a block's hash also covers past it (vLLM's num_hash_lookahead_tokens:
    # 0 with the 0.32.0 hashing, or without speculative decoding), as the bench's
    # servers hash (serve_args.hash_lookahead); the bench passes it to expected() and
    # prompt_checkpoint(), and the scheduler rig passes vLLM's own value to those.
    hash_lookahead: int = 0
    # vLLM's prefix_cache_retention_interval where the bench's servers report it (0:
    # vllm serve's default; None: dense, the scheduler rig's default): the bench
    # passes it to expected(), so its hits are predicted under the servers' retention.
    retention: int | None = None

    def __post_init__(self) -> None:
        if self.hash_lookahead < 0 or (self.hash_lookahead and not self.num_spec):
            raise ValueError(
                f"hash lookahead {self.hash_lookahead}: vLLM hashes past a block only "
                "under speculative decoding, by a count of tokens"
            )
        if self.checkpoints not in REGIMES:
            raise ValueError(
                f"checkpoint regime {self.checkpoints!r} is not one of {', '.join(REGIMES)}"
            )
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

    @property
    def checkpoint_alignment(self) -> int | None:
        """``MambaSpec.prefill_checkpoint_alignment`` the layer declares (None: split path)."""
        if self.checkpoints == "internal-1":
            return 1
        if self.checkpoints == "internal-grid":
            return lcm(self.unit, FLASHINFER_GDN_CHUNK)
        return None


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
        return replace(self, geometry=replace(self.geometry, num_spec=0, hash_lookahead=0))

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


def prompt_checkpoint(prompt_len: int, unit: int, eagle: bool, lookahead: int = 0) -> int:
    """Where a resend of a prompt, or a continuation of it, resumes.

    EAGLE: full attention holds ``floor(N/H)*H`` and drops one unit, to where the
    Mamba checkpoint is; with lookahead hashes (``lookahead`` L) it holds the last
    boundary L tokens below the end, ``floor((N-L)/H)*H``, and drops nothing.
    Without EAGLE the last token is recomputed: ``floor((N-1)/H)*H``.
    """
    if eagle and lookahead:
        return max((prompt_len - lookahead) // unit * unit, 0)
    if eagle:
        return max(prompt_len // unit * unit - unit, 0)
    return max((prompt_len - 1) // unit * unit, 0)


def next_turn_resume(prompt_len: int, reply_tokens: int, geo: Geometry) -> int:
    """Where a conversation's next turn resumes: the previous prompt's checkpoint,
    or the last block boundary its reply completed where that is higher.

    Align mode keeps the running state at every block boundary the reply's
    decode crosses, and the boundary's attention block is hashed once the tokens
    it needs are known: the boundary itself, or with lookahead hashes L more
    (``prompt_len + reply_tokens - max(1, L)``, the last sampled token never
    being computed). Under EAGLE with 0.32.0's hashing the follow-up's match at
    that boundary drops a unit, where no state is, so it resumes at the
    checkpoint. Checked on the real scheduler of 0.32.0 and 0.34.0
    (``tests/bench/test_hash_lookahead.py``, ``tests/regression/test_conversation.py``),
    decoding one token per step: the rig proposes no draft tokens.
    """
    checkpoint = prompt_checkpoint(prompt_len, geo.unit, geo.eagle, geo.hash_lookahead)
    if geo.eagle and not geo.hash_lookahead:
        return checkpoint
    known = prompt_len + reply_tokens - max(1, geo.hash_lookahead)
    return max(checkpoint, known // geo.block * geo.block)


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
    # patched, where the tree exports it: ``last_block`` again, kept by an export
    # where a chunk runs past it (``Geometry.fix_exports_block_boundary``)
    boundary: int = 0

    def extra(self) -> tuple[int, ...]:
        """The patched positions, which may lie inside the block below ``last_block``."""
        return tuple(p for p in (self.pred, self.block_pred) if p)

    def exportable(self) -> tuple[int, ...]:
        """Every position the fix may export inside a chunk: ``extra`` and ``boundary``."""
        return tuple(p for p in (*self.extra(), self.boundary) if p)


def checkpoints_of(case: Case, patched: bool, lookahead: int = 0) -> Checkpoints:
    """Where producer A keeps Mamba states on the ``patched`` or unpatched tree."""
    n, b, h = case.producer_len, case.block, case.unit
    tail = checkpoint_position(n, case, lookahead)
    if not case.eagle:
        return Checkpoints((n - 1) // b * b, tail, 0, 0)
    if lookahead:
        limit = _proof_limit(case, lookahead)
        last_block, crossed = limit // b * b, limit // b * b
    else:
        # EAGLE drops a whole block below the last one A fills.
        last_block = max(n // b * b - b, 0)
        # The last block boundary a follow-up that diverges inside A can share.
        crossed = (n - 1) // b * b
    if not patched:
        return Checkpoints(last_block, tail, 0, 0)
    # The EAGLE rewind turns a match on the boundary into a resume one unit below.
    block_pred = crossed - h if crossed and h < b else 0
    boundary = last_block if case.geometry.fix_exports_block_boundary else 0
    return Checkpoints(last_block, tail, max(tail - h, 0), block_pred, boundary)


def checkpoint_position(num_tokens: int, case: Case, lookahead: int = 0) -> int:
    """The prompt checkpoint of ``num_tokens`` tokens (vLLM's
    ``get_mamba_prefill_checkpoint_position`` at the hash unit): the last unit
    boundary a resend may resume at, less EAGLE's unit under the 0.32.0 hashing."""
    return prompt_checkpoint(num_tokens, case.unit, case.eagle, lookahead)


def _exportable(case: Case, start: int, end: int, position: int) -> bool:
    """vLLM's ``is_mamba_prefill_checkpoint_valid`` for the layer's alignment.

    The chunk starts on a hash boundary at least one unit below the position,
    the position sits on the alignment from the chunk start, and the chunk
    reaches past the block after the one its initial state lives in (the state
    is written into the block before the chunk's last one).
    """
    align = case.geometry.checkpoint_alignment
    b, h = case.block, case.unit
    return (
        align is not None
        and start % h == 0
        and -(-end // b) - 2 > (start - 1) // b
        and start + h <= position
        and start < position < end
        and (position - start) % align == 0
    )


def internal_checkpoint(case: Case, start: int, lookahead: int = 0) -> int:
    """The state the layer exports inside the prompt's final chunk ``[start, N)``, or 0.

    The scheduler then ends no chunk inside it: no tail stop, no block-boundary
    stops, none of the fix's stops.
    """
    n = case.producer_len
    position = checkpoint_position(n, case, lookahead if case.eagle else 0)
    return position if _exportable(case, start, n, position) else 0


@dataclass(frozen=True)
class Prefill:
    """A's prefill: chunk ends, the states its layer exports and keeps, which of
    the kept exports are the fix's (each in a block of its own), and which of
    those are block boundaries above a mid-block start (``mid_block_export``:
    kept only where retention keeps the boundary)."""

    ends: tuple[int, ...]
    kept_exports: tuple[int, ...] = ()
    fix_exports: tuple[int, ...] = ()
    boundary_exports: tuple[int, ...] = ()


def fix_exports(
    case: Case, cp: Checkpoints, start: int, end: int, lookahead: int
) -> tuple[int, ...]:
    """The fix's states the layer exports inside the chunk ``[start, end)``, each
    into a block of its own: no chunk end, no engine step.

    Where the layer takes internal checkpoints and writes extra states per row
    (``layer_extra_exports``: 0.32.0's CPU GDN; 0.34.0's FlashInfer GDN and
    Mamba2 with ``fix-eagle-fine-prefix-exports``; elsewhere the fix declines
    the layer's export instead), at any offset at least one hash unit into the
    chunk: a layer whose kernel emits on a grid runs the rest of the way itself
    (FlashInfer GDN: a short recurrence from the emitted state below). Where the
    tree does (``fix_exports_block_boundary``), also the last block boundary,
    which a chunk that runs past it keeps no state at; where the split path
    stops there it is a chunk end instead. ``lookahead`` only moves the
    positions (``cp``).

    The prompt checkpoint only in the prompt's final chunk (the whole rest fits
    the step's budget) where the layer cannot export it into the block table
    (``_exportable``: the chunk ends in its initial state's block or the next):
    there the scheduler would stop at it, a second engine step for a resumed
    follow-up. Elsewhere the layer exports it or the scheduler stops at it.
    """
    if not _takes_fix_exports(case.geometry):
        return ()
    n = case.producer_len
    own = {p for p in cp.exportable() if p != cp.tail}
    if (
        case.eagle
        and end >= n
        and n - start <= case.budget
        and not _exportable(case, start, n, cp.tail)
    ):
        own.add(cp.tail)
    return tuple(sorted(p for p in own if start < p < end and p - start >= case.unit))


def _takes_fix_exports(geo: Geometry) -> bool:
    """Whether the layer writes states inside a pass and more than one per row."""
    return geo.checkpoint_alignment is not None and geo.layer_extra_exports


def mid_block_export(case: Case, start: int) -> int:
    """The block boundary a patched prompt chunk that starts inside a block exports
    instead of ending there (vLLM's ``get_mamba_mid_block_boundary``), or 0.

    Where the fix's states are exports (``fix_exports``, under EAGLE/MTP), a chunk
    from ``start`` runs past the boundary: the layer writes the boundary state into
    a block of its own, and the key the full-block pass would give the column
    below the boundary (which holds the chunk's initial state) moves to it, so it
    is kept where retention keeps that boundary. Never left out near a hit.
    """
    boundary = (start // case.block + 1) * case.block
    if (
        case.eagle
        and _takes_fix_exports(case.geometry)
        and start % case.block
        and boundary < case.producer_len
        and boundary - start >= case.unit
    ):
        return boundary
    return 0


def resumed_fix_skips(case: Case, cp: Checkpoints, resume: int) -> set[int]:
    """The fix's states a prompt that resumed from a cache hit at ``resume``
    leaves out (every release and hashing): those less than ``FIX_MIN_GAIN``
    above the hit, on every path and in every chunk (neither exported nor a
    chunk end; a follow-up that needed one resumes at the hit). Cold prompts
    keep all."""
    if resume <= 0 or not case.eagle:
        return set()
    return {p for p in cp.exportable() if resume < p < resume + FIX_MIN_GAIN and p != cp.tail}


def producer_chunk_ends(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, ...]:
    return producer_prefill(case, patched, lookahead).ends


def producer_prefill(
    case: Case, patched: bool, lookahead: int = 0, resume: int = 0, junction: int = 0
) -> Prefill:
    """A's chunks as the scheduler cuts them, and what the cache manager publishes.

    Internal regimes: besides the final chunk's export, the manager reserves a
    checkpoint for *every* chunk that could export one at its own end's
    checkpoint position (dense retention ignores where the prefill ends), and
    the worker writes it. Kept only when it is the prompt checkpoint or a block
    boundary, otherwise dropped; either way the chunk end is published as on the
    split path (``fix-mamba-transient-checkpoint-tail``, in both trees; vLLM
    itself publishes only a kept export, so a prompt tail the scheduler stopped
    at was lost). The patched tree exports the fix's states inside whatever
    chunk spans them where the layer writes extra states (``fix_exports``), so
    its chunk ends are the unpatched tree's.

    ``resume``: the prompt resumed from a cache hit there (0: cold), so its first
    chunk starts there and it keeps none of the fix's states just above it
    (``resumed_fix_skips``); ``junction``: where vLLM ends a chunk for a sibling
    (the block-floored end of the longest single-group hit), if above the hit.
    """
    n, b = case.producer_len, case.block
    lookahead = lookahead if case.eagle else 0
    cp = checkpoints_of(case, patched, lookahead)
    skips = resumed_fix_skips(case, cp, resume) if patched else set()
    stops = [cp.last_block]
    stops += [p for p in (cp.tail,) if cp.last_block < p < n]
    # The fix's stops may lie inside the block below the last block checkpoint.
    stops += [p for p in cp.extra() if cp.last_block - b < p < n and p not in skips]
    stops += [junction] if resume < junction < n else []
    ends: list[int] = []
    kept: list[int] = []
    fix_kept: list[int] = []
    boundaries: list[int] = []
    start = resume
    while start < n:
        exported = internal_checkpoint(case, start, lookahead) if n - start <= case.budget else 0
        extra = fix_exports(case, cp, start, n, lookahead) if patched else ()
        boundary = mid_block_export(case, start) if patched else 0
        extra = tuple(p for p in extra if p not in skips and p != boundary)
        if (
            exported
            and patched
            and any(
                start < p < n and p != exported and p not in extra and p not in skips
                for p in cp.extra()
            )
        ):
            # The fix declines the export when the final chunk spans a state it
            # keeps that the layer cannot export (a layer that writes one state
            # per row), so the split path materialises them all.
            exported = 0
        # A resume inside a block still ends its chunk on the next boundary
        # unless it exports it, and a junction above it is a chunk end too, with
        # or without the export.
        mid_block_stop = (start // b + 1) * b if start % b and not boundary else 0
        cuts = [c for c in (mid_block_stop, junction) if start < c < n]
        if exported and cuts:
            end = min(cuts)
            passed = [boundary] if start < boundary < end else []
            kept += [p for p in extra if p < end] + passed
            fix_kept += sorted([p for p in extra if p < end] + passed)
            boundaries += passed
            ends.append(end)
            start = end
            continue
        if exported:
            # The final chunk exports the prompt checkpoint, and the fix's states.
            passed = [boundary] if boundary else []
            return Prefill(
                (*ends, n),
                (*kept, exported, *extra, *passed),
                (*fix_kept, *sorted((*extra, *passed))),
                (*boundaries, *passed),
            )
        # An export is no stop, but the last block boundary stays one on this path
        # unless it is the boundary above a mid-block start, which is exported.
        inside = [
            s
            for s in stops
            if start < s < n and s != boundary and (s not in extra or s == cp.last_block)
        ]
        if start % b and not boundary:
            next_boundary = (start // b + 1) * b
            if next_boundary < n:
                inside.append(next_boundary)
        end = min(inside, default=n)
        if end - start > case.budget:
            # Align mode cuts a chunk the budget cannot finish at a block boundary.
            end = (start + case.budget) // b * b
        if cp.tail in extra and start < cp.tail < end < n:
            # The prompt checkpoint is exported only from the prompt's final
            # chunk: another stop ends this one first, so it is a stop again.
            end = cp.tail
        position = checkpoint_position(end, case, lookahead)
        if _exportable(case, start, end, position) and (position == cp.tail or position % b == 0):
            # The manager keys the export (the column below the chunk end's) and,
            # as for a dropped transient export, publishes the chunk end as on the
            # split path (fix-mamba-transient-checkpoint-tail; vLLM itself
            # publishes only the kept export, or neither).
            kept.append(position)
        # The fix's states inside this chunk are exported, not stopped at.
        passed = [boundary] if start < boundary < end else []
        kept += [p for p in extra if p < end] + passed
        fix_kept += sorted([p for p in extra if p < end] + passed)
        boundaries += passed
        ends.append(end)
        start = end
    return Prefill(tuple(ends), tuple(kept), tuple(fix_kept), tuple(boundaries))


def fa_partials(case: Case, patched: bool, lookahead: int = 0) -> tuple[int, ...]:
    n, h = case.producer_len, case.unit
    cp = checkpoints_of(case, patched, lookahead)
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


def retained_block_state(
    position: int, prompt_len: int, block: int, eagle_drop: bool, retention: int | None
) -> bool:
    """Whether the Mamba manager keys a block-aligned state at ``position`` of a
    ``prompt_len``-token prompt under ``prefix_cache_retention_interval``
    ``retention`` (vLLM's ``MambaManager.reachable_block_mask`` with the
    coordinator's ``replay_boundaries``, the same in 0.32.0 and 0.34.0):

    - ``None`` (dense, ``KVCacheConfig``'s default): every block it reaches;
    - ``0`` (``vllm serve``'s default, ``CacheConfig``'s): only the replay
      boundaries, ``floor((N-1)/B)*B`` without the EAGLE drop, else one block
      below ``floor((N-1)/B)*B`` and below ``floor(N/B)*B``;
    - ``R`` > 0, a multiple of B: those and every multiple of R (R = B: dense).

    ``eagle_drop``: the coordinator drops EAGLE's block (speculation with the
    0.32.0 hashing; lookahead hashes drop nothing). Not modelled: the block of a
    shared-prefix junction, which only a producer that resumed from a hit has.
    Checked against the real scheduler of 0.32.0 and 0.34.0 (docs/retention.md).
    """
    if retention is None or (retention and retention // block <= 1):
        return True
    if retention and position % retention == 0:
        return True
    if eagle_drop:
        replay = {
            max((prompt_len - 1) // block * block - block, 0),
            max(prompt_len // block * block - block, 0),
        }
    else:
        replay = {(prompt_len - 1) // block * block}
    return position in replay - {0}


class ProducerStates(NamedTuple):
    """A's prefill, its published partial Mamba states, and every Mamba state it leaves."""

    prefill: Prefill
    mamba_partials: tuple[int, ...]
    states: set[int]


def producer_states(
    case: Case,
    patched: bool,
    lookahead: int = 0,
    resume: int = 0,
    junction: int = 0,
    retention: int | None = None,
) -> set[int]:
    """The positions at which producer A leaves a Mamba state in the cache (A resumed
    at ``resume``, vLLM stopping at ``junction``: see ``producer_prefill``;
    ``retention``: see ``retained_block_state``)."""
    lookahead = lookahead if case.eagle else 0
    return _producer_states(case, patched, lookahead, resume, junction, retention).states


def _producer_states(
    case: Case,
    patched: bool,
    lookahead: int,
    resume: int = 0,
    junction: int = 0,
    retention: int | None = None,
) -> ProducerStates:
    b = case.block
    prefill = producer_prefill(case, patched, lookahead, resume, junction)
    ends = prefill.ends
    cp = checkpoints_of(case, patched, lookahead)
    exported = set(prefill.kept_exports)
    mamba_partials = tuple(
        sorted(
            {p for p in (cp.tail, *cp.extra()) if p in ends and p % b}
            | {p for p in exported if p % b}
        )
    )
    # Mamba states A leaves behind: block-aligned chunk ends and its checkpoints.
    states = (
        {e for e in ends if e % b == 0 and e < case.producer_len}
        | set(mamba_partials)
        | set(exported)
    )
    if retention is not None:
        # The prompt checkpoint and the fix's positions are keyed on their own
        # (``_cache_partial_tail_block``: a chunk end there, or an export), block
        # boundary or not; other block-aligned states only where the mask keeps them.
        eagle_drop = case.eagle and not lookahead
        own = {cp.tail, *cp.extra(), *set(prefill.fix_exports) - set(prefill.boundary_exports)}
        states = {
            p
            for p in states
            if p % b
            or p in own
            or retained_block_state(p, case.producer_len, b, eagle_drop, retention)
        }
    return ProducerStates(prefill, mamba_partials, states)


def expected(
    case: Case, patched: bool, lookahead: int = 0, retention: int | None = None
) -> Expected:
    """``lookahead``: tokens each hash covers past its unit (0: the 0.32.0 hashing);
    ``retention``: vLLM's ``prefix_cache_retention_interval`` (None: dense, the
    scheduler rig's default; 0: ``vllm serve``'s; see ``retained_block_state``)."""
    b, h, s = case.block, case.unit, case.shared
    lookahead = lookahead if case.eagle else 0
    prefill, mamba_partials, states = _producer_states(
        case, patched, lookahead, retention=retention
    )
    ends = prefill.ends
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


class BoundaryControl(NamedTuple):
    """The bench's control for a resumed follow-up (issue 49): a fresh context of
    ``context`` tokens loaded cold with a one-token probe, then a follow-up of
    ``context`` of its tokens and a fresh rest, which resumes at the block boundary
    ``resume`` on both trees."""

    context: int
    resume: int

    def prompt_len(self, tail: int) -> int:
        """The follow-up's length when it prefills ``tail`` uncached tokens."""
        if tail <= self.context - self.resume:
            raise ValueError(
                f"a control tail of {tail} tokens: the follow-up shares {self.context} "
                f"tokens with the load and resumes at {self.resume}, so it recomputes more"
            )
        return self.resume + tail


def boundary_control(geo: Geometry) -> BoundaryControl:
    """The shortest control context whose load leaves the state at the first block
    boundary and whose follow-up resumes there on both trees (``expected``).

    Under the 0.32.0 hashing with EAGLE the follow-up's attention match drops a
    unit, so it must share one unit past the boundary, and the load's prompt
    checkpoint (``prompt_checkpoint``: floor(N/H)*H - H) must be the boundary:
    2064 tokens and a probe at B = 2048, H = 16 (the load's internal export, or
    on the split path its chunk end, materialises 2048; at retention 0 the
    prompt checkpoint is kept on its own). With lookahead hashes one token past
    the boundary is enough. The resume is on the boundary, not mid-block, so the
    follow-up's first chunk has no block-boundary stop (``resumed_chunk_ends``)."""
    resume = geo.block
    for context in range(resume, resume + 3 * geo.unit):
        case = Case(geo, context, 1)
        if all(
            expected(case, patched, geo.hash_lookahead, geo.retention).hit == resume
            for patched in (False, True)
        ):
            return BoundaryControl(context, resume)
    raise ValueError(f"no control context resumes at {resume} on both trees for {geo}")


def resumed_chunk_ends(geo: Geometry, prompt_len: int, resume: int, patched: bool) -> tuple:
    """The chunk ends (one engine step each) of a ``prompt_len``-token prompt that
    resumed from a cache hit at ``resume`` (``producer_prefill``; no junction)."""
    case = Case(geo, prompt_len - 1, 1)
    return producer_prefill(case, patched, geo.hash_lookahead, resume=resume).ends
