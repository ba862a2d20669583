"""The cpu base image's Debian mirror comes from this machine's apt sources (or an
override), never from a host name written in the kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.images import buildah_build

pytestmark = pytest.mark.cpu


@pytest.fixture
def apt(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.delenv(buildah_build.MIRROR_ENV, raising=False)
    (tmp_path / "sources.list.d").mkdir()
    return tmp_path


def test_one_line_sources_with_options(apt: Path) -> None:
    (apt / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    assert buildah_build.debian_mirror("bookworm", apt) == "http://mirror.example/debian"


def test_deb822_sources_skip_disabled_stanzas_and_other_suites(apt: Path) -> None:
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb deb-src\nURIs: http://on.example/debian\nSuites: bookworm bookworm-updates\n"
    )
    assert buildah_build.debian_mirror("bookworm", apt) == "http://on.example/debian"


def test_the_override_wins(apt: Path, monkeypatch) -> None:
    (apt / "sources.list").write_text("deb http://mirror.example/debian bookworm main\n")
    monkeypatch.setenv(buildah_build.MIRROR_ENV, "http://override.example/debian")
    assert buildah_build.debian_mirror("bookworm", apt) == "http://override.example/debian"


def test_no_source_for_the_suite_says_what_to_set(apt: Path) -> None:
    (apt / "sources.list").write_text("deb http://ubuntu.example/ubuntu noble main\n")
    with pytest.raises(buildah_build.BuildError, match="KIT_DEBIAN_MIRROR=<URL"):
        buildah_build.debian_mirror("bookworm", apt)
