"""The cut-network probe the container tests run, checked here on both sides: in a
namespace with only loopback it passes, on this machine's own network it fails.
Nothing outside this machine is contacted."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.netprobe import PROBE, host_listener

pytestmark = pytest.mark.cpu


def probe(address: str, port: int, *wrap: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*wrap, sys.executable, "-c", PROBE.format(address=address, port=port)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_probe_fails_where_the_network_is_not_cut() -> None:
    with host_listener() as (address, port):
        done = probe(address, port)
    assert done.returncode in (3, 4), done  # a default route, or the listener reached


def test_the_probe_passes_in_a_namespace_with_only_loopback() -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode:
        pytest.skip("cannot make a network namespace here (unshare --net)")
    with host_listener() as (address, port):
        done = probe(address, port, "unshare", "--net")
    assert done.returncode == 0, done
