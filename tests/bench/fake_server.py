"""A stand-in for `vllm serve` with vLLM's process shape: an API server that forks an
"engine core" and a "worker" into its process group, and answers /health, /metrics
(prefix-cache counters and ``vllm:cache_config_info``), /version and /v1/completions.

``python tests/bench/fake_server.py --port P --state DIR [--hang]``: every process writes
its pid to ``DIR/pids``; with ``--hang`` a completion writes ``DIR/requesting`` and
never answers (a bench caught mid-request); with ``--never-healthy`` /health
answers 503 (a bench caught during start-up). /version answers the vLLM release
this process finds, or ``--vllm-version``'s. The children outlive their parent
unless someone signals the group, as vLLM's engine processes do. A server that
starts while a process of another server (a sibling folder of DIR) is alive writes
``DIR/overlap``: a one-server-at-a-time run must leave none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kit.bench import serve_args

METRICS = (
    "# TYPE vllm:prefix_cache_hits_total counter\n"
    'vllm:prefix_cache_hits_total{engine="0"} 0.0\n'
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    'vllm:prefix_cache_queries_total{engine="0"} 0.0\n'
    'vllm:cache_config_info{block_size="2048",prefix_match_unit="16"} 1.0\n'
)
CHILD = "import time\nwhile True: time.sleep(1)\n"


def note_pid(state: Path, pid: int) -> None:
    with (state / "pids").open("a") as f:
        f.write(f"{pid}\n")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def note_overlap(state: Path) -> None:
    others = [
        int(pid)
        for folder in state.parent.iterdir()
        if folder != state and (folder / "pids").is_file()
        for pid in (folder / "pids").read_text().split()
    ]
    running = [pid for pid in others if alive(pid)]
    if running:
        (state / "overlap").write_text(" ".join(map(str, running)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--never-healthy", action="store_true", help="/health answers 503")
    parser.add_argument(
        "--vllm-version", help="what /version answers (default: the vLLM this process finds)"
    )
    args, _ = parser.parse_known_args()
    for _ in ("engine core", "worker"):
        child = subprocess.Popen([sys.executable, "-c", CHILD])
        note_pid(args.state, child.pid)
    import os

    note_pid(args.state, os.getpid())
    note_overlap(args.state)

    version = args.vllm_version or serve_args.client_release()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b"" if self.path == "/health" else METRICS.encode()
            if self.path == "/version":
                body = json.dumps({"version": version}).encode()
            sick = self.path == "/health" and args.never_healthy
            self.send_response(503 if sick else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if args.hang:
                (args.state / "requesting").write_text("1")
                time.sleep(3600)
            chunk = {"choices": [{"token_ids": [1], "logprobs": {}}]}
            usage = {"usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}
            body = (
                "".join(f"data: {json.dumps(c)}\n\n" for c in (chunk, usage)) + "data: [DONE]\n\n"
            )
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
