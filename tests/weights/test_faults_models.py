"""Faults of the model store: an import that fails after the archive was checked never
costs the verified model already there, and the fast verify is not fooled by a
weight changed in place with its mtime put back.

A small fake model in the Hugging Face cache layout (blobs, snapshot links), built by
hand: nothing talks to a hub."""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
from pathlib import Path

import pytest

from kit.weights import models

pytestmark = pytest.mark.cpu

REPO = "kit-test/tiny-store"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FOLDER = f"models--{REPO.replace('/', '--')}"
FILES = {
    "config.json": b'{"model_type": "tiny"}\n',
    "model.safetensors": bytes(range(256)) * 64,
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def lock(tmp_path: Path) -> list[models.Entry]:
    path = tmp_path / "models.lock"
    text = [
        "version = 1",
        "",
        "[models.tiny]",
        f'repo = "{REPO}"',
        'targets = ["cpu"]',
        "enabled = true",
        f'revision = "{COMMIT}"',
    ]
    for name, data in FILES.items():
        text += ["", "[[models.tiny.files]]", f'path = "{name}"', f"size = {len(data)}"]
        text.append(f'sha256 = "{_sha(data)}"')
    path.write_text("\n".join(text) + "\n")
    return models.load(path)[1]


def _model(root: Path, blobs_in: str = FOLDER) -> Path:
    """The fake model's repo folder under ``root``; its snapshot links point into
    ``blobs_in``'s blobs (another folder than its own: a link that leaves the model)."""
    repo = root / FOLDER
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / blobs_in / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, data in FILES.items():
        (root / blobs_in / "blobs" / _sha(data)).write_bytes(data)
        (snap / name).symlink_to(Path("../../..") / blobs_in / "blobs" / _sha(data))
    return repo


def _tarball(tmp_path: Path, blobs_in: str = FOLDER) -> Path:
    staging = tmp_path / "staging"
    _model(staging, blobs_in)
    tarball = tmp_path / "models.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for top in sorted(staging.iterdir()):
            tar.add(top, arcname=top.name)
    return tarball


@pytest.fixture()
def store(tmp_path: Path, lock: list[models.Entry]) -> Path:
    """A store holding the verified model, with a marker only the old copy has."""
    store = tmp_path / "store"
    repo = _model(store)
    (repo / "old-copy").write_text("the verified model already here\n")
    models.verify(lock, store, full=True)
    return store


def _old_model_intact(store: Path, lock: list[models.Entry]) -> None:
    assert (store / FOLDER / "old-copy").is_file()
    models.verify(lock, store, full=True)
    assert sorted(p.name for p in store.iterdir()) == [models.STAMP_DIR, FOLDER]


def test_an_archive_whose_links_leave_the_model_is_refused_and_the_old_model_stays(
    tmp_path: Path, lock: list[models.Entry], store: Path
) -> None:
    """The snapshot links into another top-level folder of the archive: whole in the
    scratch store, dangling once the model's folder alone is moved into place."""
    tarball = _tarball(tmp_path, blobs_in="models--elsewhere")
    with pytest.raises(models.VerifyError, match="Nothing was imported"):
        models.import_(lock, store, tarball)
    _old_model_intact(store, lock)


@pytest.mark.parametrize("fault", [models.VerifyError, KeyboardInterrupt, OSError])
def test_a_failure_once_the_new_model_is_in_place_puts_the_old_one_back(
    tmp_path: Path, lock: list[models.Entry], store: Path, monkeypatch, fault: type
) -> None:
    real = models.verify

    def verify(entries, where, full=False):
        if Path(where) == store:  # the check of the model in its final place
            raise fault("the disk went away")
        return real(entries, where, full)

    monkeypatch.setattr(models, "verify", verify)
    with pytest.raises(fault, match="the disk went away"):
        models.import_(lock, store, _tarball(tmp_path))
    monkeypatch.setattr(models, "verify", real)
    _old_model_intact(store, lock)


def test_a_good_import_replaces_the_model_and_leaves_nothing_beside(
    tmp_path: Path, lock: list[models.Entry], store: Path
) -> None:
    models.import_(lock, store, _tarball(tmp_path))
    assert not (store / FOLDER / "old-copy").exists()
    models.verify(lock, store, full=True)
    assert sorted(p.name for p in store.iterdir()) == [models.STAMP_DIR, FOLDER]


def test_fast_verify_sees_a_weight_changed_in_place_with_its_mtime_put_back(
    lock: list[models.Entry], store: Path
) -> None:
    models.verify(lock, store)  # stamps written: the next plain verify trusts them
    weights = (store / FOLDER / "snapshots" / COMMIT / "model.safetensors").resolve()
    before = weights.stat()
    time.sleep(0.05)  # past the filesystem's timestamp tick, as any real edit is
    data = bytearray(weights.read_bytes())
    data[0] ^= 1
    with weights.open("r+b") as f:  # in place: same inode, same size
        f.write(data)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    with pytest.raises(models.VerifyError, match="sha256 differs"):
        models.verify(lock, store)


def test_fast_verify_of_an_untouched_store_hashes_nothing(
    lock: list[models.Entry], store: Path, monkeypatch
) -> None:
    models.verify(lock, store)
    hashed = []
    monkeypatch.setattr(models, "file_sha256", lambda path: hashed.append(path))
    models.verify(lock, store)
    assert hashed == []


# --- an import killed outright, an archive with a bad hash -----------------------------

KILLED_IMPORT = """
import sys, time
from pathlib import Path
from kit.weights import models
lock, store, tarball, ready = map(Path, sys.argv[1:])
real = models.verify

def verify(entries, where, full=False):
    if Path(where) == store:  # the old model is aside, the new one in place: stop here
        ready.write_text("")
        time.sleep(600)
    return real(entries, where, full)

models.verify = verify
models.import_(models.load(lock)[1], store, tarball)
"""


def test_an_import_killed_mid_swap_is_undone_by_the_next_verify(
    tmp_path: Path, lock: list[models.Entry], store: Path, capsys
) -> None:
    """kill -9 once the old model is aside: the next verify removes the scratch folder
    and puts the old model back, saying so in one line."""
    import subprocess
    import sys

    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_IMPORT, str(tmp_path / "models.lock"), str(store)]
        + [str(_tarball(tmp_path)), str(ready)],
        cwd=Path(models.__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the import never reached its swap"
    finally:
        child.kill()
        child.wait()
    assert not (store / FOLDER / "old-copy").exists()  # the old model is aside
    lock_file = str(tmp_path / "models.lock")
    assert models.main(["--lock-file", lock_file, "--store", str(store), "verify", "--full"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"(pid {child.pid}) that was killed" in err[0], err
    assert f"put back the model it had moved aside: {FOLDER}" in err[0]
    _old_model_intact(store, lock)


def test_a_running_imports_scratch_folder_is_left_alone(store: Path) -> None:
    scratch = store / f"{models.SCRATCH_PREFIX}{os.getppid()}-abc"  # a live process's
    (scratch / f".old-{FOLDER}").mkdir(parents=True)
    assert models.recover(store) == []
    assert scratch.is_dir()


def test_an_archive_with_a_bad_hash_says_export_again_not_fetch(
    tmp_path: Path, lock: list[models.Entry], store: Path
) -> None:
    staging = tmp_path / "staging"
    _model(staging)
    blob = staging / FOLDER / "blobs" / _sha(FILES["model.safetensors"])
    blob.write_bytes(bytes(reversed(FILES["model.safetensors"])))  # same size, other bytes
    tarball = tmp_path / "models.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(staging / FOLDER, arcname=FOLDER)
    with pytest.raises(models.VerifyError) as caught:
        models.import_(lock, store, tarball)
    fix = str(caught.value).splitlines()[-1]
    assert "make export-models" in fix and "Nothing was imported" in fix
    assert "fetch-models MODEL=" not in fix
    _old_model_intact(store, lock)
