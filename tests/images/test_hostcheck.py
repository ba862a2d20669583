"""Host checks replayed from recorded GB10 and Strix Halo hosts (tests/data/hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.images import hostcheck

pytestmark = pytest.mark.cpu

HOSTS = Path(__file__).resolve().parents[1] / "data" / "hosts"


def failing(target: str, host: str) -> dict[str, str]:
    return failing_at(target, HOSTS / host)


def failing_at(target: str, root: Path) -> dict[str, str]:
    findings = hostcheck.CHECKS[target](hostcheck.Probe(root))
    assert findings, "no checks ran"
    return {f.check: f.fix for f in findings if not f.ok}


@pytest.mark.parametrize(
    "target,host",
    [("gb10", "gb10-ok"), ("strix", "strix-ok"), ("strix", "strix-no-rocminfo")],
)
def test_good_hosts_pass(target: str, host: str) -> None:
    assert failing(target, host) == {}


@pytest.mark.parametrize(
    "target,host,check,fix",
    [
        ("gb10", "gb10-old-driver", "nvidia driver", "R580"),
        ("strix", "strix-no-kfd", "device nodes", "/dev/kfd"),
        ("strix", "strix-not-in-render", "groups", "usermod -aG render"),
        ("strix", "strix-small-gtt", "gtt limit", "ttm.pages_limit=25165824"),
    ],
)
def test_bad_hosts_fail_with_the_fix(target: str, host: str, check: str, fix: str) -> None:
    problems = failing(target, host)
    assert list(problems) == [check]
    assert fix in problems[check]


def test_gb10_checks_on_the_wrong_machine_say_so() -> None:
    # The strix recording has no nvidia-smi and an x86 CPU: every GB10 check is named.
    problems = failing("gb10", "strix-ok")
    assert {"architecture", "nvidia driver"} <= set(problems)


def test_host_record_for_bundles() -> None:
    record = hostcheck.host_record(hostcheck.Probe(HOSTS / "strix-ok"))
    assert record["gpu_agents"] == ["gfx1151"]
    assert record["ttm_pages_limit"] == "29360128"
    assert "ttm.pages_limit" in record["cmdline"]
    assert record["kernel"].startswith("6.16")


def test_cli_exit_code() -> None:
    assert hostcheck.main(["gb10", "--recorded", str(HOSTS / "gb10-ok")]) == 0
    assert hostcheck.main(["strix", "--recorded", str(HOSTS / "strix-small-gtt")]) == 1


def test_strix_gpu_comes_from_kfd_topology_without_rocminfo() -> None:
    probe = hostcheck.Probe(HOSTS / "strix-no-rocminfo")
    assert probe.command("rocminfo", ["rocminfo"]) is None  # nothing to fall back on
    assert hostcheck.gpu_agents(probe) == ["gfx1151"]
    # KFD writes minor and stepping in hex: 11.5.1 is gfx1151, 9.4.2 gfx942, 9.0.10 gfx90a.
    assert [hostcheck.gfx_name(v) for v in (110501, 90402, 90010)] == [
        "gfx1151",
        "gfx942",
        "gfx90a",
    ]


def test_a_gpu_that_is_not_strix_halo_is_named(tmp_path: Path) -> None:
    import shutil

    host = tmp_path / "host"
    shutil.copytree(HOSTS / "strix-no-rocminfo", host)
    props = host / "files/sys/class/kfd/kfd/topology/nodes/1/properties"
    props.write_text(props.read_text().replace("110501", "110000"))
    problems = failing_at("strix", host)
    assert list(problems) == ["gpu"] and "gfx1151" in problems["gpu"]
