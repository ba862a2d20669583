"""``kit bench``'s plan (``kit.bench.plan``): one frozen value from the command line,
its defaults, each refusal in one line, the checkpoint path as one value, the step
budget passed as a value, the run modes, and every child's command line (a server, the
client, a one-server session's client, the merge) making the same plan again, in the
container flow too."""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from kit.bench import one_server, oracle, serve_args
from kit.bench import plan as bench_plan
from kit.bench import run as bench
from kit.bench.plan import (
    DEFAULT_SHARED,
    SERVING,
    BenchPlan,
    BenchPlanError,
    ClientRole,
    MergeRole,
    ServerRole,
    SessionRole,
    child_argv,
    child_plan,
    to_argv,
)
from kit.bench.serve_args import CHECKPOINT_ENV as ENV
from kit.bench.serve_args import LOCKED_BATCHED_TOKENS, PATHS
from kit.images import orchestrate
from kit.images.containers import Network
from kit.weights import models

pytestmark = pytest.mark.cpu

Q35 = "qwen3_5_moe"
URLS = (("unpatched", "http://u:8001"), ("patched", "http://p:8002"))


@pytest.fixture(autouse=True)
def _no_switch(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


# --- the plan from the command line ------------------------------------------------


def test_the_default_plan() -> None:
    plan = bench.parse_args([])
    assert plan == BenchPlan()
    assert (plan.reps, plan.shared, plan.block, plan.unit, plan.num_spec) == (
        10,
        DEFAULT_SHARED,
        serve_args.CPU_BLOCK,
        16,
        1,
    )
    assert plan.checkpoints == "internal" and plan.path is PATHS["internal"]
    assert plan.budget == 8192 and dict(plan.path.env) == {ENV: "1"}
    assert plan.path.regime == "internal-1"
    assert plan.arch == "qwen3_next" and plan.model is None and plan.target == "cpu"
    assert plan.store == models.DEFAULT_STORE and plan.out is None
    assert plan.mode == "interleaved" and plan.starts_servers
    assert plan.tolerance == oracle.DEFAULT_TOLERANCE
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reps = 3  # type: ignore[misc]


def test_the_options_and_their_aliases_set_the_plan() -> None:
    long = ["--block-size", "64", "--prefix-match-unit", "32", "--num-speculative-tokens", "0"]
    short = ["--block", "64", "--unit", "32", "--num-spec", "0"]
    assert bench.parse_args(long) == bench.parse_args(short)
    plan = bench.parse_args([*short, "--reps", "3", "--shared", "900", "1007"])
    assert (plan.block, plan.unit, plan.num_spec, plan.reps) == (64, 32, 0, 3)
    assert plan.shared == (900, 1007)


def test_a_served_model_takes_the_split_path_and_no_tiny_model() -> None:
    plan = bench.parse_args(["--model", "k"])
    assert plan.checkpoints == "split" and plan.arch is None
    # Its budget is the models.lock entries', not the CPU split path's.
    assert plan.budget == LOCKED_BATCHED_TOKENS != PATHS["split"].budget
    assert bench.parse_args(["--model", "k", "--checkpoints", "split"]) == plan


@pytest.mark.parametrize(
    "argv,mode",
    [
        ([], "interleaved"),
        (
            ["--server-url", "unpatched=http://u:1", "--server-url", "patched=http://p:2"],
            "interleaved",
        ),
        (["--one-server"], "one-server"),
        (["--session", "patched:0", "--server-url", "patched=http://p:2", "--out", "o"], "session"),
        (["--merge-sessions", "a", "b", "--out", "o"], "merge"),
        (["--serve-only", "patched"], "serve"),
        (["--print-serve-args"], "print"),
        (["--print-serve-args", "--serve-only", "patched"], "print"),
    ],
)
def test_the_run_modes(argv: list[str], mode: str, tmp_path: Path) -> None:
    argv = [str(tmp_path / a) if a in ("o", "a", "b") else a for a in argv]
    plan = bench.parse_args(argv)
    assert plan.mode == mode
    assert plan.starts_servers == (
        mode in ("interleaved", "one-server", "serve") and not plan.servers
    )


REFUSALS = [
    (["--server-url", "http://x"], {}, "write TREE=URL"),
    (["--server-url", "unpatched=host:1", "--server-url", "patched=x"], {}, "not an http://"),
    (["--server-url", "unpatched=http://h:1"], {}, "needs both unpatched=URL and patched=URL"),
    (
        ["--server-url", "other=http://h:1", "--server-url", "patched=http://h:2"],
        {},
        "no tree 'other'",
    ),
    (["--session", "patched"], {}, "write TREE:REPS"),
    (["--session", "patched:0", "--out", "o"], {}, "--server-url patched=URL"),
    (["--one-server", "--merge-sessions", "a", "--out", "o"], {}, "give one of them"),
    (
        [
            "--one-server",
            "--server-url",
            "unpatched=http://u:1",
            "--server-url",
            "patched=http://p:2",
        ],
        {},
        "give one of them",
    ),
    (["--merge-sessions", "a"], {}, "needs --out"),
    (
        [
            "--step-log",
            "--server-url",
            "unpatched=http://u:1",
            "--server-url",
            "patched=http://p:2",
        ],
        {},
        "start them with",
    ),
    (["--arch", Q35, "--model", "x"], {}, "leave --arch out"),
    (["--model", "x", "--checkpoints", "internal"], {}, "leave --checkpoints out (split)"),
    (["--checkpoints", "split"], {ENV: "1"}, f"{ENV} is set in this environment"),
    # make bench VLLM=0.99.0 once ran the pinned release and exited 0.
    (["--vllm", "0.99.0"], {}, "not a release pins.toml knows"),
    (["--vllm", "0.33.0"], {}, "no CPU wheel of it exists and no mod lets its server run"),
    (
        [
            "--vllm",
            "0.34.0",
            "--server-url",
            "unpatched=http://a",
            "--server-url",
            "patched=http://b",
        ],
        {},
        "--server-url needs servers or images elsewhere",
    ),
    (["--vllm", "0.34.0", "--target", "gb10"], {}, "--target gb10 needs servers or images"),
]


@pytest.mark.parametrize("argv,env,message", REFUSALS)
def test_each_refusal_is_one_line(argv, env, message, monkeypatch, capsys) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(BenchPlanError) as refused:
        bench.parse_args(argv)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    # kit bench prints it as one line, error: ..., and exits 2 before anything runs.
    assert bench.main(argv) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"


def test_an_out_that_holds_a_run_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text("{}")
    with pytest.raises(BenchPlanError, match="already holds a bench run") as refused:
        bench.parse_args(["--out", str(tmp_path)])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"reps": 0}, "--reps 0: must be 1 or more"),
        ({"block_reps": 0}, "--block-reps 0: must be 1 or more"),
        ({"shared": (900, -1)}, "--shared -1: must be 1 or more"),
        ({"checkpoints": "both"}, "no such checkpoint path"),
        ({"arch": "qwen3_vl"}, "--arch 'qwen3_vl'"),
        ({"serve_only": "other"}, "--serve-only 'other'"),
        ({"model": "x", "checkpoints": "internal"}, "a served model's path"),
        ({"session": ("patched", (2,)), "servers": URLS[1:], "out": Path("o")}, "from 0 to 1"),
    ],
)
def test_a_plan_made_directly_is_checked_the_same(fields: dict, message: str) -> None:
    """A plan made without a command line (a child, the container flow's) meets the
    same checks, in the same one line."""
    with pytest.raises(BenchPlanError, match=message) as refused:
        BenchPlan(**({"reps": 2} | fields))
    assert "\n" not in str(refused.value)


# --- the plan as a command line ------------------------------------------------------

ROUND_TRIPS = [
    [],
    ["--checkpoints", "split", "--reps", "3", "--shared", "900"],
    ["--arch", Q35, "--tolerance", "0.5", "--startup-timeout", "12.5", "--block", "64"],
    ["--unit", "32", "--num-spec", "0", "--target", "gb10", "--record-only"],
    ["--model", "k", "--store", "/m"],
    ["--model-dir", "/tiny", "--one-server", "--block-reps", "3", "--step-log"],
    ["--print-serve-args", "--checkpoints", "split"],
    ["--serve-only", "patched", "--host", "0.0.0.0", "--port", "9", "--model-dir", "/t"],
    ["--server-url", "patched=http://p:2", "--server-url", "unpatched=http://u:1"],
    ["--session", "unpatched:1,0", "--server-url", "unpatched=http://u:1", "--out", "OUT"],
    ["--merge-sessions", "s1", "s2", "--out", "OUT", "--block-reps", "1"],
]


@pytest.mark.parametrize("argv", ROUND_TRIPS, ids=lambda argv: " ".join(argv) or "defaults")
def test_a_plan_round_trips_through_its_argv(argv: list[str], tmp_path: Path) -> None:
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    plan = bench.parse_args(argv)
    assert bench.parse_args(to_argv(plan)) == plan


def _plans(tmp_path: Path) -> dict[str, BenchPlan]:
    return {
        "internal": bench.parse_args(["--reps", "3", "--shared", "900", "2159"]),
        "split": bench.parse_args(["--checkpoints", "split", "--model-dir", "/tiny"]),
        "variant": bench.parse_args(["--arch", Q35, "--tolerance", "0.1", "--block-reps", "1"]),
        "model": bench.parse_args(["--model", "k", "--store", "/models", "--target", "gb10"]),
    }


def _roles(tmp_path: Path) -> dict[str, object]:
    return {
        "server": ServerRole("patched", "0.0.0.0", 8002),
        "client": ClientRole(URLS, tmp_path / "out"),
        "session": SessionRole("unpatched", (0, 2), "http://u:8001", tmp_path / "s" / "01"),
        "merge": MergeRole((tmp_path / "s" / "01", tmp_path / "s" / "02"), tmp_path / "out"),
    }


@pytest.mark.parametrize("which", ["internal", "split", "variant", "model"])
@pytest.mark.parametrize("role_name", ["server", "client", "session", "merge"])
def test_each_childs_argv_makes_its_plan(which: str, role_name: str, tmp_path: Path) -> None:
    plan, role = _plans(tmp_path)[which], _roles(tmp_path)[role_name]
    argv = child_argv(plan, role)
    assert argv[:3] == ["python", "-m", "kit.bench.run"]
    child = bench.parse_args(argv[3:])
    assert child == child_plan(plan, role)
    # Every child serves or expects what the plan serves: the same model, geometry
    # and checkpoint path, so the same step budget and environment.
    assert {name: getattr(child, name) for name in SERVING} == {
        name: getattr(plan, name) for name in SERVING
    }
    assert child.path is plan.path and child.budget == plan.budget
    want = {"server": "serve", "client": "interleaved", "session": "session", "merge": "merge"}
    assert child.mode == want[role_name]
    if role_name != "server":  # a client measures what the plan measures
        assert (child.reps, child.shared, child.tolerance) == (
            plan.reps,
            plan.shared,
            plan.tolerance,
        )
        assert child.block_reps == plan.block_reps


# --- the step budget, passed as a value ------------------------------------------------


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_the_servers_get_the_plans_budget(path: str, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    plan = bench.parse_args(["--checkpoints", path, "--model-dir", str(model)])
    served = bench.serve_plan(plan)
    assert served.base[served.base.index("--max-num-batched-tokens") + 1] == str(plan.budget)
    assert plan.budget == PATHS[path].budget
    assert served.env == {"VLLM_CPU_KVCACHE_SPACE": "1", **PATHS[path].env}
    # Nothing reads the budget back out of a server's arguments any more.
    assert not hasattr(serve_args, "batched_tokens")


def test_a_served_model_gets_the_plans_budget(monkeypatch) -> None:
    seen = {}

    def locked(key, store, unit, budget):
        seen.update(key=key, store=store, unit=unit, budget=budget)
        return ["--model", "/m", *serve_args.common_serve_args(unit, budget)], 3, 1

    monkeypatch.setattr(bench, "locked_serve_args", locked)
    plan = bench.parse_args(["--model", "k", "--store", "/store"])
    served = bench.serve_plan(plan)
    assert seen == {"key": "k", "store": Path("/store"), "unit": 16, "budget": plan.budget}
    assert served.num_spec == 3 and served.model_record == {"locked": "k"} and served.env == {}
    assert served.hash_lookahead == 1


# --- the container flow: its children's argv are the plan's ----------------------------


class _Box:
    """A container as the engine hands it back: a server serves at once, a client is done."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.server = "--serve-only" in command

    def alive(self) -> bool:
        return self.server

    def logs(self) -> str:
        return orchestrate.READY_LINE

    def wait(self, timeout: float) -> int:
        return 0

    def stop(self) -> None:
        pass


class _Engine:
    kind = "docker"

    def __init__(self) -> None:
        self.started: dict[str, list[str]] = {}

    @contextmanager
    def network(self):
        yield Network("kit-net", shared_loopback=False)

    def start(self, image, command, spec, name, mounts=(), network=None) -> _Box:
        self.started[name] = command
        return _Box(command)


def _flow(tmp_path: Path, monkeypatch, **fields) -> tuple[argparse.Namespace, dict, _Engine]:
    monkeypatch.setattr(orchestrate, "COMPILE_CACHES", tmp_path / "caches")
    monkeypatch.setattr(orchestrate, "write_tiny_model", lambda *a, **k: tmp_path / "tiny")
    plan = argparse.Namespace(
        target="cpu", reps=3, shared=[900, 2159], checkpoints=None, one_server=False
    )
    plan.block_reps, plan.store = 2, tmp_path / "store"
    for key, value in fields.items():
        setattr(plan, key, value)
    found = {
        stage: {"ref": f"img-{stage}", "id": f"sha256:{stage}"} for stage in orchestrate.STAGES
    }
    engine = _Engine()
    code, record = orchestrate.run_bench(engine, found, plan, None, tmp_path / "bundle")
    assert code == 0
    return plan, record["commands"], engine


@pytest.mark.parametrize("checkpoints", [None, "split"])
def test_the_flows_client_argv_is_the_plans(checkpoints, tmp_path: Path, monkeypatch) -> None:
    plan, commands, engine = _flow(tmp_path, monkeypatch, checkpoints=checkpoints)
    bench_plan = orchestrate.images_plan(plan, None)
    urls = tuple(
        (stage, f"http://kit-net-{stage}:{orchestrate.PORTS[stage]}")
        for stage in orchestrate.STAGES
    )
    client = commands["client"]
    assert client == child_argv(bench_plan, ClientRole(urls, Path(orchestrate.IN_IMAGE_OUT)))
    assert engine.started["kit-net-client"] == client
    got = bench.parse_args(client[3:])
    # What the flow was asked for, as the bench's plan.
    assert (got.reps, got.shared, got.block_reps) == (3, (900, 2159), 2)
    assert got.checkpoints == (checkpoints or "internal") and got.external == dict(urls)
    assert got.model_dir == Path(orchestrate.IN_IMAGE_TINY) and got.out == Path("/out")
    for stage in orchestrate.STAGES:
        server = bench.parse_args(commands[f"server-{stage}"][3:])
        assert server == child_plan(
            bench_plan, ServerRole(stage, "0.0.0.0", orchestrate.PORTS[stage])
        )
        assert server.path is got.path and server.budget == got.budget


def test_the_flows_one_server_argv_are_the_plans(tmp_path: Path, monkeypatch) -> None:
    plan, commands, _ = _flow(tmp_path, monkeypatch, one_server=True, checkpoints="split")
    bench_plan = orchestrate.images_plan(plan, None)
    sessions = one_server.sessions(3, 2)
    folders = []
    for index, (stage, reps) in enumerate(sessions, 1):
        folder = Path(orchestrate.session_folder(index, stage))
        folders.append(folder)
        url = f"http://kit-net-{stage}-{index}:{orchestrate.PORTS[stage]}"
        role = SessionRole(stage, reps, url, folder)
        client = commands[f"client-session-{index}"]
        assert client == child_argv(bench_plan, role)
        got = bench.parse_args(client[3:])
        assert got == child_plan(bench_plan, role) and got.session == (stage, reps)
        assert got.checkpoints == "split" and got.shared == (900, 2159)
    merge = commands["client"]
    assert merge == child_argv(bench_plan, MergeRole(tuple(folders), Path("/out")))
    got = bench.parse_args(merge[3:])
    assert got.merge_sessions == tuple(folders) and got.block_reps == 2 and got.reps == 3


def test_the_flows_plan_for_a_served_model() -> None:
    plan = argparse.Namespace(target="gb10", reps=2, shared=None, checkpoints=None, block_reps=2)
    entry = argparse.Namespace(key="qwen3_6-35b-a3b")
    bench_plan = orchestrate.images_plan(plan, entry)
    assert bench_plan.model == entry.key and bench_plan.store == Path(orchestrate.IN_IMAGE_MODELS)
    assert bench_plan.checkpoints == "split" and bench_plan.budget == LOCKED_BATCHED_TOKENS
    assert bench_plan.shared == DEFAULT_SHARED and bench_plan.model_dir is None
    server = orchestrate.server_command(bench_plan, "unpatched")
    assert server[server.index("--model") + 1] == entry.key and "--model-dir" not in server
    assert json.dumps(server)  # plain strings


def test_the_flow_refuses_what_the_bench_would(capsys) -> None:
    """The internal path on a GPU target and a bad context length, before anything runs,
    in the bench plan's one line."""
    assert orchestrate.main(["strix", "--checkpoints", "internal", "--dry-run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert orchestrate.main(["cpu", "--shared", "900", "0", "--dry-run"]) == 2
    assert capsys.readouterr().err == "error: --shared 0: must be 1 or more\n"


def test_a_release_served_under_the_interpreter_is_planned_with_its_step_log() -> None:
    """make bench VLLM=0.34.0: the release's own trees (mods/cpu-triton-interpreter),
    both servers started here, each step logged (the fence's counts are read there);
    the pinned release named is the default."""
    plan = bench.parse_args(["--vllm", "0.34.0", "--reps", "2", "--one-server"])
    assert (plan.vllm, plan.release, plan.logs_steps) == ("0.34.0", "0.34.0", True)
    assert bench_plan.from_argv(bench_plan.to_argv(plan)) == plan
    pinned = bench_plan.pins.load()["cpu"]["vllm_cpu"]
    default = bench.parse_args(["--vllm", pinned])
    assert (default.vllm, default.release, default.logs_steps) == (None, pinned, False)
