"""One small adapter for every container the kit runs: Docker SDK, or buildah here.

``DockerEngine`` drives Docker or Podman's Docker-compatible service through the
Docker SDK (``DOCKER_HOST=unix:///run/user/$UID/podman/podman.sock`` for Podman).
``BuildahEngine`` runs commands in images with ``buildah run`` where no engine
exists (this is how the CPU image is exercised on our build machines).

The interface: ``run`` (wait for a command), ``start`` (a background container,
e.g. a server), ``network`` (an isolated network: containers on it reach each
other and nothing else), ``image_info``. ``close`` removes every container,
process and network the engine started; it runs on failure and on Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kit.images import buildah_storage
from kit.process_group import ProcessGroupError, WatchedPopen


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
        flags += [f"--group-add={g}" for g in host_gids(self.groups)]
        for opt in self.security_opt:
            flags += ["--security-opt", opt]
        # Podman refuses --shm-size beside --ipc=host (the host's /dev/shm is used,
        # so a size means nothing there); Docker accepts either alone.
        flags += ["--ipc=host"] if self.ipc_host else [f"--shm-size={self.shm_size}"]
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
            "group_add": host_gids(self.groups),
            "security_opt": list(self.security_opt),
            "shm_size": None if self.ipc_host else self.shm_size,
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


def host_gids(names: tuple[str, ...]) -> list[str]:
    """The host's numeric ids for these groups: the image may not know the names (render)."""
    import grp

    out = []
    for name in names:
        try:
            out.append(str(grp.getgrnam(name).gr_gid))
        except KeyError:
            out.append(name)
    return out


RUN_SPECS = {
    "gb10": RunSpec(
        gpus=True,
        runtime="nvidia",
        ulimits=(("memlock", -1, -1), ("stack", 67108864, 67108864)),
    ),
    # ROCm: the KFD and DRI nodes, video/render groups and an unconfined seccomp
    # profile; --privileged is not needed.
    "strix": RunSpec(
        devices=("/dev/kfd", "/dev/dri"),
        groups=("video", "render"),
        security_opt=("seccomp=unconfined",),
    ),
    "cpu": RunSpec(),
}


@dataclass
class RunResult:
    returncode: int
    output: str


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    writable: bool = False


@dataclass(frozen=True)
class Network:
    """An isolated network; ``address`` is how one container reaches another on it."""

    name: str
    shared_loopback: bool  # buildah: one network namespace, so containers meet on 127.0.0.1

    def address(self, container_name: str) -> str:
        return "127.0.0.1" if self.shared_loopback else container_name


class Container:
    """A background container: poll it, read its output, stop it."""

    name: str

    def alive(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> int:
        raise NotImplementedError

    def logs(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class _Engine:
    """What every engine offers; see the module docstring."""

    kind = ""

    def start(
        self,
        image: str,
        command: list[str],
        spec: RunSpec,
        name: str,
        mounts: tuple[Mount, ...] = (),
        network: Network | None = None,
    ) -> Container:
        raise NotImplementedError

    def network(self) -> contextlib.AbstractContextManager[Network]:
        raise NotImplementedError

    def image_info(self, image: str) -> dict | None:
        """``{"id": ..., "labels": {...}}``, or None when the image is not there."""
        raise NotImplementedError

    def run(
        self,
        image: str,
        command: list[str],
        spec: RunSpec,
        mounts: tuple[Mount, ...] = (),
        network: Network | None = None,
        timeout: float = 3600,
    ) -> RunResult:
        box = self.start(image, command, spec, f"kit-run-{uuid.uuid4().hex[:8]}", mounts, network)
        try:
            code = box.wait(timeout)
            return RunResult(code, box.logs())
        finally:
            box.stop()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _DockerContainer(Container):
    def __init__(self, container, name: str, network: str | None) -> None:
        self.container, self.name, self.network = container, name, network

    def alive(self) -> bool:
        self.container.reload()
        return self.container.status in ("created", "running")

    def wait(self, timeout: float) -> int:
        import requests

        try:
            return int(self.container.wait(timeout=timeout).get("StatusCode", 1))
        # The SDK reports its own timeout as a requests read timeout.
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as exc:
            raise TimeoutError(f"{self.name}: still running after {timeout:.0f} s") from exc

    def logs(self) -> str:
        return self.container.logs().decode(errors="replace")

    def stop(self) -> None:
        import docker

        with contextlib.suppress(docker.errors.NotFound):
            self.container.remove(force=True)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def loopback_without_proxy() -> Iterator[None]:
    """While the Docker SDK makes its client (it asks the engine's version then, before
    ``trust_env`` can be turned off): loopback names added to ``no_proxy``."""
    saved = {k: os.environ.get(k) for k in ("no_proxy", "NO_PROXY")}
    for key, value in saved.items():
        os.environ[key] = ",".join(filter(None, [value, *LOOPBACK_NAMES]))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class DockerEngine(_Engine):
    """Docker or Podman (Docker-compatible API) through the Docker SDK."""

    kind = "docker"
    started: list = field(default_factory=list)
    networks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        import docker

        try:
            with loopback_without_proxy():
                self.client = docker.from_env()
            # The engine's API on this machine never goes through a web proxy
            # (requests would follow http_proxy to a tcp://127.0.0.1 DOCKER_HOST).
            self.client.api.trust_env = False
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise EngineUnavailable(
                f"no Docker-compatible engine reachable ({exc}); start Docker, or point "
                "DOCKER_HOST at Podman's socket (systemctl --user start podman.socket)"
            ) from exc

    def start(self, image, command, spec, name, mounts=(), network=None) -> Container:
        kwargs = spec.sdk_kwargs()
        if network is not None:
            kwargs.pop("network_mode", None)
            kwargs["network"] = network.name
        volumes = {
            m.source: {"bind": m.target, "mode": "rw" if m.writable else "ro"} for m in mounts
        }
        container = self.client.containers.run(
            image, command, name=name, detach=True, volumes=volumes, **kwargs
        )
        box = _DockerContainer(container, name, network.name if network else None)
        self.started.append(box)
        return box

    @contextlib.contextmanager
    def network(self) -> Iterator[Network]:
        # internal=True: no route out of the network, only between its containers.
        net = self.client.networks.create(
            f"kit-{uuid.uuid4().hex[:8]}", driver="bridge", internal=True
        )
        self.networks.append(net)
        try:
            yield Network(net.name, shared_loopback=False)
        finally:
            self._remove_network(net)

    def _remove_network(self, net) -> None:
        import docker

        for box in [b for b in self.started if b.network == net.name]:
            box.stop()
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            net.remove()
        if net in self.networks:
            self.networks.remove(net)

    def image_info(self, image: str) -> dict | None:
        import docker

        try:
            found = self.client.images.get(image)
        except docker.errors.ImageNotFound:
            return None
        return {"id": found.id, "labels": found.labels or {}}

    def close(self) -> None:
        for box in self.started:
            box.stop()
        self.started.clear()
        for net in list(self.networks):
            self._remove_network(net)


class _ProcessContainer(Container):
    """A ``buildah run`` process; its own session, so a stop reaches every child, and
    a watchdog (``WatchedPopen``) that stops them where the kit cannot (``kill -9``)."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.name = name
        # Outlives this call on purpose: logs() reads it after the process ends.
        # Appending, as the watchdog does: neither overwrites the other's lines.
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.log = open(path, "a")  # noqa: SIM115
        self.proc = WatchedPopen(
            cmd, watch_log=Path(path), stdout=self.log, stderr=subprocess.STDOUT
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{self.name}: still running after {timeout:.0f} s") from exc

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, grace: float = 20.0) -> None:
        # The whole group, also after its leader ended (what it started may not have).
        # A member that survives SIGKILL is left to the watchdog, which keeps trying
        # after the kit: the engine's other clean-up goes on.
        with contextlib.suppress(ProcessGroupError):
            self.proc.stop(grace)
        self.log.close()

    def discard(self) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)


@dataclass
class BuildahEngine(_Engine):
    """`buildah run` with chroot isolation over the kit's store: no daemon, CPU images only.

    With vfs every new container copies the whole image (~4 GB, ~20 s), so the
    engine keeps one working container per image and runs each command in it
    (with overlay that is cheap anyway):
    commands of one image share its writable layer for the engine's lifetime.
    A network is one empty network namespace (loopback only) that every
    container started on it joins.
    """

    kind = "buildah"
    storage: tuple[str, ...] = field(default_factory=lambda: tuple(buildah_storage.flags()))
    started: list[str] = field(default_factory=list)
    processes: list[_ProcessContainer] = field(default_factory=list)
    holders: dict[str, WatchedPopen] = field(default_factory=dict)
    working: dict[str, str] = field(default_factory=dict)

    def _working_container(self, image: str) -> str:
        if image not in self.working:
            ctr = subprocess.run(
                ["buildah", *self.storage, "from", image],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            self.started.append(ctr)
            self.working[image] = ctr
        return self.working[image]

    def start(self, image, command, spec, name, mounts=(), network=None) -> Container:
        if spec.gpus or spec.devices:
            raise EngineUnavailable("buildah run here has no GPU passthrough; use Docker/Podman")
        ctr = self._working_container(image)
        cmd = ["buildah", *self.storage, "run", "--isolation", "chroot"]
        if network is not None:
            cmd = ["nsenter", f"--net=/proc/{self.holders[network.name].pid}/ns/net", *cmd]
        elif not spec.network:
            # chroot isolation shares the host's network namespace and refuses
            # --network none: give buildah an empty namespace of its own instead.
            cmd = ["unshare", "--net", *cmd]
        for key, value in spec.env:
            cmd += ["--env", f"{key}={value}"]
        for m in mounts:
            cmd += ["-v", f"{m.source}:{m.target}:{'rw' if m.writable else 'ro'}"]
        box = _ProcessContainer(name, [*cmd, ctr, "--", *command])
        self.processes.append(box)
        return box

    @contextlib.contextmanager
    def network(self) -> Iterator[Network]:
        name = f"kit-{uuid.uuid4().hex[:8]}"
        # Watched: a kit killed with SIGKILL leaves no namespace holder behind.
        holder = WatchedPopen(
            ["unshare", "--net", "sh", "-c", "ip link set lo up && exec sleep infinity"]
        )
        self.holders[name] = holder
        deadline = time.monotonic() + 10
        while not _isolated_loopback_up(holder.pid):
            if holder.poll() is not None or time.monotonic() > deadline:
                self._stop_holder(name)
                raise EngineUnavailable(
                    "could not create a network namespace (needs unshare and ip as root)"
                )
            time.sleep(0.1)
        try:
            yield Network(name, shared_loopback=True)
        finally:
            self._stop_holder(name)

    def _stop_holder(self, name: str) -> None:
        holder = self.holders.pop(name, None)
        if holder:
            holder.stop(grace=5.0)

    def image_info(self, image: str) -> dict | None:
        done = subprocess.run(
            ["buildah", *self.storage, "inspect", "--type", "image", image],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return None
        data = json.loads(done.stdout)
        config = data.get("Docker", {}).get("config") or data.get("OCIv1", {}).get("config", {})
        return {"id": "sha256:" + data["FromImageID"], "labels": config.get("Labels") or {}}

    def close(self) -> None:
        for box in self.processes:
            box.discard()
        self.processes.clear()
        for ctr in list(self.started):
            subprocess.run(["buildah", *self.storage, "rm", ctr], capture_output=True)
            self.started.remove(ctr)
        self.working.clear()
        for name in list(self.holders):
            self._stop_holder(name)


def _isolated_loopback_up(pid: int) -> bool:
    """Whether ``pid`` has a network namespace of its own with its loopback up.

    Until ``unshare`` has run, the holder is still in ours, whose loopback is up
    as well: a container that joined it then would run on the host's network
    (and one on the namespace would not reach it)."""
    try:
        if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return False
        state = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "cat", "/sys/class/net/lo/operstate"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return False
    return state in ("up", "unknown")


def engine_for(kind: str, target: str) -> _Engine:
    """``auto``: a reachable Docker-compatible engine, else buildah for the cpu target."""
    if kind in ("docker", "auto"):
        try:
            return DockerEngine()
        except EngineUnavailable:
            if kind == "docker":
                raise
    import shutil

    if target == "cpu" and shutil.which("buildah"):
        return BuildahEngine()
    raise EngineUnavailable(
        f"no container engine for {target}: start Docker (or Podman's socket and DOCKER_HOST)"
        + (
            "; or install buildah (apt-get install buildah) for the cpu target"
            if target == "cpu"
            else ""
        )
    )
