"""`make lock` against a fake registry, a local git repository and the fake hub, all on
this machine: every unresolved pin it can reach is saved, the rest named, nothing else
touched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kit.pins import lock
from kit.vllm_tree import pins, setup_env
from tests.hub_server import COMMIT, REPO, FakeHub, HubServer, tiny_repo_files

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = json.dumps({"schemaVersion": 2, "manifests": []}).encode()
DIGEST = hashlib.sha256(MANIFEST).hexdigest()
TOKEN = "kit-test-token"


class FakeRegistry:
    """Answers manifest HEADs for the repositories it holds, behind an anonymous
    bearer token as Docker Hub does; anything else is a 404."""

    def __init__(self, repositories: set[str]) -> None:
        self.repositories = repositories
        self.requests: list[str] = []
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                registry.requests.append(self.path)
                if self.path.startswith("/token"):
                    body = json.dumps({"token": TOKEN}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command == "GET":
                        self.wfile.write(body)
                    return
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_response(401)
                    self.send_header(
                        "WWW-Authenticate",
                        f'Bearer realm="{registry.url}/token",service="fake",'
                        'scope="repository:x:pull"',
                    )
                    self.end_headers()
                    return
                repo = self.path.removeprefix("/v2/").rsplit("/manifests/", 1)[0]
                if repo not in registry.repositories:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Docker-Content-Digest", f"sha256:{DIGEST}")
                self.send_header("Content-Length", str(len(MANIFEST)))
                self.end_headers()

            do_GET = _answer
            do_HEAD = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeRegistry:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _git_repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository with an annotated tag (ls-remote must peel it to the commit)."""
    repo = tmp_path / "vllm.git"
    git = ["git", "-C", str(repo), "-c", "user.name=kit", "-c", "user.email=kit@localhost"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("release\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "tag", "-a", "-m", "v0.32.0", "v0.32.0"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return repo, head


@pytest.fixture()
def online(tmp_path: Path) -> Iterator[dict]:
    """A copy of pins.toml whose vLLM abbreviation is the local repository's, a models
    lock with one enabled and one disabled entry, and the three fake services."""
    repo, head = _git_repo(tmp_path)
    text = (ROOT / "pins.toml").read_text()
    text = text.replace(
        f'commit_abbrev = "{pins.get("vllm.commit_abbrev")}"', f'commit_abbrev = "{head[:9]}"', 1
    )
    pin_file = tmp_path / "pins.toml"
    pin_file.write_text(text)
    models_lock = tmp_path / "models.lock"
    models_lock.write_text(
        f"""# test lock
version = 1

[models.enabled-one]
repo = "{REPO}"
role = "quick-check"
targets = ["gb10"]
enabled = true
revision = "unresolved"
serve_args = []

[models.disabled-one]
repo = "kit-test/not-served"
role = "candidate"
targets = ["gb10"]
enabled = false
disabled_reason = "test"
revision = "unresolved"
serve_args = []
"""
    )
    with FakeRegistry({"library/ubuntu"}) as registry, HubServer(FakeHub(tiny_repo_files())) as hub:
        yield {
            "pins": pin_file,
            "models": models_lock,
            "repo": repo,
            "head": head,
            "registry": registry,
            "hub": hub,
        }


def run_lock(online: dict, *targets: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        HF_ENDPOINT=online["hub"].url,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(online["pins"].parent / "hf-home"),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kit.pins.lock",
            "pins",
            *targets,
            "--pins",
            str(online["pins"]),
            "--models",
            str(online["models"]),
            "--vllm-repo",
            f"file://{online['repo']}",
            # Docker Hub names and NVIDIA's registry both go to the loopback fake.
            "--registry-url",
            f"{lock.DEFAULT_REGISTRY}={online['registry'].url}",
            "--registry-url",
            f"nvcr.io={online['registry'].url}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_make_lock_saves_what_resolves_and_names_what_does_not(online: dict) -> None:
    done = run_lock(online, "gb10", "strix")
    pinned = tomllib.loads(online["pins"].read_text())
    # strix's base (Docker Hub's ubuntu) resolved through the token dance...
    assert pinned["images"]["strix"]["base"] == f"ubuntu:24.04@sha256:{DIGEST}"
    # ... gb10's (a repository the fake registry lacks) stays unresolved and is named.
    assert pinned["images"]["gb10"]["base"].endswith("@sha256:unresolved")
    assert "images.gb10.base: FAILED" in done.stdout and "HTTP 404" in done.stdout
    # The tag's commit, peeled from the annotated tag.
    assert pinned["vllm"]["commit"] == online["head"]
    # Only the enabled model entry of the targets was locked, at the hub's commit.
    models = tomllib.loads(online["models"].read_text())["models"]
    assert models["enabled-one"]["revision"] == COMMIT
    assert models["disabled-one"]["revision"] == "unresolved"
    # The diff of what changed, and exit 1 because something is left.
    assert f'+base = "ubuntu:24.04@sha256:{DIGEST}"' in done.stdout
    assert done.returncode == 1, done.stdout + done.stderr
    # Untouched lines stay byte for byte (comments included).
    before = (ROOT / "pins.toml").read_text().splitlines()
    after = online["pins"].read_text().splitlines()
    assert len(before) == len(after)
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 3  # base, abbrev, commit


def test_release_commits_whose_tag_is_missing_are_named(online: dict) -> None:
    done = run_lock(online, "cpu")
    # The fake repository has no v0.33.0 / v0.34.0 tags: named, pins.toml keeps them.
    assert 'releases."0.33.0".commit: FAILED' in done.stdout
    assert "has no tag v0.33.0" in done.stdout
    pinned = tomllib.loads(online["pins"].read_text())
    assert pinned["releases"]["0.33.0"]["commit"] == "unresolved"
    assert pinned["vllm"]["commit"] == online["head"]


def test_a_moved_tag_is_refused(online: dict) -> None:
    with pytest.raises(lock.LockError, match="tag moved"):
        lock.tag_commit(f"file://{online['repo']}", "v0.32.0", "0000000")


def test_image_refs_parse_to_registry_and_repository() -> None:
    assert lock.ImageRef.parse("ubuntu:24.04@sha256:unresolved") == lock.ImageRef(
        lock.DEFAULT_REGISTRY, "library/ubuntu", "24.04"
    )
    ref = lock.ImageRef.parse("nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04@sha256:unresolved")
    assert ref == lock.ImageRef("nvcr.io", "nvidia/cuda", "13.0.1-devel-ubuntu24.04")
    with pytest.raises(lock.LockError, match="names no tag"):
        lock.ImageRef.parse("ubuntu@sha256:unresolved")


def test_set_pin_refuses_a_missing_key_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pins.toml"
    path.write_text('[vllm]\n# why\ncommit = "unresolved"\n')
    lock.set_pin(path, "vllm", "commit", "a" * 40)
    assert path.read_text() == f'[vllm]\n# why\ncommit = "{"a" * 40}"\n'
    with pytest.raises(lock.LockError, match="no tag in \\[vllm\\]"):
        lock.set_pin(path, "vllm", "tag", "v1")


FAKE_UV = """#!{python}
# uv pip compile as make lock-deps calls it: the arguments to calls.jsonl, a
# one-package lock to -o (another version for Python 3.12 when asked to differ).
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_UV_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
python = args[args.index("--python-version") + 1]
version = "2.0" if python == "3.12" and os.environ.get("FAKE_UV_DIFFER") else "1.0"
with open(args[args.index("-o") + 1], "w") as f:
    f.write(f"kit-fake-package=={{version}} \\\\\\n    --hash=sha256:{{'0' * 64}}\\n")
"""


def _lock_deps(
    tmp_path: Path, monkeypatch, *only: str, sdist: bool = False
) -> tuple[int, list[list[str]]]:
    """`kit.pins.lock deps --only ...` with a fake uv and locks/ in tmp_path (no network);
    ``sdist``: the locks chosen read a release's sdist (a stand-in path here)."""
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable))
    uv.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_UV_CALLS", str(calls))
    monkeypatch.setattr(lock, "uv_binary", lambda version: uv)
    monkeypatch.setattr(lock, "LOCKS", tmp_path / "locks")
    monkeypatch.setattr(lock, "pip_config", dict)

    def no_sdist(*args) -> Path:
        raise AssertionError("the host locks need no vLLM sdist")

    monkeypatch.setattr("kit.vllm_tree.sdists.pinned", no_sdist)
    stand_in = (lambda version: tmp_path / f"vllm-{version}.tar.gz") if sdist else no_sdist
    monkeypatch.setattr("kit.vllm_tree.sdists.release", stand_in)
    argv = ["deps", "--torch-index", ""] + [a for name in only for a in ("--only", name)]
    rc = lock.main(argv)
    return rc, [json.loads(line) for line in calls.read_text().splitlines()]


def test_the_host_locks_are_one_per_platform_for_both_pythons() -> None:
    host = {d.name: d for d in lock.dep_locks() if d.name.startswith("host-venv-")}
    assert sorted(host) == [f"host-venv-{arch}" for arch in sorted(lock.HOST_ARCHES)]
    for arch in lock.HOST_ARCHES:
        dep = host[f"host-venv-{arch}"]
        assert dep.path == setup_env.host_lock(arch)
        assert dep.lines == tuple(setup_env.light_requirements(pins.load()))
        assert dep.platform == f"{arch}-manylinux_{lock.HOST_GLIBC}"
        pythons = (dep.python, *dep.also_pythons)
        assert pythons == tuple(f"{a}.{b}" for a, b in setup_env.LIGHT_PYTHONS)
        assert not dep.sdist_files and not dep.torch_index


def test_lock_deps_writes_a_host_lock_resolved_alike_for_both_pythons(
    tmp_path: Path, monkeypatch
) -> None:
    rc, calls = _lock_deps(tmp_path, monkeypatch, "host-venv-aarch64")
    assert rc == 0
    assert [c[c.index("--python-version") + 1] for c in calls] == ["3.11", "3.12"]
    assert {c[c.index("--python-platform") + 1] for c in calls} == {
        f"aarch64-manylinux_{lock.HOST_GLIBC}"
    }
    assert all("--generate-hashes" in c for c in calls)
    text = (tmp_path / "locks" / "host-venv-aarch64.txt").read_text()
    assert text.startswith(
        f"# host-venv-aarch64: hash lock for Python 3.11 on aarch64-manylinux_{lock.HOST_GLIBC}"
    )
    assert "# Resolved the same for Python 3.12" in text and "kit-fake-package==1.0 " in text


def test_lock_deps_refuses_one_host_lock_for_pythons_that_resolve_apart(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    (tmp_path / "locks").mkdir()
    kept = tmp_path / "locks" / "host-venv-x86_64.txt"
    kept.write_text("# the committed lock\n")
    monkeypatch.setenv("FAKE_UV_DIFFER", "1")
    rc, _ = _lock_deps(tmp_path, monkeypatch, "host-venv-x86_64")
    assert rc == 1
    out = capsys.readouterr().out
    assert "Python 3.12 resolves differently from 3.11" in out and "split it per Python" in out
    assert kept.read_text() == "# the committed lock\n"


def test_the_image_locks_are_one_per_release_the_image_builds() -> None:
    """locks/vllm-<release>/<target>-<arch>.txt for each release of the images'
    torch tables, each from that release's sdist; the pinned release's too."""
    image = {d.key: d for d in lock.dep_locks() if d.release}
    want = {
        f"vllm-{release}/{name}"
        for target, names in (
            ("gb10", ("gb10-aarch64", "gb10-x86_64")),
            ("strix", ("strix-x86_64",)),
        )
        for release in pins.image_releases(target)
        for name in names
    }
    assert set(image) == want
    assert {"vllm-0.32.0/gb10-aarch64", "vllm-0.34.0/gb10-aarch64"} <= set(image)
    for key, dep in image.items():
        assert dep.path == lock.LOCKS / f"{key}.txt"
        if dep.name.startswith("gb10-"):
            assert f"vllm=={dep.release}" in dep.lines
            assert dep.overrides == tuple(pins.lock_overrides("gb10", dep.release))


def test_lock_deps_resolves_a_release_lock_from_that_releases_sdist(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """--only vllm-<release>/gb10-aarch64: the release's requirement files, its
    overrides passed to uv, the lock written in locks/vllm-<release>/."""
    release = pins.image_release("gb10")
    asked = []

    def extract(sdist, version, dest):
        asked.append(version)
        (dest / "requirements" / "build").mkdir(parents=True)
        (dest / "requirements" / "build" / "cuda.txt").write_text("ninja\n")
        return dest

    monkeypatch.setattr(lock, "_extract_requirements", extract)
    rc, calls = _lock_deps(tmp_path, monkeypatch, f"vllm-{release}/gb10-aarch64", sdist=True)
    assert rc == 0, capsys.readouterr()
    assert asked == [release] and len(calls) == 1
    call = calls[0]
    assert call[call.index("--python-platform") + 1] == f"aarch64-manylinux_{lock.IMAGE_GLIBC}"
    overrides = pins.lock_overrides("gb10", release)
    assert ("--override" in call) == bool(overrides)
    text = (tmp_path / "locks" / f"vllm-{release}" / "gb10-aarch64.txt").read_text()
    assert text.startswith("# gb10-aarch64: hash lock for Python 3.12")
    assert f"vLLM {release}'s requirements/build/cuda.txt" in text
    assert all(o in text.splitlines()[2] for o in overrides)
