"""Cached follow-up TTFT, unpatched vs patched vLLM, measured side by side in one run.

Prompt pair (token ids; written into the results): probe A = shared context of S
tokens + one "." token (a context load); follow-up B = the same context + a
48-token user turn. Per repetition and geometry, on each server: A (cold),
B (cached: the measurement), B again (exact repeat: lower bound), then the
prefix cache is reset and B is sent once more (cold: upper bound, and the
correctness reference for the cached B). Also a 4-turn conversation.
Every request's cached-token count must equal the geometry model's number and
every cached answer must pass the oracle (``kit/oracle.py``); otherwise
the run fails, naming the tree, S and repetition (``--record-only`` records
instead).
Isolation: every repetition uses a fresh context (new token ids), so one
repetition cannot warm the next. Servers are interleaved A B A B … with the
order swapped every repetition; one warm-up repetition is excluded.
No pass/fail threshold on TTFT: the report gives medians, spread and ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from kit import models, mods, oracle, pins, trees
from kit.geometry_model import UNIT, Case, Geometry, expected, prompt_checkpoint
from kit.openai_client import cache_config_info, complete, counters, reset_prefix_cache
from kit.serve import Server, server_command, server_env, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PROBE_TOKEN = 13
TURN_LEN = 48
REPLY_TOKENS = 8
TREES = ("unpatched", "patched")
WAKE_PROMPT = [5, 6, 7]  # shorter than one hash unit: leaves no cache entry
IDLE_GAP_S = 1.5
# The CPU default's scheduler budget, pinned so the geometry model can use it.
CPU_BATCHED_TOKENS = 2048
# GPU models: their blocks reach thousands of tokens; the budget must hold one.
LOCKED_BATCHED_TOKENS = 8192
# vLLM's CPU platform stores GDN SSM states in float32 on CPUs with AVX-512 BF16
# and in the model dtype elsewhere; the page size, and with it the block vLLM
# picks (2048 or 1024 tokens), followed the machine. Pinned to float32 (what
# those CPUs pick anyway, and the more precise state), so every machine gets
# 2048-token blocks.
CPU_SSM_CACHE_DTYPE = "float32"
CPU_BLOCK = 2048


SERVED_NAME = "kit-model"


def common_serve_args(unit: int, budget: int) -> list[str]:
    """What every bench server needs, whatever the model and target.

    The step budget is pinned because the expected hits depend on it (a chunk
    the budget cannot finish ends on a block boundary).
    """
    return [
        "--max-num-batched-tokens",
        str(budget),
        "--served-model-name",
        SERVED_NAME,
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--mamba-cache-mode",
        "align",
        "--prefix-match-unit",
        str(unit),
        "--enable-prompt-tokens-details",
    ]


def cpu_serve_args(model_dir: Path, block: int, unit: int, num_spec: int) -> list[str]:
    """The CPU default: the tiny random-weight model, a large block so prefill dominates."""
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--block-size",
        str(block),
        "--gpu-memory-utilization",
        "0.3",
        "--mamba-ssm-cache-dtype",
        CPU_SSM_CACHE_DTYPE,
        *common_serve_args(unit, CPU_BATCHED_TOKENS),
    ]
    if num_spec:
        args += [
            "--speculative-config",
            json.dumps({"method": "mtp", "num_speculative_tokens": num_spec}),
        ]
    return args


def locked_serve_args(key: str, store: Path, unit: int) -> tuple[list[str], int]:
    """A models.lock entry, verified offline first; returns its args and MTP draft count.

    vLLM picks the hybrid block size itself; the bench reads it back from
    ``vllm:cache_config_info`` once the server is up.
    """
    _, entries = models.load()
    (entry,) = models.select(entries, key, None)
    models.verify([entry], store)  # refuses unresolved, missing or partial files
    serve = list(entry.fields.get("serve_args", []))
    num_spec = 0
    if "--speculative-config" in serve:
        spec = json.loads(serve[serve.index("--speculative-config") + 1])
        num_spec = int(spec.get("num_speculative_tokens", 0))
    return [
        "--model",
        str(models.snapshot(store, entry)),
        *serve,
        *common_serve_args(unit, LOCKED_BATCHED_TOKENS),
    ], num_spec


def fix_flags(target: str) -> list[str]:
    """The patched server's switches: those of the mods made for the vLLM this
    process finds (an image may carry a later release than the pinned one)."""
    spec = importlib.util.find_spec("vllm")  # located, not imported: no GPU init
    release = mods.tree_version(Path(spec.origin).parent)[0] if spec and spec.origin else None
    return [m.manifest["enable_flag"] for m in mods.switched_mods(target, release)]


def context(rep: int, shared: int, salt: str) -> list[int]:
    rng = random.Random(f"{salt}-{rep}-{shared}")
    return [rng.randrange(16, 4000) for _ in range(shared)]


def measure(
    server: Server,
    tree: str,
    prompt: list[int],
    kind: str,
    expect: int,
    rep: int,
    shared: int,
    max_tokens: int = 4,
) -> dict:
    before = counters(server.url)
    done = complete(server.url, SERVED_NAME, prompt, max_tokens)
    after = counters(server.url)
    return {
        "tree": tree,
        "rep": rep,
        "S": shared,
        "kind": kind,
        "ttft_s": done.ttft_s,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "expected_cached": expect,
        "hit_ok": done.cached_tokens == expect,
        "metrics_hits": after["vllm:prefix_cache_hits_total"]
        - before["vllm:prefix_cache_hits_total"],
        "metrics_queries": after["vllm:prefix_cache_queries_total"]
        - before["vllm:prefix_cache_queries_total"],
        "token_ids": done.token_ids,
        "logprobs": done.logprobs,
        "top_logprobs": done.top_logprobs,
    }


def bench_case(geo: Geometry, shared: int) -> Case:
    """The bench's A/B pair as a geometry-model case: the "." probe is a one-token tail."""
    return Case(geo, shared, 1)


def run_pair(
    server: Server,
    tree: str,
    rep: int,
    shared: int,
    geo: Geometry,
    tolerance: float = oracle.DEFAULT_TOLERANCE,
) -> list[dict]:
    ctx = context(rep, shared, "pair")
    a = ctx + [PROBE_TOKEN]
    b = ctx + [4000 + i for i in range(TURN_LEN)]
    case = bench_case(geo, shared)
    want_b = expected(case, patched=tree == "patched").hit
    resend = prompt_checkpoint(len(b), geo.unit, geo.eagle)
    # Unmeasured: the first request after the server sat idle (while the other
    # tree ran) waited about 1 s before its prefill in a third of the
    # repetitions, on either tree; cold A should time the prefill, not that.
    complete(server.url, SERVED_NAME, WAKE_PROMPT, 1)
    rows = [
        measure(server, tree, a, "cold_A", 0, rep, shared),
        measure(server, tree, b, "cached_B", want_b, rep, shared),
        measure(server, tree, b, "repeat_B", resend, rep, shared),
    ]
    reset_prefix_cache(server.url)
    rows.append(measure(server, tree, b, "cold_B", 0, rep, shared))
    rows[1]["ideal_cached"] = case.ideal
    cold, cached = rows[3], rows[1]
    verdict = oracle.judge(
        cached["token_ids"],
        cold["token_ids"],
        cached["top_logprobs"],
        cold["top_logprobs"],
        tolerance,
    )
    cached["oracle"] = verdict.as_dict()
    return rows


def run_conversation(server: Server, tree: str, rep: int, shared: int, geo: Geometry) -> list[dict]:
    prompt = context(rep, shared, "conv") + [4000 + i for i in range(TURN_LEN)]
    rows, expect = [], 0
    for turn in range(4):
        row = measure(
            server, tree, prompt, f"turn{turn + 1}", expect, rep, shared, max_tokens=REPLY_TOKENS
        )
        rows.append(row)
        expect = prompt_checkpoint(len(prompt), geo.unit, geo.eagle)
        prompt = prompt + row["token_ids"] + [3000 + 50 * turn + i for i in range(TURN_LEN)]
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["S"], r["kind"]) for r in rows})
    for shared, kind in keys:
        line = {"S": shared, "kind": kind}
        for tree in TREES:
            sel = [r for r in rows if r["tree"] == tree and (r["S"], r["kind"]) == (shared, kind)]
            ttft = sorted(r["ttft_s"] for r in sel)
            # inclusive: quartiles stay inside the measured range for small n.
            q = (
                statistics.quantiles(ttft, n=4, method="inclusive")
                if len(ttft) > 1
                else [ttft[0]] * 3
            )
            line[tree] = {
                "n": len(sel),
                "median_ms": 1000 * statistics.median(ttft),
                "iqr_ms": [1000 * q[0], 1000 * q[2]],
                "min_ms": 1000 * ttft[0],
                "max_ms": 1000 * ttft[-1],
                "median_cached": statistics.median(r["cached_tokens"] for r in sel),
                "expected_cached": sel[0]["expected_cached"],
                "flagged_no_hit": sum(not r["hit_ok"] for r in sel),
                # cached_B only: the oracle's verdicts against the cold reference.
                "verdicts": {
                    v: sum(r["oracle"]["verdict"] == v for r in sel)
                    for v in ("same", "tie", "wrong")
                }
                if kind == "cached_B"
                else None,
            }
        line["ratio_patched_unpatched"] = paired_ratio(
            [r for r in rows if (r["S"], r["kind"]) == (shared, kind)], "ttft_s"
        )
        out.append(line)
    return out


def paired_ratio(rows: list[dict], key: str) -> dict:
    """patched/unpatched of ``key`` per repetition (the two sides run back to back):
    median, min and max."""
    pairs: dict = {}
    for r in rows:
        pairs.setdefault(r["rep"], {})[r["tree"]] = r[key]
    ratios = sorted(p["patched"] / p["unpatched"] for p in pairs.values() if len(p) == 2)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def table(summary: list[dict]) -> tuple[list[str], list[list]]:
    headers = [
        "S",
        "request",
        "unpatched ms (IQR)",
        "cached",
        "patched ms (IQR)",
        "cached",
        "expected u/p",
        "ratio p/u (min-max)",
        "hit != expected u/p",
        "answer = cold u/p (ties, wrong)",
    ]
    body = []
    for s in summary:
        u, p, r = s["unpatched"], s["patched"], s["ratio_patched_unpatched"]
        body.append(
            [
                s["S"],
                s["kind"],
                f"{u['median_ms']:.1f} ({u['iqr_ms'][0]:.1f}-{u['iqr_ms'][1]:.1f})",
                f"{u['median_cached']:.0f}",
                f"{p['median_ms']:.1f} ({p['iqr_ms'][0]:.1f}-{p['iqr_ms'][1]:.1f})",
                f"{p['median_cached']:.0f}",
                f"{u['expected_cached']}/{p['expected_cached']}",
                f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})",
                f"{u['flagged_no_hit']}/{p['flagged_no_hit']}",
                "" if u.get("verdicts") is None else f"{_answers(u)} / {_answers(p)}",
            ]
        )
    return headers, body


def _answers(side: dict) -> str:
    v = side["verdicts"]
    return f"{v['same']}/{side['n']} ({v['tie']}, {v['wrong']})"


def failures(rows: list[dict], distinct_cold: int) -> list[str]:
    """Every reason this run is not evidence, one line each, naming tree, S and repetition."""
    out = []
    for r in rows:
        if not r["hit_ok"]:
            out.append(
                f"HIT: {r['tree']} S={r['S']} rep={r['rep']} {r['kind']}: "
                f"{r['cached_tokens']} cached tokens, the geometry says {r['expected_cached']}"
            )
        if r.get("oracle", {}).get("verdict") == "wrong":
            out.append(
                f"ORACLE: {r['tree']} S={r['S']} rep={r['rep']}: the cached answer's first "
                f"position differs from the cold run's by {r['oracle']['first_logprob_diff']} "
                "(a restored state is not the state it claims to be)"
            )
    if distinct_cold <= 1:
        out.append("ORACLE: every cold request got the same answer: it proves nothing")
    return out


def host_provenance() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        kit_commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        kit_commit = ""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kit_commit": kit_commit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=10, help="repetitions (default: %(default)s)")
    parser.add_argument(
        "--shared",
        type=int,
        nargs="+",
        default=[900, 1007, 2048, 2159],
        help="context lengths S (default: %(default)s: inside the first 2048-token "
        "block, S mod 16 = 4 and 15; block-aligned; beyond it)",
    )
    parser.add_argument("--block", type=int, default=CPU_BLOCK)
    parser.add_argument("--unit", type=int, default=UNIT)
    parser.add_argument("--num-spec", type=int, default=1, help="MTP draft tokens (0: none)")
    parser.add_argument(
        "--out", type=Path, help="results folder (default: results/<date>-cpu-<id>)"
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--print-serve-args", action="store_true", help="print the server arguments as JSON"
    )
    parser.add_argument(
        "--server-url",
        action="append",
        default=[],
        metavar="TREE=URL",
        help="use running servers (unpatched=URL and patched=URL, e.g. one per container) "
        "instead of starting them",
    )
    parser.add_argument(
        "--record-only",
        action="store_true",
        help="record hit and oracle failures in the bundle and exit 0 (default: exit 1)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=oracle.DEFAULT_TOLERANCE,
        help="oracle: max |log-prob difference| at the first generated position "
        "(default: %(default)s, four bf16 ulps of the tiny CPU model's logits)",
    )
    parser.add_argument(
        "--serve-only",
        choices=TREES,
        help="become this server (the installed vLLM, e.g. inside an image) instead of "
        "benchmarking; with --host/--port",
    )
    parser.add_argument("--host", default="127.0.0.1", help="for --serve-only")
    parser.add_argument("--port", type=int, default=8000, help="for --serve-only")
    parser.add_argument(
        "--target",
        choices=mods.TARGETS,
        default="cpu",
        help="whose patched-stage switches the patched server gets (default: %(default)s)",
    )
    parser.add_argument(
        "--locked-model",
        metavar="KEY",
        help="serve this models.lock entry (verified offline first) instead of "
        "the CPU default's tiny model; inside the gb10/strix images",
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=models.DEFAULT_STORE,
        help="model store for --locked-model (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    from tabulate import tabulate
    from tqdm import tqdm

    from kit.tiny_model import weights_sha256, write_tiny_model

    stamp = time.strftime("%Y%m%d-%H%M%S")
    label = args.locked_model or "cpu"
    out = args.out or ROOT / "results" / f"{stamp}-{label}-{os.urandom(3).hex()}"
    writes_results = not (args.print_serve_args or args.serve_only)
    if writes_results:
        out.mkdir(parents=True, exist_ok=True)
    if args.locked_model:
        try:
            base, num_spec = locked_serve_args(args.locked_model, args.store, args.unit)
        except (models.LockError, models.VerifyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        env = {}
    else:
        # The weights (13 MB) stay out of the results; the bundle gets the config
        # and the weights' sha256.
        if args.serve_only:  # inside an image the kit's folder is read-only
            model_dir = write_tiny_model(
                Path(tempfile.gettempdir()) / "kit-tiny-qwen3-next", weights=True
            )
            print(f"tiny model weights sha256 {weights_sha256(model_dir)}", flush=True)
        elif args.server_url:  # the servers made their own
            model_dir = write_tiny_model(out / "tiny-qwen3-next")
        else:
            model_dir = write_tiny_model(ROOT / ".models" / "tiny-qwen3-next", weights=True)
            if writes_results:
                write_tiny_model(out / "tiny-qwen3-next")
        base = cpu_serve_args(model_dir, args.block, args.unit, args.num_spec)
        num_spec, env = args.num_spec, {"VLLM_CPU_KVCACHE_SPACE": "1"}
    patched_extra = fix_flags(args.target)
    if args.print_serve_args:
        print(json.dumps({"args": base, "patched_extra": patched_extra, "env": env}))
        return 0
    if args.serve_only:
        cmd = server_command(
            args.host, args.port, base + (patched_extra if args.serve_only == "patched" else [])
        )
        print("$ " + shlex.join(cmd), flush=True)
        os.execve(cmd[0], cmd, server_env(env))
    budget = LOCKED_BATCHED_TOKENS if args.locked_model else CPU_BATCHED_TOKENS
    external = dict(item.split("=", 1) for item in args.server_url)
    if external and set(external) != set(TREES):
        parser.error("--server-url needs both unpatched=URL and patched=URL")
    servers = {
        tree: Server(
            tree,
            base + (patched_extra if tree == "patched" else []),
            out / "logs" / f"server-{tree}.log",
            tree=None if external else trees.pinned(tree),
            # One compile cache per tree: the two servers start at once, and one
            # tree's compiled artifacts should never be what the other runs.
            env={**env, "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm" / tree)},
            startup_timeout=args.startup_timeout,
            url_override=external[tree].rstrip("/") if external else None,
        )
        for tree in TREES
    }
    rows: list[dict] = []
    with ExitStack() as stack:
        if external:
            for tree, server in servers.items():
                wait_healthy(server.url, args.startup_timeout, name=tree)
        else:
            print(f"starting both servers (logs in {out / 'logs'})", flush=True)
            # Registered before starting: a server that fails must not leave the other running.
            for server in servers.values():
                stack.callback(server.stop)
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda s: s.start(), servers.values()))
        # The geometry the expectations use is the one the servers report.
        reported = {t: cache_config_info(s.url) for t, s in servers.items()}
        if reported["unpatched"] != reported["patched"]:
            raise SystemExit(f"error: the two servers' cache geometry differs: {reported}")
        if not args.locked_model and reported["patched"]["block"] != args.block:
            raise SystemExit(
                f"error: vLLM resolved the block to {reported['patched']['block']} tokens, "
                f"not the {args.block} asked for (its Mamba page did not fit the attention "
                "page); the expected hits would be wrong. Check --mamba-ssm-cache-dtype."
            )
        geo = Geometry(reported["patched"]["block"], reported["patched"]["unit"], num_spec, budget)
        work = [(rep, s) for rep in range(-1, args.reps) for s in args.shared]
        for rep, shared in tqdm(work, desc="repetitions x geometries", unit="pair"):
            order = TREES if rep % 2 == 0 else TREES[::-1]
            for tree in order:
                # vLLM's worker busy-polls for 1 s after its last request: on a
                # small machine the server that just finished would steal CPU
                # from the other one's first requests (patched cold A, with its
                # extra steps, measured 3x slower that way; alone, 1.1x).
                time.sleep(IDLE_GAP_S)
                pair = run_pair(servers[tree], tree, rep, shared, geo, args.tolerance)
                conv = run_conversation(servers[tree], tree, rep, shared, geo)
                if rep >= 0:  # rep -1 is the warm-up
                    rows += pair + conv
    summary = summarize(rows)
    judged = [r for r in rows if r["kind"] == "cached_B"]
    # The oracle can only fail if the answer depends on the context: count the
    # distinct answers the cold requests got.
    distinct = len({tuple(r["token_ids"]) for r in rows if r["kind"] in ("cold_A", "cold_B")})
    report = {
        "question": "cached follow-up TTFT, unpatched vs patched (fix-eagle-fine-prefix)",
        "prompt_pair": {
            "A": "context(S) + [13]",
            "B": f"context(S) + {TURN_LEN} user tokens",
            "isolation": "fresh context token ids per repetition",
            "conversation": f"4 turns, {REPLY_TOKENS}-token replies, {TURN_LEN}-token user turns",
        },
        "geometry": dataclasses.asdict(geo),
        "model": args.locked_model
        or {"tiny": "kit/tiny_model.py", "weights_sha256": weights_sha256(model_dir)},
        "reps": args.reps,
        "shared": args.shared,
        "summary": summary,
        "oracle": {
            "tolerance_first_logprob": args.tolerance,
            "verdicts": {
                v: sum(r["oracle"]["verdict"] == v for r in judged)
                for v in ("same", "tie", "wrong")
            },
            "max_first_logprob_diff": max(
                (
                    float("inf") if (d := r["oracle"]["first_logprob_diff"]) is None else d
                    for r in judged
                ),
            ),
            "distinct_cold_answers": distinct,
            "can_fail": distinct > 1,
            "wrong": sorted(
                {(r["tree"], r["S"], r["rep"]) for r in judged if r["oracle"]["verdict"] == "wrong"}
            ),
        },
        "failures": (problems := failures(rows, distinct)),
        "provenance": {
            "host": host_provenance(),
            "pins_sha256": pins.file_sha256(),
            "vllm": pins.get("vllm.version"),
            # External servers (one per image): the orchestrator's manifest has
            # the images' provenance.
            "trees": {} if external else {t: trees.pinned(t).mods_record() for t in TREES},
            "servers": {t: s.url for t, s in servers.items()},
            "commands": {
                "bench": [sys.executable, "-m", "kit.bench", *sys.argv[1:]],
                **{t: s.args for t, s in servers.items()},
            },
        },
    }
    (out / "raw.json").write_text(json.dumps(rows) + "\n")
    (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    headers, body = table(summary)
    md = [
        f"# TTFT, unpatched vs patched — {stamp}",
        "",
        __doc__.strip(),
        "",
        tabulate(body, headers=headers, tablefmt="github"),
        "",
        f"Correctness oracle (cached B vs cold B): verdicts {report['oracle']['verdicts']}; "
        f"max |first-position log-prob diff| {report['oracle']['max_first_logprob_diff']:.2e} "
        f"(tolerance {args.tolerance}); {distinct} distinct answers among the cold "
        "requests (the oracle can only fail when answers depend on the context).",
        "",
        f"Failures: {len(problems)}" + "".join(f"\n- {p}" for p in problems),
        "",
    ]
    (out / "bench.md").write_text("\n".join(md))
    try:
        from kit.plot import ttft_plot

        ttft_plot(summary, out / "ttft.png")
    except ImportError:
        pass
    print(tabulate(body, headers=headers))
    print(f"oracle: {report['oracle']}")
    print(f"results: {out}")
    for line in problems:
        print(line, file=sys.stderr)
    if problems and not args.record_only:
        print(f"FAILED: {len(problems)} problem(s) above; the bundle records them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
