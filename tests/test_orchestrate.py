"""The container flow's steps (kit/orchestrate.py) on this machine, for real where it can.

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

from kit import buildah_storage, hostcheck, images, orchestrate, upstream_suite
from kit.containers import RUN_SPECS, BuildahEngine
from tests.netprobe import host_listener

pytestmark = pytest.mark.cpu
HOSTS = Path(__file__).parent / "data" / "hosts"
ROOT = Path(__file__).resolve().parent.parent


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
    from kit.tiny_model import write_tiny_model

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
