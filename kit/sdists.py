"""vLLM source distributions from PyPI: fetched once, sha256-checked, unpacked in part.

The release trees (``kit.releases``) take ``vllm/`` from them, the upstream
suite (``kit.upstream_suite``) ``tests/``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

from kit import pins

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"


class SdistError(RuntimeError):
    exit_code = 2


def pinned(explicit: Path | None = None) -> Path:
    """The pinned sdist: an explicit file, a wheelhouse copy, or a download, sha256-checked."""
    return fetch(
        pins.get("vllm.version"),
        pins.get("vllm.sdist_url"),
        pins.get("vllm.sdist_sha256"),
        explicit,
    )


def fetch(version: str, url: str, want: str, explicit: Path | None = None) -> Path:
    """One release's sdist: an explicit file, a wheelhouse copy, or a download, sha256-checked."""
    name = f"vllm-{version}.tar.gz"
    candidates = [explicit] if explicit else []
    if os.environ.get("KIT_WHEELHOUSE"):
        candidates.append(Path(os.environ["KIT_WHEELHOUSE"]) / name)
    candidates.append(CACHE / name)
    for path in candidates:
        if path and path.is_file():
            if pins.file_sha256(path) != want:
                raise SdistError(f"{path}: sha256 differs from pins.toml; delete it and retry")
            return path
    CACHE.mkdir(exist_ok=True)
    target = CACHE / name
    partial = target.with_suffix(".part")
    print(f"downloading {url}", file=sys.stderr)
    with (
        urllib.request.urlopen(url, timeout=120) as resp,
        partial.open("wb") as out,
    ):
        shutil.copyfileobj(resp, out)
    if pins.file_sha256(partial) != want:
        partial.unlink()
        raise SdistError(f"downloaded {name} does not match its sdist_sha256 in pins.toml")
    partial.replace(target)
    return target


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
