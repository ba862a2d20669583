"""Run flags that Docker and Podman both accept, for every target."""

from __future__ import annotations

import pytest

from kit.images.containers import RUN_SPECS, RunSpec

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("target", sorted(RUN_SPECS))
def test_no_shm_size_beside_ipc_host(target: str) -> None:
    """Podman refuses --shm-size together with --ipc=host."""
    spec = RUN_SPECS[target]
    flags = spec.cli_flags()
    assert not ("--ipc=host" in flags and any(f.startswith("--shm-size") for f in flags)), flags
    kwargs = spec.sdk_kwargs()  # the same rule through the Docker SDK
    assert not ("ipc_mode" in kwargs and "shm_size" in kwargs), kwargs


def test_a_private_ipc_namespace_gets_its_shm_size() -> None:
    flags = RunSpec(ipc_host=False, shm_size="8g").cli_flags()
    assert "--shm-size=8g" in flags and "--ipc=host" not in flags
