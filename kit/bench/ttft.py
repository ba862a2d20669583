"""The TTFT measurement: the A/B pair and the conversation on one server, and the
interleaved run over both trees. Every request's cached-token count is checked
against the geometry model; every cached answer is judged against the cold one."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from kit.bench import oracle
from kit.bench.host_steal import steal_s, stolen_between
from kit.bench.openai_client import (
    MetricsError,
    RequestError,
    cache_config_info,
    complete,
    metrics_text,
    one_request_times,
    parse_counters,
    parse_engine_times,
    reset_prefix_cache,
)
from kit.bench.regime_fit import BY_REGIME
from kit.bench.serve import Server
from kit.bench.serve_args import SERVED_NAME, path_by_regime
from kit.geometry.geometry_cases import PROBE_TOKEN
from kit.geometry.geometry_model import (
    REGIMES,
    Case,
    Geometry,
    boundary_control,
    expected,
    lookahead_ideal,
    next_turn_resume,
    prompt_checkpoint,
    resumed_chunk_ends,
)
from kit.vllm_tree.trees import TREE_NAMES as TREES

TURN_LEN = 48
REPLY_TOKENS = 8
WAKE_PROMPT = [5, 6, 7]  # shorter than one hash unit: leaves no cache entry
IDLE_GAP_S = 1.5


def context(rep: int, shared: int, salt: str, length: int | None = None) -> list[int]:
    """Fresh token ids for repetition ``rep`` at S = ``shared``: ``length`` of them
    (default S)."""
    rng = random.Random(f"{salt}-{rep}-{shared}")
    return [rng.randrange(16, 4000) for _ in range(shared if length is None else length)]


def measure(
    server: Server,
    tree: str,
    prompt: list[int],
    kind: str,
    expect: int,
    rep: int,
    shared: int,
    max_tokens: int = 4,
) -> dict:
    text = metrics_text(server.url)
    before, times_before = parse_counters(text), parse_engine_times(text)
    steal_before = steal_s()
    done = complete(server.url, SERVED_NAME, prompt, max_tokens)
    stolen = stolen_between(steal_before, steal_s())
    after, times = settled_metrics(server, times_before)
    return {
        "tree": tree,
        "rep": rep,
        "S": shared,
        "kind": kind,
        "ttft_s": done.ttft_s,
        # Host steal during the request (``host_steal``): None where unknown.
        "stolen_s": stolen,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "expected_cached": expect,
        "hit_ok": done.cached_tokens == expect,
        "metrics_hits": after["vllm:prefix_cache_hits_total"]
        - before["vllm:prefix_cache_hits_total"],
        "metrics_queries": after["vllm:prefix_cache_queries_total"]
        - before["vllm:prefix_cache_queries_total"],
        "token_ids": done.token_ids,
        "logprobs": done.logprobs,
        "top_logprobs": done.top_logprobs,
        # vLLM's own times for this request (``ENGINE_TIMES``): None where unknown.
        **times,
    }


METRICS_SETTLE = (0.0, 0.005, 0.02, 0.05, 0.1, 0.2)


def settled_metrics(server: Server, times_before: dict) -> tuple[dict, dict]:
    """The counters and the request's own times after it ended. vLLM's API server
    records a step's stats after it hands that step's outputs to the streams
    (``AsyncLLM`` output handler, yielding between), so a reading at once can miss
    them; it reads again, briefly, until each histogram the server exports moved."""
    for wait in METRICS_SETTLE:
        time.sleep(wait)
        text = metrics_text(server.url)
        times = one_request_times(times_before, parse_engine_times(text))
        if all(times[field] is not None for field in times_before):
            break
    return parse_counters(text), times


def bench_case(geo: Geometry, shared: int) -> Case:
    """The bench's A/B pair as a geometry-model case: the "." probe is a one-token tail."""
    return Case(geo, shared, 1)


def pair_requests(
    server: Server,
    tree: str,
    rep: int,
    shared: int,
    geo: Geometry,
    tolerance: float = oracle.DEFAULT_TOLERANCE,
) -> Iterator[dict]:
    """The A/B pair on one server, one measured request per row yielded as it is
    measured (so two servers can take turns request by request). The cached B's
    oracle verdict is added to its row when cold B is in, before cold B is yielded.
    The cached B is expected the fix's hit on the server under test (``Server.fix``)."""
    ctx = context(rep, shared, "pair")
    a = ctx + [PROBE_TOKEN]
    b = ctx + [4000 + i for i in range(TURN_LEN)]
    case = bench_case(geo, shared)
    # The hit each checkpoint regime predicts (kit.bench.regime_fit: a served
    # model's regime is its vLLM's choice); the bench expects its geometry's.
    by_regime = {
        regime: expected(
            bench_case(replace(geo, checkpoints=regime), shared),
            patched=server.fix,
            lookahead=geo.hash_lookahead,
            retention=geo.retention,
        ).hit
        for regime in REGIMES
    }
    want_b = by_regime[geo.checkpoints]
    resend = prompt_checkpoint(len(b), geo.unit, geo.eagle, geo.hash_lookahead)
    # Unmeasured: the first request after the server sat idle (while the other
    # tree ran) waited about 1 s before its prefill in a third of the
    # repetitions, on either tree; cold A should time the prefill, not that.
    complete(server.url, SERVED_NAME, WAKE_PROMPT, 1)
    yield tag_path([measure(server, tree, a, "cold_A", 0, rep, shared)], geo)[0]
    cached = measure(server, tree, b, "cached_B", want_b, rep, shared)
    cached["ideal_cached"] = lookahead_ideal(case, geo.hash_lookahead)
    cached["chunk_ends"] = list(resumed_chunk_ends(geo, len(b), want_b, server.fix))
    cached[BY_REGIME] = by_regime
    yield tag_path([cached], geo)[0]
    yield tag_path([measure(server, tree, b, "repeat_B", resend, rep, shared)], geo)[0]
    yield from control_requests(server, tree, rep, shared, geo, len(b) - fix_hit(geo, shared))
    reset_prefix_cache(server.url)
    cold = tag_path([measure(server, tree, b, "cold_B", 0, rep, shared)], geo)[0]
    verdict = oracle.judge(
        cached["token_ids"],
        cold["token_ids"],
        cached["top_logprobs"],
        cold["top_logprobs"],
        tolerance,
    )
    cached["oracle"] = verdict.as_dict()
    yield cold


def fix_hit(geo: Geometry, shared: int) -> int:
    """Where the fix resumes cached B at S = ``shared`` (the geometry's regime)."""
    case = bench_case(geo, shared)
    return expected(case, patched=True, lookahead=geo.hash_lookahead, retention=geo.retention).hit


def control_requests(
    server: Server, tree: str, rep: int, shared: int, geo: Geometry, tail: int
) -> Iterator[dict]:
    """The control for cached B (issue 49), the same requests on both trees: a fresh
    context loaded cold ("control_A"), then a follow-up ("control_B") that resumes
    at a block boundary and prefills ``tail`` uncached tokens, cached B's under the
    fix at this S (``boundary_control``: the hit is the geometry model's on both trees).

    Its engine steps (``chunk_ends``) are the fewest any resumed prompt of that many
    uncached tokens gets on the tree: the resume is on a block boundary, so no
    chunk ends at the next one (the scheduler's mid-block stop,
    ``Scheduler._mamba_block_aligned_split``). The prompt's own checkpoint,
    floor(N/H)*H - H, lies inside the chunk, and ``is_mamba_prefill_checkpoint_valid``
    refuses the in-pass export for any chunk that ends less than two block
    columns above its initial state's, so vLLM ends a chunk there: two steps
    unpatched and on the split path. The fix exports it into a block of its own
    where the layer exports several states per row: one step, as cached B takes
    at S 900, 1007 and 2159 (two at S 2048, whose resume at 2032 crosses the
    boundary). A request of fewer uncached tokens would be one step on both trees
    but not the same work (repeat B is that: one step over the tokens above its
    prompt checkpoint)."""
    control = boundary_control(geo)
    rng = random.Random(f"control-tail-{rep}-{shared}")
    ctx = context(rep, shared, "control", control.context)
    # Fresh ids from 16 up: never the load's probe, so the follow-up leaves the
    # load right after the context.
    follow = ctx + [
        rng.randrange(16, 4000) for _ in range(control.prompt_len(tail) - control.context)
    ]
    load = measure(server, tree, ctx + [PROBE_TOKEN], "control_A", 0, rep, shared)
    yield tag_path([load], geo)[0]
    row = measure(server, tree, follow, "control_B", control.resume, rep, shared)
    row["chunk_ends"] = list(resumed_chunk_ends(geo, len(follow), control.resume, server.fix))
    yield tag_path([row], geo)[0]


def conversation_requests(
    server: Server, tree: str, rep: int, shared: int, geo: Geometry
) -> Iterator[dict]:
    """The 4-turn conversation on one server, a row yielded per turn."""
    prompt = context(rep, shared, "conv") + [4000 + i for i in range(TURN_LEN)]
    expect = 0
    for turn in range(4):
        row = measure(
            server, tree, prompt, f"turn{turn + 1}", expect, rep, shared, max_tokens=REPLY_TOKENS
        )
        expect = next_turn_resume(len(prompt), len(row["token_ids"]), geo)
        prompt = prompt + row["token_ids"] + [3000 + 50 * turn + i for i in range(TURN_LEN)]
        yield tag_path([row], geo)[0]


def tag_path(rows: list[dict], geo: Geometry) -> list[dict]:
    """Every row says which checkpoint path its server ran ("internal" or "split")."""
    for row in rows:
        row["path"] = path_by_regime(geo.checkpoints).name
    return rows


def reported_geometry(server: Server) -> dict:
    """The cache geometry a server reports (``vllm:cache_config_info``)."""
    with naming(server):
        return cache_config_info(server.url)


def geometry_from(
    reported: dict, num_spec: int, budget: int, checkpoints: str, hash_lookahead: int = 0
) -> Geometry:
    return Geometry(
        reported["block"],
        reported["unit"],
        num_spec,
        budget,
        checkpoints=checkpoints,
        hash_lookahead=hash_lookahead,
        retention=reported.get("retention"),
    )


def served_geometry(
    servers: dict[str, Server],
    num_spec: int,
    budget: int,
    checkpoints: str = "split",
    hash_lookahead: int = 0,
) -> Geometry:
    """The geometry the expectations use: the one both servers report, with the step
    budget, checkpoint regime (``Geometry.checkpoints``) and hash lookahead they were
    started with."""
    reported = {tree: reported_geometry(server) for tree, server in servers.items()}
    if reported["unpatched"] != reported["patched"]:
        raise MeasureError(f"the two servers' cache geometry differs: {reported}")
    return geometry_from(reported["patched"], num_spec, budget, checkpoints, hash_lookahead)


class MeasureError(RuntimeError):
    pass


@contextmanager
def naming(server: Server) -> Iterator[None]:
    """A failed request becomes a MeasureError that names the server's tree and what
    became of its process (a dead server's exit status and last log lines)."""
    try:
        yield
    except (RequestError, MetricsError, OSError) as exc:
        raise MeasureError(f"{server.health()}\nthe request failed: {exc}") from exc


def interleaved(
    servers: dict[str, Server],
    geo: Geometry,
    reps: int,
    shared: list[int],
    tolerance: float,
    progress=lambda work: work,
) -> list[dict]:
    """Every repetition and S on both servers, A B / B A alternating; repetition -1
    is the warm-up and is not returned. Where the kit runs both servers' processes
    (``pausable``) the trees take turns request by request, the idle one paused;
    otherwise (servers reached by URL) a whole repetition at a time."""
    by_request = pausable(servers)
    rows: list[dict] = []
    work = [(rep, s) for rep in range(-1, reps) for s in shared]
    try:
        for rep, s in progress(work):
            order = TREES if rep % 2 == 0 else TREES[::-1]
            if by_request:
                got = request_by_request(servers, order, rep, s, geo, tolerance)
            else:
                got = [
                    row
                    for tree in order
                    for row in measure_rep(servers[tree], tree, rep, s, geo, tolerance)
                ]
            if rep >= 0:
                rows += got
    finally:
        if by_request:
            for server in servers.values():
                server.resume()
    return rows


def pausable(servers: dict[str, Server]) -> bool:
    """Whether every server can be paused (``Server.pause``): stand-ins without the
    method, and servers the kit reaches only by URL, cannot."""
    return all(hasattr(server, "can_pause") and server.can_pause() for server in servers.values())


def request_by_request(
    servers: dict[str, Server],
    order: tuple[str, ...] | list[str],
    rep: int,
    shared: int,
    geo: Geometry,
    tolerance: float,
) -> list[dict]:
    """One repetition at one S, the trees taking turns per request (``order``
    first): each tree's same request runs a fraction of a second after the other's,
    not a whole repetition (~4 s) later. The other tree's server is paused
    (SIGSTOP) meanwhile, so it neither busy-polls nor runs anything beside the
    measured one, and no idle gap is needed."""
    streams = {
        tree: _rep_requests(servers[tree], tree, rep, shared, geo, tolerance) for tree in order
    }
    rows: list[dict] = []
    while streams:
        for tree in list(streams):
            for other, server in servers.items():
                if other != tree:
                    server.pause()
            servers[tree].resume()
            with naming(servers[tree]):
                # Unmeasured: the resumed server's first request of this turn.
                complete(servers[tree].url, SERVED_NAME, WAKE_PROMPT, 1)
                row = next(streams[tree], None)
            if row is None:
                del streams[tree]
            else:
                rows.append(row)
    return rows


def _rep_requests(
    server: Server, tree: str, rep: int, shared: int, geo: Geometry, tolerance: float
) -> Iterator[dict]:
    yield from pair_requests(server, tree, rep, shared, geo, tolerance)
    yield from conversation_requests(server, tree, rep, shared, geo)


def measure_rep(
    server: Server, tree: str, rep: int, shared: int, geo: Geometry, tolerance: float
) -> list[dict]:
    """One repetition at one S on one server: the A/B pair and the conversation."""
    # vLLM's worker busy-polls for 1 s after its last request: on a small machine
    # the server that just finished would steal CPU from the other one's first
    # requests (patched cold A, with its extra steps, measured 3x slower that way;
    # alone, 1.1x).
    time.sleep(IDLE_GAP_S)
    with naming(server):
        return list(_rep_requests(server, tree, rep, shared, geo, tolerance))


def one_tree(
    server: Server,
    tree: str,
    geo: Geometry,
    reps: tuple[int, ...],
    shared: list[int],
    tolerance: float,
    progress=lambda work: work,
) -> list[dict]:
    """Some repetitions on one server alone (``kit.bench.one_server``): a warm-up
    repetition (-1, not returned) at every S first, as the interleaved run has."""
    rows: list[dict] = []
    for rep, s in progress([(rep, s) for rep in (-1, *reps) for s in shared]):
        got = measure_rep(server, tree, rep, s, geo, tolerance)
        if rep >= 0:
            rows += got
    return rows
