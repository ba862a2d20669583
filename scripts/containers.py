"""One small adapter for every container the kit runs: Docker SDK, or buildah here.

``DockerEngine`` drives Docker or Podman's Docker-compatible service through the
Docker SDK (``DOCKER_HOST=unix:///run/user/$UID/podman/podman.sock`` for Podman).
``BuildahEngine`` runs commands in images with ``buildah run`` where no engine
exists (this is how the CPU image is exercised on our build machines). Both
remove every container they started, also when the run fails or is interrupted.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field


class EngineUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class RunSpec:
    """How a target's containers run, encoded once for the CLI and for the SDK."""

    gpus: bool = False
    runtime: str | None = None
    devices: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    ipc_host: bool = True
    shm_size: str = "4g"
    ulimits: tuple[tuple[str, int, int], ...] = ()
    network: bool = False  # cut off: proof that nothing is fetched at run time
    env: tuple[tuple[str, str], ...] = (("HF_HUB_OFFLINE", "1"),)

    def cli_flags(self) -> list[str]:
        flags = [f"--runtime={self.runtime}"] if self.runtime else []
        flags += ["--gpus=all"] if self.gpus else []
        flags += [f"--device={d}" for d in self.devices]
        flags += [f"--group-add={g}" for g in self.groups]
        for opt in self.security_opt:
            flags += ["--security-opt", opt]
        flags += ["--ipc=host"] if self.ipc_host else []
        flags += [f"--shm-size={self.shm_size}"]
        for name, soft, hard in self.ulimits:
            flags += ["--ulimit", f"{name}={soft}:{hard}"]
        flags += [] if self.network else ["--network=none"]
        for key, value in self.env:
            flags += ["-e", f"{key}={value}"]
        return flags

    def sdk_kwargs(self) -> dict:
        import docker.types

        kwargs: dict = {
            "devices": [f"{d}:{d}:rwm" for d in self.devices],
            "group_add": list(self.groups),
            "security_opt": list(self.security_opt),
            "shm_size": self.shm_size,
            "ulimits": [docker.types.Ulimit(name=n, soft=s, hard=h) for n, s, h in self.ulimits],
            "environment": dict(self.env),
            "network_mode": None if self.network else "none",
        }
        if self.ipc_host:
            kwargs["ipc_mode"] = "host"
        if self.runtime:
            kwargs["runtime"] = self.runtime
        if self.gpus:
            kwargs["device_requests"] = [
                docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
            ]
        return {k: v for k, v in kwargs.items() if v not in (None, [], {})}


RUN_SPECS = {
    "gb10": RunSpec(
        gpus=True,
        runtime="nvidia",
        shm_size="16g",
        ulimits=(("memlock", -1, -1), ("stack", 67108864, 67108864)),
    ),
    # ROCm: the KFD and DRI nodes, video/render groups and an unconfined seccomp
    # profile; --privileged is not needed.
    "strix": RunSpec(
        devices=("/dev/kfd", "/dev/dri"),
        groups=("video", "render"),
        security_opt=("seccomp=unconfined",),
        shm_size="16g",
    ),
    "cpu": RunSpec(),
}


@dataclass
class RunResult:
    returncode: int
    output: str


class _Engine:
    """What every engine offers: run, and close() removing whatever it started."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class DockerEngine(_Engine):
    """Docker or Podman (Docker-compatible API) through the Docker SDK."""

    started: list = field(default_factory=list)

    def __post_init__(self) -> None:
        import docker

        try:
            self.client = docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise EngineUnavailable(
                f"no Docker-compatible engine reachable ({exc}); start Docker, or point "
                "DOCKER_HOST at Podman's socket (systemctl --user start podman.socket)"
            ) from exc

    def run(
        self,
        image: str,
        command: list[str],
        spec: RunSpec,
        mounts: dict[str, str] | None = None,
        timeout: float = 3600,
    ) -> RunResult:
        volumes = {src: {"bind": dst, "mode": "ro"} for src, dst in (mounts or {}).items()}
        container = self.client.containers.run(
            image, command, detach=True, volumes=volumes, **spec.sdk_kwargs()
        )
        self.started.append(container)
        try:
            status = container.wait(timeout=timeout)
            return RunResult(status.get("StatusCode", 1), container.logs().decode(errors="replace"))
        finally:
            container.remove(force=True)
            self.started.remove(container)

    def close(self) -> None:
        for container in list(self.started):
            container.remove(force=True)
        self.started.clear()


@dataclass
class BuildahEngine(_Engine):
    """`buildah run` with vfs storage and chroot isolation: no daemon, CPU images only."""

    storage: tuple[str, ...] = ("--storage-driver", "vfs")
    started: list[str] = field(default_factory=list)

    def run(
        self,
        image: str,
        command: list[str],
        spec: RunSpec,
        mounts: dict[str, str] | None = None,
        timeout: float = 3600,
    ) -> RunResult:
        if spec.gpus or spec.devices:
            raise EngineUnavailable("buildah run here has no GPU passthrough; use Docker/Podman")
        ctr = subprocess.run(
            ["buildah", *self.storage, "from", image], capture_output=True, text=True, check=True
        ).stdout.strip()
        self.started.append(ctr)
        try:
            cmd = ["buildah", *self.storage, "run", "--isolation", "chroot"]
            if not spec.network:
                # chroot isolation shares the host's network namespace and refuses
                # --network none: give buildah an empty namespace of its own instead.
                cmd = ["unshare", "--net", *cmd]
            for key, value in spec.env:
                cmd += ["--env", f"{key}={value}"]
            for src, dst in (mounts or {}).items():
                cmd += ["-v", f"{src}:{dst}:ro"]
            done = subprocess.run(
                [*cmd, ctr, "--", *command], capture_output=True, text=True, timeout=timeout
            )
            return RunResult(done.returncode, done.stdout + done.stderr)
        finally:
            self._remove(ctr)

    def _remove(self, ctr: str) -> None:
        subprocess.run(["buildah", *self.storage, "rm", ctr], capture_output=True)
        if ctr in self.started:
            self.started.remove(ctr)

    def close(self) -> None:
        for ctr in list(self.started):
            self._remove(ctr)
