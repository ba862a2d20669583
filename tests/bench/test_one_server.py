"""One server at a time (``kit.bench.one_server``): the A B B A block schedule, the
session records and their merge, a host run whose servers never overlap, the
container flow's session protocol against running servers, and the flow choosing it
where two servers of the model do not fit."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kit import bundle, schema
from kit.bench import one_server, serve_args
from kit.bench import run as bench
from kit.bench.plan import BenchPlanError
from kit.bench.serve import free_port, wait_healthy
from kit.bench.ttft import TREES
from kit.images import hostcheck, orchestrate
from tests.images.test_orchestrate import _entry  # one stand-in models.lock entry

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ROOT / "tests" / "data" / "hosts"
STAND_IN = "tests/bench/fake_server.py"  # vLLM's process shape, run from ROOT


# --- the schedule ---------------------------------------------------------------


def test_blocks_alternate_a_b_b_a_and_neighbours_share_a_server() -> None:
    assert one_server.sessions(4, 1) == [
        ("unpatched", (0,)),
        ("patched", (0, 1)),
        ("unpatched", (1, 2)),
        ("patched", (2, 3)),
        ("unpatched", (3,)),
    ]
    assert one_server.sessions(1, 2) == [("unpatched", (0,)), ("patched", (0,))]


@pytest.mark.parametrize("reps", range(1, 13))
@pytest.mark.parametrize("block", range(1, 5))
def test_every_tree_measures_every_repetition_once(reps: int, block: int) -> None:
    plan = one_server.sessions(reps, block)
    for tree in TREES:
        got = sorted(r for t, rs in plan for r in rs if t == tree)
        assert got == list(range(reps))
    assert [t for t, _ in plan] == [TREES[i % 2] for i in range(len(plan))]  # alternating
    # Each block boundary lets one pair of neighbouring sessions share a server.
    assert len(plan) == math.ceil(reps / block) + 1


def test_a_session_argument_names_its_tree_and_repetitions() -> None:
    assert one_server.parse_session("patched:0,3", 4) == ("patched", (0, 3))
    for bad, words in [
        ("patched", "TREE:REPS"),
        ("other:0", "TREE:REPS"),
        ("patched:a", "integers"),
        ("patched:4", "from 0 to 3"),
        ("patched:1,1", "once"),
    ]:
        with pytest.raises(ValueError, match=words):
            one_server.parse_session(bad, 4)


def _record(tree: str, reps: tuple[int, ...], block: int = 2048) -> dict:
    rows = [
        {"tree": tree, "rep": r, "S": s, "kind": "cold_A", "ttft_s": 0.1}
        for r in reps
        for s in (900, 1007)
    ]
    reported = {"block": block, "unit": 16}
    return one_server.record(tree, reps, [900, 1007], reported, rows, {"url": "http://x:1"})


def test_the_merge_needs_every_repetition_on_both_trees_and_one_geometry() -> None:
    records = [_record(t, r) for t, r in one_server.sessions(3, 1)]
    rows, reported = one_server.merge(records, 3, [900, 1007])
    assert reported == {"block": 2048, "unit": 16} and len(rows) == 2 * 3 * 2
    assert [(r["rep"], r["S"], r["tree"]) for r in rows][:2] == [
        (0, 900, "unpatched"),
        (0, 900, "patched"),
    ]
    with pytest.raises(one_server.SessionError, match="each tree needs"):
        one_server.merge(records[:-1], 3, [900, 1007])
    with pytest.raises(one_server.SessionError, match="geometry differs"):
        one_server.merge(
            [*records[:-1], _record(*one_server.sessions(3, 1)[-1], 1024)], 3, [900, 1007]
        )
    with pytest.raises(one_server.SessionError, match="measured S"):
        one_server.merge(records, 3, [900])


def test_session_records_carry_their_schema(tmp_path: Path) -> None:
    path = one_server.write(tmp_path / "01-unpatched", _record("unpatched", (0,)))
    assert json.loads(path.read_text())["schema"] == {"name": "bench-session", "version": 1}
    assert one_server.read([tmp_path / "01-unpatched"])[0]["tree"] == "unpatched"
    with pytest.raises(one_server.SessionError, match="no session record"):
        one_server.read([tmp_path / "02-patched"])


# --- bench arguments -------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--session", "patched:0", "--out", "x"], "--server-url patched=URL"),
        (
            ["--session", "patched:0", "--server-url", "unpatched=http://h:1", "--out", "x"],
            "--server-url patched=URL",
        ),
        (["--one-server", "--merge-sessions", "a", "--out", "x"], "give one of them"),
        (["--merge-sessions", "a"], "needs --out"),
    ],
)
def test_bad_one_server_arguments_are_refused(argv: list[str], words: str) -> None:
    with pytest.raises(BenchPlanError, match=words):
        bench.parse_args(argv)


def test_a_block_of_no_repetitions_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--one-server", "--block-reps", "0"])
    assert exit_.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err


# --- a host run with stand-in servers ------------------------------------------------

DRIVER = """
import sys
from pathlib import Path
import kit.bench.serve, kit.bench.ttft, kit.bundle, kit.vllm_tree.trees
state, package = Path(sys.argv[1]), Path(sys.argv[2])
def fake(host, port, args):
    folder = state / str(port)
    folder.mkdir(parents=True, exist_ok=True)
    stand_in = "tests/bench/fake_server.py"
    return [sys.executable, stand_in, "--port", str(port), "--state", str(folder)]
kit.bench.serve.server_command = fake
kit.vllm_tree.trees.pinned = lambda name, target="cpu": kit.vllm_tree.trees.Tree(name, package)
kit.bundle.record_environment = lambda out: {}
kit.bench.ttft.IDLE_GAP_S = 0
from kit.bench import run as bench
sys.exit(bench.main(sys.argv[3:]))
"""


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"stand-in weights")
    return folder


@pytest.mark.slow
def test_a_host_run_starts_one_server_at_a_time(tmp_path: Path) -> None:
    state, package, out = tmp_path / "state", tmp_path / "vllm", tmp_path / "out"
    state.mkdir()
    package.mkdir()
    cmd = [sys.executable, "-c", DRIVER, str(state), str(package), "--one-server"]
    cmd += ["--block-reps", "1", "--reps", "2", "--shared", "900", "--record-only"]
    cmd += ["--model-dir", str(_model(tmp_path / "m")), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # Sessions U[0] P[0,1] U[1]: three servers, each alone.
    logs = sorted(p.name for p in (out / bundle.LOGS).glob("server-*.log"))
    assert logs == ["server-patched-2.log", "server-unpatched-1.log", "server-unpatched-3.log"]
    assert not list(state.glob("*/overlap")), "two servers ran at once"
    report = json.loads((out / bundle.BENCH).read_text())
    assert schema.check("bench", report, "bench.json") is report
    assert report["one_server"]["sessions"] == [
        {"tree": "unpatched", "reps": [0]},
        {"tree": "patched", "reps": [0, 1]},
        {"tree": "unpatched", "reps": [1]},
    ]
    rows = json.loads((out / bundle.RAW).read_text())
    assert sorted({(r["tree"], r["rep"]) for r in rows}) == sorted(
        (t, r) for t in TREES for r in (0, 1)
    )
    assert "one at a time" in (out / bundle.BENCH_MD).read_text()


@pytest.mark.slow
def test_the_interleaved_run_overlaps_so_the_check_can_fail(tmp_path: Path) -> None:
    # The overlap check of the test above, shown to fire where servers do overlap.
    state, package, out = tmp_path / "state", tmp_path / "vllm", tmp_path / "out"
    state.mkdir()
    package.mkdir()
    cmd = [sys.executable, "-c", DRIVER, str(state), str(package), "--reps", "1"]
    cmd += ["--shared", "900", "--record-only", "--model-dir", str(_model(tmp_path / "m"))]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(state.glob("*/overlap"))  # one or both, as they start at once


# --- the container flow's protocol: sessions against running servers, then the merge -----


@pytest.fixture()
def running_server(tmp_path: Path):
    started = []

    def start(tree: str, *extra: str) -> str:
        port = free_port()
        folder = tmp_path / "servers" / f"{tree}-{port}"
        folder.mkdir(parents=True)
        proc = subprocess.Popen(
            [sys.executable, STAND_IN, "--port", str(port), "--state", str(folder), *extra],
            cwd=ROOT,
            start_new_session=True,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60, name=tree)
        return url

    yield start
    for proc in started:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_session_records_merge_into_one_bundle(tmp_path: Path, running_server, monkeypatch) -> None:
    from kit.bench import ttft

    monkeypatch.setattr(ttft, "IDLE_GAP_S", 0)
    monkeypatch.setattr(bundle, "record_environment", lambda out: {})
    model = _model(tmp_path / "m")
    common = ["--reps", "2", "--shared", "900", "--model-dir", str(model), "--record-only"]
    folders = []
    for index, (tree, reps) in enumerate(one_server.sessions(2, 1), 1):
        url = running_server(tree)  # a fresh server per session, as the flow starts one
        folder = tmp_path / "out" / "sessions" / f"{index:02d}-{tree}"
        session = f"{tree}:{','.join(map(str, reps))}"
        argv = [*common, "--server-url", f"{tree}={url}", "--session", session]
        assert bench.main([*argv, "--out", str(folder)]) == 0
        folders.append(str(folder))
        assert not (folder / bundle.BENCH).exists()  # a record, not a bundle
    out = tmp_path / "out"
    argv = [*common, "--block-reps", "1", "--merge-sessions", *folders, "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads((out / bundle.BENCH).read_text())
    assert [s["tree"] for s in report["one_server"]["sessions"]] == [
        "unpatched",
        "patched",
        "unpatched",
    ]
    assert set(report["run"]["servers"]) == set(TREES)
    # A missing session is refused, naming what is missing.
    bad = tmp_path / "bad"
    argv = [*common, "--merge-sessions", *folders[:-1], "--out", str(bad)]
    assert bench.main(argv) == 1
    assert "each tree needs" in json.loads((bad / bundle.FAILED).read_text())["reason"]


def test_a_server_of_another_release_is_refused(tmp_path: Path, running_server) -> None:
    """The expected hits follow the hashing of the vLLM the client finds, so a server
    given by URL that runs another release is refused in one line, before any
    request, naming both releases."""
    url = running_server("patched", "--vllm-version", "0.99.0+cu130")
    out = tmp_path / "out"
    argv = ["--reps", "1", "--shared", "900", "--model-dir", str(_model(tmp_path / "m"))]
    argv += ["--server-url", f"patched={url}", "--session", "patched:0", "--out", str(out)]
    assert bench.main(argv) == 1
    reason = json.loads((out / bundle.FAILED).read_text())["reason"]
    here = serve_args.client_release()
    assert f"the server runs vLLM 0.99.0 and this client finds vLLM {here}" in reason
    assert "\n" not in reason


# --- the flow chooses it ---------------------------------------------------------------


def test_the_flow_runs_one_server_where_two_do_not_fit(capsys) -> None:
    mem = hostcheck.host_record(hostcheck.Probe(HOSTS / "strix-ok"))["mem_total_gib"]
    gib = hostcheck.GIB
    plan = argparse.Namespace(one_server=False, block_reps=2)
    # Strix Halo, BF16 35B: two do not fit, one does -> one at a time, said why.
    orchestrate.choose_servers(plan, _entry("bf16-35b", 67, 4 * gib), mem)
    assert plan.one_server
    assert "2 x (67 GiB weights" in capsys.readouterr().out
    # The FP8 checkpoint fits twice: both at once.
    plan = argparse.Namespace(one_server=False, block_reps=2)
    orchestrate.choose_servers(plan, _entry("fp8-35b", 36, 8 * gib), mem)
    assert not plan.one_server
    # Not even one fits: refused with the numbers.
    with pytest.raises(orchestrate.PlanError, match="1 x \\(130 GiB weights"):
        orchestrate.choose_servers(plan, _entry("huge", 130, 4 * gib), mem)
