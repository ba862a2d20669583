"""vLLM source distributions: found through pip's configured index, fetched once,
sha256-checked against pins.toml, unpacked in part.

No index is named here: the sdist is looked up where this machine's pip looks
(``pip config``: index-url, extra-index-url, find-links, and their PIP_* variables;
pip's own default index when none is set), so a machine behind a mirror works as
it is. The sha256 pin guards the bytes whichever index served them. Offline, a
folder named by ``KIT_WHEELHOUSE`` (or an explicit file) holding
``vllm-<version>.tar.gz`` is used instead.

The release trees (``kit.vllm_tree.releases``) take ``vllm/`` from them, the upstream
suite (``kit.vllm_tree.upstream_suite``) ``tests/``.
"""

from __future__ import annotations

import html.parser
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kit.paths import CACHE
from kit.vllm_tree import pins

WHEELHOUSE_ENV = "KIT_WHEELHOUSE"


class SdistError(RuntimeError):
    exit_code = 2


def sha256_pin(version: str) -> str:
    """The sdist sha256 pins.toml pins for a release (any in ``pins.release_table``)."""
    try:
        return pins.release_table()[version]["sdist_sha256"]
    except (pins.PinError, KeyError) as exc:
        raise SdistError(
            f"no sdist_sha256 pinned for vLLM {version} ({exc}); add it to pins.toml"
        ) from exc


def pinned(explicit: Path | None = None) -> Path:
    """The pinned release's sdist."""
    return release(pins.get("vllm.version"), explicit)


def release(version: str, explicit: Path | None = None) -> Path:
    """One release's sdist, sha256-checked: an explicit file, a wheelhouse copy, the
    cache, or a download through pip's configured index."""
    want = sha256_pin(version)
    name = f"vllm-{version}.tar.gz"
    candidates = []
    if explicit:
        candidates.append((explicit, "the file you named"))
    if os.environ.get(WHEELHOUSE_ENV):
        candidates.append((Path(os.environ[WHEELHOUSE_ENV]) / name, f"${WHEELHOUSE_ENV}"))
    candidates.append((CACHE / name, "the kit's download cache"))
    for path, where in candidates:
        if path.is_file():
            got = pins.file_sha256(path)
            if got != want:
                raise SdistError(_mismatch(path, where, got, want, cached=path.parent == CACHE))
            return path
    if explicit:
        raise SdistError(f"{explicit}: no such file")
    return _download(version, name, want)


def _mismatch(path: Path, where: str, got: str, want: str, cached: bool) -> str:
    head = (
        f"{path} ({where}) has sha256 {got}, pins.toml pins {want}: it is not that release's sdist"
    )
    if cached:
        return head + "; the cache holds other bytes: remove it and run again to fetch it anew"
    return head + "; put the release's own sdist there (or check the pin against the release)"


def _download(version: str, name: str, want: str) -> Path:
    sources = pip_sources()
    url = find(name, sources)
    if url is None:
        raise SdistError(
            f"{name} is not on pip's configured indexes ({', '.join(sources['index']) or 'none'})"
            f" or find-links; put it in a folder and set {WHEELHOUSE_ENV}=<folder>, or pass "
            "--sdist FILE"
        )
    CACHE.mkdir(exist_ok=True)
    target = CACHE / name
    partial = target.with_name(target.name + ".part")
    print(f"downloading {url}", file=sys.stderr)
    try:
        with _open(url, sources) as resp, partial.open("wb") as out:
            shutil.copyfileobj(resp, out)
    except (OSError, urllib.error.URLError) as exc:
        partial.unlink(missing_ok=True)
        raise SdistError(_offline(name, url, exc)) from exc
    got = pins.file_sha256(partial)
    if got != want:
        partial.unlink()
        raise SdistError(
            f"{url} served {name} with sha256 {got}, pins.toml pins {want}: that index serves "
            f"other bytes than the release (a re-upload or a bad mirror); retrying cannot help. "
            f"Get the release's sdist and set {WHEELHOUSE_ENV}, or check the pin"
        )
    partial.replace(target)
    return target


def _offline(name: str, where: str, exc: Exception) -> str:
    return (
        f"cannot fetch {name} from {where} ({exc}); offline, put the file in a folder and "
        f"set {WHEELHOUSE_ENV}=<folder> (or pass --sdist FILE)"
    )


# -- pip's configuration ---------------------------------------------------------
def pip_sources(python: str = sys.executable) -> dict[str, list[str]]:
    """Index URLs (index-url first, then extra-index-url), find-links and the CA bundle
    pip would use, read with ``pip config list`` (files and PIP_* variables; a
    variable wins over a file, as in pip)."""
    done = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    )
    chosen: dict[str, tuple[int, str]] = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, option = key.rpartition(".")
        rank = 2 if scope == ":env:" else 1 if scope in ("global", "install", "download") else 0
        if option not in chosen or rank >= chosen[option][0]:
            chosen[option] = (rank, value.strip().strip("'\""))
    values = {k: v for k, (_, v) in chosen.items()}
    index = values.get("index-url") or _pip_default_index(python)
    return {
        "index": [u for u in [index, *values.get("extra-index-url", "").split()] if u],
        "find_links": values.get("find-links", "").split(),
        "cert": [values["cert"]] if values.get("cert") else [],
    }


def _pip_default_index(python: str) -> str:
    """pip's built-in default index, asked of pip (not written here)."""
    done = subprocess.run(
        [python, "-c", "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip()


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _open(url: str, sources: dict[str, list[str]]):
    if url.startswith("file:"):
        return urllib.request.urlopen(url, timeout=120)
    context = ssl.create_default_context(cafile=(sources.get("cert") or [None])[0])
    return urllib.request.urlopen(url, timeout=120, context=context)


def _page_links(page: str, sources: dict[str, list[str]]) -> list[str]:
    """The links of a PEP 503 project page or a find-links page/folder."""
    parsed = urllib.parse.urlparse(page)
    if parsed.scheme in ("", "file"):
        folder = Path(urllib.parse.unquote(parsed.path))
        if folder.is_dir():
            index = folder / "index.html"
            if not index.is_file():
                return [p.resolve().as_uri() for p in folder.iterdir()]
            page = index.resolve().as_uri()
        elif not folder.is_file():
            return []
        else:
            page = folder.resolve().as_uri()
    try:
        with _open(page, sources) as resp:
            text = resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise SdistError(_offline("the project page", page, exc)) from exc
    except (OSError, urllib.error.URLError) as exc:
        raise SdistError(_offline("the project page", page, exc)) from exc
    parser = _Links()
    parser.feed(text)
    return [urllib.parse.urljoin(page, href) for href in parser.hrefs]


def find(name: str, sources: dict[str, list[str]]) -> str | None:
    """The URL of file ``name`` on the first index or find-links location that has it."""
    pages = [u.rstrip("/") + "/vllm/" for u in sources["index"]] + sources["find_links"]
    for page in pages:
        for link in _page_links(page, sources):
            path = urllib.parse.urlparse(link).path
            if urllib.parse.unquote(path.rsplit("/", 1)[-1]) == name:
                return link.split("#", 1)[0]
    return None


def unpack(sdist: Path, version: str, subdir: str, dest: Path) -> None:
    """Unpack ``vllm-<version>/<subdir>/`` of an sdist as ``dest/<subdir>/`` (files only)."""
    top = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(f"{top}{subdir}/") and (member.isfile() or member.isdir()):
                member.name = member.name[len(top) :]
                members.append(member)
        if not members:
            raise SdistError(f"{sdist}: no {subdir}/ inside; is it the vLLM {version} sdist?")
        tar.extractall(dest, members=members, filter="data")
