"""Start and stop a `vllm serve` process on loopback: free port, health wait, logs, cleanup.

The server always stops: on normal exit, on failure, on Ctrl-C and on SIGTERM
(``kit.bench.run`` turns SIGTERM into an exception), by signalling its whole process
group (vLLM forks engine-core and worker processes) and waiting until no member
of the group is left, also when the API server itself already died. Where the kit
cannot stop it (``kill -9`` of the kit), the server's watchdog does
(``kit.process_group.Watchdog``).

A start-up that cannot succeed fails within seconds, not at the health timeout:
the API server exits, one of vLLM's engine processes dies while the API server
lives on, or vLLM logs that its engine failed (the engine then may hang instead of
exiting: a checkout path with a space fails torch's compile step that way).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from kit.loopback import urlopen
from kit.process_group import (
    ProcessGroupError,
    Watchdog,
    group_members,
    parent_pid,
    pause_group,
    process_title,
    resume_group,
    stop_group,
)
from kit.vllm_tree.trees import Tree

PORT_IN_USE = "Address already in use"
PORT_ATTEMPTS = 3
# vLLM's process titles (``VLLM::EngineCore``, ``VLLM::Worker_TP0``; set with
# setproctitle) of the processes a server cannot serve without.
ENGINE_TITLES = ("EngineCore", "Worker")
# vLLM's log lines for an engine that will not serve. The engine may hang after the
# first instead of exiting (seen with torch's failed compile step), and the API
# server then waits for it.
ENGINE_FAILED = (
    "EngineCore failed to start",
    "EngineCore encountered a fatal error",
    "engine core exited unexpectedly",
    "Engine core initialization failed",
)
# A log line that names an exception: the cause an error quotes.
EXCEPTION_LINE = re.compile(r"\b(?:[A-Z]\w*)?(?:Error|Exception): .*")
# A record vLLM logs below ERROR. Such a record may quote an exception it only warns
# about (its ulimit warning names "OSError: [Errno 24] Too many open files" whenever
# the hard limit is under 65535), so it is never an error's cause.
NOT_AN_ERROR = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d\b")
ENGINE_DIED = "died during start-up"
# A start that failed: the server never served, so its stop need not wait long for
# a graceful exit (a hung engine ignores SIGTERM; SIGKILL comes after this).
FAILED_START_GRACE = 5.0


class ServerError(RuntimeError):
    pass


def engine_processes(pids: list[int]) -> dict[int, str]:
    """Which of ``pids`` are vLLM engine processes, with their titles. A child that an
    engine forked carries its parent's title until it execs (torch's C++ compiler,
    lscpu) or exits, seconds later: it is not an engine, and its end is no engine's
    death."""
    engines = {}
    for pid in pids:
        title = process_title(pid)
        if not title.partition("::")[2].startswith(ENGINE_TITLES):
            continue
        parent = parent_pid(pid)
        if parent is not None and process_title(parent) == title:
            continue
        engines[pid] = title
    return engines


def free_port() -> int:
    """A port nobody listens on now. Another process can still take it before vLLM
    binds it; ``Server.start`` retries on another port when that happens."""
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


def wait_healthy(
    url: str, timeout: float, alive: Callable[[], bool] = lambda: True, name: str = "server"
) -> None:
    """Poll ``/health`` until it answers 200; ``alive`` says whether waiting still makes sense."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"{name}: exited during startup")
        try:
            with urlopen(url + "/health", timeout=5) as resp:
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
    # The command line (default: ``server_command``); tests put a stand-in process
    # tree here.
    command: Callable[[str, int, list[str]], list[str]] | None = None
    # The server under test of the bench's A/B pair (``kit.bench.plan.carries_fix``):
    # started with the fix's switches, expected the fix's hits.
    fix: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopping: bool = field(default=False, repr=False)
    _watchdog: Watchdog | None = field(default=None, repr=False)
    # Start-up: vLLM's engine processes seen so far (pid: title), and how far the
    # log has been read for ENGINE_FAILED.
    _engines: dict[int, str] = field(default_factory=dict, repr=False)
    _log_read: int = field(default=0, repr=False)

    @property
    def url(self) -> str:
        return self.url_override or f"http://127.0.0.1:{self.port}"

    def describe(self) -> str:
        where = f"{self.tree}" if self.tree else "the installed vllm"
        return f"{self.name} server ({where}, {self.url})"

    def start(self) -> Server:
        fixed = bool(self.port)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = self.port if fixed else free_port()
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except ServerError:
                # Another process took the free port between our check and
                # vLLM's bind: try another one (a fixed port is the caller's).
                if fixed or attempt == PORT_ATTEMPTS or PORT_IN_USE not in self.log_tail(40):
                    raise
                print(f"{self.name}: port {self.port} was taken; retrying", file=sys.stderr)
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        env = server_env(self.env, self.tree)
        cmd = (self.command or server_command)("127.0.0.1", self.port, self.args)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            # stop() from another thread (a signal) must not race a start.
            if self._stopping:
                raise ServerError(f"{self.name}: stopped before it started")
            self.log_path.write_text("$ " + " ".join(cmd) + "\n")
            # The watchdog first: the server's environment carries its token.
            watchdog = Watchdog(self.log_path)
            try:
                # Appending, as the watchdog does: neither overwrites the other's lines.
                with self.log_path.open("a") as log:
                    self.process = subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**env, **watchdog.env()},
                        start_new_session=True,
                    )
            except BaseException:
                watchdog.release()
                raise
            watchdog.watch(self.process.pid)
            self._watchdog = watchdog
            self._engines, self._log_read = {}, 0

    def _wait_healthy(self) -> None:
        problem: str | None = None

        def fine() -> bool:
            nonlocal problem
            problem = self._startup_problem()
            return problem is None

        try:
            wait_healthy(self.url, self.startup_timeout, fine, self.name)
        except ServerError as exc:
            cause = self._cause()  # before the stop adds its own lines to the log
            self._kill(FAILED_START_GRACE)
            what = problem or f"not healthy after {self.startup_timeout:.0f} s"
            if not cause and problem and ENGINE_DIED in problem:
                # A process killed from outside (the out-of-memory killer) writes no
                # traceback; say so rather than leave the reader searching the log.
                cause = "; its log names no exception (was it killed, by the OOM killer?)"
            # One line: what happened, vLLM's own words for why, where to read more.
            raise ServerError(
                f"{self.describe()}: {what}{cause}; its log: {self.log_path}"
            ) from exc

    def _startup_problem(self) -> str | None:
        """Why waiting for /health is pointless now, or None: the API server exited,
        an engine process of vLLM's died (the API server can outlive it), or vLLM
        logged that its engine failed."""
        if self._stopping:
            return "stopped during start-up"
        if self.process is None:
            return "never started"
        code = self.process.poll()
        if code is not None:
            return f"exited with {code} during start-up"
        live = group_members(self.process.pid)
        # An engine is dead when its process is, not when its title changed: a fork
        # in flight (torch's compiler, lscpu) is no engine, and one that exec'd is
        # simply no longer one.
        gone = {pid: title for pid, title in self._engines.items() if pid not in live}
        self._engines = engine_processes(live)
        if gone:
            pid, title = next(iter(gone.items()))
            return f"its engine process {title} (pid {pid}) {ENGINE_DIED}"
        failed = self._new_log_line(ENGINE_FAILED)
        if failed:
            return f"vLLM logged {failed!r} during start-up (its engine will not serve)"
        return None

    def _new_log_line(self, words: tuple[str, ...]) -> str | None:
        """The first of ``words`` in the log's lines written since the last call."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_read)
                text = log.read()
        except OSError:
            return None
        # Only whole lines; a line still being written is read next time.
        text = text[: text.rfind(b"\n") + 1]
        self._log_read += len(text)
        lines = text.decode(errors="replace").splitlines()
        return next((w for line in lines for w in words if w in line), None)

    def _cause(self) -> str:
        """The last exception the log names (vLLM's root cause, usually), as
        ``; cause: ...``; "" when it names none."""
        for line in reversed(self.log_tail(200).splitlines()):
            found = None if NOT_AN_ERROR.search(line) else EXCEPTION_LINE.search(line)
            if found:
                return f"; cause: {found.group(0).strip()[:300]}"
        return ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def health(self) -> str:
        """What happened to this server, for an error that names it."""
        if self.url_override:
            return f"{self.describe()}"
        if self.process is None:
            return f"{self.describe()}: never started"
        try:
            # A server that just dropped a connection may still be exiting.
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        state = "still running" if code is None else f"exited with {code}"
        return f"{self.describe()}: {state}; last log lines ({self.log_path}):\n{self.log_tail()}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def can_pause(self) -> bool:
        """Whether ``pause`` can stop this server: only a server whose process group
        the kit started (not one it reaches by URL, e.g. in a container)."""
        return self.url_override is None and self.alive()

    def pause(self) -> None:
        """Stop the whole server (API server, engine core, workers) with SIGSTOP, so
        it takes no CPU while the other tree is measured; ``resume`` continues it.
        A server that already exited is left alone: its next request says so."""
        with self._lock:
            if self._stopping or self.process is None:
                return
            with suppress(ProcessLookupError):
                pause_group(self.process.pid)

    def resume(self) -> None:
        with self._lock:
            if self.process is None:
                return
            with suppress(ProcessLookupError):
                resume_group(self.process.pid)

    def stop(self, grace: float = 20.0) -> None:
        """Stop the whole process tree, also when the API server itself already exited
        (its engine core and workers stay in its group)."""
        with self._lock:
            self._stopping = True
        self._kill(grace)

    def _kill(self, grace: float = 20.0) -> None:
        process = self.process
        if process is None:
            return
        try:
            stop_group(process.pid, grace)
            process.wait(timeout=grace)
        except ProcessGroupError as exc:
            self._release_watchdog(stopped=False)  # it keeps trying after the kit
            raise ServerError(f"{self.describe()}: {exc}") from exc
        except subprocess.TimeoutExpired:  # a leader that outlived SIGKILL
            self._release_watchdog(stopped=False)
            raise ServerError(f"{self.describe()}: pid {process.pid} survived SIGKILL") from None
        self._release_watchdog()

    def _release_watchdog(self, stopped: bool = True) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.release(stopped)  # safe twice (a stop and a failed start at once)

    def __enter__(self) -> Server:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
