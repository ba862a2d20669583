"""The container flow's steps (kit/images/orchestrate.py) on this machine, for real where it can.

Runs here: host-check stops (recorded hosts), model selection and offline
verification against the shipped models.lock, the NODES guard, junit
counting, image reuse rules, and — with buildah and the cpu images built
(``make bench-cpu-image ENGINE=buildah``) — an isolated network that two
containers share and nothing else reaches, and cleanup on interrupt.
The GPU targets' containers (nvidia runtime, /dev/kfd) cannot run here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.images import build as images
from kit.images import buildah_storage, hostcheck, orchestrate
from kit.images.containers import RUN_SPECS, BuildahEngine
from kit.vllm_tree import upstream_suite
from kit.weights import models
from tests.netprobe import host_listener

pytestmark = pytest.mark.cpu
HOSTS = Path(__file__).resolve().parents[1] / "data" / "hosts"
ROOT = Path(__file__).resolve().parents[2]


def test_host_check_stops_early_with_every_fix(tmp_path: Path) -> None:
    probe = hostcheck.Probe(HOSTS / "strix-small-gtt")
    with pytest.raises(orchestrate.OrchestrateError) as err:
        orchestrate.check_host("strix", tmp_path, probe)
    assert "gtt limit" in str(err.value) and "ttm.pages_limit=" in str(err.value)


def test_host_check_records_a_good_host(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(orchestrate.MIN_FREE_DISK_GIB, "gb10", 0)
    record = orchestrate.check_host("gb10", tmp_path, hostcheck.Probe(HOSTS / "gb10-ok"))
    assert all(c["ok"] for c in record["checks"])
    assert "free disk" in {c["check"] for c in record["checks"]}
    assert record["record"]["kernel"]


def test_host_check_wants_free_disk(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(orchestrate.MIN_FREE_DISK_GIB, "cpu", 10**6)
    with pytest.raises(orchestrate.OrchestrateError, match="free disk"):
        orchestrate.check_host("cpu", tmp_path)


def test_gpu_targets_refuse_unresolved_models(tmp_path: Path) -> None:
    # The shipped lock has no resolved revision yet (no hub access where it was made).
    with pytest.raises(orchestrate.OrchestrateError, match="unresolved"):
        orchestrate.bench_model("gb10", None, tmp_path)


def test_unknown_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(orchestrate.OrchestrateError, match="no model 'nope'"):
        orchestrate.bench_model("strix", "nope", tmp_path)


def test_cpu_target_needs_no_locked_model(tmp_path: Path) -> None:
    assert orchestrate.bench_model("cpu", None, tmp_path) is None


def test_the_tiny_model_the_containers_mount_is_readable_by_their_user(tmp_path: Path) -> None:
    from kit.weights.tiny_model import write_tiny_model

    # The servers and the client run as uid 10001 over a read-only mount of this folder.
    model = write_tiny_model(tmp_path / "tiny", weights=True)
    assert all(f.stat().st_mode & 0o004 for f in model.iterdir()), [
        (f.name, oct(f.stat().st_mode)) for f in model.iterdir()
    ]


def test_two_nodes_say_where_the_plan_is(capsys) -> None:
    assert orchestrate.main(["gb10", "--nodes", "2"]) == 2
    assert "Plan: two DGX Sparks" in capsys.readouterr().err


def test_junit_counts_xfail_apart_from_skip(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "@pytest.mark.xfail(strict=True)\n"
        "def test_xf(): assert False\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_sk(): pass\n"
        "def test_bad(): assert False\n"
    )
    junit = tmp_path / "j.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
            f"--junitxml={junit}",
            "-c",
            "/dev/null",
            "--rootdir",
            str(tmp_path),
        ],
        capture_output=True,
    )
    assert upstream_suite.counts(junit) == {
        "passed": 1,
        "failed": 1,
        "xfailed": 1,
        "skipped": 1,
    }


def test_no_regression_table_without_both_image_records(tmp_path: Path) -> None:
    """Without an image's record of its mods (suites stopped before writing it), the
    patched image would be judged as one with no fix: a problem, and no table."""
    outs = {stage: tmp_path / stage for stage in orchestrate.STAGES}
    measured = {stage: {"rows": []} for stage in orchestrate.STAGES}
    records = {"unpatched": {"vllm_version": "0.32.0", "mods": []}, "patched": {}}
    table, problems = orchestrate.regression_table(records, measured, tmp_path, outs)
    assert table is None
    assert problems == [
        "patched: no image record beside its measurement, so the regression table "
        f"cannot tell what the image carries; see {outs['patched']}"
    ]
    assert not any(tmp_path.rglob("regression.*"))
    # Nothing measured: nothing to judge, and the suites' exit status says why.
    empty = {stage: {} for stage in orchestrate.STAGES}
    assert orchestrate.regression_table(records, empty, tmp_path, outs) == (None, [])


def test_an_image_from_other_kit_sources_is_not_reused() -> None:
    labels = {
        images.SOURCE_LABEL: images.source_sha256(),
        images.PINS_LABEL: images.pins.file_sha256(),
    }
    assert images.is_current(labels)
    assert not images.is_current({**labels, images.SOURCE_LABEL: "0" * 64})
    assert not images.is_current({})


SERVE = (
    "import http.server, socketserver\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'kit')\n"
    "socketserver.TCPServer(('0.0.0.0', 8123), H).serve_forever()\n"
)
FETCH = (
    "import socket, sys, time, urllib.request\n"
    "for _ in range(60):\n"
    "    try:\n"
    "        body = urllib.request.urlopen('http://{host}:8123', timeout=2).read(); break\n"
    "    except OSError:\n"
    "        time.sleep(0.5)\n"
    "try:\n"
    "    socket.create_connection(('{outside}', {port}), 3); sys.exit(3)\n"
    "except OSError:\n"
    "    pass\n"
    "sys.exit(0 if body == b'kit' else 2)\n"
)


@pytest.mark.container
def test_containers_on_one_network_reach_each_other_and_nothing_else(cpu_images) -> None:
    refs = cpu_images
    # "Nothing else" is this machine's own address (a listener it reaches itself):
    # no host outside this machine is contacted to prove the cut.
    with host_listener() as (outside, port), BuildahEngine() as engine, engine.network() as net:
        server = engine.start(
            refs["unpatched"], ["python", "-c", SERVE], RUN_SPECS["cpu"], "srv", network=net
        )
        done = engine.run(
            refs["patched"],
            ["python", "-c", FETCH.format(host=net.address("srv"), outside=outside, port=port)],
            RUN_SPECS["cpu"],
            network=net,
            timeout=120,
        )
        assert server.alive(), server.logs()
        assert done.returncode == 0, done.output  # reached the server, not the internet


@pytest.mark.container
def test_interrupt_removes_everything_the_engine_started(cpu_images) -> None:
    refs = cpu_images
    engine = BuildahEngine()
    with pytest.raises(KeyboardInterrupt), engine, engine.network():
        box = engine.start(refs["patched"], ["sleep", "600"], RUN_SPECS["cpu"], "long")
        time.sleep(2)
        assert box.alive()
        working = set(engine.working.values())
        holders = list(engine.holders.values())
        raise KeyboardInterrupt
    assert not box.alive()
    assert not engine.started and not engine.holders and not engine.processes
    listed = subprocess.run(
        ["buildah", *buildah_storage.flags(), "containers", "-q"], capture_output=True, text=True
    ).stdout.split()
    assert working and not working & set(listed)
    assert all(h.poll() is not None for h in holders)


# -- dry runs of bench-gb10 / bench-strix against recorded hosts ----------------------


def test_dry_run_refuses_the_shipped_unresolved_pins_naming_make_lock(capsys) -> None:
    code = orchestrate.main(["gb10", "--dry-run", "--recorded-host", str(HOSTS / "gb10-ok")])
    err = capsys.readouterr().err
    assert code == 2
    assert "images.gb10.base" in err and "make lock" in err and "BASE_IMAGE=" in err


@pytest.mark.parametrize("target,host", [("gb10", "gb10-ok"), ("strix", "strix-ok")])
def test_a_gpu_flow_says_it_never_ran_when_it_starts(target: str, host: str, capsys) -> None:
    orchestrate.main([target, "--dry-run", "--recorded-host", str(HOSTS / host)])
    notes = [line for line in capsys.readouterr().err.splitlines() if "never run" in line]
    assert notes == [f"note: {orchestrate.NEVER_RUN[target]}"]


@pytest.fixture()
def resolved(tmp_path: Path, monkeypatch) -> dict:
    """pins.toml and a models lock after `make lock` ran against the loopback fakes."""
    from kit.vllm_tree import pins
    from kit.weights import models
    from tests.hub_server import FakeHub, HubServer, tiny_repo_files
    from tests.pins.test_lock import FakeRegistry, _git_repo, run_lock

    repo, head = _git_repo(tmp_path)
    pin_file = tmp_path / "pins.toml"
    pin_file.write_text(
        (ROOT / "pins.toml")
        .read_text()
        .replace(
            f'commit_abbrev = "{pins.get("vllm.commit_abbrev")}"', f'commit_abbrev = "{head[:9]}"'
        )
    )
    models_lock = tmp_path / "models.lock"
    models_lock.write_text(
        'version = 1\n\n[models.tiny]\nrepo = "kit-test/tiny-hybrid"\nrole = "primary"\n'
        'targets = ["gb10", "strix"]\nenabled = true\nrevision = "unresolved"\nserve_args = []\n'
    )
    with (
        FakeRegistry({"nvidia/cuda", "library/ubuntu"}) as registry,
        HubServer(FakeHub(tiny_repo_files())) as hub,
    ):
        online = {"pins": pin_file, "models": models_lock, "repo": repo}
        done = run_lock({**online, "registry": registry, "hub": hub}, "gb10", "strix")
    # The release tags are absent from the fake repository; the rest resolved.
    assert "images.gb10.base: sha256" not in done.stdout
    real_load, real_models = pins.load, models.load
    monkeypatch.setattr(pins, "load", lambda path=pin_file: real_load(path))
    monkeypatch.setattr(models, "load", lambda path=models_lock: real_models(path))
    assert pins.is_resolved(pins.get("images.gb10.base"))
    assert pins.is_resolved(pins.get("images.strix.base"))
    return online


@pytest.mark.parametrize(
    "target,host,platform",
    [("gb10", "gb10-ok", "linux/arm64"), ("strix", "strix-no-rocminfo", "linux/amd64")],
)
def test_dry_run_with_resolved_pins_prints_the_exact_commands(
    resolved: dict, capsys, target: str, host: str, platform: str, monkeypatch, tmp_path: Path
) -> None:
    lock = images.lock_file(
        target, platform.replace("linux/arm64", "aarch64").replace("linux/amd64", "x86_64")
    )
    if not lock.is_file():
        # Only the strix lock can be missing: AMD's index is out of reach of our build
        # machines. The flow says so, naming the command...
        code = orchestrate.main([target, "--dry-run", "--recorded-host", str(HOSTS / host)])
        assert code == 2
        assert f"locks/{lock.relative_to(images.LOCKS)} (make lock-deps)" in (
            capsys.readouterr().err
        )
        # ... and with the file in place goes on to the build.
        stand_in = tmp_path / lock.relative_to(images.LOCKS)
        stand_in.parent.mkdir(parents=True)
        stand_in.write_text("# stand-in: the dry run reads no package from it\n")
        monkeypatch.setattr(images, "LOCKS", tmp_path)
    code = orchestrate.main([target, "--dry-run", "--recorded-host", str(HOSTS / host)])
    out, err = capsys.readouterr()
    assert code == 0, err
    builds = [line for line in out.splitlines() if line.startswith("+ docker buildx build")]
    assert len(builds) == 2
    for stage, line in zip(("unpatched", "patched"), builds, strict=True):
        assert f"--platform {platform} --target {stage}" in line
        # The resolved digest, as the build argument the Dockerfile's FROM reads.
        assert f"BASE_IMAGE={images.pins.get(f'images.{target}.base')}" in line
        # The image's own release by default (0.34.0; VLLM=0.32.0 the pinned one).
        release = images.pins.image_release(target)
        assert f"VLLM_VERSION={release} " in line and f":{release}-{stage} " in line
    servers = [line for line in out.splitlines() if line.startswith("+ docker run")]
    assert [("kit-unpatched" in s, "kit-patched" in s) for s in servers] == [
        (True, False),
        (False, True),
    ]
    for line in servers:
        assert "--ipc=host" in line and "--shm-size" not in line
        assert "VLLM_CACHE_ROOT=/kit-cache/vllm" in line and "--model tiny" in line
    assert "kit.weights.models verify --model tiny" in out
    assert out.count("wait until its log says") == 2


def test_a_one_server_dry_run_prints_every_session(resolved: dict, capsys) -> None:
    argv = ["gb10", "--dry-run", "--recorded-host", str(HOSTS / "gb10-ok"), "--one-server"]
    code = orchestrate.main([*argv, "--reps", "3", "--block-reps", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    # Sessions U[0,1] P[0,1,2] U[2]: three servers, each followed by its client and
    # removed before the next starts, then the merge.
    runs = [line for line in out.splitlines() if line.startswith(("+ docker run", "+ docker rm"))]
    kinds = [
        "server" if " run -d " in line else "remove" if " rm " in line else "client"
        for line in runs
    ]
    assert kinds == ["server", "client", "remove"] * 3 + ["client"]
    assert all(":/out" in line for line, kind in zip(runs, kinds, strict=True) if kind == "client")
    assert out.count("--serve-only") == 3
    for session in ("unpatched:0,1", "patched:0,1,2", "unpatched:2"):
        assert f"--session {session}" in out
    assert "--merge-sessions /out/sessions/01-unpatched /out/sessions/02-patched" in out


def test_dry_run_stops_at_a_failing_recorded_host(resolved: dict, capsys) -> None:
    code = orchestrate.main(["strix", "--dry-run", "--recorded-host", str(HOSTS / "strix-no-kfd")])
    assert code == 2
    assert "device nodes" in capsys.readouterr().err


class _Server:
    """A started server as the engines hand it back: alive() and logs() only."""

    def __init__(self, lines: list[str], alive: bool = True) -> None:
        self.lines, self._alive = lines, alive

    def alive(self) -> bool:
        return self._alive

    def logs(self) -> str:
        return "\n".join(self.lines)


def test_the_next_server_waits_for_the_first_to_serve() -> None:
    orchestrate.wait_ready(_Server(["loading", f"INFO: {orchestrate.READY_LINE}."]), "unpatched")
    with pytest.raises(orchestrate.OrchestrateError, match="exited while starting"):
        orchestrate.wait_ready(_Server(["CUDA out of memory"], alive=False), "unpatched")
    with pytest.raises(orchestrate.OrchestrateError, match="did not report"):
        orchestrate.wait_ready(_Server(["loading"]), "patched", timeout=0)


def test_each_image_gets_its_own_compile_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(orchestrate, "COMPILE_CACHES", tmp_path)
    a = orchestrate.compile_cache("gb10", "sha256:" + "a" * 64)
    b = orchestrate.compile_cache("gb10", "sha256:" + "b" * 64)
    assert a != b and a.is_dir() and (a.stat().st_mode & 0o777) == 0o777
    env = dict(orchestrate.with_compile_cache(RUN_SPECS["gb10"]).env)
    assert env["VLLM_CACHE_ROOT"].startswith(orchestrate.IN_IMAGE_CACHE)
    assert env["HF_HUB_OFFLINE"] == "1"  # the spec's own environment stays


def _entry(key: str, weights_gib: float, kv_bytes: int) -> models.Entry:
    size = int(weights_gib * hostcheck.GIB)
    return models.Entry(
        key=key,
        repo=f"kit-test/{key}",
        revision="0" * 40,
        targets=["gb10", "strix"],
        enabled=True,
        fields={"serve_args": ["--kv-cache-memory-bytes", str(kv_bytes)]},
        files=[models.LockedFile("model.safetensors", size, "0" * 64)],
    )


def test_two_servers_must_fit_the_box_together() -> None:
    mem = hostcheck.host_record(hostcheck.Probe(HOSTS / "strix-ok"))["mem_total_gib"]
    gib = hostcheck.GIB
    # Strix Halo with two BF16 copies of a 35B model: refused, with the numbers.
    problem = orchestrate.memory_fit(_entry("bf16-35b", 67, 4 * gib), mem)
    assert problem and "2 x (67 GiB weights + 4 GiB KV cache" in problem and "MODEL=" in problem
    # The FP8 checkpoint GB10 serves fits twice.
    assert orchestrate.memory_fit(_entry("fp8-35b", 36, 8 * gib), mem) is None
