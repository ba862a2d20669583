"""Cached follow-up TTFT, unpatched vs patched vLLM, measured side by side in one run.

Prompt pair (token ids; written into the results): probe A = shared context of S
tokens + one "." token (a context load); follow-up B = the same context + a
48-token user turn. Per repetition and geometry, on each server: A (cold),
B (cached: the measurement), B again (exact repeat: lower bound), then the
prefix cache is reset and B is sent once more (cold: upper bound, and the
correctness reference for the cached B). After the repeat, a control: a fresh
context loaded cold, then a follow-up that resumes at its block boundary and
prefills as many uncached tokens as the fix's cached B, in the fewest engine steps
the tree gives such a resume (cached B / control: how far cached B is from that floor).
Also a 4-turn conversation.
Every request's cached-token count must equal the geometry model's number and
every cached answer must pass the oracle (``kit/bench/oracle.py``); otherwise
the run fails, naming the tree, S and repetition (``--record-only`` records
instead).
Isolation: every repetition uses a fresh context (new token ids), so one
repetition cannot warm the next. Servers are interleaved A B A B … with the
order swapped every repetition; one warm-up repetition is excluded. Where the
kit runs both servers, the trees take turns request by request (each request
kind's pair a fraction of a second apart), the idle server paused with SIGSTOP
so it takes no CPU; servers reached by URL take turns a repetition at a time.
``--one-server``: one server at a time, the trees in alternating blocks of
repetitions (A B B A; ``kit/bench/one_server.py``), for a box that cannot hold
two servers of the model.
No pass/fail threshold on TTFT: the report gives medians, spread and ratios
(patched/unpatched per repetition: median, min-max and a seeded 95 % bootstrap
interval of the median, per request kind and S, and pooled: later turns, cold A,
cold B over every S). Each request also records the host's steal time around it
(``kit/bench/host_steal.py``): on a virtual machine with a CPU quota the host
pauses the whole machine now and then (the kit's 2-core build machine: ~100 ms,
in about one request in nine), so the pooled table is given again without the
pairs a pause hit.
Checkpoint path (``--checkpoints``, CPU default): ``internal`` (default) switches
the CPU GDN layers' in-pass export on in both servers
(VLLM_CPU_GDN_PREFILL_CHECKPOINT=1) under an 8192-token step budget, so every
prompt is one chunk and the layer writes the prompt checkpoint's state (the
geometry model's "internal-1" regime); ``split`` leaves the variable out under a
2048-token budget, and the scheduler ends a chunk at every state it keeps.
Model (``--arch``, CPU default): ``qwen3_next`` (default) the tiny Qwen3-Next
checkpoint; ``qwen3_5_moe`` the same sizes in the primary model's architecture
(Qwen3.5/3.6-MoE, native MTP), served with --language-model-only and, where no
torchvision is installed, the kit's torchvision stand-in (``kit/weights/tiny_model.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple, NoReturn

from kit import bundle
from kit.bench import one_server, regime_fit, step_log
from kit.bench import plan as bench_plan
from kit.bench.bench_lock import BenchBusy, bench_lock
from kit.bench.md_blocks import kernels_line, result_blocks, retention_text
from kit.bench.openai_client import MetricsError, RequestError, served_release
from kit.bench.plan import BenchPlan, BenchPlanError
from kit.bench.serve import Server, ServerError, server_command, server_env, wait_healthy
from kit.bench.serve_args import (
    CHECKPOINT_ENV,
    TINY_DRAFTER_LOOKAHEAD,
    client_release,
    cpu_serve_args,
    fix_flags,
    hash_lookahead,
    locked_serve_args,
)
from kit.bench.ttft import (
    PROBE_TOKEN,
    REPLY_TOKENS,
    TREES,
    TURN_LEN,
    MeasureError,
    geometry_from,
    interleaved,
    one_tree,
    pausable,
    reported_geometry,
    served_geometry,
)
from kit.bench.ttft_stats import (
    distinct_cold_answers,
    engine_pooled,
    failures,
    hop_gap,
    host_pauses,
    oracle_summary,
    pooled_ratios,
    ratio_method,
    summarize,
)
from kit.geometry.geometry_model import Geometry
from kit.vllm_tree import pins, releases, trees
from kit.weights import models
from kit.weights.tiny_model import (
    DIR_NAMES,
    arch_of,
    needs_vision_stand_in,
    serve_env,
    serve_extra_args,
)

ROOT = Path(__file__).resolve().parents[2]
# Exit statuses of a run stopped by a signal: 128 + the signal, as a shell reports it.
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwind (stopping both servers) and exit 128 + signal.

    A BaseException so no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _frame: object) -> None:
    # A second signal must not cut the clean-up of the first short.
    for sig in EXIT_SIGNAL:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def space_problem() -> str | None:
    """What a space in a path the servers compile from would break, or None.

    torch's compile step (inductor, at every CPU server's start) runs g++ with a
    command line it splits at spaces: the include paths under the Python
    environment (torch's headers), the compile cache under the checkout
    (VLLM_CACHE_ROOT) and torch's temporary folder must have none. The servers would
    fail only after loading the model (the compile comes late in their start-up, and
    the engine then hangs); the kit cannot quote torch's command, so it refuses up
    front."""
    move = "move the checkout to a path without spaces (and run make setup there)"
    places = [
        ("the checkout", ROOT, move),
        ("the Python environment", Path(sys.prefix), move),
        ("the temporary folder", Path(tempfile.gettempdir()), "set TMPDIR to one without"),
    ]
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        places.append(
            (
                "TORCHINDUCTOR_CACHE_DIR",
                Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]),
                "point it at a path without spaces, or unset it",
            )
        )
    for what, path, fix in places:
        if any(ch.isspace() for ch in str(path)):
            return (
                f"{what} ({path}) has a space in its path, and torch's compile step splits "
                f"its compiler command at spaces, so the servers would fail to start; {fix}"
            )
    return None


def longest_prompt(shared: int) -> int:
    """The longest sequence a repetition sends at context length S: the fourth
    conversation turn and its reply."""
    return shared + TURN_LEN + 3 * (REPLY_TOKENS + TURN_LEN) + REPLY_TOKENS


def max_model_len(serve: list[str]) -> int | None:
    """The servers' ``--max-model-len`` when the plan sets one."""
    if "--max-model-len" in serve:
        return int(serve[serve.index("--max-model-len") + 1])
    return None


def build_parser() -> argparse.ArgumentParser:
    """``kit bench``'s options, each with its help (``kit.bench.plan.build_parser``)."""
    return bench_plan.build_parser(__doc__)


def parse_args(argv: list[str] | None) -> BenchPlan:
    """The plan of a ``kit bench`` command line (``kit.bench.plan.from_argv``, with
    this module's description in its help)."""
    return bench_plan.from_argv(argv, __doc__)


class Served(NamedTuple):
    """What the servers are started with: the arguments both trees get, the extra
    switches of the server under test (the fix's), the environment, MTP draft tokens,
    and what the bundle records of the model."""

    base: list[str]
    patched_extra: list[str]
    env: dict[str, str]
    num_spec: int
    model_record: dict
    # vLLM's num_hash_lookahead_tokens for these servers (serve_args.hash_lookahead).
    hash_lookahead: int = 0

    def args(self, fix: bool) -> list[str]:
        """A server's arguments; ``fix``: it is the one under test
        (``kit.bench.plan.carries_fix``)."""
        return self.base + (self.patched_extra if fix else [])


def serve_plan(plan: BenchPlan) -> Served:
    """The servers of the plan: a models.lock entry's (``locked_served``) or the CPU
    default's tiny model (``tiny_served``); with --step-log, vLLM's per-step log."""
    served = locked_served(plan) if plan.model else tiny_served(plan)
    if plan.logs_steps:
        # vLLM logs its steps (and the fence its counts) at INFO: a shell that
        # quietened vLLM (VLLM_LOGGING_LEVEL=ERROR) would leave the log empty.
        served = served._replace(
            base=[*served.base, step_log.FLAG], env={**served.env, **step_log.ENV}
        )
    return served


def locked_served(plan: BenchPlan) -> Served:
    """``--model KEY``: the models.lock entry, verified offline first."""
    base, num_spec, lookahead = locked_serve_args(plan.model, plan.store, plan.unit, plan.budget)
    return Served(base, fix_flags(plan.target), {}, num_spec, {"locked": plan.model}, lookahead)


def tiny_served(plan: BenchPlan) -> Served:
    """The CPU default: the tiny model of ``plan.arch`` (``--model-dir``, or written
    here), on the plan's checkpoint path (its step budget and environment)."""
    from kit.weights.tiny_model import weights_sha256, write_tiny_model

    arch = plan.arch
    if plan.model_dir:
        model_dir = plan.model_dir
        if weights_sha256(model_dir) is None:
            raise models.VerifyError(f"{model_dir}: no tiny model weights; run 'make tiny-model'")
        declared = arch_of(model_dir)
        if (model_dir / "config.json").is_file() and declared != arch:
            raise models.VerifyError(
                f"{model_dir}: its config.json declares model type {declared or 'unknown'}, "
                f"not --arch {arch}; pass the --arch of the model there (kit tiny-model "
                f"--arch {arch} writes one)"
            )
    elif plan.serve_only:  # inside an image the kit's folder is read-only
        tmp = Path(tempfile.gettempdir())
        model_dir = write_tiny_model(tmp / DIR_NAMES[arch], weights=True, arch=arch)
    else:
        model_dir = write_tiny_model(ROOT / ".models" / DIR_NAMES[arch], weights=True, arch=arch)
    base = cpu_serve_args(model_dir, plan.block, plan.unit, plan.num_spec, plan.budget)
    base += serve_extra_args(arch)
    record = {
        "tiny": "kit/weights/tiny_model.py",
        "arch": arch,
        "weights_sha256": weights_sha256(model_dir),
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **plan.path.env}
    # The hashing and the switches of the release the servers run (--vllm), read from
    # its tree; the default is the .venv's, which this process finds.
    package = releases.tree(plan.vllm, "unpatched").package if plan.vllm else None
    lookahead = hash_lookahead(base, plan.num_spec, TINY_DRAFTER_LOOKAHEAD, package)
    flags = fix_flags(plan.target, plan.vllm)
    return Served(base, flags, env, plan.num_spec, record, lookahead)


def check_fits(plan: BenchPlan, served: Served) -> None:
    """Every repetition's longest sequence within the servers' model length."""
    limit = max_model_len(served.base)
    too_long = [s for s in plan.shared if limit and longest_prompt(s) > limit]
    if too_long:
        raise BenchPlanError(
            f"--shared {' '.join(map(str, too_long))}: a repetition at S sends up to "
            f"S + {longest_prompt(0)} tokens and the model's length is {limit}; "
            f"use S <= {limit - longest_prompt(0)}"
        )


# Start-up of a server whose warm-up runs Triton's interpreter (vLLM 0.34.0 on the CPU):
# 250-330 s alone on 2 cores, measured, most of it the sampler's kernels; two at once
# share the cores.
INTERPRETED_STARTUP_S = 2400.0


def startup_timeout(plan: BenchPlan, tree: trees.Tree | None) -> float:
    """How long a server may take to answer /health: the plan's, or longer where its
    kernels run under Triton's interpreter."""
    interpreted = tree is not None and tree.serve_env.get("TRITON_INTERPRET") == "1"
    return max(plan.startup_timeout, INTERPRETED_STARTUP_S) if interpreted else plan.startup_timeout


def bench_trees(plan: BenchPlan, which: tuple[str, ...] = TREES) -> dict[str, trees.Tree]:
    """The trees the servers run from: the plan's release's (``--vllm``), each built
    first when missing or stale."""
    return {tree: releases.tree(plan.release, tree) for tree in which}


def check_release(tree: str, url: str) -> None:
    """A server given by URL must run the release this process finds: the expected
    hits follow its hashing (``serve_args.hash_lookahead`` reads it here)."""
    served = served_release(url)
    here = client_release()
    if served != here:
        found = f"vLLM {here}" if here else "no vLLM"
        raise ServerError(
            f"--server-url {tree}: the server runs vLLM {served} and this client finds "
            f"{found}; the expected hits follow the servers' release, so run the "
            f"client where vLLM {served} is installed"
        )


def start_servers(
    stack: ExitStack,
    plan: BenchPlan,
    served: Served,
    out: Path,
    pinned: dict[str, trees.Tree] | None = None,
    which: tuple[str, ...] = TREES,
    log_tag: str = "",
    start: bool = True,
    external: dict[str, str] | None = None,
) -> dict[str, Server]:
    """The servers of the trees in ``which`` (default both) up (or, with
    --server-url, reachable); each one's stop is registered before any starts, so a
    failure never leaves the other running. ``start=False``: the records only
    (merging one-server sessions, whose servers' URLs are ``external``, else the
    plan's). ``log_tag`` tells one server session's log from another's.

    A tiny model whose vLLM code needs more than the tree (``tiny_model.serve_env``:
    the torchvision stand-in of Qwen3.5/3.6) gets it in a folder of this run's,
    removed when the run ends."""
    external = plan.external if external is None else external
    if pinned is None:
        pinned = {} if external else bench_trees(plan, which)
    arch_env = {tree: {} for tree in TREES}
    if pinned and plan.arch not in (None, bench_plan.DEFAULT_ARCH):
        scratch = Path(tempfile.mkdtemp(prefix="kit-bench-"))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        for tree, found in pinned.items():
            # The tree's search path first: the value replaces the one the tree sets.
            arch_env[tree] = serve_env(plan.arch, scratch / "vision-stand-in", found.search_path)
    # Started from a tree: as its mods say; by URL: as the plan declares the side.
    fix = {tree: bench_plan.carries_fix(tree, pinned.get(tree)) for tree in which}
    servers = {
        tree: Server(
            tree,
            served.args(fix[tree]),
            out / bundle.LOGS / f"server-{tree}{log_tag}.log",
            tree=pinned.get(tree),
            # One compile cache per tree: the two servers start at once, and one
            # tree's compiled artifacts should never be what the other runs.
            env={
                **served.env,
                **(pinned[tree].serve_env if tree in pinned else {}),
                **arch_env[tree],
                "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm" / tree),
            },
            startup_timeout=startup_timeout(plan, pinned.get(tree)),
            url_override=external[tree].rstrip("/") if external else None,
            fix=fix[tree],
        )
        for tree in which
    }
    if not start:
        return servers
    if external:
        for tree, server in servers.items():
            wait_healthy(server.url, plan.startup_timeout, name=tree)
            check_release(tree, server.url)
        return servers
    print(f"starting {' and '.join(which)} (logs in {out / bundle.LOGS})", flush=True)
    for server in servers.values():
        stack.callback(server.stop)
    pool = ThreadPoolExecutor(max_workers=len(servers))
    try:
        for future in [pool.submit(s.start) for s in servers.values()]:
            future.result()
    except BaseException:
        # Stopping ends the other start's health wait, so the pool can be joined
        # (a signal or one failed start must not wait out the other's timeout).
        for server in servers.values():
            server.stop()
        raise
    finally:
        pool.shutdown(wait=True)
    return servers


def run_record(
    servers: dict[str, Server],
    tree_records: dict[str, dict],
    release: str | None = None,
    serve_env: dict[str, dict] | None = None,
) -> dict:
    """``tree_records``: the trees' mod records as the servers were started from them
    (read before, not after: a mod edited during the run rebuilds a tree on the next
    ``releases.tree``, and the record must name what was served); ``release``: the
    servers' vLLM (default the pinned one); ``serve_env``: what each tree's server
    needed beyond the bench's environment (``Tree.serve_env``)."""
    return {
        "host": bundle.host_record(),
        "pins_sha256": pins.file_sha256(),
        "vllm": release or pins.get("vllm.version"),
        **({"serve_env": serve_env} if serve_env and any(serve_env.values()) else {}),
        # Servers in images: the images' records are in the manifest (and the
        # orchestrator copies them here); started here: the trees' mod records.
        "trees": tree_records,
        "servers": {t: s.url for t, s in servers.items()},
        "commands": {
            "bench": [sys.executable, "-m", "kit.bench.run", *sys.argv[1:]],
            **{t: s.args for t, s in servers.items()},
        },
    }


def model_label(record: dict) -> str:
    """The model of a bench.json ``model`` record, for the markdown header."""
    if "locked" in record:
        return f"models.lock {record['locked']}"
    # Records written before --arch existed are the Qwen3-Next tiny model's.
    return f"tiny {record.get('arch', 'qwen3_next')} (CPU default)"


def servers_line(schedule: dict | None, pairing: str | None = None) -> str:
    if not schedule and pairing == "request":
        return (
            "Servers: both at once, the trees taking turns request by request (A B, then "
            "B A the next repetition), the idle server paused (SIGSTOP) meanwhile."
        )
    if not schedule:
        return "Servers: both at once, the trees interleaved per repetition (A B, then B A)."
    sessions = " ".join(
        f"{s['tree']}[{','.join(map(str, s['reps']))}]" for s in schedule["sessions"]
    )
    return (
        f"Servers: one at a time, blocks of {schedule['block_reps']} repetitions in A B B A "
        f"order; sessions (tree[repetitions], one server start each): {sessions}."
    )


def markdown(report: dict) -> str:

    oracle_part = report["oracle"]
    problems = report["failures"]
    geo = report["geometry"]
    method = report["ratio_method"]
    env = " ".join(f"{k}={v}" for k, v in report["checkpoints"]["env"].items())
    return "\n".join(
        [
            f"# TTFT, unpatched vs patched, vLLM {report['run']['vllm']}, "
            f"{model_label(report.get('model') or {})}",
            "",
            __doc__.strip(),
            "",
            f"Checkpoint path: **{report['path']}** (geometry regime {geo['checkpoints']}; "
            f"step budget {geo['budget']}; block {geo['block']}, H {geo['unit']}, "
            f"MTP k={geo['num_spec']}; {retention_text(geo)}; "
            f"{env or 'no checkpoint variable'}).",
            *regimes_line(report["checkpoints"].get("by_tree")),
            "",
            servers_line(report.get("one_server"), report.get("pairing")),
            "",
            *kernels_line(report),
            *interpreter_line(report),
            *result_blocks(
                report,
                "Pooled over every S (ratios of the same repetition, S and request; "
                f"{method['interval']}, {method['resamples']} resamples, seed {method['seed']}):",
            ),
            f"Correctness oracle (cached B vs cold B): verdicts {oracle_part['verdicts']}; "
            f"max |first-position log-prob diff| {oracle_part['max_first_logprob_diff']:.2e} "
            f"(tolerance {oracle_part['tolerance_first_logprob']}); "
            f"{oracle_part['distinct_cold_answers']} distinct answers among the cold "
            "requests (the oracle can only fail when answers depend on the context).",
            "",
            f"Failures: {len(problems)}" + "".join(f"\n- {p}" for p in problems),
            "",
        ]
    )


def interpreter_line(report: dict) -> list[str]:
    """Servers whose Triton kernels ran under Triton's interpreter (vLLM 0.34.0 on the
    CPU: mods/cpu-triton-interpreter) time the interpreter, not the fix."""
    env = report["run"].get("serve_env") or {}
    under = [tree for tree, found in env.items() if found.get("TRITON_INTERPRET") == "1"]
    if not under:
        return []
    return [
        f"Triton kernels: under Triton's interpreter on {' and '.join(under)} "
        "(TRITON_INTERPRET=1: no triton-cpu for this release here). Every Triton kernel "
        "(sampler, align-mode copies, the fix's checkpoint store) runs in Python, about "
        "0.2 s an engine step: hits, steps and the oracle are the release's, the times "
        "and ratios are not what the fix costs compiled; never quote them as such.",
        "",
    ]


def regimes_line(by_tree: dict | None) -> list[str]:
    """Where the servers' vLLM chose the checkpoint regime, the one each tree's hits
    fit (``regime_fit``); nothing where the kit set it."""
    if not by_tree or not any(t["observed"] for t in by_tree.values()):
        return []
    said = "; ".join(
        f"{tree} {t['regime']} (fit: {', '.join(t['fits']) or 'none'})"
        for tree, t in by_tree.items()
    )
    return [f"Regime the servers' hits fit, by tree: {said}."]


def main(argv: list[str] | None = None) -> int:
    try:
        plan = parse_args(argv)
    except BenchPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Servers this process starts (or becomes): they compile with torch.
    if plan.starts_servers:
        problem = space_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    with ExitStack() as stack:
        # A bench that starts its servers here holds the checkout's lock from before
        # it writes anything (the tiny model under .models, the results folder) until
        # its servers are stopped. With --server-url the servers are someone else's
        # (the container flow runs each client in its own container).
        if plan.starts_servers and not plan.serve_only:
            try:
                stack.enter_context(bench_lock())
            except BenchBusy as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        return _main(plan)


def _main(plan: BenchPlan) -> int:
    try:
        served = serve_plan(plan)
        check_fits(plan, served)
    except (models.LockError, models.VerifyError, BenchPlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan.mode == "print":
        return print_serve_args(plan, served)
    if plan.mode == "serve":
        become_server(plan, served)
    chosen = plan.out is None
    # Another release than the pin's is named in the folder (the index reads the record).
    label = plan.model or ("cpu" if plan.vllm is None else f"cpu-vllm{plan.vllm}")
    out = plan.out or bundle.new_path(label)
    out.mkdir(parents=True, exist_ok=True)
    previous = {sig: signal.signal(sig, _interrupt) for sig in EXIT_SIGNAL}
    try:
        return run(plan, out, served)
    except Interrupted as exc:
        _give_up(out, chosen, f"stopped by {exc}; both servers stopped", "interrupted")
        return EXIT_SIGNAL[exc.signum]
    except KeyboardInterrupt:
        _give_up(out, chosen, "stopped by SIGINT; both servers stopped", "interrupted")
        return EXIT_SIGNAL[signal.SIGINT]
    except (
        MeasureError,
        one_server.SessionError,
        ServerError,
        RequestError,
        MetricsError,
        OSError,
    ) as exc:
        where = _give_up(out, chosen, str(exc), "failed", say=False)
        # One line. The error may name a file in the run's folder (a server's log),
        # which _give_up renamed when the kit chose the folder; a full disk or the
        # file size limit says what to do about it.
        message = bundle.write_problem(exc) or str(exc)
        message = message.replace(str(out), str(where)) if where != out else message
        # failed.json is named only where it was written (a full disk may refuse it too).
        kept = (
            f"with {bundle.FAILED}"
            if (where / bundle.FAILED).is_file()
            else f"no {bundle.FAILED}: it could not be written either"
        )
        print(f"error: {message} (the run's folder, {kept}: {where})", file=sys.stderr)
        return 1
    except BaseException as exc:
        # Anything else (a tree that cannot be built, a bug): the folder still says
        # why, and the error goes on up (kit/cli.py: one line for a kit error, the
        # traceback for a bug).
        _give_up(out, chosen, f"{type(exc).__name__}: {exc}", "failed")
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _give_up(out: Path, chosen: bool, reason: str, status: str, say: bool = True) -> Path:
    """A run that wrote no bench.json says why in failed.json; a folder the kit named
    itself gets a ``-failed`` suffix so nothing takes it for a bundle. Returns where
    it is now; ``say``: print why and where (else the caller does, in its own line)."""
    if (out / bundle.BENCH).is_file():
        return out
    unwritten = ""
    try:
        bundle.write_failed(out, reason, status)
    except OSError as exc:  # a full or read-only disk: said in the one line, after the first error
        unwritten = f"; {bundle.FAILED} could not be written ({bundle.write_problem(exc) or exc})"
    if chosen:
        moved = out.with_name(out.name + "-failed")
        os.replace(out, moved)
        out = moved
    if say:
        print(f"{status}: {reason}; what the run left is in {out}{unwritten}", file=sys.stderr)
    return out


# -- the run modes (``BenchPlan.mode``) ------------------------------------------------


def print_serve_args(plan: BenchPlan, served: Served) -> int:
    """``--print-serve-args``: the servers' arguments, environment, path and budget."""
    shown = {"args": served.base, "patched_extra": served.patched_extra, "env": served.env}
    shown |= {"checkpoints": plan.checkpoints, "budget": plan.budget}
    shown |= {"vllm": plan.release, "hash_lookahead": served.hash_lookahead}
    if plan.vllm is not None:  # the release's trees say what their servers need
        shown["serve_env"] = {tree: dict(t.serve_env) for tree, t in bench_trees(plan).items()}
    if not plan.model:
        # Started here, such servers also get the torchvision stand-in on their
        # PYTHONPATH (kit.weights.tiny_model.serve_env) when this says true.
        shown |= {"arch": plan.arch, "vision_stand_in": needs_vision_stand_in(plan.arch)}
    print(json.dumps(shown))
    return 0


def become_server(plan: BenchPlan, served: Served) -> NoReturn:
    """``--serve-only TREE``: exec that tree's server (the installed vLLM; the fix's
    switches where its mods carry the fix)."""
    fix = bench_plan.carries_fix(plan.serve_only, trees.installed())
    cmd = server_command(plan.host, plan.port, served.args(fix))
    env = served.env
    if not plan.model and needs_vision_stand_in(plan.arch):
        # The installed vllm (search path empty); a folder of this server's own.
        scratch = Path(tempfile.mkdtemp(prefix="kit-serve-"))
        env = {**env, **serve_env(plan.arch, scratch / "vision-stand-in")}
    print("$ " + shlex.join(cmd), flush=True)
    os.execve(cmd[0], cmd, server_env(env))


def check_block(plan: BenchPlan, geo: Geometry) -> None:
    if not plan.model and geo.block != plan.block:
        raise MeasureError(
            f"vLLM resolved the block to {geo.block} tokens, not the {plan.block} "
            "asked for (its Mamba page did not fit the attention page); the expected "
            "hits would be wrong. Check --mamba-ssm-cache-dtype."
        )


class Measured(NamedTuple):
    """What a measuring mode hands the report: the rows, the geometry they were
    checked against, the servers, and how the trees took turns."""

    rows: list[dict]
    geo: Geometry
    servers: dict[str, Server]
    schedule: dict | None = None  # one server at a time (``one_server.schedule_record``)
    pairing: str | None = None  # the interleaved run's turn-taking (``ttft.interleaved``)


Progress = Callable


def measure_alone(
    plan: BenchPlan,
    served: Served,
    server: Server,
    tree: str,
    reps: tuple[int, ...],
    progress: Progress,
) -> tuple[dict, Geometry, list[dict]]:
    """One server's session: the geometry it reports, checked, and its repetitions."""
    reported = reported_geometry(server)
    geo = geometry_from(
        reported, served.num_spec, plan.budget, plan.path.regime, served.hash_lookahead
    )
    check_block(plan, geo)
    rows = one_tree(server, tree, geo, reps, list(plan.shared), plan.tolerance, progress)
    return reported, geo, rows


def measure_session(plan: BenchPlan, out: Path, served: Served, progress: Progress) -> int:
    """``--session TREE:REPS``: one running server, these repetitions, a session record."""
    tree, reps = plan.session
    with ExitStack() as stack:
        server = start_servers(stack, plan, served, out, {}, (tree,))[tree]
        reported, _, rows = measure_alone(plan, served, server, tree, reps, progress)
    record = one_server.record(
        tree, reps, list(plan.shared), reported, rows, {"url": server.url, "args": server.args}
    )
    print(f"session record: {one_server.write(out, record)}")
    return 0


def merge_sessions(
    plan: BenchPlan, out: Path, served: Served, pinned: dict, progress: Progress
) -> Measured:
    """``--merge-sessions DIR...``: the rows of the session records; no server."""
    records = one_server.read(list(plan.merge_sessions))
    rows, reported = one_server.merge(records, plan.reps, list(plan.shared))
    geo = geometry_from(
        reported, served.num_spec, plan.budget, plan.path.regime, served.hash_lookahead
    )
    urls = {r["tree"]: r["server"]["url"] for r in records}
    with ExitStack() as stack:
        servers = start_servers(stack, plan, served, out, {}, start=False, external=urls)
    schedule = [(r["tree"], tuple(r["reps"])) for r in records]
    return Measured(rows, geo, servers, one_server.schedule_record(plan.block_reps, schedule))


def run_sessions(
    plan: BenchPlan, out: Path, served: Served, pinned: dict, progress: Progress
) -> Measured:
    """``--one-server``: each session's server started alone, measured, stopped before
    the next starts (``kit.bench.one_server``)."""
    schedule = one_server.sessions(plan.reps, plan.block_reps)
    records, last = [], {}
    for index, (tree, reps) in enumerate(schedule, 1):
        print(f"session {index}/{len(schedule)}: {tree}, repetitions {list(reps)}", flush=True)
        with ExitStack() as stack:
            tag = f"-{index}"
            started = start_servers(stack, plan, served, out, pinned, (tree,), tag)
            server = started[tree]
            reported, geo, rows = measure_alone(plan, served, server, tree, reps, progress)
        records.append(one_server.record(tree, reps, list(plan.shared), reported, rows, {}))
        last[tree] = server
    rows, _ = one_server.merge(records, plan.reps, list(plan.shared))
    return Measured(rows, geo, last, one_server.schedule_record(plan.block_reps, schedule))


def run_interleaved(
    plan: BenchPlan, out: Path, served: Served, pinned: dict, progress: Progress
) -> Measured:
    """Both servers at once (started here, or reached by --server-url), the trees
    taking turns (``ttft.interleaved``)."""
    with ExitStack() as stack:
        servers = start_servers(stack, plan, served, out, pinned)
        geo = served_geometry(
            servers, served.num_spec, plan.budget, plan.path.regime, served.hash_lookahead
        )
        check_block(plan, geo)
        pairing = "request" if pausable(servers) else "repetition"
        rows = interleaved(servers, geo, plan.reps, list(plan.shared), plan.tolerance, progress)
    return Measured(rows, geo, servers, pairing=pairing)


# The modes that make a bundle, by ``BenchPlan.mode``.
MEASURES = {"merge": merge_sessions, "one-server": run_sessions, "interleaved": run_interleaved}


def run(plan: BenchPlan, out: Path, served: Served) -> int:
    from tqdm import tqdm

    from kit.weights.tiny_model import write_tiny_model

    if not plan.model:  # the config; the weights stay out
        write_tiny_model(out / DIR_NAMES[plan.arch], arch=plan.arch)
    progress = lambda work: tqdm(work, desc="repetitions x geometries", unit="pair")  # noqa: E731
    if plan.mode == "session":
        return measure_session(plan, out, served, progress)
    external = plan.servers or plan.merge_sessions
    pinned = {} if external else bench_trees(plan)
    tree_records = {tree: found.mods_record() for tree, found in pinned.items()}
    measured = MEASURES[plan.mode](plan, out, served, pinned, progress)
    rows, geo, servers = measured.rows, measured.geo, measured.servers
    # Off the CPU the servers' vLLM picks the checkpoint regime: read it off the hits.
    regimes = (
        regime_fit.fit(rows, geo.checkpoints)
        if plan.target != "cpu"
        else regime_fit.assumed(geo.checkpoints)
    )
    summary = summarize(rows)
    pauses = host_pauses(rows)
    # Every server this run started logs here (one-server runs: one per session).
    logs = {tree: sorted((out / bundle.LOGS).glob(f"server-{tree}*.log")) for tree in TREES}
    report = {
        "question": "cached follow-up TTFT, unpatched vs patched (fix-eagle-fine-prefix)",
        "prompt_pair": {
            "A": f"context(S) + [{PROBE_TOKEN}]",
            "B": f"context(S) + {TURN_LEN} user tokens",
            "isolation": "fresh context token ids per repetition",
            "conversation": f"4 turns, {REPLY_TOKENS}-token replies, {TURN_LEN}-token user turns",
            "control": "a fresh context of one block plus up to three units loaded cold, "
            "then resumed at the block boundary with as many uncached tokens as the fix's "
            "cached B (kit.geometry.geometry_model.boundary_control)",
        },
        "geometry": dataclasses.asdict(geo),
        "path": plan.checkpoints,
        "checkpoints": {
            "path": plan.checkpoints,
            "regime": geo.checkpoints,
            # Per tree: the regime its hits were judged by (regime_fit).
            "by_tree": regimes,
            "budget": plan.budget,
            # The servers' checkpoint switch (from --server-url: what the servers
            # were told by the orchestrator, which passes the same --checkpoints).
            "env": {k: v for k, v in served.env.items() if k == CHECKPOINT_ENV},
        },
        "model": served.model_record,
        "reps": plan.reps,
        "shared": list(plan.shared),
        "summary": summary,
        "pooled_ratios": pooled_ratios(rows),
        "ratio_method": ratio_method(),
        "host_pauses": pauses,
        "pooled_ratios_unpaused": pooled_ratios(rows, drop_paused=True) if pauses else None,
        "pooled_ratios_engine_prefill": engine_pooled(rows),
        "hop_gap": hop_gap(rows),
        "oracle": oracle_summary(rows, plan.tolerance),
        "failures": failures(rows, distinct_cold_answers(rows)),
        "run": run_record(
            servers,
            tree_records,
            plan.vllm,
            {tree: dict(found.serve_env) for tree, found in pinned.items()},
        ),
        "engine_steps": step_log.from_logs(logs) if plan.logs_steps else None,
        "fence": step_log.fence(logs) if plan.logs_steps else None,
    }
    if measured.schedule is not None:
        report["one_server"] = measured.schedule
    if measured.pairing is not None:
        report["pairing"] = measured.pairing
    # The environment that ran the servers: started here, this one; in images,
    # the client's (the same image as the patched server).
    report["run"]["environment"] = bundle.record_environment(out)
    if plan.vllm is not None:
        # The releases past the pin carry the fenced fix (fix-eagle-fine-prefix-lookahead,
        # which logs its counts in the step log): its exports must go through the fence.
        fixed = next(tree for tree, found in pinned.items() if found.patched)
        report["failures"] += step_log.fence_problems(report["fence"] or {}, fixed)
    text = markdown(report)
    bundle.write_bench(out, report, rows, text)
    print(text)
    print(f"results: {out}")
    problems = report["failures"]
    for line in problems:
        print(line, file=sys.stderr)
    if problems and not plan.record_only:
        print(f"FAILED: {len(problems)} problem(s) above; the bundle records them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
