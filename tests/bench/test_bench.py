"""The TTFT harness against a real vLLM server on loopback (the tiny CPU model with MTP).

Tree-independent, so it runs once, in the patched-tree pass of `make test`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kit.bench import run as bench
from kit.bench import serve_args, ttft
from kit.bench.openai_client import (
    MetricsError,
    RequestError,
    cache_config_info,
    complete,
    counters,
    parse_cache_config_info,
    parse_counters,
)
from kit.bench.serve import Server, ServerError
from kit.geometry.geometry_model import Geometry, expected
from kit.vllm_tree import trees

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

GOOD = """# HELP vllm:prefix_cache_hits_total x
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 5.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 40.0
vllm:other_total 3.0
"""


def test_parse_counters_sums_label_sets() -> None:
    assert parse_counters(GOOD) == {
        "vllm:prefix_cache_hits_total": 15.0,
        "vllm:prefix_cache_queries_total": 40.0,
    }


@pytest.mark.parametrize(
    "text,match",
    [
        (GOOD.replace("} 10.0", "} ten"), "does not parse as Prometheus text"),
        ("vllm:other_total 1\n", "lacks vllm:prefix_cache_hits_total"),
    ],
)
def test_malformed_metrics_are_refused(text: str, match: str) -> None:
    with pytest.raises(MetricsError, match=match):
        parse_counters(text)


# Trimmed from a real vLLM 0.32.0 CPU server's /metrics.
CACHE_CONFIG_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="1024",'
    'enable_prefix_caching="True",engine="0",mamba_block_size="1024",'
    'mamba_cache_mode="align",prefix_match_unit="16"} 1.0'
)


def test_cache_config_info_gives_the_geometry() -> None:
    assert parse_cache_config_info(CACHE_CONFIG_LINE) == {"block": 1024, "unit": 16}
    with pytest.raises(MetricsError, match="no vllm:cache_config_info"):
        parse_cache_config_info(GOOD)


def test_locked_model_must_be_pinned_and_verified(capsys) -> None:
    # The repository's lock is unresolved here: the bench stops before any server.
    assert bench.main(["--model", "qwen3_5-0_8b", "--print-serve-args"]) == 2
    assert "make lock-models MODEL=qwen3_5-0_8b" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tree() -> trees.Tree:
    # The bench's own machinery under test, on the tree the bench measures the fix with.
    return trees.pinned("patched")


def test_server_that_fails_to_start_is_reported(tmp_path: Path, tree: trees.Tree) -> None:
    server = Server(
        "broken",
        ["--model", str(tmp_path / "no-such-model"), "--load-format", "dummy"],
        tmp_path / "broken.log",
        tree=tree,
        startup_timeout=300,
    )
    with pytest.raises(ServerError, match="exited with"), server:
        pass
    assert not server.alive()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tree: trees.Tree):
    from kit.weights.tiny_model import write_tiny_model

    home = tmp_path_factory.mktemp("bench")
    args = serve_args.cpu_serve_args(
        write_tiny_model(home / "tiny", weights=True), serve_args.CPU_BLOCK, 16, 1
    ) + serve_args.fix_flags("cpu")
    with Server(
        "patched",
        args,
        home / "server.log",
        tree=tree,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        startup_timeout=900,
        fix=True,
    ) as srv:
        yield srv
    assert not srv.alive()  # stopped on exit


GEO = Geometry(serve_args.CPU_BLOCK, 16, 1, serve_args.CPU_BATCHED_TOKENS)
# The S = 1007 cached request, kept for the known-defect test (one server run).
RESUMED: dict[int, dict] = {}


def test_follow_up_hits_as_the_geometry_predicts(server: Server) -> None:
    # The resolved block: the same on every CPU only because the SSM cache dtype is pinned.
    # Retention 0: vllm serve's default, which the bench records and predicts under.
    assert cache_config_info(server.url) == {"block": 2048, "unit": 16, "retention": 0}
    shared = 1007  # S mod 16 = 15: the case the fix exists for
    rows = list(ttft.pair_requests(server, "patched", rep=0, shared=shared, geo=GEO))
    by_kind = {r["kind"]: r for r in rows}
    want = ttft.bench_case(GEO, shared)
    want = expected(want, patched=True).hit
    assert want == 976
    cached = by_kind["cached_B"]
    assert cached["cached_tokens"] == want and cached["hit_ok"]
    assert cached["metrics_hits"] == want  # /metrics agrees with the usage field
    for row in rows:
        # vLLM's own times of this very request: inside the client's TTFT, which also
        # holds the HTTP round trip and the API server's share.
        assert 0 < row["engine_prefill_s"] <= row["server_ttft_s"] <= row["ttft_s"], row
    assert by_kind["cold_A"]["cached_tokens"] == 0
    assert by_kind["cold_B"]["cached_tokens"] == 0  # after /reset_prefix_cache
    RESUMED[shared] = cached


def test_cached_answer_equals_cold_beyond_the_first_block(server: Server) -> None:
    shared = 2159  # the fix's geometry again, resuming at 2128 in the third block
    rows = list(ttft.pair_requests(server, "patched", rep=1, shared=shared, geo=GEO))
    cached = next(r for r in rows if r["kind"] == "cached_B")
    assert cached["cached_tokens"] == 2128
    assert cached["oracle"]["verdict"] == "same", cached["oracle"]


def test_cached_answer_inside_the_first_block_equals_cold(server: Server) -> None:
    """Failed on 0.32.0 (verdict "wrong"): the copy-on-write of B's partial attention
    block lost most of V; fixed by mods/fix-cow-aliased-kv-copy."""
    cached = RESUMED.get(1007)
    assert cached is not None, "test_follow_up_hits_as_the_geometry_predicts runs first"
    assert cached["cached_tokens"] == 976
    assert cached["oracle"]["verdict"] == "same", cached["oracle"]


def test_request_that_does_not_hit_is_flagged(server: Server) -> None:
    fresh = ttft.context(rep=99, shared=500, salt="nohit")
    row = ttft.measure(server, "patched", fresh, "cached_B", expect=480, rep=0, shared=500)
    assert row["cached_tokens"] == 0
    assert not row["hit_ok"]


def test_server_that_dies_mid_run(server: Server) -> None:
    # Last test of the module: it kills the shared server.
    before = counters(server.url)
    assert before["vllm:prefix_cache_queries_total"] > 0
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=60)
    with pytest.raises(RequestError):
        complete(server.url, serve_args.SERVED_NAME, [100, 101, 102], 2, timeout=30)
    assert not server.alive()
