"""The export planners and the device bundle of `make device-check`.

The planners are the rules for which states one forward pass hands out: FLA's
chunk kernel holds the state before every 64-token chunk of each sequence (the
grid starts where the prefill starts) and the final state; vLLM's SSD scan holds
the state at the end of each of its chunks. The bundle
(kit/kernels/device_bundle, written by `kit kernel-check --export`) is all a GPU
machine gets: the cases, vLLM's kernel files per release and a manifest; its
dry run runs the same script under Triton's interpreter on the tiny cases.

The dry run skips only where .venv-triton cannot be built here, and then only
outside CI (CI=true or KIT_REQUIRE_KERNEL_CHECK=1 make that a failure).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from kit import paths
from kit.kernels import check as kernel_check
from kit.kernels import triton_check as triton_side
from kit.vllm_tree import pins, sdists

pytestmark = [pytest.mark.cpu]

BUNDLE = kernel_check.DEVICE_BUNDLE


def _manifest() -> dict[str, Any]:
    return json.loads((BUNDLE / triton_side.MANIFEST).read_text())


# --------------------------------------------------------------------------
# the planners
# --------------------------------------------------------------------------


def test_gdn_plan_exports_the_chunk_starts_and_the_end_of_a_fresh_prefill() -> None:
    plan = triton_side.gdn_export_plan(0, 150, [0, 1, 48, 64, 100, 128, 149, 150])
    assert plan == ([0, 64, 128, 150], [1, 48, 100, 149])


def test_gdn_plan_grid_starts_where_the_prefill_starts() -> None:
    """Resumed at 100: FLA's chunks start at 100, 164, 228, so the request's own
    multiples of 64 (128, 192) fall inside chunks and are refused."""
    plan = triton_side.gdn_export_plan(100, 300, [100, 128, 164, 192, 228, 256, 300])
    assert plan == ([100, 164, 228, 300], [128, 192, 256])


def test_gdn_plan_end_is_exportable_on_or_off_the_grid_and_outside_is_refused() -> None:
    assert triton_side.gdn_export_plan(37, 101, [101, 36, 102, 165, 37]) == (
        [37, 101],
        [36, 102, 165],
    )
    assert triton_side.gdn_export_plan(0, 128, [128, 64, 64, 0]) == ([0, 64, 128], [])


def test_gdn_sources_index_h_per_sequence_and_take_the_end_from_the_final_state() -> None:
    # The second of sequences 130 and 130 tokens long: its rows of h begin at 3.
    assert triton_side.gdn_export_sources(100, 230, 3, [100, 164, 228, 230]) == [
        ("h", 3),
        ("h", 4),
        ("h", 5),
        ("final", 0),
    ]
    # A length that is a multiple of 64: h has no row after its last chunk.
    assert triton_side.gdn_export_sources(0, 128, 0, [0, 64, 128]) == [
        ("h", 0),
        ("h", 1),
        ("final", 0),
    ]
    with pytest.raises(triton_side.CheckError):
        triton_side.gdn_export_sources(0, 128, 0, [65])


def test_ssd_plan_exports_where_the_scans_chunks_end() -> None:
    """A row resumed at 37 with chunk size 16 and a checkpoint 20 tokens in, as vLLM
    lays it out: chunks end 11, 20, 27, 43, 59 and 70 tokens in (48, 57, 64, 80, 96,
    107 in the request)."""
    ends = [11, 20, 27, 43, 59, 70]
    plan = triton_side.ssd_export_plan(37, ends, [37, 38, 48, 53, 57, 64, 106, 107])
    assert plan == ({48: 0, 57: 1, 64: 2, 107: 5}, [37, 38, 53, 106])


# --------------------------------------------------------------------------
# the bundle
# --------------------------------------------------------------------------


def test_bundle_is_whole_and_fits_a_device_run() -> None:
    manifest = _manifest()
    files = {manifest["cases"]["file"]: manifest["cases"]["sha256"]}
    files |= {r["kernels"]: r["sha256"] for r in manifest["releases"].values()}
    total = 0
    for name, want in files.items():
        assert pins.file_sha256(BUNDLE / name) == want, name
        total += (BUNDLE / name).stat().st_size
    # The device machine takes the working tree, 64 MiB of carried paths at most.
    assert total < 32 << 20
    patched = kernel_check.patched_fla_key()
    assert set(manifest["releases"]) == {
        pins.get("vllm.version"),
        *kernel_check.LATER_RELEASES,
        patched,
    }
    assert manifest["releases"][pins.get("vllm.version")]["kinds"] == list(kernel_check.KINDS)
    for version in kernel_check.LATER_RELEASES:
        assert manifest["releases"][version]["kinds"] == list(kernel_check.LATER_KINDS)
    assert manifest["releases"][patched]["kinds"] == list(kernel_check.PATCHED_KINDS)
    assert manifest["tiny"] == {name: kind for kind, name in kernel_check.TINY_CASES.items()}


def test_bundle_holds_every_kind_and_the_export_cases() -> None:
    import torch

    cases = torch.load(BUNDLE / _manifest()["cases"]["file"], weights_only=True)["cases"]
    assert {c["kind"] for c in cases} == set(kernel_check.KINDS)
    names = {c["name"] for c in cases}
    assert {name for name, *_ in kernel_check.GDN_EXPORT_BATCHES} <= names
    assert {name for name, *_ in kernel_check.SSD_EXPORT_CASES} <= names
    for case in cases:
        if case["kind"] in ("gdn_export", "ssd_export"):
            # Some positions on the kernel's grid and some off it, in every row with room.
            assert any(case["off_grid"]) and all(case["requested"]), case["name"]


def _bundled(release: dict[str, Any]) -> dict[str, bytes]:
    with tarfile.open(BUNDLE / release["kernels"]) as bundled:
        return {m.name: bundled.extractfile(m).read() for m in bundled if m.isfile()}  # type: ignore[union-attr]


def test_bundle_patched_kernels_are_the_patched_trees_files() -> None:
    """The patched entry: the release's patched tree, mods applied, file for file."""
    patched = kernel_check.patched_fla_key()
    ours = _bundled(_manifest()["releases"][patched])
    root = kernel_check.patched_fla_tree().package.parent
    assert "vllm/third_party/flash_linear_attention/ops/chunk.py" in ours
    for name, data in ours.items():
        assert (root / name).read_bytes() == data, name
    chunk = ours["vllm/third_party/flash_linear_attention/ops/chunk.py"].decode()
    assert "def chunk_gated_delta_rule_with_chunk_states(" in chunk


@pytest.mark.slow
def test_bundle_kernels_are_the_sdists_files_verbatim() -> None:
    for version, release in _manifest()["releases"].items():
        if version == kernel_check.patched_fla_key():
            continue  # the patched tree's (the test above)
        ours = _bundled(release)
        assert "vllm/v1/worker/mamba_utils.py" in ours
        assert "vllm/model_executor/layers/mamba/ops/ssd_combined.py" in ours
        top, seen = f"vllm-{version}/", set()
        # One pass over the sdist: a gzip tar reads slowly out of order.
        with tarfile.open(sdists.release(version)) as sdist:
            for member in sdist:
                name = member.name.removeprefix(top)
                if name in ours:
                    theirs = sdist.extractfile(member)
                    assert theirs is not None and theirs.read() == ours[name], (version, name)
                    seen.add(name)
        assert seen == set(ours), version


def test_the_device_script_imports_neither_vllm_nor_the_kit() -> None:
    tree = ast.parse(Path(triton_side.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"vllm", "kit"}
    # torch, Triton and numpy (through Triton); packaging and einops only where present.
    others = {"__future__", "torch", "triton", "packaging", "einops"}
    assert imported - others <= set(sys.stdlib_module_names)


def test_make_device_check_runs_the_bundle_on_cuda_or_dry() -> None:
    def make_n(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", "device-check", *args],
            cwd=paths.ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert "kit/kernels/triton_check.py --bundle kit/kernels/device_bundle" in make_n()
    assert "--device cuda --out results/kernel-check-cuda.json" in make_n()
    assert "--dry-run" in make_n("DRY_RUN=1") and "--device cuda" not in make_n("DRY_RUN=1")


@pytest.mark.slow
def test_dry_run_matches_every_tiny_case_on_every_release(triton_env: Path, tmp_path: Path) -> None:
    """The device script as make device-check runs it, under the interpreter (about
    40 s on two shared cores): every tiny case of every release within tolerance."""
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    done = subprocess.run(
        [
            str(triton_env),
            str(triton_side.__file__),
            "--bundle",
            str(BUNDLE),
            "--dry-run",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["dry_run"] and result["device"] == "cpu"
    manifest = _manifest()
    assert set(result["releases"]) == set(manifest["releases"])
    for version, release in result["releases"].items():
        assert release["interpreter"], version
        kinds = manifest["releases"][version]["kinds"]
        want = {n for n, k in manifest["tiny"].items() if k in kinds}
        assert {c["name"] for c in release["cases"]} == want, version
        bad = [c["name"] for c in release["cases"] if not c["ok"]]
        assert not bad, (version, bad)
        for case in release["cases"]:
            if case["kind"] in ("gdn_export", "ssd_export"):
                assert case["positions"]["as_expected"], (version, case["name"])
            # The patched FLA's stored float32 states, bit for bit as stock where they must be.
            wide = case.get("stored_states")
            assert (wide is not None) == (version == kernel_check.patched_fla_key())
            assert wide is None or all(wide.values()), (version, case["name"])
