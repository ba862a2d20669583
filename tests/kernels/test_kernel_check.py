"""The kit's CPU kernels against vLLM 0.32.0's own Triton kernels (kit.kernels.check).

vLLM's kernels come from the pinned sdist and run under Triton's interpreter in
.venv-triton (built here if missing; kit/kernels/triton_env.py). The copies must equal
the kit's CPU port bit for bit, the CPU GDN kernel's final and per-chunk states
FLA's within ``GDN_TOLERANCE``; the states exported from one pass (FLA's h, the
SSD scan's chunk states, on 0.32.0's and 0.34.0's kernels) the float64
recurrence's and the CPU export's, the off-grid positions refused; and the check
must fail when the CPU side or a reference is broken on purpose.

Skipped only when .venv-triton cannot be built here (no torch CPU build or
Triton reachable), and then only outside CI: with CI=true or
KIT_REQUIRE_KERNEL_CHECK=1 that is a failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from kit import paths
from kit.kernels import check as kernel_check
from kit.kernels import triton_env as kernel_env  # the fixture triton_env is its python
from kit.vllm_tree import trees

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def test_triton_env_is_hash_locked_like_the_kits_venv(triton_env: Path) -> None:
    want = kernel_env.wanted()
    locked = kernel_env.locked_requirements(want)
    if locked is None:
        pytest.skip(f"{kernel_env.lock_file()}: the kit has no CPU lock for this machine")
    path, body = locked
    names = [line.split("==")[0] for line in body.splitlines() if "==" in line]
    assert sorted(names) == sorted(kernel_env.LOCKED)
    # Each entry carries at least one hash; torch is the CPU build .venv has.
    assert body.count("--hash=sha256:") >= len(names)
    assert f"torch=={want['torch']} " in body
    stamp = json.loads(kernel_env.STAMP.read_text())
    assert stamp["lock"] == {"file": str(path.relative_to(paths.ROOT)), "sha256": ANY}
    assert stamp == want


def _state_fields(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-state comparisons of a copy case (state0_conv, state1_temporal, ...)."""
    fields = [v for k, v in case.items() if k.startswith("state") and isinstance(v, dict)]
    assert len(fields) == 4  # two layers, a conv and a temporal state each
    return fields


def _run(tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    return kernel_check.run(tmp_path / "kernel-check.json", **kwargs)


def assert_exports_match(result: dict[str, Any], export_mod: bool) -> None:
    """The export cases of a kernel-check result: every requested position either
    exported from the pass's own states or refused, exactly as the case laid it out,
    and the exports within tolerance of the float64 recurrence (and of the CPU
    export where the tree has it); the same on each later release's kernels."""
    released = [r for k, r in result["releases"].items() if k != kernel_check.patched_fla_key()]
    for release in [result, *released]:
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for case in release["cases"]:
            by_kind.setdefault(case["kind"], []).append(case)
        assert by_kind.get("gdn_export") and by_kind.get("ssd_export"), release["kernels"]
        for case in by_kind["gdn_export"] + by_kind["ssd_export"]:
            assert case["ok"], (release["kernels"], case["name"])
            positions = case["positions"]
            assert positions["as_expected"], case["name"]
            assert positions["count"] >= 4 and any(positions["refused"]), case["name"]
        for case in by_kind["gdn_export"]:
            tol = kernel_check.GDN_EXPORT_TOLERANCE["states"]
            # h's rows are fp16 under the interpreter: well inside the tolerance.
            assert case["triton_vs_float64"]["max_rel"] < 0.01, case["name"]
            assert ("triton_vs_cpu_export" in case) == export_mod, case["name"]
            if export_mod:
                assert case["triton_vs_cpu_export"]["max_rel"] <= tol, case["name"]
                assert case["cpu_export_vs_float64"]["max_rel"] < 0.01, case["name"]
        for case in by_kind["ssd_export"]:
            assert case["states_vs_float64"]["max_rel"] < 0.01, case["name"]
            assert case["output_vs_float64"]["max_rel"] < 0.01, case["name"]
    for version in kernel_check.LATER_RELEASES:
        later = result["releases"][version]
        assert {c["kind"] for c in later["cases"]} == set(kernel_check.LATER_KINDS)
        assert later["ok"], version
        # The stock sdist's FLA has no float32-h path.
        assert not any("stored_states" in c for c in later["cases"]), version
    assert_patched_fla_as_stock(result["releases"][kernel_check.patched_fla_key()])


def assert_patched_fla_as_stock(patched: dict[str, Any]) -> None:
    """The FLA files of fix-eagle-fine-prefix-exports on the ``gdn`` cases: within
    tolerance as stock, and storing float32 states changes the output and the final
    states by not one bit, each stored chunk state rounds to h and each stored end
    is the final state."""
    assert {c["kind"] for c in patched["cases"]} == set(kernel_check.PATCHED_KINDS)
    assert patched["ok"] and patched["cases"]
    for case in patched["cases"]:
        assert case["stored_states"] == {
            "output_bitwise": True,
            "final_bitwise": True,
            "h_rounds_to_stock": True,
            "finals_stored": True,
        }, case["name"]


def test_cpu_ports_match_vllm_triton_kernels(triton_env: Path, tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result["interpreter"] and result["device"] == "cpu"
    assert result["cpu_port"]["vllm"] == "0.32.0"
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for case in result["cases"]:
        by_kind.setdefault(case["kind"], []).append(case)
    assert set(by_kind) == set(kernel_check.KINDS)
    bad = [c["name"] for c in result["cases"] if not c["ok"]]
    assert not bad, f"differ from vLLM's kernels: {bad}; see {tmp_path / 'kernel-check.json'}"
    for kind in ("postprocess", "precopy"):
        for case in by_kind[kind]:
            # Something moved in every case, and moved exactly as the kernel moves it.
            assert case["states_changed_by_step"] > 0, case["name"]
            assert all(s["bitwise_equal"] for s in _state_fields(case)), case["name"]
    for case in by_kind["postprocess"]:
        assert case["num_accepted_equal"], case["name"]
    for case in by_kind["batch_memcpy"]:
        assert case["buffer"]["bitwise_equal"], case["name"]
    assert sum(c["chunk_states"]["count"] for c in by_kind["gdn"]) >= 5
    # States inside chunks too, 48 tokens in among them (the bench's later turns).
    assert sum(c["mid_states"]["count"] for c in by_kind["gdn"]) >= 10
    export_mod = "cpu-gdn-prefill-checkpoint" in trees.select().mods
    assert_exports_match(result, export_mod)
    for case in by_kind["gdn"]:
        tol = kernel_check.GDN_TOLERANCE
        # The export mod's states, from one call, against FLA's chunk states.
        assert ("export" in case) == export_mod, case["name"]
        if export_mod:
            assert case["export"]["chunk_states"]["max_rel"] <= tol["chunk_states"], case
            assert case["export"]["chunk_states"]["count"] == case["chunk_states"]["count"]
            assert case["export"]["mid_states"]["max_rel"] <= tol["chunk_states"], case
        assert case["final_state"]["max_rel"] <= tol["final_state"], case["name"]
        assert case["chunk_states"]["max_rel"] <= tol["chunk_states"], case["name"]
        assert case["mid_states"]["max_rel"] <= tol["chunk_states"], case["name"]
        assert case["output"]["max_rel"] <= tol["output"], case["name"]
        # Both stay close to the exact recurrence: the agreement is not two equal mistakes.
        for side in ("triton_vs_float64", "cpu_vs_float64"):
            for states in ("final_state", "chunk_states", "mid_states"):
                got = case[side][states]  # None: a case without chunk boundaries
                assert got is None or got["max_rel"] < 0.01, (case["name"], side, states)


def test_check_fails_when_the_post_copy_bias_is_off_by_one(
    triton_env: Path, tmp_path: Path
) -> None:
    """The mod's post-copy decision with the accepted-token bias one too small."""
    result = _run(tmp_path, perturb="align-bias", kinds={"postprocess"})
    assert not result["ok"]
    failed = [c for c in result["cases"] if not c["ok"]]
    assert len(failed) >= 2
    for case in failed:
        assert not all(s["bitwise_equal"] for s in _state_fields(case)), case["name"]


def test_check_fails_when_a_chunk_state_is_one_token_early(
    triton_env: Path, tmp_path: Path
) -> None:
    """The CPU split schedule taking each chunk-boundary state one token short."""
    result = _run(tmp_path, perturb="gdn-position", kinds={"gdn"})
    assert not result["ok"]
    tol = kernel_check.GDN_TOLERANCE
    for case in result["cases"]:
        assert not case["ok"], case["name"]
        # Only the chunk states moved, and far past the tolerance.
        assert case["chunk_states"]["max_rel"] > 10 * tol["chunk_states"], case["name"]
        assert case["final_state"]["max_rel"] <= tol["final_state"], case["name"]
        # Inside chunks too (measured: 57-98 % of scale).
        assert case["mid_states"]["max_rel"] > 10 * tol["chunk_states"], case["name"]
        if "export" in case:  # the export, asked for the same wrong positions
            assert case["export"]["chunk_states"]["max_rel"] > 10 * tol["chunk_states"]
            assert case["export"]["mid_states"]["max_rel"] > 10 * tol["chunk_states"]


def test_check_fails_when_an_export_is_one_token_early(triton_env: Path, tmp_path: Path) -> None:
    """The references of the export cases taken one token before each requested
    position (FLA's and the SSD scan's exports unchanged): every case fails on its
    states, though each position is still exported or refused as laid out."""
    for perturb, kind, field in (
        ("gdn-position", "gdn_export", "triton_vs_float64"),
        ("ssd-position", "ssd_export", "states_vs_float64"),
    ):
        result = _run(tmp_path, perturb=perturb, kinds={kind}, later=False)
        assert not result["ok"] and result["cases"], perturb
        for case in result["cases"]:
            assert not case["ok"] and case["positions"]["as_expected"], case["name"]
            # Measured: 66-157 % of scale, against a tolerance of 2 %.
            assert case[field]["max_rel"] > 10 * case["tolerance"]["states"], case["name"]
