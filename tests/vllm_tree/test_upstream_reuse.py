"""`make test` reads vLLM's suite from the container flow only when the flow ran it
on the same code: same kit commit, same pin file, the cpu images, and each image's
vLLM release and mods (by patch hash) equal to the host tree's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kit import bundle
from kit.vllm_tree import pins, trees, upstream_suite

pytestmark = pytest.mark.cpu

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def host_trees() -> dict[str, trees.Tree]:
    return {name: trees.pinned(name) for name in trees.TREE_NAMES}


@pytest.fixture()
def results(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr(bundle, "RESULTS", tmp_path)
    monkeypatch.setattr(bundle, "kit_commit", lambda: COMMIT)
    return tmp_path


def flow_bundle(results: Path, name: str, host_trees: dict, **manifest) -> Path:
    run = results / name
    meta = {"kit_commit": COMMIT, "pins_sha256": pins.file_sha256(), "target": "cpu"}
    run.mkdir(parents=True)
    bundle.write_manifest(run, {**meta, **manifest})
    for stage, tree in host_trees.items():
        folder = bundle.suite_dir(run, stage)
        folder.mkdir(parents=True)
        record = {"target": "cpu", "stage": stage, **copy.deepcopy(tree.mods_record())}
        bundle.write_json(folder / bundle.IMAGE_RECORD, record)
        (folder / f"upstream-{stage}.xml").write_text("<testsuites/>")
        (folder / f"upstream-{stage}.log").write_text("")
    return run


def test_a_flow_run_on_the_same_code_is_read(results: Path, host_trees: dict) -> None:
    older = flow_bundle(results, "20261201-000000-cpu-aaaaaa", host_trees)
    newer = flow_bundle(results, "20261202-000000-cpu-bbbbbb", host_trees)
    assert upstream_suite.flow_run_of(host_trees) == newer != older


@pytest.mark.parametrize(
    "change", ["kit_commit", "pins_sha256", "target", "mod patch", "mod missing", "no junit"]
)
def test_a_flow_run_on_other_code_is_not_read(results: Path, host_trees: dict, change: str) -> None:
    manifest = {
        "kit_commit": {"kit_commit": "f" * 40},
        "pins_sha256": {"pins_sha256": "0" * 64},
        "target": {"target": "gb10"},
    }.get(change, {})
    run = flow_bundle(results, "20261202-000000-cpu-bbbbbb", host_trees, **manifest)
    record_path = bundle.suite_dir(run, "patched") / bundle.IMAGE_RECORD
    record = bundle.read_json(record_path)
    if change == "mod patch":
        record["mods"][-1]["patch_sha256"] = "0" * 64
    if change == "mod missing":
        record["mods"].pop()
    bundle.write_json(record_path, record)
    if change == "no junit":
        (bundle.suite_dir(run, "unpatched") / "upstream-unpatched.xml").unlink()
    assert upstream_suite.flow_run_of(host_trees) is None


def test_a_changed_checkout_reads_nothing(results: Path, host_trees: dict, monkeypatch) -> None:
    # Even a flow run of the same changed checkout: its images may hold older files.
    flow_bundle(results, "20261202-000000-cpu-bbbbbb", host_trees, kit_commit=COMMIT + "-dirty")
    monkeypatch.setattr(bundle, "kit_commit", lambda: COMMIT + "-dirty")
    assert upstream_suite.flow_run_of(host_trees) is None
