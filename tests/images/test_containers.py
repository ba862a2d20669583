"""The container adapter: one encoding of each target's run flags, and the engines."""

from __future__ import annotations

import os
import shutil

import pytest

from kit.images.containers import (
    RUN_SPECS,
    BuildahEngine,
    DockerEngine,
    EngineUnavailable,
    _isolated_loopback_up,
    host_gids,
)
from tests.netprobe import PROBE, host_listener

pytestmark = pytest.mark.cpu


def test_strix_flags_without_privileged() -> None:
    flags = RUN_SPECS["strix"].cli_flags()
    groups = host_gids(("video", "render"))
    assert {
        "--device=/dev/kfd",
        "--device=/dev/dri",
        *(f"--group-add={g}" for g in groups),
    } <= set(flags)
    assert "seccomp=unconfined" in flags and "--privileged" not in flags
    assert "--network=none" in flags  # runs offline
    kwargs = RUN_SPECS["strix"].sdk_kwargs()
    assert kwargs["devices"] == ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]
    assert kwargs["group_add"] == groups
    assert kwargs["network_mode"] == "none" and "privileged" not in kwargs


def test_gb10_flags_and_sdk_kwargs_agree() -> None:
    spec = RUN_SPECS["gb10"]
    flags = spec.cli_flags()
    assert "--runtime=nvidia" in flags and "--gpus=all" in flags and "--ipc=host" in flags
    kwargs = spec.sdk_kwargs()
    assert kwargs["runtime"] == "nvidia" and kwargs["ipc_mode"] == "host"
    assert kwargs["device_requests"][0]["Capabilities"] == [["gpu"]]
    assert {u["Name"] for u in kwargs["ulimits"]} == {"memlock", "stack"}
    assert kwargs["environment"] == {"HF_HUB_OFFLINE": "1"}


def test_groups_are_passed_as_the_hosts_numeric_ids() -> None:
    import grp

    known = grp.getgrgid(0).gr_name  # every host has gid 0
    assert host_gids((known, "no-such-group-kit")) == ["0", "no-such-group-kit"]


def test_docker_engine_without_an_engine_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(EngineUnavailable, match="DOCKER_HOST"):
        DockerEngine()


def test_buildah_engine_refuses_gpu_specs() -> None:
    with pytest.raises(EngineUnavailable, match="GPU"):
        BuildahEngine().run("any", ["true"], RUN_SPECS["gb10"])


def test_our_own_namespace_does_not_pass_for_an_isolated_one() -> None:
    """Its loopback is up too: a holder that has not run ``unshare`` yet must not
    be taken for ready, or a container joining it runs on the host's network."""
    assert not _isolated_loopback_up(os.getpid())


@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
    reason="network namespaces need root, unshare and nsenter",
)
def test_a_buildah_network_is_its_own_namespace_once_yielded() -> None:
    """Every time, also when nothing else delays the first container: the holder's
    namespace is not ours by the time a container may join it."""
    engine = BuildahEngine(storage=())
    ours = os.readlink("/proc/self/ns/net")
    for _ in range(20):
        with engine.network() as net:
            holder = engine.holders[net.name].pid
            assert os.readlink(f"/proc/{holder}/ns/net") != ours
    assert not engine.holders  # each holder stopped


@pytest.mark.container
def test_buildah_engine_runs_offline_in_the_cpu_image(cpu_images) -> None:
    # No default route, and this machine's own address unreachable: cut, proven
    # without contacting any host outside this machine.
    with host_listener() as (address, port), BuildahEngine() as engine:
        probe = PROBE.format(address=address, port=port)
        done = engine.run(cpu_images["patched"], ["python", "-c", probe], RUN_SPECS["cpu"])
        assert done.returncode == 0, done.output  # the network is cut off
    assert not engine.started and not engine.processes  # nothing left behind


def test_docker_engine_on_loopback_ignores_a_dead_proxy(monkeypatch) -> None:
    """A Docker-compatible API on 127.0.0.1 (a stand-in answering the SDK's version and
    ping calls) is reached directly although every proxy variable names a dead proxy."""
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Engine(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            body = (
                b"OK"
                if self.path.endswith("/_ping")
                else json.dumps({"ApiVersion": "1.44", "Version": "stand-in"}).encode()
            )
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening
    proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{httpd.server_address[1]}")
    try:
        engine = DockerEngine()
        engine.client.ping()
    finally:
        httpd.shutdown()
        dead.close()
    assert any(p.endswith("/_ping") for p in seen)
    assert "no_proxy" not in os.environ  # the SDK's set-up left the environment as it was
