"""Fixtures the bench's tests share."""

from __future__ import annotations

import pytest

from kit.bench import ttft
from kit.bench.openai_client import Completion


@pytest.fixture()
def no_server(monkeypatch) -> None:
    """ttft's requests answered in-process: cached tokens as the expectation of the
    request kind the bench sends next (the rows' path is what is under test)."""

    def complete(url, model, prompt, max_tokens, **_):
        return Completion(0.01, 0, len(prompt), [7] * max_tokens, [-0.1] * max_tokens, [{7: -0.1}])

    monkeypatch.setattr(ttft, "complete", complete)
    # A /metrics with the counters and without vLLM's time histograms.
    monkeypatch.setattr(
        ttft,
        "metrics_text",
        lambda url: "vllm:prefix_cache_hits_total 0\nvllm:prefix_cache_queries_total 0\n",
    )
    monkeypatch.setattr(ttft, "reset_prefix_cache", lambda url: None)
    monkeypatch.setattr(ttft, "IDLE_GAP_S", 0)
