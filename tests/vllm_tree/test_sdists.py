"""Release sdists come through pip's configured index (here a PEP 503 index on loopback,
configured the way a user behind a mirror would: PIP_INDEX_URL), and the sha256 pin
decides whether the bytes are the release's."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kit.vllm_tree import sdists

pytestmark = pytest.mark.cpu
NAME = "vllm-9.9.9.tar.gz"


def make_tarball() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        data = b"__version__ = version = '9.9.9'\n"
        member = tarfile.TarInfo("vllm-9.9.9/vllm/_version.py")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


# Made once: a gzip header carries the time it was written.
TARBALL = make_tarball()


def tarball() -> bytes:
    return TARBALL


@pytest.fixture
def index(tmp_path: Path, monkeypatch):
    root = tmp_path / "index"
    (root / "simple" / "vllm").mkdir(parents=True)
    (root / "files").mkdir()
    (root / "files" / NAME).write_bytes(tarball())
    (root / "simple" / "vllm" / "index.html").write_text(
        f'<html><body><a href="../../files/{NAME}#sha256=x">{NAME}</a></body></html>'
    )
    handler = partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/simple"
    # Only this index: the machine's own pip configuration is not the world.
    monkeypatch.setenv("PIP_INDEX_URL", url)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.delenv(sdists.WHEELHOUSE_ENV, raising=False)
    monkeypatch.setattr(sdists, "CACHE", tmp_path / "cache")
    yield url
    httpd.shutdown()


def test_pip_configuration_names_the_index(index: str) -> None:
    sources = sdists.pip_sources()
    assert sources["index"] == [index] and sources["find_links"] == []
    assert sdists.find(NAME, sources).endswith(f"/files/{NAME}")


def test_download_through_the_configured_index_checks_the_pin(index: str) -> None:
    want = hashlib.sha256(tarball()).hexdigest()
    path = sdists._download("9.9.9", NAME, want)
    assert path == sdists.CACHE / NAME and path.read_bytes() == tarball()


def test_other_bytes_from_the_index_are_refused_with_advice_that_helps(index: str) -> None:
    with pytest.raises(sdists.SdistError, match="retrying cannot help.*KIT_WHEELHOUSE"):
        sdists._download("9.9.9", NAME, "0" * 64)
    assert not list(sdists.CACHE.iterdir())


def test_a_release_the_index_lacks_points_at_the_wheelhouse(index: str) -> None:
    with pytest.raises(sdists.SdistError, match="not on pip's configured indexes.*KIT_WHEELHOUSE"):
        sdists._download("9.9.8", "vllm-9.9.8.tar.gz", "0" * 64)


def test_offline_says_how_to_work_without_the_index(monkeypatch, tmp_path: Path) -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{sock.getsockname()[1]}/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(sdists.SdistError, match="cannot fetch.*KIT_WHEELHOUSE=<folder>"):
        sdists._download("9.9.9", NAME, "0" * 64)
    sock.close()


def test_a_wrong_file_in_the_wheelhouse_is_named_not_deleted(tmp_path: Path, monkeypatch) -> None:
    version = sdists.pins.get("vllm.version")
    house = tmp_path / "house"
    house.mkdir()
    wrong = house / f"vllm-{version}.tar.gz"
    wrong.write_bytes(b"not the release")
    monkeypatch.setenv(sdists.WHEELHOUSE_ENV, str(house))
    with pytest.raises(sdists.SdistError, match=r"\$KIT_WHEELHOUSE.*put the release's own sdist"):
        sdists.pinned()
    assert wrong.is_file()


def test_every_pinned_release_has_its_sha256() -> None:
    """Release keys hold dots ("0.34.0"): each is found as a table key."""
    import re

    from kit.vllm_tree import releases

    assert sdists.pins.get("vllm.version") in releases.known()
    for version in releases.known():
        assert re.fullmatch(r"[0-9a-f]{64}", sdists.sha256_pin(version)), version
    with pytest.raises(sdists.SdistError, match="no sdist_sha256 pinned for vLLM 9.9.9"):
        sdists.sha256_pin("9.9.9")
