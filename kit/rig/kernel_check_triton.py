"""The Triton side of `make kernel-check`: vLLM's own kernels on the kit's cases, compared.

Standalone on purpose: it needs torch, Triton and numpy, and no vLLM and no
kit, so the same file runs in the kit's .venv-triton under Triton's
interpreter (``TRITON_INTERPRET=1``, ``--device cpu``) and on a GPU machine
with compiled kernels (``--device cuda``), where vLLM's kernel sources travel
as files.

    python kit/rig/kernel_check_triton.py --kernels DIR --cases cases.pt \
        --device cpu --out result.json

``DIR`` holds the needed files of the vLLM 0.32.0 sdist at their sdist paths:
``vllm/v1/worker/mamba_utils.py`` and ``vllm/third_party/flash_linear_attention/ops/``.
``cases.pt`` (written by ``kit.rig.kernel_check``) holds each case's inputs and
what the kit's CPU ports computed from them. The kernels are loaded from the
files as they are: the ``@triton.jit`` functions of ``mamba_utils.py`` (that
module also imports half of vLLM's engine, which the kernels do not use), and
the FLA modules as a package whose few vLLM imports (``vllm.triton_utils``,
``vllm.platforms``, two helpers of ``vllm.utils``) are answered by the shims
below. Under the interpreter, and only there, four adaptations (each where it
is made says why): FLA's aliased builtins (``exp = tl.exp``) look ``tl`` up when
called, chunk_delta_h's loop index is a Triton scalar, every autotuned kernel
runs its first config, and the GDN inputs go in as fp16 instead of bf16 (the
same values). The kernels' own code is not changed.

Exit status: 0 every case within its tolerance, 1 a case is not, 2 it could
not run (missing files, unreadable cases).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

MAMBA_UTILS = Path("vllm/v1/worker/mamba_utils.py")
FLA_OPS = Path("vllm/third_party/flash_linear_attention/ops")
# The FLA kernels read this at import: it makes chunk_gated_delta_rule_fwd also
# return h, the per-chunk states (the same kernels run either way).
os.environ["GDN_RECOMPUTE_SUPPRESS_LEVEL"] = "3"


class CheckError(RuntimeError):
    exit_code = 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------
# Loading vLLM's kernels from the sdist files
# --------------------------------------------------------------------------


def load_align_kernels(kernels: Path, work: Path) -> types.ModuleType:
    """The ``@triton.jit`` functions (and ``_TEMPORAL_TILES``) of mamba_utils.py, verbatim."""
    source_path = kernels / MAMBA_UTILS
    if not source_path.is_file():
        raise CheckError(f"{source_path}: missing; --kernels must hold the vLLM sdist's files")
    source = source_path.read_text()
    tree = ast.parse(source)
    pieces = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            "triton.jit" in ast.unparse(d) for d in node.decorator_list
        ):
            start = node.decorator_list[0].lineno
            pieces.append("\n".join(source.splitlines()[start - 1 : node.end_lineno]))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_TEMPORAL_TILES" for t in node.targets
        ):
            pieces.append(ast.get_source_segment(source, node) or "")
    names = {"postprocess_mamba_fused_kernel", "precopy_mamba_align_fused_kernel"}
    names |= {"batch_memcpy_kernel", "_copy_mamba_state_block", "_memcpy_u64_tiled"}
    missing = [n for n in sorted(names) if f"def {n}(" not in "\n".join(pieces)]
    if missing:
        raise CheckError(f"{source_path}: no kernel {', '.join(missing)}; another vLLM release?")
    # Triton's JIT reads each kernel's source from its file, so the extract is a file.
    target = work / "vllm_mamba_align_kernels.py"
    header = (
        f"# Extracted from {MAMBA_UTILS} of the vLLM sdist by kit/rig/kernel_check_triton.py.\n"
    )
    target.write_text(
        header + "import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(pieces) + "\n"
    )
    spec = importlib.util.spec_from_file_location("vllm_mamba_align_kernels", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path else []  # a package: submodules import from path
    sys.modules[name] = module
    return module


def _install_vllm_shims(kernels: Path) -> None:
    """Just what the FLA ops import from vLLM; the FLA package's own __init__ is skipped
    (it also imports the layernorm and warm-up machinery the chunk kernels do not use)."""
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    _package("vllm")
    _package("vllm.third_party", kernels / "vllm/third_party")
    _package("vllm.third_party.flash_linear_attention", kernels / FLA_OPS.parent)
    _package("vllm.third_party.flash_linear_attention.ops", kernels / FLA_OPS)
    triton_utils = _package("vllm.triton_utils")
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = True

    class Platform:
        # FLA asks only these two: which GPU vendor, to pick its configs.
        @staticmethod
        def is_cuda_alike() -> bool:
            return torch.cuda.is_available() and not interpreting()

        @staticmethod
        def is_rocm() -> bool:
            return torch.version.hip is not None and torch.cuda.is_available()

    platforms = _package("vllm.platforms")
    platforms.current_platform = Platform()
    _package("vllm.utils")
    sync = _package("vllm.utils.gpu_sync_debug")
    sync.gpu_sync_allowed = lambda first_only=False: contextlib.nullcontext()
    torch_utils = _package("vllm.utils.torch_utils")

    def async_tensor_h2d(data: Any, device: Any = None, dtype: Any = None, out: Any = None) -> Any:
        return torch.as_tensor(data, dtype=dtype).to(device)

    torch_utils.async_tensor_h2d = async_tensor_h2d


def load_fla(kernels: Path) -> types.ModuleType:
    """vLLM's FLA chunk module (``chunk_gated_delta_rule`` and the kernels under it)."""
    if not (kernels / FLA_OPS / "chunk.py").is_file():
        raise CheckError(f"{kernels / FLA_OPS}: missing; --kernels must hold the sdist's files")
    _install_vllm_shims(kernels)
    chunk = importlib.import_module("vllm.third_party.flash_linear_attention.ops.chunk")
    if interpreting():
        _adapt_to_interpreter()
    return chunk


def _adapt_to_interpreter() -> None:
    """Two things Triton's interpreter does not do for these modules (compiled runs need neither):
    FLA names some builtins by alias (``exp = tl.exp`` in op.py), and the interpreter
    swaps in its own versions of ``tl.exp`` on the module only, so an alias keeps
    the compiled-only builtin; and autotuning would run every config several
    times to time it. Each alias is made to look ``tl.<name>`` up when called;
    each autotuner keeps its first config. And a loop index is a Python int
    under the interpreter, a Triton scalar when compiled: chunk_delta_h's
    ``i_t.to(tl.int64)`` needs the latter, so its loops yield interpreter scalars."""
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import _implicit_cvt

    def scalar_range(*args: Any) -> Any:
        ints = [int(a.handle.data.item()) if hasattr(a, "handle") else int(a) for a in args]
        return (_implicit_cvt(i) for i in range(*ints))

    vars(sys.modules["vllm.third_party.flash_linear_attention.ops.chunk_delta_h"])["range"] = (
        scalar_range
    )

    def via_module(owner: types.ModuleType, name: str) -> Any:
        return lambda *args, **kwargs: getattr(owner, name)(*args, **kwargs)

    for name in list(sys.modules):
        if name.startswith("vllm.third_party.flash_linear_attention.ops."):
            module_globals = vars(sys.modules[name])
            for key, value in list(module_globals.items()):
                if tl.core.is_builtin(value):
                    owner = next(
                        (m for m in (tl, tl.math) if getattr(m, value.__name__, None) is value),
                        None,
                    )
                    if owner is None:
                        raise CheckError(f"{name}.{key}: a Triton builtin the check cannot map")
                    module_globals[key] = via_module(owner, value.__name__)
            for obj in module_globals.values():
                # @triton.heuristics may wrap the autotuner: walk the .fn chain.
                while hasattr(obj, "fn"):
                    if isinstance(obj, Autotuner):
                        obj.configs = obj.configs[:1]
                    obj = obj.fn


# --------------------------------------------------------------------------
# (a) the align-mode state copies
# --------------------------------------------------------------------------


def _as_i64_address(value: int) -> int:
    return value if value < (1 << 63) else value - (1 << 64)


def state_metadata(states: list[torch.Tensor], kinds: list[str], device: str) -> dict[str, Any]:
    """Per-state layout metadata as vLLM's MambaSpecDecodeGPUContext fills it (SD conv layout)."""
    n = len(states)
    meta = {
        "state_base_addrs": torch.zeros(n, dtype=torch.int64),
        "state_block_strides": torch.zeros(n, dtype=torch.int64),
        "state_elem_sizes": torch.zeros(n, dtype=torch.int32),
        "state_inner_sizes": torch.zeros(n, dtype=torch.int64),
        "state_conv_widths": torch.zeros(n, dtype=torch.int32),
        "state_group_indices": torch.zeros(n, dtype=torch.int32),
        "state_dim_row_count": torch.zeros(n, dtype=torch.int32),
        "state_dim_row_stride": torch.zeros(n, dtype=torch.int64),
    }
    for i, (state, kind) in enumerate(zip(states, kinds, strict=True)):
        meta["state_base_addrs"][i] = _as_i64_address(state.data_ptr())
        meta["state_block_strides"][i] = state.stride(0) * state.element_size()
        meta["state_elem_sizes"][i] = state.element_size()
        if kind == "conv":
            meta["state_conv_widths"][i] = state.size(1)
            meta["state_inner_sizes"][i] = state.stride(1)
        else:
            meta["state_inner_sizes"][i] = state[0].numel()
    return {k: v.to(device) for k, v in meta.items()}


def run_postprocess(mod: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    states = [s.clone().to(device) for s in case["states"]]
    table = case["block_table"].to(device)
    meta = state_metadata(states, case["kinds"], device)
    num_reqs = int(case["num_accepted"].numel())
    num_accepted = case["num_accepted"].to(device)
    accepted_out = num_accepted.clone()
    table_ptrs = torch.tensor([_as_i64_address(table.data_ptr())], dtype=torch.int64, device=device)
    grid = (num_reqs, len(states), mod._TEMPORAL_TILES)
    mod.postprocess_mamba_fused_kernel[grid](
        num_accepted,
        case["state_idx"].to(device),
        case["num_scheduled"].to(device),
        case["num_computed"].to(device),
        case["num_draft"].to(device),
        table_ptrs,
        table.stride(0),
        *meta.values(),
        accepted_out,
        None,
        num_reqs,
        block_size=case["block_size"],
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        TEMPORAL_TILES=mod._TEMPORAL_TILES,
    )
    return {"states": [s.cpu() for s in states], "num_accepted": accepted_out.cpu()}


def run_precopy(mod: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    states = [s.clone().to(device) for s in case["states"]]
    table = case["block_table"].to(device)
    meta = state_metadata(states, case["kinds"], device)
    num_reqs = int(case["dst_col"].numel())
    table_ptrs = torch.tensor([_as_i64_address(table.data_ptr())], dtype=torch.int64, device=device)
    grid = (num_reqs, len(states), mod._TEMPORAL_TILES)
    # The kernel itself skips fresh requests (src < 0) and requests that stay in
    # their block (src == dst), so the previous columns go in unfiltered.
    mod.precopy_mamba_align_fused_kernel[grid](
        case["dst_col"].to(device),
        case["src_col"].to(device),
        (case["num_accepted"] - 1).to(device),
        table_ptrs,
        table.stride(0),
        *meta.values(),
        None,
        num_reqs,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        HAS_IDX_MAPPING=False,
        TEMPORAL_TILES=mod._TEMPORAL_TILES,
    )
    return {"states": [s.cpu() for s in states]}


def run_batch_memcpy(mod: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    buf = case["buffer"].clone().to(device)
    base = buf.data_ptr()
    src = torch.tensor([base + o for o in case["src"].tolist()], dtype=torch.uint64)
    dst = torch.tensor([base + o for o in case["dst"].tolist()], dtype=torch.uint64)
    sizes = case["sizes"].to(torch.int32)
    # As vLLM's batch_memcpy launches it: one program per entry, 1024-byte tiles.
    mod.batch_memcpy_kernel[(len(sizes),)](
        src.to(device), dst.to(device), sizes.to(device), BLOCK_SIZE=1024
    )
    return {"buffer": buf.cpu()}


# --------------------------------------------------------------------------
# (b) the FLA chunked gated delta rule
# --------------------------------------------------------------------------


def run_gdn(chunk: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    """vLLM's chunk_gated_delta_rule forward, as ChunkGatedDeltaRuleFunction runs it,
    keeping h (the state at the start of every 64-token chunk)."""
    ops = sys.modules["vllm.third_party.flash_linear_attention.ops.l2norm"]
    # The interpreter keeps bf16 as raw uint16 bits and does arithmetic on the bits
    # (only casts to and from float32 are converted), so there the same bf16 values
    # go in as fp16, exactly (the cases hold none below fp16's normal range); FLA
    # then rounds its intermediates to fp16, finer than a GPU's bf16.
    dtype = torch.float16 if interpreting() else torch.bfloat16
    inputs = {}
    for name in ("q", "k", "v", "beta"):
        inputs[name] = case[name].to(dtype)
        if not torch.equal(inputs[name].to(case[name].dtype), case[name]):
            raise CheckError(f"{case['name']}: {name} does not convert to {dtype} exactly")
    q, k, v, beta = (inputs[n].to(device) for n in ("q", "k", "v", "beta"))
    g = case["g"].to(device)
    cu = case["cu_seqlens"].to(device)
    # vLLM's GPU path gathers ssm_state[indices] (layout [N, H, V, K]); zero rows
    # for sequences without an initial state.
    h0 = case["initial_state_vk"].to(device).contiguous()
    q, k = ops.l2norm_fwd(q), ops.l2norm_fwd(k)
    _, o, _, final, _, h, _ = chunk.chunk_gated_delta_rule_fwd(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=k.shape[-1] ** -0.5,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
    )
    result = {"final_vk": final.float().cpu(), "h_vk": h[0].float().cpu(), "o": o[0].float().cpu()}
    mid_index = case.get("mid_index")
    if mid_index is not None and mid_index.numel():
        # States inside a chunk: each prefix ending there as a sequence of its own,
        # its final state the state at that position.
        idx = mid_index.to(device)
        _, _, _, mid_final, _, _, _ = chunk.chunk_gated_delta_rule_fwd(
            q=q[:, idx],
            k=k[:, idx],
            v=v[:, idx],
            g=g[:, idx],
            beta=beta[:, idx],
            scale=k.shape[-1] ** -0.5,
            initial_state=case["mid_initial_state_vk"].to(device).contiguous(),
            output_final_state=True,
            cu_seqlens=case["mid_cu_seqlens"].to(device),
        )
        result["mid_vk"] = mid_final.float().cpu()
    return result


# --------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------


def diff(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Max abs difference, and the same relative to the largest magnitude of ``want``."""
    got64, want64 = got.double(), want.double()
    if got64.shape != want64.shape:
        raise CheckError(f"shape {tuple(got64.shape)} vs {tuple(want64.shape)}")
    if got64.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "scale": 0.0}
    err = (got64 - want64).abs().max().item()
    scale = want64.abs().max().item()
    return {"max_abs": err, "max_rel": err / scale if scale else err, "scale": scale}


def _bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def compare_copy(case: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Copies move bytes: the kernel's result must equal the CPU port's bit for bit."""
    cpu = case["cpu"]
    fields: dict[str, Any] = {}
    ok = True
    if "states" in out:
        for i, (got, want) in enumerate(zip(out["states"], cpu["states"], strict=True)):
            same = _bitwise(got.contiguous(), want.contiguous())
            fields[f"state{i}_{case['kinds'][i]}"] = {**diff(got, want), "bitwise_equal": same}
            ok &= same
        changed = sum(
            not torch.equal(a, b) for a, b in zip(case["states"], cpu["states"], strict=True)
        )
        fields["states_changed_by_step"] = changed
        # A case in which nothing moved would pass whatever the kernel did.
        ok &= changed > 0
    if "num_accepted" in out:
        same = out["num_accepted"].tolist() == cpu["num_accepted"].tolist()
        fields["num_accepted_equal"] = same
        ok &= same
    if "buffer" in out:
        same = torch.equal(out["buffer"], cpu["buffer"])
        fields["buffer"] = {**diff(out["buffer"].int(), cpu["buffer"].int()), "bitwise_equal": same}
        ok &= same and not torch.equal(case["buffer"], cpu["buffer"])
    return {"ok": ok, "tolerance": "bit for bit", **fields}


def compare_gdn(case: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    cpu, tol = case["cpu"], case["tolerance"]
    # The CPU kernel keeps the state as [K, V], FLA as [V, K]: compare the same matrix.
    final = diff(out["final_vk"].transpose(-1, -2), cpu["final_kv"])
    chunks = case["chunk_rows"].tolist()
    if chunks:
        h = out["h_vk"][chunks].transpose(-1, -2)
        inter = diff(h, cpu["chunk_states_kv"])
    else:
        inter = {"max_abs": 0.0, "max_rel": 0.0, "scale": 0.0}
    output = diff(out["o"], cpu["o"])
    ref = case["reference"]
    fields = {
        "final_state": final,
        "chunk_states": {**inter, "count": len(chunks)},
        "output": output,
        "triton_vs_float64": {
            "final_state": diff(out["final_vk"].transpose(-1, -2), ref["final_kv"]),
            "chunk_states": diff(h, ref["chunk_states_kv"]) if chunks else None,
        },
        "cpu_vs_float64": {
            "final_state": diff(cpu["final_kv"], ref["final_kv"]),
            "chunk_states": diff(cpu["chunk_states_kv"], ref["chunk_states_kv"])
            if chunks
            else None,
        },
    }
    ok = (
        final["max_rel"] <= tol["final_state"]
        and inter["max_rel"] <= tol["chunk_states"]
        and output["max_rel"] <= tol["output"]
    )
    mids = out.get("mid_vk")
    wanted = case.get("mid_index")
    if wanted is not None and wanted.numel() and mids is None:
        raise CheckError(f"{case['name']}: states inside chunks asked for, none computed")
    if mids is not None:
        # States inside chunks: the CPU split schedule against FLA on each prefix.
        mid_vk = mids.transpose(-1, -2)
        fields["mid_states"] = {**diff(mid_vk, cpu["mid_states_kv"]), "count": len(mids)}
        fields["triton_vs_float64"]["mid_states"] = diff(mid_vk, ref["mid_states_kv"])
        fields["cpu_vs_float64"]["mid_states"] = diff(cpu["mid_states_kv"], ref["mid_states_kv"])
        ok = ok and fields["mid_states"]["max_rel"] <= tol["chunk_states"]
    if "export" in case:
        # The checkpoint export (one forward call, states written at each chunk
        # boundary and inside chunks) against FLA's states, final states and output.
        exp = case["export"]
        got_h = out["h_vk"][chunks].transpose(-1, -2) if chunks else exp["states_kv"]
        exported = {
            "chunk_states": {**diff(got_h, exp["states_kv"]), "count": len(chunks)},
            "final_state": diff(out["final_vk"].transpose(-1, -2), exp["final_kv"]),
            "output": diff(out["o"], exp["o"]),
        }
        if mids is not None:
            exported["mid_states"] = {
                **diff(mid_vk, exp["mid_states_kv"]),
                "count": len(mids),
            }
            ok = ok and exported["mid_states"]["max_rel"] <= tol["chunk_states"]
        fields["export"] = exported
        ok = (
            ok
            and exported["chunk_states"]["max_rel"] <= tol["chunk_states"]
            and exported["final_state"]["max_rel"] <= tol["final_state"]
            and exported["output"]["max_rel"] <= tol["output"]
        )
    return {"ok": ok, "tolerance": tol, **fields}


RUNNERS = {
    "postprocess": run_postprocess,
    "precopy": run_precopy,
    "batch_memcpy": run_batch_memcpy,
}


def check(kernels: Path, cases_path: Path, device: str) -> dict[str, Any]:
    try:
        cases = torch.load(cases_path, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckError(f"{cases_path}: cannot read the cases ({exc})") from exc
    with tempfile.TemporaryDirectory(prefix="kernel-check-") as tmp:
        align = load_align_kernels(kernels, Path(tmp))
        fla = load_fla(kernels)
        results = []
        for case in cases["cases"]:
            start = time.monotonic()
            if case["kind"] == "gdn":
                out = run_gdn(fla, case, device)
                verdict = compare_gdn(case, out)
            else:
                out = RUNNERS[case["kind"]](align, case, device)
                verdict = compare_copy(case, out)
            results.append(
                {
                    "name": case["name"],
                    "kind": case["kind"],
                    "seconds": round(time.monotonic() - start, 2),
                    **verdict,
                }
            )
    import triton

    return {
        "device": device,
        "interpreter": interpreting(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "kernels": str(kernels),
        "cpu_port": cases.get("cpu_port", {}),
        "ok": all(r["ok"] for r in results),
        "cases": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True, help="folder with the sdist files")
    parser.add_argument(
        "--cases", type=Path, required=True, help="cases.pt from kit.rig.kernel_check"
    )
    parser.add_argument("--device", default="cpu", help="cpu (TRITON_INTERPRET=1) or cuda")
    parser.add_argument("--out", type=Path, required=True, help="the result JSON file")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not interpreting():
        print(
            "error: --device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)", file=sys.stderr
        )
        return 2
    try:
        result = check(args.kernels, args.cases, args.device)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = [c["name"] for c in result["cases"] if not c["ok"]]
    print(f"{len(result['cases']) - len(bad)}/{len(result['cases'])} cases within tolerance")
    for name in bad:
        print(f"FAILED: {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
