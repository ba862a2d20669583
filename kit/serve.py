"""Start and stop a `vllm serve` process on loopback: free port, health wait, logs, cleanup.

The server always stops: on normal exit, on failure and on Ctrl-C, by signalling
its whole process group (vLLM forks engine and worker processes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kit.trees import Tree


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(host: str, port: int, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        host,
        "--port",
        str(port),
        *args,
    ]


def server_env(extra: dict[str, str], tree: Tree | None = None) -> dict[str, str]:
    """A server's environment; with ``tree`` its vllm is that tree's, else the installed one."""
    env = tree.env(**extra) if tree else dict(os.environ, **extra)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache (the cold reference)
    return env


def wait_healthy(url: str, timeout: float, alive=lambda: True, name: str = "server") -> None:
    """Poll ``/health`` until it answers 200; ``alive`` says whether waiting still makes sense."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"{name}: exited during startup")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise ServerError(f"{name}: not healthy after {timeout:.0f} s at {url}")


@dataclass
class Server:
    """One vLLM OpenAI-compatible server; use as a context manager."""

    name: str
    args: list[str]
    log_path: Path
    tree: Tree | None = None  # None: the vllm installed here (the images)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 600.0
    port: int = 0
    process: subprocess.Popen | None = None
    # A server someone else runs (e.g. in a container): only its URL is used.
    url_override: str | None = None

    @property
    def url(self) -> str:
        return self.url_override or f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.port = self.port or free_port()
        env = server_env(self.env, self.tree)
        cmd = server_command("127.0.0.1", self.port, self.args)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, self.startup_timeout, self.alive, self.name)
        except ServerError as exc:
            died = not self.alive()
            self.stop()
            if died:
                raise ServerError(
                    f"{self.name}: server exited with {self.process.returncode} "
                    f"during startup; last log lines:\n{self.log_tail()}"
                ) from exc
            raise ServerError(f"{exc}; log: {self.log_path}") from exc

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=grace)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Server:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
