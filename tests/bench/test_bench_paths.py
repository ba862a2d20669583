"""The bench's two checkpoint paths and its ratio statistics, without servers:
``--checkpoints`` (arguments, the serve plan's environment and budget, the
geometry, the container flow's forwarding, turn-cost), every row's path, and the
seeded bootstrap interval of the paired patched/unpatched ratios."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from kit import schema
from kit.bench import run as bench
from kit.bench import serve_args, ttft, ttft_stats, turn_cost
from kit.bench.plan import BenchPlanError
from kit.geometry.geometry_model import REGIMES, Geometry
from kit.images import orchestrate
from kit.vllm_tree import mods

pytestmark = pytest.mark.cpu

ENV = serve_args.CHECKPOINT_ENV


# --- the bootstrap -----------------------------------------------------------------


def test_the_interval_is_deterministic_and_ignores_the_order() -> None:
    values = [0.91, 1.32, 1.05, 0.77, 1.21, 1.18, 0.98, 1.4, 1.02, 1.11]
    first = ttft_stats.bootstrap_median_ci(values)
    assert ttft_stats.bootstrap_median_ci(values) == first
    assert ttft_stats.bootstrap_median_ci(values[::-1]) == first
    assert ttft_stats.bootstrap_median_ci(sorted(values)) == first
    low, high = first
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)


def test_the_interval_of_a_hand_made_sample() -> None:
    # Median of 5 draws from {1, 2, 3, 4, 10}: P(median = 1) = P(median = 10) =
    # P(at least 3 of 5 draws are that value) = 0.0579 > 0.025, so the 2.5 % and
    # 97.5 % quantiles of the bootstrap medians are exactly 1 and 10.
    assert ttft_stats.bootstrap_median_ci([1, 2, 3, 4, 10]) == (1, 10)
    # Every resample of a constant sample has that median.
    assert ttft_stats.bootstrap_median_ci([0.8] * 7) == (0.8, 0.8)
    assert ttft_stats.bootstrap_median_ci([1.25]) == (1.25, 1.25)
    with pytest.raises(ValueError):
        ttft_stats.bootstrap_median_ci([])


def test_the_interval_narrows_with_more_pairs() -> None:
    import random

    rng = random.Random(7)
    wide = [rng.gauss(1.2, 0.1) for _ in range(10)]
    narrow = wide * 12  # the same spread, 12 times the pairs
    w, n = ttft_stats.bootstrap_median_ci(wide), ttft_stats.bootstrap_median_ci(narrow)
    assert n[1] - n[0] < w[1] - w[0]


def test_quantiles_are_linear_between_order_statistics() -> None:
    data = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3, 5.8])
    inclusive = statistics.quantiles(data, n=40, method="inclusive")
    assert ttft_stats._quantile(data, 0.025) == pytest.approx(inclusive[0])
    assert ttft_stats._quantile(data, 0.975) == pytest.approx(inclusive[-1])
    assert ttft_stats._quantile(data, 0.0) == 1.0 and ttft_stats._quantile(data, 1.0) == 9.0


# --- paired ratios, per kind and S, and pooled ------------------------------------


def _row(tree: str, rep: int, shared: int, kind: str, ttft_s: float) -> dict:
    return {
        "tree": tree,
        "rep": rep,
        "S": shared,
        "kind": kind,
        "ttft_s": ttft_s,
        "cached_tokens": 0,
        "expected_cached": 0,
        "hit_ok": True,
        "path": "internal",
    }


def _rows() -> list[dict]:
    """Two repetitions, two S; patched = unpatched x a factor per kind and S."""
    factor = {"cold_A": 1.1, "cold_B": 1.2, "turn2": 1.3, "turn3": 1.4, "turn4": 1.5}
    rows = []
    for rep in range(2):
        for shared in (1007, 2159):
            for kind, f in factor.items():
                base = 0.1 * (rep + 1) + shared / 1e5
                bump = 0.01 * rep if shared == 2159 else 0.0
                rows.append(_row("unpatched", rep, shared, kind, base))
                rows.append(_row("patched", rep, shared, kind, base * (f + bump)))
    return rows


def test_ratios_pair_the_same_repetition_s_and_kind() -> None:
    rows = _rows()
    assert ttft_stats.paired_ratios(
        [r for r in rows if r["kind"] == "turn3"], "ttft_s"
    ) == pytest.approx([1.4, 1.4, 1.4, 1.41])
    line = next(s for s in ttft_stats.summarize(rows) if (s["S"], s["kind"]) == (2159, "cold_B"))
    ratio = line["ratio_patched_unpatched"]
    assert ratio["n"] == 2
    assert ratio["median"] == pytest.approx(1.205)
    assert (ratio["min"], ratio["max"]) == pytest.approx((1.2, 1.21))
    assert ratio["min"] <= ratio["ci95"][0] <= ratio["ci95"][1] <= ratio["max"]


def test_pooled_groups_are_later_turns_cold_a_and_cold_b_over_every_s() -> None:
    pooled = {p["group"]: p for p in ttft_stats.pooled_ratios(_rows())}
    # Kinds with no rows (cached B, repeat B, turn 1 here) get no group.
    assert list(pooled) == [
        "turn2-turn4",
        "cold_A",
        "cold_B",
        "cold_A+cold_B",
        "turn2",
        "turn3",
        "turn4",
    ]
    assert pooled["cold_A+cold_B"]["n"] == 8
    assert pooled["turn4"]["median"] == pytest.approx(1.5, abs=0.01)
    turns = pooled["turn2-turn4"]
    assert turns["n"] == 3 * 2 * 2 and turns["S"] == [1007, 2159]
    assert turns["median"] == pytest.approx(1.4)
    assert (turns["min"], turns["max"]) == pytest.approx((1.3, 1.51))
    assert pooled["cold_A"]["n"] == 4 and pooled["cold_A"]["median"] == pytest.approx(1.1)
    # Whole repetitions are resampled: repetition 1 gave 1.2, 1.2; repetition 2 gave 1.2, 1.21.
    assert pooled["cold_B"]["ci95"] == pytest.approx(
        list(ttft_stats.cluster_bootstrap_median_ci([[1.2, 1.2], [1.2, 1.21]]))
    )
    # Rows in another order: the same numbers.
    assert ttft_stats.pooled_ratios(_rows()[::-1]) == ttft_stats.pooled_ratios(_rows())


def test_the_markdown_shows_the_path_the_intervals_and_the_pooled_groups() -> None:
    rows = [
        dict(r, oracle={"verdict": "same", "first_logprob_diff": 0.0}, token_ids=[r["rep"]])
        for r in _rows()
    ]
    geo = Geometry(2048, 16, 1, 8192, checkpoints="internal-1")
    report = {
        "run": {"vllm": "0.32.0"},
        "geometry": {**geo.__dict__},
        "path": "internal",
        "checkpoints": {"env": {ENV: "1"}},
        "summary": ttft_stats.summarize(rows),
        "pooled_ratios": ttft_stats.pooled_ratios(rows),
        "ratio_method": ttft_stats.ratio_method(),
        "oracle": {
            "verdicts": {},
            "max_first_logprob_diff": 0.0,
            "tolerance_first_logprob": 0.03,
            "distinct_cold_answers": 2,
        },
        "failures": [],
    }
    text = bench.markdown(report)
    assert "Checkpoint path: **internal** (geometry regime internal-1; step budget 8192" in text
    assert f"{ENV}=1" in text
    assert "ratio p/u [95% CI] (min-max)" in text
    assert "| turn2-turn4 " in text and "| cold_A " in text
    assert "10000 resamples" in text


# --- arguments and the serve plan per path ----------------------------------------


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"stand-in weights")
    return tmp_path


def test_the_cpu_default_takes_the_internal_path(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert serve_args.DEFAULT_CHECKPOINTS == "internal"
    assert bench.parse_args([]).checkpoints == "internal"
    assert bench.parse_args(["--checkpoints", "split"]).checkpoints == "split"
    assert bench.parse_args(["--checkpoints", "internal"]).checkpoints == "internal"


def test_an_unknown_path_is_refused_by_the_parser(monkeypatch, capsys) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--checkpoints", "both"])
    assert exit_.value.code == 2
    assert "invalid choice: 'both'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--model", "x", "--checkpoints", "internal"], {}, "a served model's path"),
        (["--checkpoints", "split"], {ENV: "1"}, f"{ENV} is set in this environment"),
    ],
)
def test_bad_checkpoint_choices_are_refused(argv, env, message, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(BenchPlanError, match=message):
        bench.parse_args(argv)


def test_a_locked_model_runs_as_split(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert bench.parse_args(["--model", "x"]).checkpoints == "split"


@pytest.mark.parametrize(
    "path,budget,switch", [("internal", 8192, {ENV: "1"}), ("split", 2048, {})]
)
def test_the_serve_plan_per_path(path, budget, switch, model_dir, monkeypatch, capsys) -> None:
    monkeypatch.delenv(ENV, raising=False)
    args = bench.parse_args(["--checkpoints", path, "--model-dir", str(model_dir)])
    base, patched_extra, env, num_spec, _, lookahead = bench.serve_plan(args)
    assert base[base.index("--max-num-batched-tokens") + 1] == str(budget)
    assert budget == serve_args.PATHS[path].budget == args.budget
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", **switch}
    assert num_spec == 1 and "--max-num-batched-tokens" not in patched_extra
    assert lookahead == 0  # the pinned release hashes without lookahead
    # Both trees get the same environment and budget; only the fix's switches differ.
    assert patched_extra == serve_args.fix_flags("cpu")
    # What --print-serve-args shows.
    assert (
        bench.main(["--checkpoints", path, "--model-dir", str(model_dir), "--print-serve-args"])
        == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["env"] == env and shown["checkpoints"] == path and shown["budget"] == budget
    assert shown["args"] == base


def test_every_bench_prompt_is_one_chunk_on_the_internal_path() -> None:
    longest = bench.longest_prompt(max([900, 1007, 2048, 2159]))
    assert longest <= serve_args.PATHS["internal"].budget
    # ... and the split path's budget is the block: no final chunk spans two columns.
    assert serve_args.PATHS["split"].budget == serve_args.CPU_BLOCK


def test_the_switch_is_the_mods_opt_in_variable() -> None:
    mod = mods.load_mod("cpu-gdn-prefill-checkpoint")
    assert mod.manifest["opt_in_env"] == ENV
    assert set(mod.manifest["stages"]) == {"unpatched", "patched"}


def test_each_path_names_a_geometry_regime() -> None:
    for name, path in serve_args.PATHS.items():
        assert path.name == name and path.regime in REGIMES
        assert serve_args.path_by_regime(path.regime) is path
        geo = Geometry(2048, 16, 1, path.budget, checkpoints=path.regime)
        assert geo.checkpoint_alignment == (1 if name == "internal" else None)
    assert serve_args.CHECKPOINT_PATHS == tuple(serve_args.PATHS) == ("internal", "split")
    # Every internal-* regime is the internal path's (the rows say which path ran).
    assert serve_args.path_by_regime("internal-grid").name == "internal"


# --- every row says its path -------------------------------------------------------


class _Stub:
    url = "http://stub"
    fix = False


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_every_row_carries_its_path(path: str, no_server) -> None:
    geo = Geometry(2048, 16, 1, serve_args.PATHS[path].budget, serve_args.PATHS[path].regime)
    servers = {tree: _Stub() for tree in ttft.TREES}
    rows = ttft.interleaved(servers, geo, reps=1, shared=[1007], tolerance=0.03)
    kinds = {r["kind"] for r in rows}
    assert kinds == {
        "cold_A",
        "cached_B",
        "repeat_B",
        "control_A",
        "control_B",
        "cold_B",
        "turn1",
        "turn2",
        "turn3",
        "turn4",
    }
    assert len(rows) == 2 * len(kinds)
    assert {r["path"] for r in rows} == {path}
    # No histograms to read: no engine time, and no wait for one.
    assert all(r["engine_prefill_s"] is None for r in rows)


def test_the_served_geometry_says_its_regime(monkeypatch) -> None:
    monkeypatch.setattr(ttft, "cache_config_info", lambda url: {"block": 2048, "unit": 16})
    servers = {tree: _Stub() for tree in ttft.TREES}
    geo = ttft.served_geometry(servers, 1, 8192, "internal-1")
    assert geo == Geometry(2048, 16, 1, budget=8192, checkpoints="internal-1")
    assert ttft.served_geometry(servers, 1, 2048).checkpoints == "split"


def test_the_bench_schema_is_version_2() -> None:
    assert schema.VERSIONS["bench"] == 2


# --- the container flow forwards the choice ---------------------------------------


def _plan(target: str = "cpu", checkpoints: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        target=target, checkpoints=checkpoints, reps=3, shared=None, block_reps=2
    )


@pytest.mark.parametrize("path", serve_args.CHECKPOINT_PATHS)
def test_the_flow_passes_the_path_to_both_servers(path: str, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    plan = orchestrate.images_plan(_plan(checkpoints=path), None)
    for stage in ("unpatched", "patched"):
        command = orchestrate.server_command(plan, stage)
        assert command[command.index("--checkpoints") + 1] == path
        # What the server in the image becomes: the bench's serve plan for that path.
        assert command[:4] == ["python", "-m", "kit.bench.run", "--serve-only"]
        served = bench.parse_args(command[3:])
        assert served.path == plan.path and served.budget == plan.budget


def test_the_flow_takes_the_benchs_default(monkeypatch) -> None:
    """Left out, the path is the bench's own default (its plan resolves it): internal
    for the cpu image's tiny model, split for a served model."""
    monkeypatch.delenv(ENV, raising=False)
    assert orchestrate.images_plan(_plan(), None).checkpoints == "internal"
    model = argparse.Namespace(key="tiny")
    assert orchestrate.images_plan(_plan("gb10"), model).checkpoints == "split"


def test_the_flow_refuses_the_internal_path_on_gpu_targets(capsys) -> None:
    assert orchestrate.main(["gb10", "--checkpoints", "internal", "--dry-run"]) == 2
    err = capsys.readouterr().err
    # The bench's own refusal (kit.bench.plan.checkpoint_path), word for word.
    with pytest.raises(BenchPlanError) as refused:
        bench.parse_args(["--model", "x", "--checkpoints", "internal"])
    assert err == f"error: {refused.value}\n"


def test_the_servers_in_images_get_the_paths_environment(model_dir, monkeypatch) -> None:
    """--serve-only execs vLLM with the serve plan's environment: the switch for
    internal, none for split (what the container flow's servers run)."""
    monkeypatch.delenv(ENV, raising=False)
    seen = {}

    def execve(cmd, argv, env):
        seen.update(cmd=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(bench.os, "execve", execve)
    for path, budget in (("internal", "8192"), ("split", "2048")):
        argv = ["--serve-only", "patched", "--checkpoints", path, "--model-dir", str(model_dir)]
        with pytest.raises(SystemExit):
            bench.main(argv)
        cmd = seen["cmd"]
        assert cmd[cmd.index("--max-num-batched-tokens") + 1] == budget
        assert (seen["env"].get(ENV) == "1") == (path == "internal")


# --- turn-cost ---------------------------------------------------------------------


def test_turn_cost_takes_the_same_paths(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert turn_cost.parse_args([]).checkpoints == "internal"
    assert turn_cost.parse_args(["--checkpoints", "split"]).checkpoints == "split"
    internal = turn_cost.tree_env("patched", "internal")
    assert internal[ENV] == "1"
    # Split removes an inherited switch.
    split = turn_cost.tree_env("patched", "split", base={ENV: "1", "PATH": "/usr/bin"})
    assert ENV not in split


def test_turn_cost_records_its_path_and_engine_steps() -> None:
    rows = [
        {"tree": tree, "path": "split", "rep": rep, "turn": turn, "wall_s": 0.1 * turn + rep}
        | {"step_n": steps + (tree == "patched")}
        for tree in ttft.TREES
        for rep in range(2)
        for turn, steps in ((1, 9), (2, 9))
    ]
    args = argparse.Namespace(checkpoints="split", reps=1, shared=1007, one_process=False)
    result = turn_cost.report(args, rows)
    assert schema.check("turn-cost", result, "turn-cost.json") is result
    assert result["path"] == "split" and result["budget"] == 2048 and result["env"] == {}
    assert result["mode"] == "process-per-tree"
    assert result["engine_steps"] == {
        "unpatched": {"turn1": 9, "turn2": 9},
        "patched": {"turn1": 10, "turn2": 10},
    }
    assert result["summary"][0]["ratio_wall"]["n"] == 2


class _PausableStub:
    """A server the bench can pause: records whether it is running."""

    def __init__(self, name: str) -> None:
        self.url = f"http://{name}"
        self.running = True
        self.fix = False

    def can_pause(self) -> bool:
        return True

    def pause(self) -> None:
        self.running = False

    def resume(self) -> None:
        self.running = True


def test_the_trees_take_turns_request_by_request_the_other_paused(monkeypatch, no_server) -> None:
    """Where the kit runs both servers, each request kind's pair runs back to back
    (A B, then B A the next repetition) and only the measured server runs."""
    log: list[tuple[str, bool]] = []
    servers = {tree: _PausableStub(tree) for tree in ttft.TREES}
    answer = ttft.complete

    def complete(url, model, prompt, max_tokens, **kw):
        tree = url.removeprefix("http://")
        others_running = any(s.running for t, s in servers.items() if t != tree)
        log.append((tree, servers[tree].running and not others_running))
        return answer(url, model, prompt, max_tokens, **kw)

    monkeypatch.setattr(ttft, "complete", complete)
    # Pausing replaces the idle gap: no sleep of that length may happen.
    monkeypatch.setattr(ttft, "IDLE_GAP_S", 1.5)
    slept: list[float] = []
    monkeypatch.setattr(ttft.time, "sleep", slept.append)
    geo = Geometry(2048, 16, 1, 8192, "internal-1")
    assert ttft.pausable(servers)
    rows = ttft.interleaved(servers, geo, reps=2, shared=[1007], tolerance=0.03)

    assert all(alone for _, alone in log)  # every request, wake-ups included
    assert ttft.IDLE_GAP_S not in slept
    kinds = ["cold_A", "cached_B", "repeat_B", "control_A", "control_B", "cold_B"]
    kinds += ["turn1", "turn2", "turn3", "turn4"]
    for rep, order in ((0, list(ttft.TREES)), (1, list(ttft.TREES)[::-1])):
        got = [(r["tree"], r["kind"]) for r in rows if r["rep"] == rep]
        assert got == [(tree, kind) for kind in kinds for tree in order]
    # The cached B's verdict is still judged against its own tree's cold B.
    assert all("oracle" in r for r in rows if r["kind"] == "cached_B")
    assert all(s.running for s in servers.values())  # left running for stop()


def test_servers_reached_by_url_take_turns_a_repetition_at_a_time(no_server) -> None:
    servers = {tree: _Stub() for tree in ttft.TREES}
    assert not ttft.pausable(servers)
    geo = Geometry(2048, 16, 1, 8192, "internal-1")
    rows = ttft.interleaved(servers, geo, reps=1, shared=[1007], tolerance=0.03)
    assert [r["tree"] for r in rows] == [ttft.TREES[0]] * 10 + [ttft.TREES[1]] * 10


def test_lookahead_hashes_move_the_expected_hits(no_server) -> None:
    """With lookahead hashes (0.33.0 on) the bench expects the lookahead hits: at
    S = 1007 cached B resumes at floor((1007 - 1)/16)*16 = 992 on both trees where
    the 0.32.0 hashing falls back to 0 unpatched; a resend of B and the later turns
    at the last boundary a token below their end."""
    servers = {tree: _Stub() for tree in ttft.TREES}

    def expected(lookahead: int) -> dict[str, int]:
        geo = Geometry(2048, 16, 1, 8192, hash_lookahead=lookahead)
        rows = ttft.interleaved(servers, geo, reps=1, shared=[1007], tolerance=0.03)
        return {r["kind"]: r["expected_cached"] for r in rows if r["tree"] == "unpatched"}

    legacy, lookahead = expected(0), expected(1)
    assert (legacy["cached_B"], lookahead["cached_B"]) == (0, 992)
    # B is 1007 + 48 tokens: floor(1055/16)*16 - 16 = 1024 legacy, floor(1054/16)*16.
    assert (legacy["repeat_B"], lookahead["repeat_B"]) == (1024, 1040)


def test_the_served_geometry_carries_the_hash_lookahead(monkeypatch) -> None:
    monkeypatch.setattr(ttft, "cache_config_info", lambda url: {"block": 2048, "unit": 16})
    servers = {tree: _Stub() for tree in ttft.TREES}
    assert ttft.served_geometry(servers, 1, 8192, "split", 1).hash_lookahead == 1
    assert ttft.served_geometry(servers, 1, 8192).hash_lookahead == 0
