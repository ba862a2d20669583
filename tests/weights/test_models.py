"""models.lock tools against a real HTTP server on loopback that speaks the hub's protocol."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit.weights import models
from tests.hub_server import COMMIT, REPO, FakeHub, HubServer, tiny_repo_files

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
KEY = "tiny"
LOCK_TEXT = f"""# test lock
version = 1

[models.{KEY}]
repo = "{REPO}"
role = "quick-check"
targets = ["cpu"]
enabled = true
revision = "unresolved"
serve_args = ["--dtype", "float32"]
"""


@pytest.fixture()
def hub():
    server = HubServer(FakeHub(tiny_repo_files()))
    with server:
        yield server


def run(hub: HubServer, lock: Path, store: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        HF_ENDPOINT=hub.url,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(store.parent / "hf-home"),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kit.weights.models",
            "--lock-file",
            str(lock),
            "--store",
            str(store),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture()
def locked(hub, tmp_path: Path) -> tuple[Path, Path]:
    lock = tmp_path / "models.lock"
    lock.write_text(LOCK_TEXT)
    store = tmp_path / "store"
    out = run(hub, lock, store, "lock", "--model", KEY)
    assert out.returncode == 0, out.stderr
    return lock, store


def test_lock_records_commit_sizes_and_hashes(hub, locked) -> None:
    lock, store = locked
    _, entries = models.load(lock)
    (entry,) = entries
    assert entry.revision == COMMIT and entry.pinned
    import hashlib

    want = {p: (len(d), hashlib.sha256(d).hexdigest()) for p, d in hub.hub.files.items()}
    assert {f.path: (f.size, f.sha256) for f in entry.files} == want
    assert lock.read_text().startswith("# test lock")
    # Only what changed is rewritten: a second lock leaves the file as it is.
    before = lock.read_text()
    out = run(hub, lock, store, "lock", "--model", KEY)
    assert out.returncode == 0 and "lock unchanged" in out.stdout
    assert lock.read_text() == before


def test_fetch_resumes_an_interrupted_download_and_verifies(hub, locked) -> None:
    lock, store = locked
    hub.hub.cut_once.add("model.safetensors")  # the server drops the connection mid-file
    out = run(hub, lock, store, "fetch", "--model", KEY)
    assert out.returncode == 0, out.stderr
    assert "model.safetensors" in hub.hub.range_requests  # resumed with a Range, not restarted
    snap = store / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert (snap / "model.safetensors").read_bytes() == hub.hub.files["model.safetensors"]
    assert run(hub, lock, store, "verify", "--model", KEY, "--full").returncode == 0


def _fetched(hub, locked) -> tuple[Path, Path, Path]:
    lock, store = locked
    assert run(hub, lock, store, "fetch", "--model", KEY).returncode == 0
    snap = store / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    return lock, store, snap


def _break(path: Path, data: bytes) -> None:
    real = path.resolve()  # the snapshot entry links into blobs/
    real.write_bytes(data)


@pytest.mark.parametrize(
    "damage,expect",
    [
        ("missing", "missing"),
        ("truncated", "partial or corrupt"),
        ("flipped", "corrupt"),
    ],
)
def test_verify_names_the_problem_and_the_fix(hub, locked, damage, expect) -> None:
    lock, store, snap = _fetched(hub, locked)
    target = snap / "model.safetensors"
    data = hub.hub.files["model.safetensors"]
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        _break(target, data[:-10])
    else:
        _break(target, bytes([data[0] ^ 1]) + data[1:])
    out = run(hub, lock, store, "verify", "--model", KEY, "--full")
    assert out.returncode == 1
    assert "model.safetensors" in out.stderr and expect in out.stderr
    assert f"make fetch-models MODEL={KEY}" in out.stderr


def test_fast_verify_uses_sizes_and_stamp(hub, locked) -> None:
    lock, store, snap = _fetched(hub, locked)
    assert run(hub, lock, store, "verify", "--model", KEY).returncode == 0
    target = (snap / "model.safetensors").resolve()
    data = hub.hub.files["model.safetensors"]
    stat = target.stat()
    target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # Same size and mtime, but the write moved ctime: the fast check hashes again
    # and finds the flip, as --full does.
    assert run(hub, lock, store, "verify", "--model", KEY).returncode == 1
    assert run(hub, lock, store, "verify", "--model", KEY, "--full").returncode == 1


def test_wrong_revision_is_reported(hub, locked) -> None:
    lock, store, _ = _fetched(hub, locked)
    text = lock.read_text().replace(COMMIT, "f" * 40)
    lock.write_text(text)
    out = run(hub, lock, store, "verify", "--model", KEY)
    assert out.returncode == 1 and "missing" in out.stderr
    fetch = run(hub, lock, store, "fetch", "--model", KEY)
    assert fetch.returncode != 0


def test_unresolved_entry_is_not_treated_as_pinned(hub, tmp_path: Path) -> None:
    lock = tmp_path / "models.lock"
    lock.write_text(LOCK_TEXT)
    for cmd in ("verify", "fetch"):
        out = run(hub, lock, tmp_path / "store", cmd, "--model", KEY)
        assert out.returncode == 2 and "unresolved" in out.stderr
        assert f"make lock-models MODEL={KEY}" in out.stderr


def test_malformed_lock_names_the_line(tmp_path: Path) -> None:
    lock = tmp_path / "models.lock"
    lock.write_text(LOCK_TEXT.replace("enabled = true", "enabled = yes"))
    with pytest.raises(models.LockError, match=r"line 8"):
        models.load(lock)
    lock.write_text(LOCK_TEXT.replace('revision = "unresolved"', 'revision = "main"'))
    with pytest.raises(models.LockError, match=r"models\.lock:4 \[models\.tiny\].*'main'"):
        models.load(lock)


def test_export_import_roundtrip_verifies(hub, locked, tmp_path: Path) -> None:
    lock, store, _ = _fetched(hub, locked)
    tarball = tmp_path / "models.tar.gz"
    assert run(hub, lock, store, "export", "--model", KEY, str(tarball)).returncode == 0
    other = tmp_path / "other-store"
    out = run(hub, lock, other, "import", "--model", KEY, str(tarball))
    assert out.returncode == 0, out.stderr
    assert run(hub, lock, other, "verify", "--model", KEY, "--full").returncode == 0


def test_repository_lock_file_parses() -> None:
    _, entries = models.load()
    keys = {e.key for e in entries}
    assert {"qwen3_5-0_8b", "qwen3_6-35b-a3b-fp8"} <= keys
    for entry in entries:
        assert entry.enabled or entry.fields.get("disabled_reason")


def test_a_corrupt_file_found_by_a_full_hash_fails_the_fast_check_too(hub, locked) -> None:
    lock, store, snap = _fetched(hub, locked)
    target = (snap / "model.safetensors").resolve()
    data = hub.hub.files["model.safetensors"]
    stat = target.stat()
    target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert run(hub, lock, store, "verify", "--model", KEY, "--full").returncode == 1
    # The stamp the full hash contradicted is gone: the plain verify hashes again.
    out = run(hub, lock, store, "verify", "--model", KEY)
    assert out.returncode == 1 and "sha256 differs" in out.stderr


def _hostile(tarball: Path, kind: str, tmp_path: Path) -> None:
    import io
    import tarfile

    with tarfile.open(tarball, "w:gz") as tar:
        member = tarfile.TarInfo()
        if kind == "absolute":
            member.name, member.size = "/tmp/kit-evil", 4
            tar.addfile(member, io.BytesIO(b"evil"))
        elif kind == "dotdot":
            member.name, member.size = "models--x/../../evil", 4
            tar.addfile(member, io.BytesIO(b"evil"))
        elif kind == "symlink-out":
            member.name, member.type, member.linkname = "models--x/etc", tarfile.SYMTYPE, "/etc"
            tar.addfile(member)
        elif kind == "device":
            member.name, member.type = "models--x/null", tarfile.CHRTYPE
            member.devmajor, member.devminor = 1, 3
            tar.addfile(member)


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink-out", "device"])
def test_a_hostile_archive_is_refused_and_nothing_lands(
    hub, locked, tmp_path: Path, kind: str
) -> None:
    lock, _ = locked
    tarball = tmp_path / "evil.tar.gz"
    _hostile(tarball, kind, tmp_path)
    other = tmp_path / "other-store"
    out = run(hub, lock, other, "import", "--model", KEY, str(tarball))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    # The "data" filter refuses what leaves the folder and strips a leading "/"
    # (the file then lands in the scratch store and fails verification).
    if kind != "absolute":
        assert "refused" in out.stderr and "Nothing was imported" in out.stderr
    assert not Path("/tmp/kit-evil").exists() and not (tmp_path / "evil").exists()
    assert list(other.iterdir()) == []


def test_the_store_check_refuses_a_link_out(tmp_path: Path) -> None:
    """Behind the tar filter: after extraction no link may resolve outside the store."""
    inside = tmp_path / "scratch" / "models--x"
    inside.mkdir(parents=True)
    (inside / "blob").write_text("x")
    (inside / "ok").symlink_to("blob")
    models._links_stay_inside(tmp_path / "scratch")
    (inside / "out").symlink_to("../../elsewhere")
    with pytest.raises(models.VerifyError, match="models--x/out links to ../../elsewhere"):
        models._links_stay_inside(tmp_path / "scratch")


def test_a_malformed_archive_gets_a_message(hub, locked, tmp_path: Path) -> None:
    lock, _ = locked
    tarball = tmp_path / "broken.tar.gz"
    tarball.write_bytes(b"\x1f\x8b not really gzip")
    out = run(hub, lock, tmp_path / "other", "import", "--model", KEY, str(tarball))
    assert out.returncode == 1 and "not a readable tar.gz" in out.stderr
    assert "Traceback" not in out.stderr


def test_verifying_no_model_is_an_error_not_a_success(hub, locked) -> None:
    lock, store = locked
    out = run(hub, lock, store, "verify", "--target", "strix")
    assert out.returncode == 2 and "no enabled model" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kit.weights.models", "verify", "--target", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "tiny generated model" in out.stderr


def test_lock_without_the_hub_says_what_to_do(tmp_path: Path) -> None:
    lock = tmp_path / "models.lock"
    lock.write_text(LOCK_TEXT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kit.weights.models",
            "--lock-file",
            str(lock),
            "lock",
            "--model",
            KEY,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert out.returncode == 2 and "cannot reach the hub" in out.stderr, out.stderr
