"""Cached follow-up TTFT, unpatched vs patched vLLM, measured side by side in one run.

Prompt pair (token ids; written into the results): probe A = shared context of S
tokens + one "." token (a context load); follow-up B = the same context + a
48-token user turn. Per repetition and geometry, on each server: A (cold),
B (cached: the measurement), B again (exact repeat: lower bound), then the
prefix cache is reset and B is sent once more (cold: upper bound, and the
correctness reference for the cached B). Also a 4-turn conversation.
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
import fcntl
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kit import bundle
from kit.bench import one_server, oracle, step_log
from kit.bench.md_blocks import kernels_line, result_blocks
from kit.bench.openai_client import MetricsError, RequestError
from kit.bench.serve import Server, ServerError, server_command, server_env, wait_healthy
from kit.bench.serve_args import (
    CHECKPOINT_ENV,
    CHECKPOINT_PATHS,
    CPU_BLOCK,
    DEFAULT_CHECKPOINTS,
    PATH_BUDGET,
    PATH_ENV,
    PATH_REGIME,
    batched_tokens,
    cpu_serve_args,
    fix_flags,
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
    host_pauses,
    oracle_summary,
    pooled_ratios,
    ratio_method,
    summarize,
)
from kit.geometry.geometry_model import UNIT, Geometry
from kit.vllm_tree import mods, pins, trees
from kit.weights import models
from kit.weights.tiny_model import (
    ARCHS,
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


class BenchBusy(RuntimeError):
    """Another bench holds this checkout's bench lock."""


@contextmanager
def bench_lock() -> Iterator[None]:
    """Hold this checkout's bench lock (``.cache/bench.lock``) for the block, or raise
    BenchBusy at once. Two benches at once share the CPUs (and the compile caches
    under .cache/vllm), and each would measure the other's load as its own.

    ``flock``: the kernel drops it when its holder ends, however it ends (``kill -9``
    too), so there is no stale lock to clean up; the pid written into the file is
    only for the message. The descriptor is close-on-exec and ``subprocess`` closes
    it in children, so a server or a watchdog never holds it."""
    path = ROOT / ".cache" / "bench.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            who, stop = (f"pid {holder}", f"kill {holder}") if holder.isdigit() else ("", "")
            raise BenchBusy(
                f"another bench ({who or 'pid unknown'}) is running in this checkout "
                f"({ROOT}): two at once share the CPUs and overlap their measurements; "
                f"wait until it ends{f', or stop it ({stop})' if stop else ''}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


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
    """``kit bench``'s options, each with its help."""
    # The options first (what a user looks for), the method after them.
    summary, _, method = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        description=summary,
        epilog=method,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--reps", type=positive_int, default=10, help="repetitions (default: %(default)s)"
    )
    parser.add_argument(
        "--shared",
        type=positive_int,
        nargs="+",
        default=[900, 1007, 2048, 2159],
        help="context lengths S (default: %(default)s: inside the first 2048-token "
        "block, S mod 16 = 4 and 15; block-aligned; beyond it)",
    )
    # Named as vLLM names the same settings; the kit's older spellings stay as aliases.
    parser.add_argument(
        "--block-size",
        "--block",
        dest="block",
        type=int,
        default=CPU_BLOCK,
        help="the hybrid model's physical block in tokens, as vLLM's --block-size "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--prefix-match-unit",
        "--unit",
        dest="unit",
        type=int,
        default=UNIT,
        help="vLLM's --prefix-match-unit H, the prefix-cache hit granularity "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        "--num-spec",
        dest="num_spec",
        type=int,
        default=1,
        help="MTP draft tokens per step, as vLLM's speculative config names it "
        "(0: no speculation; default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoints",
        choices=CHECKPOINT_PATHS,
        help="how the CPU default's GDN layers materialise a state: internal (default: "
        f"{CHECKPOINT_ENV}=1 in both servers, step budget {PATH_BUDGET['internal']}) or "
        f"split (the variable absent, step budget {PATH_BUDGET['split']}); with --model: "
        "split only (the served model's layers and hardware choose its path)",
    )
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        help="the CPU default's tiny model: qwen3_next (default: Qwen3-Next) or "
        "qwen3_5_moe (the primary model's Qwen3.5/3.6-MoE architecture, served with "
        "--language-model-only); not with --model",
    )
    parser.add_argument(
        "--out", type=Path, help="the bundle folder (default: results/<date>-cpu-<id>)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to answer /health (default: %(default)s)",
    )
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
        "--one-server",
        action="store_true",
        help="one server at a time: the trees in alternating blocks of repetitions "
        "(A B B A), for a box that cannot hold two servers of the model",
    )
    parser.add_argument(
        "--block-reps",
        type=positive_int,
        default=one_server.DEFAULT_BLOCK_REPS,
        help="with --one-server: repetitions per block (default: %(default)s)",
    )
    parser.add_argument(
        "--session",
        metavar="TREE:REPS",
        help="(the container flow's one-server mode) measure these repetitions on the one "
        "--server-url TREE=URL and write a session record into --out, no bundle",
    )
    parser.add_argument(
        "--merge-sessions",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="(the container flow's one-server mode) make the bundle in --out from the "
        "session records in these folders; starts no server",
    )
    parser.add_argument(
        "--step-log",
        action="store_true",
        help="start both servers with vLLM's per-step log and compare the trees' engine "
        "steps by kind in the bundle (kit/bench/step_log.py; servers started here)",
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
        "--model",
        metavar="KEY",
        help="serve this models.lock entry (verified offline first) instead of "
        "the CPU default's tiny model; inside the gb10/strix images",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        metavar="DIR",
        help="the CPU default's tiny model (config and weights) to serve, or, with "
        "--server-url, the one the servers serve: its weights are hashed into the "
        "bundle (default: written here)",
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=models.DEFAULT_STORE,
        help="model store for --model (default: %(default)s)",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [item for item in args.server_url if "=" not in item]
    if bad:
        parser.error(f"--server-url {bad[0]!r}: write TREE=URL, e.g. unpatched=http://host:8000")
    external = dict(item.split("=", 1) for item in args.server_url)
    bad = [url for url in external.values() if not url.startswith(("http://", "https://"))]
    if bad:
        parser.error(f"--server-url {bad[0]!r}: not an http:// or https:// URL")
    if args.session:
        try:
            args.session = one_server.parse_session(args.session, args.reps)
        except ValueError as exc:
            parser.error(str(exc))
        if set(external) != {args.session[0]} or args.out is None:
            parser.error(
                f"--session {args.session[0]}:... measures one running server: give "
                f"--server-url {args.session[0]}=URL (only that one) and --out"
            )
    elif external and set(external) != set(TREES):
        parser.error("--server-url needs both unpatched=URL and patched=URL")
    modes = [m for m in ("one_server", "session", "merge_sessions") if getattr(args, m)]
    if len(modes) > 1 or (args.one_server or args.merge_sessions) and external:
        parser.error(
            "--one-server starts its servers itself; --session measures one running server; "
            "--merge-sessions starts none: give one of them, and --server-url only with "
            "--session"
        )
    if args.merge_sessions and args.out is None:
        parser.error("--merge-sessions needs --out: the bundle folder to write")
    if args.step_log and (external or args.session or args.merge_sessions):
        parser.error(
            "--step-log reads the logs of the servers this run starts; with --server-url, "
            "--session or --merge-sessions the servers run elsewhere: start them with "
            f"{step_log.FLAG} and read their logs there"
        )
    args.external = external
    if args.model and args.arch:
        parser.error(
            "--arch chooses the CPU default's tiny model; a --model is served as "
            "models.lock says: leave --arch out"
        )
    args.arch = args.arch or "qwen3_next"
    if args.model:
        if args.checkpoints == "internal":
            parser.error(
                "--checkpoints internal switches the CPU GDN export of the CPU default; "
                "a --model's path is its layers' and hardware's: leave it out"
            )
        args.checkpoints = "split"
    elif args.checkpoints is None:
        args.checkpoints = DEFAULT_CHECKPOINTS
    if args.checkpoints == "split" and not args.model and CHECKPOINT_ENV in os.environ:
        parser.error(
            f"--checkpoints split: {CHECKPOINT_ENV} is set in this environment and the "
            "servers would inherit it; unset it (--checkpoints chooses the path)"
        )
    if args.out is not None and bundle.existing_bundle(args.out):
        parser.error(
            f"--out {args.out} already holds a bench run ({bundle.BENCH}, {bundle.RAW} or "
            f"{bundle.FAILED}); name a new folder or leave --out out for a fresh one"
        )
    return args


def serve_plan(args: argparse.Namespace) -> tuple[list[str], list[str], dict, int, dict]:
    """Server arguments (both trees), the patched tree's extra switches, the server
    environment, MTP draft tokens, and what the bundle records of the model."""
    from kit.weights.tiny_model import weights_sha256, write_tiny_model

    patched_extra = fix_flags(args.target)
    if args.model:
        base, num_spec = locked_serve_args(args.model, args.store, args.unit)
        return base, patched_extra, {}, num_spec, {"locked": args.model}
    arch = args.arch
    if args.model_dir:
        model_dir = args.model_dir
        if weights_sha256(model_dir) is None:
            raise models.VerifyError(f"{model_dir}: no tiny model weights; run 'make tiny-model'")
        declared = arch_of(model_dir)
        if (model_dir / "config.json").is_file() and declared != arch:
            raise models.VerifyError(
                f"{model_dir}: its config.json declares model type {declared or 'unknown'}, "
                f"not --arch {arch}; pass the --arch of the model there (kit tiny-model "
                f"--arch {arch} writes one)"
            )
    elif args.serve_only:  # inside an image the kit's folder is read-only
        tmp = Path(tempfile.gettempdir())
        model_dir = write_tiny_model(tmp / DIR_NAMES[arch], weights=True, arch=arch)
    else:
        model_dir = write_tiny_model(ROOT / ".models" / DIR_NAMES[arch], weights=True, arch=arch)
    path = args.checkpoints
    base = cpu_serve_args(model_dir, args.block, args.unit, args.num_spec, PATH_BUDGET[path])
    base += serve_extra_args(arch)
    record = {
        "tiny": "kit/weights/tiny_model.py",
        "arch": arch,
        "weights_sha256": weights_sha256(model_dir),
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **PATH_ENV[path]}
    return base, patched_extra, env, args.num_spec, record


def start_servers(
    stack: ExitStack,
    args: argparse.Namespace,
    base: list[str],
    patched_extra: list[str],
    env: dict,
    out: Path,
    pinned: dict[str, trees.Tree] | None = None,
    which: tuple[str, ...] = TREES,
    log_tag: str = "",
    start: bool = True,
) -> dict[str, Server]:
    """The servers of the trees in ``which`` (default both) up (or, with
    --server-url, reachable); each one's stop is registered before any starts, so a
    failure never leaves the other running. ``start=False``: the records only
    (merging one-server sessions). ``log_tag`` tells one server session's log from
    another's.

    A tiny model whose vLLM code needs more than the tree (``tiny_model.serve_env``:
    the torchvision stand-in of Qwen3.5/3.6) gets it in a folder of this run's,
    removed when the run ends."""
    if pinned is None:
        pinned = {} if args.external else {tree: trees.pinned(tree) for tree in which}
    arch_env = {tree: {} for tree in TREES}
    if pinned and args.arch != "qwen3_next":
        scratch = Path(tempfile.mkdtemp(prefix="kit-bench-"))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        for tree, found in pinned.items():
            # The tree's search path first: the value replaces the one the tree sets.
            arch_env[tree] = serve_env(args.arch, scratch / "vision-stand-in", found.search_path)
    servers = {
        tree: Server(
            tree,
            base + (patched_extra if tree == "patched" else []),
            out / bundle.LOGS / f"server-{tree}{log_tag}.log",
            tree=pinned.get(tree),
            # One compile cache per tree: the two servers start at once, and one
            # tree's compiled artifacts should never be what the other runs.
            env={
                **env,
                **arch_env[tree],
                "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm" / tree),
            },
            startup_timeout=args.startup_timeout,
            url_override=args.external[tree].rstrip("/") if args.external else None,
        )
        for tree in which
    }
    if not start:
        return servers
    if args.external:
        for tree, server in servers.items():
            wait_healthy(server.url, args.startup_timeout, name=tree)
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
    args: argparse.Namespace, servers: dict[str, Server], tree_records: dict[str, dict]
) -> dict:
    """``tree_records``: the trees' mod records as the servers were started from them
    (read before, not after: a mod edited during the run rebuilds a tree on the next
    ``trees.pinned``, and the record must name what was served)."""
    return {
        "host": bundle.host_record(),
        "pins_sha256": pins.file_sha256(),
        "vllm": pins.get("vllm.version"),
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
            f"MTP k={geo['num_spec']}; {env or 'no checkpoint variable'}).",
            "",
            servers_line(report.get("one_server"), report.get("pairing")),
            "",
            *kernels_line(report),
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Servers this process starts (or becomes): they compile with torch.
    serves = not (args.external or args.merge_sessions or args.print_serve_args)
    if serves:
        problem = space_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    with ExitStack() as stack:
        # A bench that starts its servers here holds the checkout's lock from before
        # it writes anything (the tiny model under .models, the results folder) until
        # its servers are stopped. With --server-url the servers are someone else's
        # (the container flow runs each client in its own container).
        if serves and not args.serve_only:
            try:
                stack.enter_context(bench_lock())
            except BenchBusy as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    try:
        base, patched_extra, env, num_spec, model_record = serve_plan(args)
    except (models.LockError, models.VerifyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.step_log:
        base = [*base, step_log.FLAG]
    limit = max_model_len(base)
    too_long = [s for s in args.shared if limit and longest_prompt(s) > limit]
    if too_long:
        print(
            f"error: --shared {' '.join(map(str, too_long))}: a repetition at S sends up to "
            f"S + {longest_prompt(0)} tokens and the model's length is {limit}; "
            f"use S <= {limit - longest_prompt(0)}",
            file=sys.stderr,
        )
        return 2
    if args.print_serve_args:
        plan = {"args": base, "patched_extra": patched_extra, "env": env}
        plan |= {"checkpoints": args.checkpoints, "budget": batched_tokens(base)}
        if not args.model:
            # Started here, such servers also get the torchvision stand-in on their
            # PYTHONPATH (kit.weights.tiny_model.serve_env) when this says true.
            plan |= {"arch": args.arch, "vision_stand_in": needs_vision_stand_in(args.arch)}
        print(json.dumps(plan))
        return 0
    if args.serve_only:
        cmd = server_command(
            args.host, args.port, base + (patched_extra if args.serve_only == "patched" else [])
        )
        if not args.model and needs_vision_stand_in(args.arch):
            # The installed vllm (search path empty); a folder of this server's own.
            scratch = Path(tempfile.mkdtemp(prefix="kit-serve-"))
            env = {**env, **serve_env(args.arch, scratch / "vision-stand-in")}
        print("$ " + shlex.join(cmd), flush=True)
        os.execve(cmd[0], cmd, server_env(env))
    chosen = args.out is None
    out = args.out or bundle.new_path(args.model or "cpu")
    out.mkdir(parents=True, exist_ok=True)
    previous = {sig: signal.signal(sig, _interrupt) for sig in EXIT_SIGNAL}
    try:
        return run(args, out, base, patched_extra, env, num_spec, model_record)
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
        # which _give_up renamed when the kit chose the folder.
        message = str(exc).replace(str(out), str(where)) if where != out else str(exc)
        print(f"error: {message} (the run's folder, with failed.json: {where})", file=sys.stderr)
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
    try:
        bundle.write_failed(out, reason, status)
    except OSError as exc:  # a full or read-only disk: say so, and keep the first error
        print(f"could not write {out / bundle.FAILED}: {exc}", file=sys.stderr)
    if chosen:
        moved = out.with_name(out.name + "-failed")
        os.replace(out, moved)
        out = moved
    if say:
        print(f"{status}: {reason}; what the run left is in {out}", file=sys.stderr)
    return out


def check_block(args: argparse.Namespace, geo: Geometry) -> None:
    if not args.model and geo.block != args.block:
        raise MeasureError(
            f"vLLM resolved the block to {geo.block} tokens, not the {args.block} "
            "asked for (its Mamba page did not fit the attention page); the expected "
            "hits would be wrong. Check --mamba-ssm-cache-dtype."
        )


def measure_alone(
    args: argparse.Namespace,
    server: Server,
    tree: str,
    reps: tuple[int, ...],
    num_spec: int,
    budget: int,
    progress,
) -> tuple[dict, Geometry, list[dict]]:
    """One server's session: the geometry it reports, checked, and its repetitions."""
    reported = reported_geometry(server)
    geo = geometry_from(reported, num_spec, budget, PATH_REGIME[args.checkpoints])
    check_block(args, geo)
    return reported, geo, one_tree(server, tree, geo, reps, args.shared, args.tolerance, progress)


def run_sessions(
    args: argparse.Namespace,
    out: Path,
    base: list[str],
    patched_extra: list[str],
    env: dict,
    pinned: dict[str, trees.Tree],
    plan: list[tuple[str, tuple[int, ...]]],
    num_spec: int,
    budget: int,
    progress,
) -> tuple[list[dict], Geometry, dict[str, Server]]:
    """``--one-server``: each session's server started alone, measured, stopped before
    the next starts (``kit.bench.one_server``)."""
    records, last = [], {}
    for index, (tree, reps) in enumerate(plan):
        print(f"session {index + 1}/{len(plan)}: {tree}, repetitions {list(reps)}", flush=True)
        with ExitStack() as stack:
            server = start_servers(
                stack, args, base, patched_extra, env, out, pinned, (tree,), f"-{index + 1}"
            )[tree]
            reported, geo, rows = measure_alone(
                args, server, tree, reps, num_spec, budget, progress
            )
        records.append(one_server.record(tree, reps, args.shared, reported, rows, {}))
        last[tree] = server
    rows, _ = one_server.merge(records, args.reps, args.shared)
    return rows, geo, last


def measure_session(
    args: argparse.Namespace,
    out: Path,
    base: list[str],
    patched_extra: list[str],
    env: dict,
    num_spec: int,
    budget: int,
    progress,
) -> int:
    """``--session TREE:REPS``: one running server, these repetitions, a session record."""
    tree, reps = args.session
    with ExitStack() as stack:
        server = start_servers(stack, args, base, patched_extra, env, out, {}, (tree,))[tree]
        reported, _, rows = measure_alone(args, server, tree, reps, num_spec, budget, progress)
    path = one_server.write(
        out,
        one_server.record(
            tree, reps, args.shared, reported, rows, {"url": server.url, "args": server.args}
        ),
    )
    print(f"session record: {path}")
    return 0


def run(
    args: argparse.Namespace,
    out: Path,
    base: list[str],
    patched_extra: list[str],
    env: dict,
    num_spec: int,
    model_record: dict,
) -> int:
    from tqdm import tqdm

    from kit.weights.tiny_model import write_tiny_model

    if not args.model:  # the config; the weights stay out
        write_tiny_model(out / DIR_NAMES[args.arch], arch=args.arch)
    budget = batched_tokens(base)
    regime = PATH_REGIME[args.checkpoints]
    external = args.external or args.merge_sessions
    pinned = {} if external else {tree: trees.pinned(tree) for tree in TREES}
    tree_records = {tree: found.mods_record() for tree, found in pinned.items()}
    progress = lambda work: tqdm(work, desc="repetitions x geometries", unit="pair")  # noqa: E731
    schedule = None
    pairing = None  # the interleaved run's turn-taking (``ttft.interleaved``)
    if args.session:
        return measure_session(args, out, base, patched_extra, env, num_spec, budget, progress)
    if args.merge_sessions:
        records = one_server.read(args.merge_sessions)
        rows, reported = one_server.merge(records, args.reps, args.shared)
        geo = geometry_from(reported, num_spec, budget, regime)
        args.external = {r["tree"]: r["server"]["url"] for r in records}
        with ExitStack() as stack:
            servers = start_servers(stack, args, base, patched_extra, env, out, {}, start=False)
        schedule = one_server.schedule_record(
            args.block_reps, [(r["tree"], tuple(r["reps"])) for r in records]
        )
    elif args.one_server:
        plan = one_server.sessions(args.reps, args.block_reps)
        rows, geo, servers = run_sessions(
            args, out, base, patched_extra, env, pinned, plan, num_spec, budget, progress
        )
        schedule = one_server.schedule_record(args.block_reps, plan)
    else:
        with ExitStack() as stack:
            servers = start_servers(stack, args, base, patched_extra, env, out, pinned)
            geo = served_geometry(servers, num_spec, budget, regime)
            check_block(args, geo)
            pairing = "request" if pausable(servers) else "repetition"
            rows = interleaved(servers, geo, args.reps, args.shared, args.tolerance, progress)
    summary = summarize(rows)
    pauses = host_pauses(rows)
    report = {
        "question": "cached follow-up TTFT, unpatched vs patched (fix-eagle-fine-prefix)",
        "prompt_pair": {
            "A": f"context(S) + [{PROBE_TOKEN}]",
            "B": f"context(S) + {TURN_LEN} user tokens",
            "isolation": "fresh context token ids per repetition",
            "conversation": f"4 turns, {REPLY_TOKENS}-token replies, {TURN_LEN}-token user turns",
        },
        "geometry": dataclasses.asdict(geo),
        "path": args.checkpoints,
        "checkpoints": {
            "path": args.checkpoints,
            "regime": geo.checkpoints,
            "budget": budget,
            # The servers' checkpoint switch (from --server-url: what the servers
            # were told by the orchestrator, which passes the same --checkpoints).
            "env": {k: v for k, v in env.items() if k == CHECKPOINT_ENV},
        },
        "model": model_record,
        "reps": args.reps,
        "shared": args.shared,
        "summary": summary,
        "pooled_ratios": pooled_ratios(rows),
        "ratio_method": ratio_method(),
        "host_pauses": pauses,
        "pooled_ratios_unpaused": pooled_ratios(rows, drop_paused=True) if pauses else None,
        "pooled_ratios_engine_prefill": engine_pooled(rows),
        "oracle": oracle_summary(rows, args.tolerance),
        "failures": failures(rows, distinct_cold_answers(rows)),
        "run": run_record(args, servers, tree_records),
        # Every server this run started logs here (one-server runs: one per session).
        "engine_steps": step_log.from_logs(
            {tree: sorted((out / bundle.LOGS).glob(f"server-{tree}*.log")) for tree in TREES}
        )
        if args.step_log
        else None,
    }
    if schedule is not None:
        report["one_server"] = schedule
    if pairing is not None:
        report["pairing"] = pairing
    # The environment that ran the servers: started here, this one; in images,
    # the client's (the same image as the patched server).
    report["run"]["environment"] = bundle.record_environment(out)
    text = markdown(report)
    bundle.write_bench(out, report, rows, text)
    print(text)
    print(f"results: {out}")
    problems = report["failures"]
    for line in problems:
        print(line, file=sys.stderr)
    if problems and not args.record_only:
        print(f"FAILED: {len(problems)} problem(s) above; the bundle records them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
