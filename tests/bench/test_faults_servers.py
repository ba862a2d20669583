"""Faults around the bench's servers (issue 37's battery): the kit killed with SIGKILL
(its servers must die with it), an engine that dies or fails during start-up (noticed
within seconds, not at the 900 s health timeout), two benches in one checkout (the
second refused at once), and a checkout path with a space (refused up front: torch's
compile step splits its compiler command at spaces).

Most servers here are stand-ins with vLLM's process shape (``tests/bench/fake_server.py``,
or the smaller ``STAND_IN`` below: an API server whose "engine core" child carries
vLLM's process title); one test starts the real tiny-model servers, to show that
vLLM's EngineCore and worker processes are in the server's process group and die
with the kit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kit import bundle
from kit.bench import run as bench
from kit.bench.serve import Server, ServerError
from kit.process_group import group_members
from tests.bench.test_bench_faults import alive, all_pids, start_bench, wait_for

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]

# An API server that starts an "engine core" under vLLM's process title (vLLM sets it
# with setproctitle: VLLM::EngineCore) and first logs the warning vLLM logs where the
# hard open-files limit is under 65535 (it quotes an OSError it only warns about).
# ``dies``: the engine exits after a moment and the API server lives on; ``logs``:
# the engine logs vLLM's start-up failure and hangs (what a checkout path with a
# space does: the worker's compile fails, the engine says so and never exits); in
# both the API server never answers /health. ``forks``: a healthy start whose worker
# forks short-lived children, as torch's compiler and lscpu do (a forked child
# carries its parent's title until it execs or exits).
STAND_IN = r"""
import http.server, os, subprocess, sys, threading, time
mode, state, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("(APIServer pid=1) WARNING 12-06 13:38:30 [system_utils.py:255] Found ulimit of "
      "1024 and failed to automatically increase with error current limit exceeds "
      "maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too "
      "many open files`. Consider increasing with ulimit -n", flush=True)
FORKS = (
    "import os, sys, time\n"
    "forks = os.path.join(sys.argv[1], 'forks')\n"
    "while True:\n"
    "    child = os.fork()\n"
    "    if child == 0:\n"
    "        time.sleep(0.4)\n"
    "        os._exit(0)\n"
    "    with open(forks, 'a') as f:\n"
    "        f.write(f'{child} ')\n"
    "    os.waitpid(child, 0)\n"
)
if mode == "forks":
    engine = subprocess.Popen(["VLLM::Worker", "-c", FORKS, state], executable=sys.executable)
else:
    engine = subprocess.Popen(
        ["VLLM::EngineCore", "-c", "import sys, time; time.sleep(float(sys.argv[1]))",
         "2" if mode == "dies" else "3600"],
        executable=sys.executable,
    )
with open(os.path.join(state, "pids"), "a") as f:
    f.write(f"{engine.pid}\n{os.getpid()}\n")
print("INFO starting the engine", flush=True)
if mode == "logs":
    time.sleep(2)
    prefix = f"(EngineCore pid={engine.pid}) ERROR 12-06 00:50:08 [core.py:1510]"
    print(f"{prefix} EngineCore failed to start.", flush=True)
    print(f"{prefix} Traceback (most recent call last):", flush=True)
    print(f"{prefix} RuntimeError: Worker failed with error 'CppCompileError: C++ "
          "compile error", flush=True)
if mode == "forks":
    time.sleep(4)  # the worker forks meanwhile, as it would while it compiles

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(1)
"""

# `kit bench` with the stand-in above as both servers (the trees are not built).
DRIVER = """
import sys
from pathlib import Path
import kit.bench.serve, kit.vllm_tree.trees
script, mode, state, package = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
def fake(host, port, args):
    folder = state / str(port)
    folder.mkdir(parents=True, exist_ok=True)
    return [sys.executable, script, mode, str(folder), str(port)]
kit.bench.serve.server_command = fake
kit.vllm_tree.trees.pinned = lambda name, target="cpu": kit.vllm_tree.trees.Tree(name, package)
from kit.bench import run as bench
sys.exit(bench.main(sys.argv[5:]))
"""


@pytest.fixture()
def leftovers() -> Iterator[Callable[[list[int]], None]]:
    """Whatever the test registers is SIGKILLed at the end, so a failing test (today's
    code leaves orphans) leaves nothing running for the next."""
    pids: list[int] = []
    yield pids.extend
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def stderr_lines(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.strip()]


# --- 1. kill -9 of the kit: its servers die with it --------------------------------


@pytest.mark.parametrize("when", ["--never-healthy", "--hang"], ids=["start-up", "mid-request"])
def test_kill_9_of_the_bench_stops_every_server_process(
    tmp_path: Path, leftovers, when: str
) -> None:
    """SIGKILL cannot be caught, so the kit cannot stop its servers itself; they must
    still go (mid-request one of them is paused with SIGSTOP, too)."""
    proc, state, _ = start_bench(tmp_path, when)
    if when == "--hang":
        wait_for(lambda: any(state.glob("*/requesting")), proc, "request in flight")
    else:
        wait_for(lambda: len(all_pids(state)) == 6, proc, "both servers started")
    pids = all_pids(state)
    leftovers(pids)
    assert len(pids) == 6 and not [p for p in pids if not alive(p)]
    proc.kill()
    proc.communicate(timeout=60)
    assert wait_gone(pids, 30) == [], "servers outlived the kit"


@pytest.mark.slow
def test_kill_9_of_a_real_bench_stops_vllm_and_its_engine_cores(tmp_path: Path, leftovers) -> None:
    """The real servers: each API server's EngineCore (and worker) processes are
    in the API server's process group, and the whole group goes with the kit."""
    from kit.weights.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", weights=True)
    cmd = [sys.executable, "-m", "kit.bench.run", "--reps", "1", "--shared", "900"]
    cmd += ["--model-dir", str(model), "--out", str(tmp_path / "out")]
    with (tmp_path / "kit.out").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    leftovers([proc.pid])

    def servers() -> list[int]:
        return [
            pid
            for pid, (ppid, command) in _processes().items()
            if ppid == proc.pid and "vllm.entrypoints.openai.api_server" in command
        ]

    def engines(pgid: int) -> list[int]:
        table = _processes()
        return [p for p in group_members(pgid) if "EngineCore" in table.get(p, (0, ""))[1]]

    deadline = time.monotonic() + 900
    while not (len(servers()) == 2 and all(engines(s) for s in servers())):
        assert proc.poll() is None, (tmp_path / "kit.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "no engine cores after 900 s"
        time.sleep(1)
    groups = servers()
    members = [p for g in groups for p in group_members(g)]
    leftovers(members)
    assert len(members) >= 6, members  # API server, resource tracker, engine core each
    proc.kill()
    proc.wait()
    left = wait_gone(members, 30)
    assert left == [], f"vLLM processes outlived the kit: {left}"
    assert [g for g in groups if group_members(g)] == []


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: its parent and its command line (vLLM's titles replace it)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), command)
    return table


# --- 2. an engine that dies or fails during start-up ---------------------------------


def stand_in_server(tmp_path: Path, mode: str, timeout: float = 40) -> tuple[Server, Path]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    state = tmp_path / "state"
    state.mkdir()
    server = Server(
        "patched",
        [],
        tmp_path / "logs" / "server-patched.log",
        command=lambda host, port, args: [sys.executable, str(script), mode, str(state), str(port)],
        startup_timeout=timeout,
    )
    return server, state


@pytest.mark.parametrize("mode", ["dies", "logs"])
def test_a_failed_engine_during_start_up_is_noticed_within_seconds(
    tmp_path: Path, leftovers, mode: str
) -> None:
    """``dies``: the engine core exits, the API server lives on; ``logs``: the engine
    logs vLLM's "EngineCore failed to start." and hangs. Either way the start fails in
    seconds (not at the health timeout), in one line that names the log, and the
    server's processes are gone."""
    server, state = stand_in_server(tmp_path, mode)
    began = time.monotonic()
    with pytest.raises(ServerError) as caught, server:
        pass
    took = time.monotonic() - began
    leftovers(all_pids(tmp_path))
    message = str(caught.value)
    assert took < 20, f"noticed after {took:.0f} s: {message}"
    assert "\n" not in message, message
    assert str(server.log_path) in message, message
    assert "EngineCore" in message, message
    if mode == "logs":
        assert "CppCompileError" in message, message  # the cause, from the log
    assert "Too many open files" not in message, message  # a warning is no cause
    if mode == "dies":
        assert "names no exception" in message, message
    pids = [int(p) for p in (state / "pids").read_text().split()]
    assert wait_gone(pids, 10) == []


def test_a_child_an_engine_forks_is_no_engine_and_its_end_no_death(
    tmp_path: Path, leftovers
) -> None:
    """The worker forks a child every half second while the server starts; each child
    carries ``VLLM::Worker`` for its short life. The start succeeds (the kit once read
    a child's end as the worker's death and failed a healthy start), and stopping the
    server leaves nothing."""
    server, state = stand_in_server(tmp_path, "forks")
    with server:
        forks = (state / "forks").read_text().split()
        assert len(forks) >= 4, forks  # children came and went during the wait
        assert server.alive()
    leftovers(all_pids(tmp_path))
    pids = [int(p) for p in (state / "pids").read_text().split()]
    assert wait_gone(pids, 10) == []


def test_a_bench_whose_engine_dies_says_so_in_one_line(tmp_path: Path, leftovers) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    state, package, model, out = (tmp_path / n for n in ("state", "vllm", "model", "out"))
    for folder in (state, package, model):
        folder.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    cmd = [sys.executable, "-c", DRIVER, str(script), "dies", str(state), str(package)]
    cmd += ["--reps", "1", "--shared", "900", "--model-dir", str(model), "--out", str(out)]
    cmd += ["--startup-timeout", "40"]
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - began
    leftovers(all_pids(state))
    assert done.returncode == 1, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "EngineCore" in lines[0] and "died" in lines[0], lines[0]
    assert str(out / bundle.LOGS / "server-") in lines[0], lines[0]  # the server's log
    assert took < 30, f"{took:.0f} s"
    assert json.loads((out / bundle.FAILED).read_text())["status"] == "failed"
    assert wait_gone(all_pids(state), 10) == []


# --- 3. two benches in one checkout ---------------------------------------------------


def test_a_second_bench_in_the_checkout_is_refused_at_once(tmp_path: Path, leftovers) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, state, _ = start_bench(tmp_path / "a", "--never-healthy")
    try:
        wait_for(lambda: len(all_pids(state)) == 6, first, "the first bench's servers")
        leftovers(all_pids(state))
        second, state_b, out_b = start_bench(tmp_path / "b", "--never-healthy")
        try:
            _, err = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            second.send_signal(signal.SIGTERM)  # it stops its own servers
            second.communicate(timeout=120)
            pytest.fail("the second bench ran beside the first")
        finally:
            leftovers(all_pids(state_b))
    except BaseException:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=120)
        raise
    assert second.returncode == 2, err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"pid {first.pid}" in lines[0] and "another bench" in lines[0], lines[0]
    assert not out_b.exists()  # refused before anything was written
    assert all_pids(state_b) == []  # and before any server started
    assert first.poll() is None and all(alive(p) for p in all_pids(state))
    # The kernel drops the lock with its holder, however it ends.
    first.kill()
    first.communicate(timeout=60)
    with bench.bench_lock():
        pass


def test_the_lock_is_free_again_after_a_bench_ends(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in")
    for _ in range(2):  # a refusal that leaves the lock held would refuse the second
        assert bench.main(["--shared", "900", "8100", "--model-dir", str(model)]) == 2
        assert "another bench" not in capsys.readouterr().err


# --- 4. a checkout path with a space -------------------------------------------------


@pytest.mark.parametrize("where", ["checkout", "python"])
def test_a_path_with_a_space_is_refused_up_front(
    tmp_path: Path, monkeypatch, capsys, where: str
) -> None:
    """torch's inductor splits its g++ command line at spaces (include paths under
    the .venv, the compile cache under the checkout): refused before any folder or
    server, in one line that says to move the checkout."""
    spaced = tmp_path / "my checkout"
    if where == "checkout":
        monkeypatch.setattr(bench, "ROOT", spaced)
    else:
        monkeypatch.setattr(sys, "prefix", str(spaced / ".venv"))
    ran = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: ran.append(a) or 0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in")
    out = tmp_path / "out"
    code = bench.main(["--shared", "900", "--model-dir", str(model), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not ran, err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(spaced) in lines[0] and "space" in lines[0], lines[0]
    assert "move the checkout" in lines[0], lines[0]
    assert not out.exists()
