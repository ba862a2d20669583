"""Faults during a bench run: signals and a server that dies. The kit's own bench
command runs in a subprocess; only the server command is a stand-in
(``tests/bench/fake_server.py``: vLLM's process shape, an API server whose engine-core
and worker children outlive it unless its group is signalled), so each test takes
seconds instead of two real vLLM start-ups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit import bundle
from kit.bench import run as bench
from kit.bench.plan import BenchPlanError
from kit.process_group import group_members

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import sys
from pathlib import Path
import kit.bench.serve, kit.vllm_tree.trees
state, package = Path(sys.argv[1]), Path(sys.argv[2])
def fake(host, port, args):
    folder = state / str(port)
    folder.mkdir(parents=True, exist_ok=True)
    hang = [a for a in ("--hang", "--never-healthy") if a in sys.argv]
    script = "tests/bench/fake_server.py"
    return [sys.executable, script, "--port", str(port), "--state", str(folder), *hang]
kit.bench.serve.server_command = fake
kit.vllm_tree.trees.pinned = lambda name, target="cpu": kit.vllm_tree.trees.Tree(name, package)
from kit.bench import run as bench
argv = [a for a in sys.argv[3:] if a not in ("--hang", "--never-healthy")]
sys.exit(bench.main(argv))
"""


def start_bench(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    state, package, model, out = (tmp_path / n for n in ("state", "vllm", "model", "out"))
    for folder in (state, package, model):
        folder.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    cmd = [sys.executable, "-c", DRIVER, str(state), str(package)]
    cmd += ["--reps", "1", "--shared", "900", "--model-dir", str(model), "--out", str(out), *extra]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return proc, state, out


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    """Poll until ``condition``; a safety net of minutes, not a timing assertion."""
    deadline = time.monotonic() + 300
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"bench exited ({proc.returncode}) before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what}")
        time.sleep(0.1)


def all_pids(state: Path) -> list[int]:
    return [int(p) for f in state.glob("*/pids") for p in f.read_text().split()]


def state_letter(pid: int) -> str:
    """A process's /proc state letter; "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return state_letter(pid) not in ("", "Z")


def fake_server(tree: str, tmp_path: Path, state: Path):
    """A kit Server whose command is the stand-in (``tests/bench/fake_server.py``)."""
    from kit.bench.serve import Server

    state.mkdir()
    return Server(
        tree,
        [],
        tmp_path / "log",
        command=lambda host, port, args: [
            sys.executable,
            "tests/bench/fake_server.py",
            "--port",
            str(port),
            "--state",
            str(state),
        ],
        startup_timeout=300,
    )


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_request_stops_every_server_process(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    proc, state, out = start_bench(tmp_path, "--hang")
    wait_for(lambda: any(state.glob("*/requesting")), proc, "request in flight")
    pids = all_pids(state)
    assert len(pids) == 6  # two servers, each with an engine core and a worker
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    assert [p for p in pids if alive(p)] == []
    failed = json.loads((out / bundle.FAILED).read_text())
    assert failed["status"] == "interrupted"
    assert signal.Signals(sig).name in failed["reason"]
    assert not (out / bundle.BENCH).exists()


def test_a_signal_during_start_up_stops_both_starting_servers(tmp_path: Path) -> None:
    """Both servers are starting (their health waits run in threads): SIGTERM ends both
    waits at once instead of after the start-up timeout, and both trees are gone."""
    proc, state, out = start_bench(tmp_path, "--never-healthy")
    wait_for(lambda: len(all_pids(state)) == 6, proc, "both servers started")
    pids = all_pids(state)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # the start-up timeout is 900 s
    assert proc.returncode == 143, err
    assert [p for p in pids if alive(p)] == []
    assert json.loads((out / bundle.FAILED).read_text())["status"] == "interrupted"


def test_a_dead_server_leaves_no_orphan_and_is_named(tmp_path: Path) -> None:
    proc, state, out = start_bench(tmp_path, "--hang")
    wait_for(lambda: any(state.glob("*/requesting")), proc, "request in flight")
    (hung,) = [p.parent for p in state.glob("*/requesting")]
    leader = int((hung / "pids").read_text().split()[-1])  # the API server writes last
    children = [int(p) for p in (hung / "pids").read_text().split()[:-1]]
    pids = all_pids(state)
    os.kill(leader, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    # The error names the server (its tree and URL) and what became of it.
    assert "server (" in err and f"127.0.0.1:{hung.name}" in err, err
    assert "exited with -9" in err, err
    # The dead server's engine core and worker went with it, and so did the other server.
    assert [p for p in children + pids if alive(p)] == []
    assert json.loads((out / bundle.FAILED).read_text())["status"] == "failed"


def test_stop_kills_a_group_whose_leader_already_died(tmp_path: Path) -> None:
    """The orphan case in one process tree, without the bench."""
    state = tmp_path / "s"
    server = fake_server("unpatched", tmp_path, state)
    with server:
        pids = [int(p) for p in (state / "pids").read_text().split()]
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        assert len(group_members(server.process.pid)) == 2  # orphans, until stop()
    assert group_members(server.process.pid) == []
    assert [p for p in pids if alive(p)] == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--reps", "0"], "--reps: 0 must be 1 or more"),
        (["--reps", "-3"], "--reps: -3 must be 1 or more"),
        (["--shared", "-5"], "--shared: -5 must be 1 or more"),
        (["--shared", "9x"], "--shared: '9x' is not a whole number"),
    ],
)
def test_bad_numbers_are_refused_by_the_parser(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--server-url", "http://x"], "write TREE=URL"),
        (["--server-url", "unpatched=host:1", "--server-url", "patched=x"], "not an http://"),
        (["--server-url", "unpatched=http://h:1"], "needs both unpatched=URL and patched=URL"),
    ],
)
def test_bad_arguments_are_refused_before_any_server(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(BenchPlanError, match=message):
        bench.parse_args(argv)
    # kit bench says it in one line and exits 2.
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_a_context_past_the_model_length_is_refused(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in")
    assert bench.main(["--shared", "900", "8100", "--model-dir", str(model)]) == 2
    err = capsys.readouterr().err
    assert "--shared 8100" in err and f"S <= {8192 - bench.longest_prompt(0)}" in err


def test_out_into_an_existing_bundle_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / bundle.BENCH).write_text("{}")
    with pytest.raises(BenchPlanError, match="already holds a bench run"):
        bench.parse_args(["--out", str(tmp_path)])


def test_a_port_taken_before_the_server_binds_it_is_retried(tmp_path: Path, monkeypatch) -> None:
    """free_port's answer can be taken by another process before the server binds it:
    the server's start sees "Address already in use" and starts again on another port."""
    import socket

    from kit.bench import serve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], serve.free_port()])
    monkeypatch.setattr(serve, "free_port", lambda: next(ports))
    state = tmp_path / "s"
    server = fake_server("patched", tmp_path, state)
    try:
        with server:
            assert server.port != taken.getsockname()[1]
            assert server.alive()
    finally:
        taken.close()
    assert [p for p in all_pids(tmp_path) if alive(p)] == []


def test_a_paused_server_stops_whole_and_still_stops_cleanly(tmp_path: Path) -> None:
    """The bench pauses the tree it is not measuring (SIGSTOP to the server's
    group): every process of it stops, resumes, and a server left paused (a fault
    mid-run) still stops on SIGTERM, leaving no process behind."""
    state = tmp_path / "s"
    server = fake_server("patched", tmp_path, state)
    with server:
        assert server.can_pause()
        pids = [server.process.pid, *(int(p) for p in (state / "pids").read_text().split())]
        server.pause()
        assert {state_letter(p) for p in pids} == {"T"}
        server.resume()
        assert "T" not in {state_letter(p) for p in pids}
        server.pause()
    assert group_members(server.process.pid) == []
    assert [p for p in pids if alive(p)] == []
    # Stopped by SIGTERM after SIGCONT, not left for SIGKILL: the stand-in's
    # return code is SIGTERM's.
    assert server.process.returncode == -signal.SIGTERM
