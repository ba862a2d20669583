"""The container adapter: one encoding of each target's run flags, and the engines."""

from __future__ import annotations

import pytest

from kit.containers import (
    RUN_SPECS,
    BuildahEngine,
    DockerEngine,
    EngineUnavailable,
    host_gids,
)

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


# Exits 0 only when no connection to the outside can be made.
OFFLINE_PROBE = (
    "import socket, sys\n"
    "try:\n    socket.create_connection(('pypi.org', 443), 3)\n"
    "except OSError:\n    sys.exit(0)\n"
    "sys.exit(1)"
)


@pytest.mark.container
def test_buildah_engine_runs_offline_in_the_cpu_image(cpu_images) -> None:
    with BuildahEngine() as engine:
        done = engine.run(cpu_images["patched"], ["python", "-c", OFFLINE_PROBE], RUN_SPECS["cpu"])
        assert done.returncode == 0, done.output  # the network is cut off
    assert not engine.started and not engine.processes  # nothing left behind
