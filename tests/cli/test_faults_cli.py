"""`kit`: an expected error is one line, ``error: <what is wrong>; <what to do>``, and
exit status 2, whichever job raised it; a bug keeps its traceback.

Expected: a file-system error (a full disk, a read-only checkout, ``--out`` into a
missing folder or onto a file), a file that is not UTF-8, JSON or TOML, a bundle
of the wrong shape given to ``kit report``, a table missing from pins.toml, a
network that cannot be reached."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib
import types
import urllib.error
from pathlib import Path

import pytest

from kit import cli

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


def kit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kit.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    """A copy of a bundle in results/ that `kit report` renders (its logs left out)."""
    for found in sorted(ROOT.glob("results/**/bench.json"), reverse=True):
        if kit("report", str(found.parent)).returncode == 0:
            copy = tmp_path / found.parent.name
            shutil.copytree(found.parent, copy, ignore=shutil.ignore_patterns("logs"))
            return copy
    pytest.skip("no bundle in results/ that this kit renders")


def test_a_bench_json_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "bench.json").write_bytes(b'{"schema": "\xff\xfe"}')
    line = one_line(kit("report", str(folder)))
    assert str(folder / "bench.json") in line and "UTF-8" in line


@pytest.mark.parametrize(
    "key,value",
    [("summary", [1, 2]), ("geometry", "x"), ("run", 5), ("pooled_ratios", 3)],
)
def test_a_bundle_of_the_wrong_shape_is_one_line(bundle: Path, key: str, value: object) -> None:
    path = bundle / "bench.json"
    report = json.loads(path.read_text())
    report[key] = value
    path.write_text(json.dumps(report))
    line = one_line(kit("report", str(bundle)))
    assert str(bundle) in line and "re-run" in line


def test_report_out_into_a_missing_folder_is_one_line(bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "no-such-folder" / "report.md"
    line = one_line(kit("report", str(bundle), "--out", str(out)))
    assert str(out) in line and "does not exist" in line
    assert not out.parent.exists()


# `kit` with the bench lock (kit.bench.bench_lock.LOCK) at argv[1]: a bench of the
# test's own, not refused while a real bench holds this checkout's .cache/bench.lock.
OWN_BENCH_LOCK = (
    "import sys; from pathlib import Path; from kit.bench import bench_lock; "
    "bench_lock.LOCK = Path(sys.argv.pop(1)); from kit import cli; sys.exit(cli.main())"
)


def test_bench_out_onto_an_existing_file_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    taken = tmp_path / "taken"
    taken.write_text("someone's file\n")
    done = subprocess.run(
        [sys.executable, "-c", OWN_BENCH_LOCK, str(tmp_path / "bench.lock"), "bench"]
        + ["--model-dir", str(model), "--out", str(taken)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = one_line(done)
    assert str(taken) in line
    assert taken.read_text() == "someone's file\n"


def test_lock_models_without_the_network_is_one_line(tmp_path: Path) -> None:
    lock = tmp_path / "models.lock"
    lock.write_text(
        'version = 1\n\n[models.tiny]\nrepo = "org/tiny"\ntargets = ["cpu"]\n'
        'enabled = true\nrevision = "unresolved"\n'
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the socket is
    env = dict(
        os.environ,
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(tmp_path / "hf-home"),
    )
    line = one_line(kit("models", "--lock-file", str(lock), "lock", env=env))
    assert "cannot reach the hub" in line


# -- every expected class, through a stand-in job ----------------------------------


def _pins_reader(pins: dict) -> str:
    return pins["cpu"]["torch"]


def _raise(exc: BaseException):
    def main(argv):
        if isinstance(exc, KeyError):
            _pins_reader({"tools": {}})
        raise exc

    return main


OSERRORS = [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out/bench.json"), "free space"),
    (OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/results/x"), "writable"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/root/x"), "permissions"),
    (FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), "/tmp/taken"), "new path"),
    (IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), "/tmp"), "a file"),
]
NETWORK = [
    (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), "network"),
    (ConnectionResetError(104, "Connection reset by peer"), "network"),
    (TimeoutError("timed out"), "network"),
]


@pytest.mark.parametrize(
    "exc,hint",
    [
        *OSERRORS,
        *NETWORK,
        (tomllib.TOMLDecodeError("Expected '=' (at line 3, column 5)"), "not valid TOML"),
        (KeyError("cpu"), "pins.toml"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_each_expected_error_is_one_line_with_status_2(
    monkeypatch, capsys, exc: BaseException, hint: str
) -> None:
    module = types.ModuleType("kit_fault_job")
    module.main = _raise(exc)
    monkeypatch.setitem(sys.modules, "kit_fault_job", module)
    monkeypatch.setitem(cli.JOBS, "fault", ("kit_fault_job", "raises"))
    monkeypatch.delenv("KIT_TRACEBACK", raising=False)
    assert cli.main(["fault"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], err
    assert hint in lines[0], err
    if getattr(exc, "filename", None):
        assert exc.filename in lines[0]


@pytest.mark.parametrize(
    "exc", [ZeroDivisionError("a bug"), TypeError("a bug"), KeyError("not_a_pin")]
)
def test_a_bug_keeps_its_traceback(monkeypatch, exc: BaseException) -> None:
    module = types.ModuleType("kit_fault_job")

    def main(argv):
        raise exc

    module.main = main
    monkeypatch.setitem(sys.modules, "kit_fault_job", module)
    monkeypatch.setitem(cli.JOBS, "fault", ("kit_fault_job", "raises"))
    with pytest.raises(type(exc)):
        cli.main(["fault"])


def test_kit_traceback_shows_the_traceback_of_an_expected_error(monkeypatch) -> None:
    module = types.ModuleType("kit_fault_job")
    module.main = _raise(OSError(errno.ENOSPC, "No space left on device", "/x"))
    monkeypatch.setitem(sys.modules, "kit_fault_job", module)
    monkeypatch.setitem(cli.JOBS, "fault", ("kit_fault_job", "raises"))
    monkeypatch.setenv("KIT_TRACEBACK", "1")
    with pytest.raises(OSError):
        cli.main(["fault"])


def test_ctrl_c_is_still_130(monkeypatch, capsys) -> None:
    module = types.ModuleType("kit_fault_job")
    module.main = _raise(KeyboardInterrupt())
    monkeypatch.setitem(sys.modules, "kit_fault_job", module)
    monkeypatch.setitem(cli.JOBS, "fault", ("kit_fault_job", "raises"))
    assert cli.main(["fault"]) == 130
    assert "interrupted" in capsys.readouterr().err
