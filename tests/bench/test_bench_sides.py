"""Which server of the bench's A/B pair is the one under test, decided once
(``kit.bench.plan.carries_fix``): a server started from a tree is as the tree's mods
say (``Tree.patched``), whatever its name; a server given by URL is as the side the
command line declares (``kit.bench.plan.Side``). What follows from it: the fix's
switches in the server's arguments (``Served.args``), the fix's hit expected of it
(``kit.bench.ttft.pair_requests``, from ``Server.fix``), and turn-cost's child told
``--fix`` by its tree (``Tree.child_args``). No real vLLM is started."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest

from kit.bench import plan as bench_plan
from kit.bench import run as bench
from kit.bench import ttft, turn_cost
from kit.bench.plan import Side, carries_fix
from kit.bench.serve import Server
from kit.geometry.geometry_model import Geometry, expected
from kit.vllm_tree import mods, releases, trees

pytestmark = pytest.mark.cpu

SWITCH = ["--the-fix-switch"]
SERVED = bench.Served(["--model", "m"], SWITCH, {}, 1, {})


def _tree(folder: Path, label: str, fix: bool) -> trees.Tree:
    """A tree labelled ``label`` whose mods record carries the fix or not."""
    package = folder / label / "vllm"
    package.mkdir(parents=True)
    names = [m.name for m in mods.switched_mods("cpu", releases.pinned())][:1] if fix else []
    assert names or not fix, "the pinned release has a switched mod (the fix)"
    record = {"mods": [{"name": name} for name in names], "files": {}}
    mods.mods_record_path(package).write_text(json.dumps(record))
    return trees.Tree(label, package)


def test_the_sides_are_the_trees_and_only_one_carries_the_fix() -> None:
    assert [side.value for side in Side] == list(bench_plan.TREES) == list(ttft.TREES)
    assert {side.value: side.fix for side in Side} == {"unpatched": False, "patched": True}
    assert [carries_fix(name) for name in ttft.TREES] == [False, True]
    with pytest.raises(ValueError):
        carries_fix("stock")


def test_a_tree_says_whether_it_carries_the_fix_not_its_name(tmp_path: Path) -> None:
    # Named the other way round on purpose: the mods decide.
    assert carries_fix("patched", _tree(tmp_path, "patched", fix=False)) is False
    assert carries_fix("unpatched", _tree(tmp_path, "unpatched", fix=True)) is True


def _started(plan, pinned=None, tmp_path: Path = Path("."), monkeypatch=None) -> dict:
    monkeypatch.setattr(Server, "start", lambda self: self)
    monkeypatch.setattr(bench, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(bench, "check_release", lambda *a, **k: None)  # no server answers
    with ExitStack() as stack:
        servers = bench.start_servers(stack, plan, SERVED, tmp_path / "out", pinned)
    return {tree: (server.fix, server.args) for tree, server in servers.items()}


def test_servers_started_from_trees_get_the_switches_their_mods_say(
    tmp_path: Path, monkeypatch
) -> None:
    pinned = {
        "unpatched": _tree(tmp_path, "unpatched", fix=True),
        "patched": _tree(tmp_path, "patched", fix=False),
    }
    started = _started(bench.parse_args([]), pinned, tmp_path, monkeypatch)
    assert started == {
        "unpatched": (True, SERVED.base + SWITCH),
        "patched": (False, SERVED.base),
    }


def test_servers_given_by_url_are_as_their_declared_side(tmp_path: Path, monkeypatch) -> None:
    argv = ["--server-url", "unpatched=http://a:1", "--server-url", "patched=http://b:2"]
    started = _started(bench.parse_args(argv), None, tmp_path, monkeypatch)
    assert started == {
        "unpatched": (False, SERVED.base),
        "patched": (True, SERVED.base + SWITCH),
    }


@pytest.mark.parametrize("fix", [False, True])
def test_serve_only_takes_the_installed_trees_word(fix: bool, tmp_path: Path, monkeypatch) -> None:
    """``--serve-only`` becomes the installed vllm's server: the switches where its mods
    (an image's record) carry the fix."""
    monkeypatch.setattr(trees, "installed", lambda: _tree(tmp_path, "installed", fix))
    seen = {}

    def execve(cmd, argv, env):
        seen["argv"] = argv
        raise SystemExit(0)

    monkeypatch.setattr(bench.os, "execve", execve)
    plan = bench_plan.BenchPlan(serve_only="patched", model_dir=tmp_path)
    with pytest.raises(SystemExit):
        bench.become_server(plan, SERVED._replace(base=[]))
    assert (seen["argv"][-len(SWITCH) :] == SWITCH) is fix


class _Stub:
    def __init__(self, fix: bool) -> None:
        self.url = "http://stub"
        self.fix = fix


@pytest.mark.parametrize("fix", [False, True])
def test_the_cached_follow_up_is_expected_the_servers_hit(fix: bool, no_server) -> None:
    geo = Geometry(2048, 16, 1, 2048)
    shared = 1007  # S mod 16 = 15: the fix's case, where the two sides differ
    # The row's label is the same either way: the server's fix decides.
    rows = {r["kind"]: r for r in ttft.pair_requests(_Stub(fix), "patched", 0, shared, geo)}
    case = ttft.bench_case(geo, shared)
    assert expected(case, patched=True).hit != expected(case, patched=False).hit
    assert rows["cached_B"]["expected_cached"] == expected(case, patched=fix).hit


def test_turn_cost_tells_its_child_what_the_tree_carries(tmp_path: Path, monkeypatch) -> None:
    made = {name: _tree(tmp_path, name, fix=name == "unpatched") for name in ttft.TREES}
    monkeypatch.setattr(trees, "pinned", lambda name, target="cpu": made[name])
    commands = []

    def run(cmd, check, env, cwd):
        commands.append(cmd)
        Path(cmd[cmd.index("--out") + 1]).write_text("[]")

    monkeypatch.setattr(turn_cost.subprocess, "run", run)
    for name in ttft.TREES:
        turn_cost._run_tree(name, 1, 1007, "split")
    assert [trees.FIX_ARG in cmd for cmd in commands] == [True, False]
    args = turn_cost.parse_args(
        ["measure", "patched", "--reps", "1", "--shared", "1"]
        + ["--out", "x", "--checkpoints", "split", trees.FIX_ARG]
    )
    assert args.fix and not args.from_sdist
