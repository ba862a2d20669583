"""Faults of a bench run outside the errors it expects (a tree that cannot be built, a
bug): the results folder still says why in failed.json, and the error goes on up
(one line for a kit error, a traceback for a bug: kit/cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit import bundle
from kit.bench import bench_lock
from kit.bench import run as bench
from kit.vllm_tree import mods

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def own_lock(tmp_path: Path, monkeypatch) -> None:
    """A bench lock of the test's own: a real bench running in this checkout holds
    .cache/bench.lock, and these benches would refuse instead of failing as tested."""
    monkeypatch.setattr(bench_lock, "LOCK", tmp_path / "bench.lock")


@pytest.mark.parametrize(
    "fault",
    [
        mods.ModError("the patched tree cannot be built"),
        ValueError("a bug in the bench"),
        SystemExit("a step that exits"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_any_failure_after_the_folder_exists_writes_failed_json(
    tmp_path: Path, monkeypatch, fault: BaseException
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in weights")
    out = tmp_path / "out"

    def broken(*args, **kwargs):
        assert out.is_dir()  # the results folder exists when the run starts
        raise fault

    monkeypatch.setattr(bench, "run", broken)
    with pytest.raises(type(fault)):
        bench.main(["--shared", "900", "--model-dir", str(model), "--out", str(out)])
    failed = json.loads((out / bundle.FAILED).read_text())
    assert failed["status"] == "failed"
    assert failed["reason"] == f"{type(fault).__name__}: {fault}"
    assert not (out / bundle.BENCH).exists()
