"""``kit bench --arch``: the CPU default's tiny model in the Qwen3-Next form
(default, unchanged) or in the primary model's Qwen3.5/3.6-MoE form, without a
real vLLM: arguments, the serve plan (``--language-model-only``), each server's
environment (the torchvision stand-in behind its tree's search path), the model
record and the markdown header; a whole run against stand-in servers
(``tests/bench/fake_server.py``) for the bundle; the container flow's refusal; and
turn-cost's per-path output file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from kit import bundle, schema
from kit.bench import run as bench
from kit.bench import serve_args, ttft, turn_cost
from kit.bench.plan import BenchPlan, BenchPlanError, ClientRole, child_argv
from kit.bench.serve import Server
from kit.images import orchestrate
from kit.vllm_tree import releases, trees
from kit.weights import tiny_model

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
ENV = serve_args.CHECKPOINT_ENV
Q35 = "qwen3_5_moe"


def _model(folder: Path, arch: str | None) -> Path:
    """A model folder as the bench checks it: stand-in weights, the arch's config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tiny_model.WEIGHTS).write_bytes(b"stand-in weights")
    if arch:
        tiny_model.write_tiny_model(folder, arch=arch)  # config only
    return folder


@pytest.fixture(autouse=True)
def _no_switch(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


# --- arguments --------------------------------------------------------------------


def test_the_default_arch_is_qwen3_next() -> None:
    assert bench.parse_args([]).arch == "qwen3_next"
    assert bench.parse_args(["--arch", Q35]).arch == Q35
    assert bench.parse_args(["--arch", Q35, "--checkpoints", "split"]).checkpoints == "split"


def test_bad_arch_choices_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--arch", "qwen3_vl"])
    assert exit_.value.code == 2
    assert "invalid choice: 'qwen3_vl'" in capsys.readouterr().err
    with pytest.raises(BenchPlanError, match="a --model is served as models.lock says"):
        bench.parse_args(["--arch", Q35, "--model", "x"])


# --- the serve plan ---------------------------------------------------------------


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_the_default_plan_is_the_qwen3_next_one(path: str, tmp_path: Path) -> None:
    model = _model(tmp_path / "m", "qwen3_next")
    args = bench.parse_args(["--checkpoints", path, "--model-dir", str(model)])
    base, patched_extra, env, num_spec, record, _ = bench.serve_plan(args)
    # Byte for byte the arguments the kit served before --arch existed.
    assert base == serve_args.cpu_serve_args(
        model, serve_args.CPU_BLOCK, 16, 1, serve_args.PATHS[path].budget
    )
    assert "--language-model-only" not in base + patched_extra
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", **serve_args.PATHS[path].env}
    assert record["arch"] == "qwen3_next" and record["tiny"] == "kit/weights/tiny_model.py"


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_the_variant_is_served_language_model_only(path: str, tmp_path: Path, capsys) -> None:
    model = _model(tmp_path / "m", Q35)
    argv = ["--arch", Q35, "--checkpoints", path, "--model-dir", str(model)]
    base, patched_extra, env, num_spec, record, _ = bench.serve_plan(bench.parse_args(argv))
    default = serve_args.cpu_serve_args(
        model, serve_args.CPU_BLOCK, 16, 1, serve_args.PATHS[path].budget
    )
    assert base == default + ["--language-model-only"] == default + tiny_model.serve_extra_args(Q35)
    assert patched_extra == serve_args.fix_flags("cpu")  # both trees get the flag
    # The path's environment and budget, as for Qwen3-Next.
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", **serve_args.PATHS[path].env}
    budget = base[base.index("--max-num-batched-tokens") + 1]
    assert int(budget) == serve_args.PATHS[path].budget
    assert num_spec == 1 and json.loads(base[base.index("--speculative-config") + 1]) == {
        "method": "mtp",
        "num_speculative_tokens": 1,
    }
    assert record == {
        "tiny": "kit/weights/tiny_model.py",
        "arch": Q35,
        "weights_sha256": tiny_model.weights_sha256(model),
    }
    assert bench.main([*argv, "--print-serve-args"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["args"] == base and shown["arch"] == Q35 and shown["checkpoints"] == path
    assert shown["vision_stand_in"] == tiny_model.needs_vision_stand_in(Q35)


@pytest.mark.parametrize("arch,other", [(Q35, "qwen3_next"), ("qwen3_next", Q35)])
def test_a_model_dir_of_another_arch_is_refused(arch, other, tmp_path: Path, capsys) -> None:
    model = _model(tmp_path / "m", other)
    assert bench.main(["--arch", arch, "--model-dir", str(model), "--print-serve-args"]) == 2
    err = capsys.readouterr().err
    assert f"declares model type {other}, not --arch {arch}" in err


def test_each_arch_has_its_own_model_folder(tmp_path: Path, monkeypatch) -> None:
    """Without --model-dir the variant is written to its own folder (.models/, or the
    temp dir for --serve-only), never over the Qwen3-Next one."""
    written = []

    def write(out_dir, weights=False, mtp_modules=1, arch="qwen3_next"):
        written.append((out_dir, weights, arch))
        return _model(Path(out_dir), None)

    monkeypatch.setattr(tiny_model, "write_tiny_model", write)
    monkeypatch.setattr(bench.tempfile, "gettempdir", lambda: str(tmp_path))
    bench.serve_plan(bench.parse_args(["--arch", Q35]))
    bench.serve_plan(bench.parse_args(["--arch", Q35, "--serve-only", "patched"]))
    bench.serve_plan(bench.parse_args([]))
    assert written == [
        (bench.ROOT / ".models" / "tiny-qwen3_5-moe", True, Q35),
        (tmp_path / "tiny-qwen3_5-moe", True, Q35),
        (bench.ROOT / ".models" / bundle.TINY_MODEL, True, "qwen3_next"),
    ]
    assert tiny_model.DIR_NAMES["qwen3_next"] == bundle.TINY_MODEL


# --- each server's environment ----------------------------------------------------


@pytest.fixture()
def fake_trees(tmp_path: Path, monkeypatch) -> dict[str, trees.Tree]:
    made = {}
    for name in ttft.TREES:
        package = tmp_path / "trees" / name / "vllm"
        package.mkdir(parents=True)
        made[name] = trees.Tree(name, package)
    # The bench takes its trees from the plan's release (releases.tree).
    monkeypatch.setattr(releases, "tree", lambda version, stage="unpatched": made[stage])
    return made


def _start(plan: BenchPlan, env: dict, out: Path, monkeypatch) -> tuple[dict, dict]:
    """start_servers with Server.start a no-op: what each server would be given, and
    whether the stand-in folders are still there once the run's stack closes."""
    monkeypatch.setattr(Server, "start", lambda self: self)
    monkeypatch.setattr(bench, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(bench, "check_release", lambda *a, **k: None)  # no server answers
    with ExitStack() as stack:
        served = bench.Served(["--model", "m"], [], env, 1, {})
        servers = bench.start_servers(stack, plan, served, out)
        seen = {tree: dict(s.env) for tree, s in servers.items()}
        paths = {
            tree: Path(e["PYTHONPATH"].split(os.pathsep)[-1])
            for tree, e in seen.items()
            if "PYTHONPATH" in e
        }
        there = {tree: (p / "torchvision" / "__init__.py").is_file() for tree, p in paths.items()}
    gone = {tree: not p.exists() for tree, p in paths.items()}
    return seen, {"there": there, "gone": gone}


def test_variant_servers_get_the_stand_in_behind_their_tree(
    fake_trees, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(tiny_model, "needs_vision_stand_in", lambda arch: arch == Q35)
    monkeypatch.setenv("PYTHONPATH", "/inherited/one")
    args = bench.parse_args(["--arch", Q35])
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", ENV: "1"}
    seen, stand_in = _start(args, env, tmp_path / "out", monkeypatch)
    for tree, found in fake_trees.items():
        entries = seen[tree]["PYTHONPATH"].split(os.pathsep)
        # The tree first (the value replaces what Tree.env would set), then what
        # this shell had, then the stand-in.
        assert entries[: len(found.search_path)] == found.search_path
        assert entries[len(found.search_path)] == "/inherited/one"
        assert entries[-1].endswith("vision-stand-in")
        assert seen[tree]["VLLM_CACHE_ROOT"].endswith(f"vllm/{tree}")
        assert seen[tree][ENV] == "1"
        # What the spawned server really gets: Tree.env with the extras last.
        assert found.env(**seen[tree])["PYTHONPATH"] == seen[tree]["PYTHONPATH"]
    assert stand_in == {
        "there": {t: True for t in ttft.TREES},
        "gone": {t: True for t in ttft.TREES},
    }


def test_with_torchvision_installed_no_stand_in(fake_trees, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tiny_model, "needs_vision_stand_in", lambda arch: False)
    seen, _ = _start(bench.parse_args(["--arch", Q35]), {"A": "1"}, tmp_path / "o", monkeypatch)
    assert all("PYTHONPATH" not in e for e in seen.values())


def test_qwen3_next_servers_get_no_stand_in(fake_trees, tmp_path: Path, monkeypatch) -> None:
    seen, _ = _start(bench.parse_args([]), {"A": "1"}, tmp_path / "out", monkeypatch)
    for tree in ttft.TREES:
        assert seen[tree] == {"A": "1", "VLLM_CACHE_ROOT": str(bench.ROOT / ".cache/vllm" / tree)}


def test_external_servers_get_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tiny_model, "needs_vision_stand_in", lambda arch: True)
    monkeypatch.setattr(releases, "tree", lambda *a, **k: pytest.fail("no tree for --server-url"))
    urls = ["--server-url", "unpatched=http://u:1", "--server-url", "patched=http://p:2"]
    seen, _ = _start(bench.parse_args(["--arch", Q35, *urls]), {}, tmp_path / "o", monkeypatch)
    assert all("PYTHONPATH" not in e for e in seen.values())


def test_serve_only_execs_the_variant_with_the_stand_in(tmp_path: Path, monkeypatch) -> None:
    """What a server in an image or on another host (the installed vllm) runs."""
    monkeypatch.setattr(tiny_model, "needs_vision_stand_in", lambda arch: arch == Q35)
    monkeypatch.setattr(bench, "needs_vision_stand_in", lambda arch: arch == Q35)
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/inherited/one")
    seen = {}

    def execve(cmd, argv, env):
        seen.update(cmd=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(bench.os, "execve", execve)
    model = _model(tmp_path / "m", Q35)
    argv = ["--serve-only", "patched", "--arch", Q35, "--model-dir", str(model)]
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "--language-model-only" in seen["cmd"]
    entries = seen["env"]["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == "/inherited/one"
    assert Path(entries[-1], "torchvision", "__init__.py").is_file()
    assert Path(entries[-1]).is_relative_to(tmp_path)
    assert seen["env"][ENV] == "1"


# --- the record and the markdown --------------------------------------------------


@pytest.mark.parametrize(
    "record,label",
    [
        ({"tiny": "kit/weights/tiny_model.py", "arch": Q35}, "tiny qwen3_5_moe (CPU default)"),
        (
            {"tiny": "kit/weights/tiny_model.py", "arch": "qwen3_next"},
            "tiny qwen3_next (CPU default)",
        ),
        ({"tiny": "kit/weights/tiny_model.py"}, "tiny qwen3_next (CPU default)"),  # an older bundle
        ({"locked": "qwen3_6-35b-a3b"}, "models.lock qwen3_6-35b-a3b"),
    ],
)
def test_the_model_label(record: dict, label: str) -> None:
    assert bench.model_label(record) == label


# --- a whole run against stand-in servers -----------------------------------------

DRIVER = """
import json, sys
from pathlib import Path
import kit.bundle, kit.bench.serve, kit.vllm_tree.releases, kit.vllm_tree.trees, kit.bench.ttft
state, package = Path(sys.argv[1]), Path(sys.argv[2])
def fake(host, port, args):
    folder = state / str(port)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "args.json").write_text(json.dumps(args))
    dump = (
        "import json, os, runpy, sys; from pathlib import Path; "
        "folder = Path(sys.argv[-1]); "
        "p = os.environ.get('PYTHONPATH', '').split(os.pathsep)[-1]; "
        "(folder / 'env.json').write_text(json.dumps(dict(os.environ, STAND_IN_THERE="
        "str(Path(p, 'torchvision', '__init__.py').is_file())))); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    script = "tests/bench/fake_server.py"
    return [sys.executable, "-c", dump, script, "--port", str(port), "--state", str(folder)]
kit.bench.serve.server_command = fake
trees = kit.vllm_tree.trees
kit.vllm_tree.releases.tree = lambda version, stage: trees.Tree(stage, package / stage / "vllm")
# Whether any server had been started when the trees' records were read.
kit.vllm_tree.trees.Tree.mods_record = lambda self: {
    "mods": [], "servers_started": any(state.glob("*/args.json"))
}
kit.bundle.record_environment = lambda out: {}
kit.bench.ttft.IDLE_GAP_S = 0
from kit.bench import run as bench
from kit.weights import tiny_model
tiny_model.needs_vision_stand_in = lambda arch: arch == "qwen3_5_moe"
sys.exit(bench.main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_a_variant_run_serves_records_and_bundles_it(tmp_path: Path) -> None:
    state, package, out = tmp_path / "state", tmp_path / "trees", tmp_path / "out"
    state.mkdir()
    for name in ttft.TREES:
        (package / name / "vllm").mkdir(parents=True)
    model = _model(tmp_path / "m", Q35)
    cmd = [sys.executable, "-c", DRIVER, str(state), str(package)]
    cmd += ["--arch", Q35, "--reps", "1", "--shared", "900", "--model-dir", str(model)]
    cmd += ["--out", str(out), "--record-only"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    servers = sorted(p for p in state.iterdir() if p.is_dir())
    assert len(servers) == 2
    for folder in servers:
        args = json.loads((folder / "args.json").read_text())
        assert args[args.index("--model") + 1] == str(model)
        assert "--language-model-only" in args
        env = json.loads((folder / "env.json").read_text())
        assert env["PYTHONPATH"].split(os.pathsep)[0].startswith(str(package))
        assert env["STAND_IN_THERE"] == "True"  # while the server ran
        assert env[ENV] == "1"  # the internal path
    report = json.loads((out / bundle.BENCH).read_text())
    assert schema.check("bench", report, "bench.json") is report
    assert report["model"]["arch"] == Q35
    assert report["path"] == "internal"
    assert report["run"]["commands"]["patched"].count("--language-model-only") == 1
    # The trees' records were read before the servers started (what was served).
    assert report["run"]["trees"] == {t: {"mods": [], "servers_started": False} for t in ttft.TREES}
    config = json.loads((out / "tiny-qwen3_5-moe" / "config.json").read_text())
    assert config["model_type"] == Q35
    assert not (out / bundle.TINY_MODEL).exists()
    header = (out / bundle.BENCH_MD).read_text().splitlines()[0]
    assert header.endswith(", tiny qwen3_5_moe (CPU default)"), header


# --- the container flow refuses it --------------------------------------------------


def test_the_container_flow_refuses_the_variant(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        orchestrate.main(["cpu", "--arch", Q35, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "tiny model architecture" in err and "image platform" in err
    assert f'make bench-cpu BENCH_ARGS="--arch {Q35}"' in err
    # Image platforms still parse; the servers and the client get no --arch.
    plan = argparse.Namespace(target="cpu", checkpoints=None, reps=2, shared=None, block_reps=2)
    bench_plan = orchestrate.images_plan(plan, None)
    assert bench_plan.arch == "qwen3_next"
    assert "--arch" not in orchestrate.server_command(bench_plan, "patched")
    client = ClientRole((("unpatched", "http://u:1"), ("patched", "http://p:2")), Path("/out"))
    assert "--arch" not in child_argv(bench_plan, client)
    assert orchestrate.image_platform("aarch64") == "aarch64"


def _make_n(*args: str) -> str:
    done = subprocess.run(
        ["make", "-n", "-o", "setup", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_cpu_image_refuses_bench_args() -> None:
    refused = _make_n("bench-cpu-image", f"BENCH_ARGS=--arch {Q35}")
    assert "takes no BENCH_ARGS" in refused and "exit 2" in refused
    assert "make bench-cpu BENCH_ARGS" in refused
    assert "takes no BENCH_ARGS" not in _make_n("bench-cpu-image")
    # The host bench passes them on.
    made = " ".join(_make_n("bench-cpu", f"BENCH_ARGS=--arch {Q35}").split())
    assert f"bench --reps 10 --arch {Q35}" in made


# --- turn-cost: one file per path ---------------------------------------------------


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_turn_cost_writes_its_paths_own_file(path: str) -> None:
    args = turn_cost.parse_args(["--checkpoints", path])
    assert args.out == ROOT / "results" / f"turn-cost-{path}.json"
    assert turn_cost.parse_args(["--checkpoints", path, "--out", "x.json"]).out == Path("x.json")
    # make turn-cost leaves the file to the kit's default: no fixed name.
    made = _make_n("turn-cost", f"CHECKPOINTS={path}")
    assert f"turn-cost --reps 5 --checkpoints {path}" in made and "--out" not in made


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_turn_cost_one_process_has_its_own_file(path: str) -> None:
    args = turn_cost.parse_args(["--checkpoints", path, "--one-process"])
    assert args.out == ROOT / "results" / f"turn-cost-{path}-one-process.json"
    made = _make_n("turn-cost", f"CHECKPOINTS={path}", "TURN_ARGS=--one-process")
    assert f"--checkpoints {path} --one-process" in made


def test_turn_cost_one_process_alternates_which_side_goes_first() -> None:
    firsts = [turn_cost.turn_order(rep, turn)[0] for rep in range(2) for turn in range(4)]
    assert firsts == ["unpatched", "patched"] * 2 + ["patched", "unpatched"] * 2
    orders = [turn_cost.turn_order(rep, turn) for rep in range(3) for turn in range(4)]
    assert all(sorted(order) == sorted(ttft.TREES) for order in orders)


def test_the_committed_one_process_turn_cost_says_what_its_sides_are() -> None:
    committed = json.loads((ROOT / "results" / "turn-cost-internal-one-process.json").read_text())
    schema.check("turn-cost", committed, "turn-cost-internal-one-process.json")
    assert committed["mode"] == "one-process" and committed["path"] == "internal"
    assert {(r["tree"], r["fix"]) for r in committed["rows"]} == {
        ("unpatched", False),
        ("patched", True),
    }
    # Equal engine steps on both sides, every turn (the internal path's promise).
    steps = committed["engine_steps"]
    assert steps["unpatched"] == steps["patched"]


def test_the_turn_cost_table_has_a_header_per_cell() -> None:
    committed = json.loads((ROOT / "results" / "turn-cost-internal-one-process.json").read_text())
    body, headers = turn_cost.table(turn_cost.summarize(committed["rows"]))
    assert [len(row) for row in body] == [len(headers)] * 4
    assert headers[:4] == ["turn", "steps u/p", "turn ms u/p", "ratio p/u [95% CI] (min-max)"]
    assert body[1][1] == "9 / 9" and body[1][0] == 2


def test_the_committed_turn_cost_file_is_the_split_paths() -> None:
    committed = json.loads((ROOT / "results" / "turn-cost-split.json").read_text())
    assert schema.check("turn-cost", committed, "turn-cost-split.json") is committed
    assert committed["path"] == "split"
    assert not (ROOT / "results" / "turn-cost.json").exists()
