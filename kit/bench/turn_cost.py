"""Where a conversation turn's time goes, unpatched vs patched (a benchmark, not a test).

Runs the bench's 4-turn conversation on vLLM's engine in this process (the CPU
default's server arguments, compiled as the server is) once per tree, each tree
in its own process, and attributes each turn's prefill: engine steps, time in
the model runner's steps, time in the copy-on-write block copies, and time in
the Mamba pre-/post-processing (``cpu-mamba-align-spec``'s Python copy loop).
Repetitions alternate the trees (A B A B ...); medians with min-max and the
ratio's seeded 95 % bootstrap interval (``kit.bench.ttft_stats``).

``--checkpoints`` as for ``kit bench``: ``internal`` (default) switches the CPU
GDN export on in both trees (VLLM_CPU_GDN_PREFILL_CHECKPOINT=1) under an
8192-token step budget; ``split`` leaves it off under 2048. The JSON output,
one file per path (``results/turn-cost-<path>.json`` unless ``--out`` says
otherwise, so one path's run never replaces the other's), records the path and
the engine steps of every turn per tree.

``--one-process``: both sides in one process, so no process-level offset (a
process's memory layout and compiled code can make it a few percent faster or
slower than another running the same work) lands on one side: the patched
tree's engine with the fix's switch off (what the unpatched tree runs: the
trees differ by that mod alone, and off it changes nothing) beside one with it
on, turn by turn, the order swapped each turn. Its own file,
``results/turn-cost-<path>-one-process.json``; rows say ``fix``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from kit import bundle, schema
from kit.bench import serve_args, ttft, ttft_stats
from kit.bench.bench_lock import BenchBusy, bench_lock
from kit.geometry.geometry_model import UNIT
from kit.vllm_tree import mods, trees

ROOT = Path(__file__).resolve().parents[2]
TREES = ttft.TREES


def default_out(path: str, one_process: bool = False) -> Path:
    """Where a run of checkpoint path ``path`` writes its JSON by default."""
    return ROOT / "results" / f"turn-cost-{path}{'-one-process' if one_process else ''}.json"


def _instrument(timings: dict[str, float], counts: dict[str, int]) -> None:
    """Wrap the engine's phases; each wrapper adds its wall time to ``timings``."""
    import vllm.v1.worker.gpu_model_runner as runner_mod
    import vllm.v1.worker.mamba_utils as mamba_mod

    def timed(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timings[key] += time.perf_counter() - start
                counts[key] += 1

        setattr(owner, name, wrapper)

    import vllm.v1.core.sched.scheduler as sched_mod

    timed(runner_mod.GPUModelRunner, "execute_model", "step")
    # Inside a step: the attention metadata (where the export's per-group
    # checkpoint metadata is built); outside: the scheduler's plan.
    timed(runner_mod.GPUModelRunner, "_build_attention_metadata", "attn_metadata")
    timed(sched_mod.Scheduler, "schedule", "schedule")
    timed(runner_mod, "copy_kv_cache_blocks_inplace", "cow_copy")
    timed(mamba_mod, "preprocess_mamba", "mamba_pre")
    if hasattr(mamba_mod, "postprocess_mamba_align_cpu"):
        timed(mamba_mod, "postprocess_mamba_align_cpu", "mamba_post")
    # The GDN layers' prefill recurrence (every layer, every step): where the
    # in-pass export (cpu-gdn-prefill-checkpoint) runs a row in pieces, the
    # extra kernel calls show here. The op calls it by its module-level name.
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_mod

    if hasattr(gdn_mod, "_chunk_gated_delta_rule_cpu"):
        timed(gdn_mod, "_chunk_gated_delta_rule_cpu", "gdn_prefill")
    if hasattr(gdn_mod, "_export_conv_checkpoints"):
        timed(gdn_mod, "_export_conv_checkpoints", "gdn_conv_export")


def _engine_kwargs(path: str) -> dict[str, Any]:
    """The CPU default's server arguments as ``LLM`` keyword arguments."""
    from kit.weights.tiny_model import write_tiny_model

    model = write_tiny_model(ROOT / ".models" / "tiny-qwen3-next", weights=True)
    return dict(
        model=str(model),
        dtype="bfloat16",
        max_model_len=8192,
        block_size=serve_args.CPU_BLOCK,
        max_num_batched_tokens=serve_args.PATHS[path].budget,
        mamba_ssm_cache_dtype=serve_args.CPU_SSM_CACHE_DTYPE,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=UNIT,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )


def _in_process_env() -> None:
    """The engine core in this process (the wrappers of ``_instrument`` see its
    phases), and a KV cache small enough for two engines side by side."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _instrumented() -> tuple[dict[str, float], dict[str, int]]:
    """The phase timers, wrapped around vLLM's functions before any engine is built
    (an engine that kept a reference to an unwrapped function would escape them)."""
    timings: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    _instrument(timings, counts)
    return timings, counts


def turn_order(rep: int, turn: int) -> tuple[str, ...]:
    """``--one-process``: which side runs a turn first (swapped every turn and rep)."""
    return TREES if (rep + turn) % 2 == 0 else TREES[::-1]


def _converse(
    engines: dict[str, Any],
    timers: tuple[dict[str, float], dict[str, int]],
    reps: int,
    shared: int,
    path: str,
    fix: dict[str, bool],
) -> list[dict]:
    """The 4-turn conversation on every engine of ``engines`` (side -> ``LLM``), a
    turn of each in ``turn_order``; per repetition and turn, the phase times that
    ``timers`` (``_instrumented``) collect."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    timings, counts = timers
    params = SamplingParams(max_tokens=ttft.REPLY_TOKENS, temperature=0.0, ignore_eos=True)
    out = []
    for rep in range(-1, reps):  # -1: warm-up, not recorded
        first = ttft.context(rep, shared, "conv") + [4000 + i for i in range(ttft.TURN_LEN)]
        prompts = {side: list(first) for side in engines}
        for turn in range(4):
            for side in (s for s in turn_order(rep, turn) if s in engines):
                timings.clear()
                counts.clear()
                start = time.perf_counter()
                done = engines[side].generate(
                    [TokensPrompt(prompt_token_ids=prompts[side])], params, use_tqdm=False
                )[0]
                wall = time.perf_counter() - start
                if rep >= 0:
                    out.append(
                        {
                            "tree": side,
                            "fix": fix[side],
                            "path": path,
                            "rep": rep,
                            "turn": turn + 1,
                            "prompt_tokens": len(prompts[side]),
                            "cached_tokens": done.num_cached_tokens,
                            "wall_s": wall,
                            **{f"{k}_s": v for k, v in timings.items()},
                            **{f"{k}_n": v for k, v in counts.items()},
                        }
                    )
                reply = list(done.outputs[0].token_ids)
                prompts[side] += reply + [3000 + 50 * turn + i for i in range(ttft.TURN_LEN)]
    return out


def measure(
    tree: str,
    reps: int,
    shared: int,
    path: str = serve_args.DEFAULT_CHECKPOINTS,
    fix: bool = False,
) -> list[dict]:
    """In a process whose ``vllm`` is the tree (and whose environment has the path's
    checkpoint switch, ``_run_tree``): per repetition and turn, the phase times;
    ``fix``: the tree carries the fix (its parent says so, ``Tree.child_args``), and
    its engine gets the fix's switches."""
    _in_process_env()
    import vllm
    from vllm import LLM

    kwargs = _engine_kwargs(path)
    if fix:
        kwargs.update(mods.switch_fields("cpu", Path(vllm.__file__).parent))
    timers = _instrumented()
    engines = {tree: LLM(**kwargs)}
    return _converse(engines, timers, reps, shared, path, {tree: fix})


def measure_one_process(reps: int, shared: int, path: str) -> list[dict]:
    """In a process whose ``vllm`` is the patched tree: its engine with the fix off
    (rows "unpatched") and on (rows "patched"), turns alternating."""
    _in_process_env()
    import vllm
    from vllm import LLM

    switches = mods.switch_fields("cpu", Path(vllm.__file__).parent)
    if not switches:
        raise SystemExit(f"turn-cost --one-process: {vllm.__file__} carries no fix switch")
    off = _engine_kwargs(path)
    timers = _instrumented()
    # Built in this order every run: an offset between two engines of one process
    # (smaller than between processes) is not alternated away.
    engines = {"unpatched": LLM(**off), "patched": LLM(**off, **switches)}
    fix = {"unpatched": False, "patched": True}
    return _converse(engines, timers, reps, shared, path, fix)


def tree_env(
    tree: str, path: str, base: dict[str, str] | None = None, found: trees.Tree | None = None
) -> dict[str, str]:
    """The measuring process's environment: the tree's vllm (``found``, else the pinned
    release's tree ``tree``), its own compile cache, and the path's checkpoint switch
    (set for internal, removed for split)."""
    found = found or trees.pinned(tree)
    env = found.env(base, VLLM_CACHE_ROOT=str(ROOT / ".cache" / "vllm" / tree))
    env.pop(serve_args.CHECKPOINT_ENV, None)
    return {**env, **serve_args.PATHS[path].env}


def _run_tree(
    tree: str, reps: int, shared: int, path: str, one_process: bool = False
) -> list[dict]:
    """``measure`` (or, ``one_process``, ``measure_one_process``) in a process of
    its own with the tree's environment, told what the tree is on its command line
    (``Tree.child_args``: ``--fix`` where its mods carry the fix)."""
    found = trees.pinned(tree)
    env = tree_env(tree, path, found=found)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kit.bench.turn_cost", "measure", tree]
        cmd += ["--reps", str(reps), "--shared", str(shared), "--out", out.name]
        cmd += ["--checkpoints", path] + (["--one-process"] if one_process else [])
        cmd += found.child_args()
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


# The summary's columns: (row key, table header, digits); the turn's wall time
# comes second in the table, after the steps, then its paired ratio.
COLUMNS = (
    ("step_n", "steps u/p", 0),
    ("wall_s", "turn ms u/p", 1),
    ("step_s", "in steps ms u/p", 1),
    ("schedule_s", "scheduler ms u/p", 2),
    ("attn_metadata_s", "attn metadata ms u/p", 2),
    ("cow_copy_s", "CoW copy ms u/p", 2),
    ("mamba_pre_s", "Mamba pre ms u/p", 2),
    ("mamba_post_s", "Mamba post ms u/p", 2),
    ("gdn_prefill_s", "GDN prefill ms u/p", 2),
    ("gdn_conv_export_s", "GDN conv export ms u/p", 2),
)


def summarize(rows: list[dict]) -> list[dict]:
    keys = [key for key, _, _ in COLUMNS]
    table = []
    for turn in sorted({r["turn"] for r in rows}):
        line: dict = {"turn": turn}
        for key in keys:
            per_tree = {}
            for tree in TREES:
                vals = [r.get(key, 0) for r in rows if r["tree"] == tree and r["turn"] == turn]
                per_tree[tree] = statistics.median(vals) if vals else 0
            line[key] = per_tree
        line["ratio_wall"] = ttft_stats.paired_ratio(
            [r for r in rows if r["turn"] == turn], "wall_s"
        )
        table.append(line)
    return table


def engine_steps(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Median engine steps per turn, per tree: {tree: {"turn1": n, ...}}."""
    return {
        tree: {
            f"turn{turn}": statistics.median(
                r.get("step_n", 0) for r in rows if r["tree"] == tree and r["turn"] == turn
            )
            for turn in sorted({r["turn"] for r in rows if r["tree"] == tree})
        }
        for tree in TREES
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd")
    m = sub.add_parser("measure", help="(internal) measure the tree this process imports")
    m.add_argument("tree", choices=TREES)
    m.add_argument("--reps", type=int, required=True)
    m.add_argument("--shared", type=int, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--checkpoints", choices=serve_args.CHECKPOINT_PATHS, required=True)
    m.add_argument("--one-process", action="store_true")
    m.add_argument(
        trees.FIX_ARG, action="store_true", help="the tree carries the fix: switch it on"
    )
    m.add_argument(
        trees.FROM_SDIST_ARG,
        action="store_true",
        help="the tree is a release's sdist sources (loads kit.vllm_tree.release_plugin)",
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default: %(default)s)")
    parser.add_argument("--shared", type=int, default=1007, help="context length S")
    parser.add_argument(
        "--out",
        type=Path,
        help="write the rows and the summary here (JSON; default: "
        "results/turn-cost-<path>.json, the --checkpoints path's own file)",
    )
    parser.add_argument(
        "--checkpoints",
        choices=serve_args.CHECKPOINT_PATHS,
        default=serve_args.DEFAULT_CHECKPOINTS,
        help=f"internal: {serve_args.CHECKPOINT_ENV}=1, step budget "
        f"{serve_args.PATHS['internal'].budget}; split: the variable absent, step budget "
        f"{serve_args.PATHS['split'].budget} (default: %(default)s)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="both sides in one process: the patched tree with the fix off and on, "
        "turn by turn (default file: results/turn-cost-<path>-one-process.json)",
    )
    args = parser.parse_args(argv)
    if args.cmd != "measure" and args.out is None:
        args.out = default_out(args.checkpoints, args.one_process)
    return args


def report(args: argparse.Namespace, rows: list[dict]) -> dict:
    """What results/turn-cost-<path>.json holds (stamped with its schema)."""
    return schema.stamp(
        "turn-cost",
        {
            "path": args.checkpoints,
            # one-process: "unpatched" rows are the patched tree with the fix off.
            "mode": "one-process" if args.one_process else "process-per-tree",
            "budget": serve_args.PATHS[args.checkpoints].budget,
            "env": dict(serve_args.PATHS[args.checkpoints].env),
            # one-process: one round of both rounds' repetitions.
            "rounds": 1 if args.one_process else 2,
            "reps_per_round": 2 * args.reps if args.one_process else args.reps,
            "shared": args.shared,
            "engine_steps": engine_steps(rows),
            "rows": rows,
            "summary": summarize(rows),
        },
    )


def table(summary: list[dict]) -> tuple[list[list], list[str]]:
    """The printed table of ``summarize``'s lines: body and headers, unpatched /
    patched per cell (ms, or counts for ``_n`` keys)."""

    def pair(line: dict, key: str, digits: int) -> str:
        scale = 1 if key.endswith("_n") else 1000
        u, p = (scale * line[key][tree] for tree in TREES)
        return f"{u:.{digits}f} / {p:.{digits}f}"

    body = []
    for line in summary:
        cells = [pair(line, key, digits) for key, _, digits in COLUMNS]
        ratio = ttft_stats.ratio_text(line["ratio_wall"])
        body.append([line["turn"], *cells[:2], ratio, *cells[2:]])
    titles = [title for _, title, _ in COLUMNS]
    return body, ["turn", *titles[:2], "ratio p/u [95% CI] (min-max)", *titles[2:]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "measure":
        trees.prepare(args.from_sdist)
        if args.one_process:
            rows = measure_one_process(args.reps, args.shared, args.checkpoints)
        else:
            rows = measure(args.tree, args.reps, args.shared, args.checkpoints, args.fix)
        args.out.write_text(json.dumps(rows))
        return 0
    # The bench's lock: a turn-cost beside a bench (or another turn-cost) would measure
    # its load and write the same committed results.
    try:
        with bench_lock():
            return _compare(args)
    except BenchBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace) -> int:
    """Both trees measured, the table printed, the JSON written (under the bench lock)."""
    from tabulate import tabulate

    rows: list[dict] = []
    if args.one_process:
        # Two rounds' worth of repetitions, both sides in the patched tree's process.
        rows = _run_tree("patched", 2 * args.reps, args.shared, args.checkpoints, one_process=True)
    else:
        # Alternate the trees per round so drift in the machine hits both alike.
        for round_ in range(2):
            order = TREES if round_ % 2 == 0 else TREES[::-1]
            for tree in order:
                rows += [
                    dict(r, rep=r["rep"] + round_ * args.reps)
                    for r in _run_tree(tree, args.reps, args.shared, args.checkpoints)
                ]
    result = report(args, rows)
    summary = result["summary"]

    body, headers = table(summary)
    budget = serve_args.PATHS[args.checkpoints].budget
    print(f"checkpoint path: {args.checkpoints} (step budget {budget})")
    if args.one_process:
        print("one process: u = the patched tree with the fix off, p = with it on")
    print(tabulate(body, headers=headers))
    # Beside and renamed: a run stopped mid-write never leaves half a committed file.
    bundle.write_json(args.out, result)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
