"""Requests to the kit's own servers never go through a proxy, whatever the environment
says; /metrics is read with Prometheus' own text parser."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kit.bench.openai_client import counters, parse_cache_config_info, parse_counters
from kit.bench.serve import wait_healthy

METRICS = (
    "# TYPE vllm:prefix_cache_hits_total counter\n"
    'vllm:prefix_cache_hits_total{engine="0",model_name="a}b"} 10.0 1700000000000\n'
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    'vllm:prefix_cache_queries_total{engine="0"} +Inf\n'
    'vllm:cache_config_info{block_size="2048",prefix_match_unit="16"} 1.0\n'
)


@pytest.fixture
def server():
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def dead_proxy(monkeypatch) -> str:
    """A proxy address where nothing listens (a port bound and never listened on)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(name, url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield url
    sock.close()


def test_loopback_requests_ignore_a_dead_proxy(server: str, dead_proxy: str) -> None:
    import urllib.error
    import urllib.request

    # The default opener would send this to the dead proxy and fail.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server + "/metrics", timeout=30)
    wait_healthy(server, timeout=60)
    assert counters(server)["vllm:prefix_cache_hits_total"] == 10.0


def test_metrics_with_timestamps_inf_and_braces_in_labels() -> None:
    assert parse_counters(METRICS) == {
        "vllm:prefix_cache_hits_total": 10.0,
        "vllm:prefix_cache_queries_total": float("inf"),
    }
    assert parse_cache_config_info(METRICS) == {"block": 2048, "unit": 16}
    # A server that exports its retention has it recorded (0, None or an interval).
    for label, value in (("0", 0), ("None", None), ("4096", 4096)):
        text = METRICS.replace(
            'prefix_match_unit="16"',
            f'prefix_match_unit="16",prefix_cache_retention_interval="{label}"',
        )
        assert parse_cache_config_info(text)["retention"] == value
