"""The end-to-end correctness oracle: does a cached answer come from the right state?

The first generated position is computed by the prefill that resumes from the
restored state (attention cache and Mamba/GDN state) plus the uncached tokens,
so its distribution is a function of that state alone. Later positions also
depend on decode numerics (speculative verification batches differ from run
to run). Hence:

- ``same``:  the greedy tokens equal the cold run's and the first position's
  top-k log-probabilities agree within the tolerance;
- ``tie``:   the first position agrees within the tolerance but the greedy tokens
  part (at that position or later): a near-tie flipped by numerics, not a wrong
  state;
- ``wrong``: the first position disagrees beyond the tolerance (or the cold
  run's top token is missing from the cached top-k): the state is not the one
  the cache claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tiny CPU model, bf16 logits (one ulp is 2^-8 or 2^-7 at its logit sizes):
# restored states that are right differ from a cold run by 0, ~1e-5, 0.0039 or
# 0.0078 at the first position (80 cached answers, make bench); the restored-V
# defect (mod fix-cow-aliased-kv-copy) moved it by 0.058-0.13 when B resumed
# 900-1000 tokens into a block. 0.03 sits between, about four ulps. A wrong state
# that moves the first position by less (the same defect 80 tokens into a block:
# ~0.008) is below what this oracle can tell from rounding.
DEFAULT_TOLERANCE = 0.03


@dataclass(frozen=True)
class Verdict:
    kind: str  # same | tie | wrong
    first_logprob_diff: float  # max |delta| over the shared top-k of position 0
    split_at: int | None  # first position where the greedy tokens differ

    def as_dict(self) -> dict:
        diff = self.first_logprob_diff
        return {
            "verdict": self.kind,
            "first_logprob_diff": diff if math.isfinite(diff) else None,
            "split_at": self.split_at,
        }


def first_position_diff(cached: dict[int, float], cold: dict[int, float]) -> float:
    """Max |log-prob difference| over the tokens both top-k lists hold; inf if the tops miss."""
    if not cached or not cold:
        return math.inf
    if max(cold, key=cold.get) not in cached or max(cached, key=cached.get) not in cold:
        return math.inf
    return max(abs(cached[t] - cold[t]) for t in cached.keys() & cold.keys())


def judge(
    cached_tokens: list[int],
    cold_tokens: list[int],
    cached_top: list[dict[int, float]],
    cold_top: list[dict[int, float]],
    tolerance: float = DEFAULT_TOLERANCE,
) -> Verdict:
    diff = first_position_diff(cached_top[0] if cached_top else {}, cold_top[0] if cold_top else {})
    split = next(
        (i for i, (a, b) in enumerate(zip(cached_tokens, cold_tokens, strict=False)) if a != b),
        None,
    )
    if split is None and len(cached_tokens) != len(cold_tokens):
        split = min(len(cached_tokens), len(cold_tokens))
    if diff > tolerance:
        return Verdict("wrong", diff, split)
    return Verdict("same" if split is None else "tie", diff, split)
