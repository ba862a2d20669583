"""The few HTTP calls the bench makes: a streamed completion, /metrics, cache reset."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kit.loopback import urlopen

COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
# vLLM's own per-request times, as histograms: the engine's prefill time (from the
# step that schedules the request to the output carrying its first token, both
# stamped in the engine core) and the API server's TTFT (from the request's arrival
# there). The bench sends one request at a time, so a histogram's _sum moved by one
# _count between two readings is that request's time.
ENGINE_TIMES = {
    "engine_prefill_s": "vllm:request_prefill_time_seconds",
    "server_ttft_s": "vllm:time_to_first_token_seconds",
}


class MetricsError(RuntimeError):
    pass


class RequestError(RuntimeError):
    pass


@dataclass
class Completion:
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    # Per generated position: the top-k candidates' log-probabilities by token id.
    top_logprobs: list[dict[int, float]]


TOP_K = 5


def _token_id(key: str) -> int:
    """``return_tokens_as_token_ids`` spells a token as ``token_id:<n>``."""
    try:
        return int(key.rsplit(":", 1)[-1])
    except ValueError as exc:
        raise RequestError(f"unexpected token key {key!r} in top_logprobs") from exc


def complete(
    base_url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 600.0
) -> Completion:
    """Greedy streamed completion over token ids; TTFT at the first chunk with choices."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "logprobs": TOP_K,
            "return_tokens_as_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft = None
    usage = None
    token_ids: list[int] = []
    logprobs: list[float] = []
    top: list[dict[int, float]] = []
    try:
        with urlopen(request, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    raise RequestError(f"server error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    token_ids += choice.get("token_ids") or []
                    lp = choice.get("logprobs") or {}
                    logprobs += lp.get("token_logprobs") or []
                    top += [
                        {_token_id(k): v for k, v in (entry or {}).items()}
                        for entry in lp.get("top_logprobs") or []
                    ]
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (OSError, json.JSONDecodeError) as exc:
        raise RequestError(f"completion request failed: {exc}") from exc
    if ttft is None or usage is None:
        raise RequestError("stream ended without a token or without usage")
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise RequestError(
            "no usage.prompt_tokens_details.cached_tokens; "
            "start the server with --enable-prompt-tokens-details"
        )
    return Completion(
        ttft,
        int(details["cached_tokens"] or 0),
        int(usage["prompt_tokens"]),
        token_ids,
        logprobs,
        top,
    )


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition (name, labels, value), read with
    prometheus_client's parser: timestamps, ``+Inf`` and quoted ``}`` in labels included."""
    try:
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"/metrics does not parse as Prometheus text: {exc}") from exc


def parse_counters(text: str) -> dict[str, float]:
    """Sum the prefix-cache counters over their label sets; refuse what does not parse."""
    totals: dict[str, float] = {}
    for name, _, value in samples(text):
        if name in COUNTERS:
            totals[name] = totals.get(name, 0.0) + value
    missing = [c for c in COUNTERS if c not in totals]
    if missing:
        raise MetricsError(f"/metrics lacks {', '.join(missing)}")
    return totals


def counters(base_url: str) -> dict[str, float]:
    return parse_counters(metrics_text(base_url))


def metrics_text(base_url: str) -> str:
    with urlopen(base_url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def parse_engine_times(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of every histogram in ``ENGINE_TIMES``, summed over label sets,
    keyed by the bench's field name; a histogram the server does not export is left out."""
    wanted = {
        f"{metric}{part}": (field, i)
        for field, metric in ENGINE_TIMES.items()
        for i, part in enumerate(("_sum", "_count"))
    }
    totals: dict[str, list[float]] = {}
    for name, _, value in samples(text):
        if name in wanted:
            field, i = wanted[name]
            totals.setdefault(field, [0.0, 0.0])[i] += value
    return {field: (t[0], t[1]) for field, t in totals.items()}


def one_request_times(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Each ``ENGINE_TIMES`` field's time for the one request between two readings,
    or None where the histogram did not move by exactly one observation."""
    out: dict[str, float | None] = {}
    for field in ENGINE_TIMES:
        b, a = before.get(field), after.get(field)
        one = b is not None and a is not None and a[1] - b[1] == 1
        out[field] = a[0] - b[0] if one else None
    return out


def parse_cache_config_info(text: str) -> dict[str, int | None]:
    """Block size, match unit and, where the server exports it, retention from
    ``vllm:cache_config_info``.

    ``block_size`` is the resolved block (vLLM raises it until an attention page
    holds a Mamba state; in align mode the Mamba block follows it). The API
    server's ``mamba_block_size`` label can still show the value asked for, so
    it is not used. ``retention`` is ``prefix_cache_retention_interval`` (0, the
    server default: semantic checkpoints only; None: dense; a positive interval),
    which decides which Mamba block states stay keyed (``geometry_model.expected``).
    """
    for name, labels, _ in samples(text):
        if name == "vllm:cache_config_info":
            block = labels.get("block_size", "")
            unit = labels.get("prefix_match_unit", "")
            if not (block.isdigit() and unit.isdigit()):
                raise MetricsError(f"vllm:cache_config_info lacks block sizes: {labels}")
            found: dict[str, int | None] = {"block": int(block), "unit": int(unit)}
            retention = labels.get("prefix_cache_retention_interval")
            if retention is not None:
                if retention != "None" and not retention.isdigit():
                    raise MetricsError(f"vllm:cache_config_info: retention {retention!r}")
                found["retention"] = None if retention == "None" else int(retention)
            return found
    raise MetricsError("/metrics has no vllm:cache_config_info")


def cache_config_info(base_url: str) -> dict[str, int | None]:
    with urlopen(base_url + "/metrics", timeout=30) as resp:
        return parse_cache_config_info(resp.read().decode())


def served_release(base_url: str) -> str:
    """The vLLM release a server runs (its ``/version``; a local label such as
    ``+cu130`` names the same release)."""
    try:
        with urlopen(base_url + "/version", timeout=30) as resp:
            version = json.loads(resp.read().decode())["version"]
    except (OSError, ValueError, KeyError) as exc:
        raise RequestError(f"{base_url}/version: no vLLM version ({exc})") from exc
    return str(version).split("+", 1)[0]


def reset_prefix_cache(base_url: str) -> None:
    request = urllib.request.Request(base_url + "/reset_prefix_cache", b"", method="POST")
    with urlopen(request, timeout=60) as resp:
        if resp.status != 200:
            raise RequestError(f"/reset_prefix_cache answered {resp.status}")
