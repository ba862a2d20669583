"""The Triton side of `make kernel-check`: vLLM's own kernels on the kit's cases, compared.

Standalone on purpose: it needs torch, Triton and numpy, and no vLLM and no
kit, so the same file runs in the kit's .venv-triton under Triton's
interpreter (``TRITON_INTERPRET=1``, ``--device cpu``) and on a GPU machine
with compiled kernels (``--device cuda``), where vLLM's kernel sources travel
as files.

    python kit/kernels/triton_check.py --kernels DIR --cases cases.pt \
        --device cpu --out result.json
    python kit/kernels/triton_check.py --bundle kit/kernels/device_bundle \
        --device cuda --out result.json          # make device-check
    python kit/kernels/triton_check.py --bundle kit/kernels/device_bundle \
        --dry-run --out result.json              # the same, interpreted, tiny cases

``DIR`` holds the needed files of a vLLM sdist at their sdist paths:
``vllm/v1/worker/mamba_utils.py``, ``vllm/third_party/flash_linear_attention/ops/``
and ``vllm/model_executor/layers/mamba/ops/`` (the SSD files). ``cases.pt``
(written by ``kit.kernels.check``) holds each case's inputs and what the
kit's CPU ports and a float64 recurrence computed from them. A bundle
(``--bundle``, written by ``kit kernel-check --export``) holds ``cases.pt``,
each release's kernel files as ``kernels-<version>.tar.gz`` and a
``manifest.json`` with their sha256 and which case kinds run on which release;
each release runs in a process of its own (both load as ``vllm.*``).

The kernels are loaded from the files as they are: the ``@triton.jit``
functions of ``mamba_utils.py`` (that module also imports half of vLLM's
engine, which the kernels do not use), ``softplus`` of ``mamba_ssm.py`` (the
same reason), and the FLA and SSD modules as packages whose few vLLM imports
(``vllm.triton_utils``, ``vllm.platforms``, helpers of ``vllm.utils``, 0.34.0's
warm-up dispatcher) are answered by the shims below; ``packaging`` and
``einops``, where missing, by two narrow stand-ins. Under the interpreter, and
only there, four adaptations (each where it is made says why): aliased
builtins (``exp = tl.exp``) look ``tl`` up when called, chunk_delta_h's loop
index is a Triton scalar, every autotuned kernel runs its first config, and
half-precision inputs go in as fp16 instead of bf16 (the same values). The
kernels' own code is not changed.

Exports (kinds ``gdn_export`` and ``ssd_export``): states at requested positions
inside a prefill, taken from what the one forward pass already materialises:
FLA's per-chunk ``h`` (``gdn_export_plan`` says which positions it holds) and
the SSD scan's per-chunk states (``ssd_export_plan``). A position the pass
does not hold is refused, never approximated.

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
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# make device-check runs this with DEVICE_PYTHON (default python3), which may lack
# torch or Triton: one line saying so, not a traceback.
NEEDS = (
    "device-check needs torch and triton in the Python that runs it: install them there "
    "(pip install torch triton) or point make at a Python that has them: "
    "make device-check DEVICE_PYTHON=/path/to/python"
)


def _missing(module: str, exc: ImportError) -> None:
    print(
        f"error: {sys.executable} cannot import {module} ({exc}); " + NEEDS,
        file=sys.stderr,
    )
    raise SystemExit(2)


try:
    import torch
except ImportError as _exc:
    if __name__ != "__main__":
        raise  # imported (the kit's tests): the importer says what is missing
    _missing("torch", _exc)

MAMBA_UTILS = Path("vllm/v1/worker/mamba_utils.py")
FLA_OPS = Path("vllm/third_party/flash_linear_attention/ops")
MAMBA_OPS = Path("vllm/model_executor/layers/mamba/ops")
# The SSD scan's files (mamba_ssm.py only for its softplus).
SSD_FILES = (
    "ssd_combined.py",
    "ssd_bmm.py",
    "ssd_chunk_scan.py",
    "ssd_chunk_state.py",
    "ssd_state_passing.py",
    "triton_helpers.py",
    "mamba_ssm.py",
)
FLA_PACKAGE = "vllm.third_party.flash_linear_attention.ops"
MAMBA_PACKAGE = "vllm.model_executor.layers.mamba.ops"
FLA_CHUNK = 64  # FLA_CHUNK_SIZE: h holds the state before every 64-token chunk
# Kinds that run vLLM's FLA or SSD kernels (not the align copies of mamba_utils.py).
RECURRENT_KINDS = ("gdn", "gdn_export", "ssd_export")


class CheckError(RuntimeError):
    exit_code = 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------
# Which positions one forward pass can export
# --------------------------------------------------------------------------


def gdn_export_plan(
    start: int, end: int, positions: Iterable[int], chunk: int = FLA_CHUNK
) -> tuple[list[int], list[int]]:
    """Split requested positions (tokens of the request: the state after exactly p
    tokens) into those FLA's chunk kernel holds after one prefill of the request's
    tokens ``[start, end)`` and those it does not: ``(exportable, refused)``, each
    sorted, each position once.

    The rule: p is exportable when ``p - start`` is a multiple of ``chunk`` or p is
    ``end``, and ``start <= p <= end``. ``h`` holds the state before each of the
    sequence's chunks, and those chunks start at ``start + chunk * i``: the grid is
    relative to where this prefill began (a resumed request's first computed
    token), not to the request's token 0; the final state is the state at ``end``.
    A position anywhere else would need another pass (or a kernel that stores more).
    """
    exportable, refused = set(), set()
    for p in positions:
        on_grid = start <= p <= end and ((p - start) % chunk == 0 or p == end)
        (exportable if on_grid else refused).add(p)
    return sorted(exportable), sorted(refused)


def gdn_export_sources(
    start: int, end: int, first_chunk_row: int, exportable: Iterable[int], chunk: int = FLA_CHUNK
) -> list[tuple[str, int]]:
    """Where each exportable position's state lies: ``("final", 0)`` for ``end`` (the
    final state: when the length is a multiple of ``chunk``, h has no row after the
    last chunk) or ``("h", row)``. For varlen input h is ``[1, total chunks, H, V, K]``,
    the sequences' chunks one after another: sequence n's chunk i is row
    ``chunk_offsets[n] + i`` (``first_chunk_row`` = FLA's ``prepare_chunk_offsets``)."""
    out = []
    for p in exportable:
        if p == end:
            out.append(("final", 0))
        elif start <= p < end and (p - start) % chunk == 0:
            out.append(("h", first_chunk_row + (p - start) // chunk))
        else:
            raise CheckError(f"position {p} is not exportable from [{start}, {end})")
    return out


def ssd_export_plan(
    start: int, chunk_ends: Iterable[int], positions: Iterable[int]
) -> tuple[dict[int, int], list[int]]:
    """The SSD scan's version: it materialises the state at the end of each of its
    chunks, so p is exportable where one of the sequence's chunks ends (``chunk_ends``:
    tokens into this prefill, one per chunk in order; chunk j's global index is
    ``first + j``, handled by the caller). vLLM lays those chunks on multiples of the
    chunk size in absolute positions, plus the sequence end and any forced
    checkpoint end (``_compute_chunk_metadata``). Returns ({p: j}, refused)."""
    where = {start + e: j for j, e in enumerate(chunk_ends)}
    exportable, refused = {}, set()
    for p in positions:
        if p in where:
            exportable[p] = where[p]
        else:
            refused.add(p)
    return dict(sorted(exportable.items())), sorted(refused)


# --------------------------------------------------------------------------
# Loading vLLM's kernels from the sdist files
# --------------------------------------------------------------------------


def _jit_pieces(source: str, names: set[str], keep: tuple[str, ...] = ()) -> list[str]:
    """The source of the module-level ``@triton.jit`` functions named in ``names``
    (also those under ``if TRITON3:``, the branch for Triton >= 3) and of the
    assignments to the names in ``keep``."""
    lines = source.splitlines()
    pieces = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                    start = node.decorator_list[0].lineno
                    # Dedented: a function under an `if` is indented in the file.
                    block = lines[start - 1 : node.end_lineno]
                    indent = len(block[0]) - len(block[0].lstrip())
                    pieces.append("\n".join(line[indent:] for line in block))
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in keep for t in node.targets
            ):
                pieces.append(ast.get_source_segment(source, node) or "")
            elif isinstance(node, ast.If) and ast.unparse(node.test) == "TRITON3":
                visit(node.body)

    visit(ast.parse(source).body)
    return pieces


def _load_extract(source_path: Path, pieces: list[str], name: str, work: Path) -> types.ModuleType:
    # Triton's JIT reads each kernel's source from its file, so the extract is a file.
    target = work / f"{name.replace('.', '_')}.py"
    header = f"# Extracted from {source_path.name} of the vLLM sdist by triton_check.py.\n"
    target.write_text(
        header + "import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(pieces) + "\n"
    )
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_align_kernels(kernels: Path, work: Path) -> types.ModuleType:
    """The ``@triton.jit`` functions (and ``_TEMPORAL_TILES``) of mamba_utils.py, verbatim."""
    source_path = kernels / MAMBA_UTILS
    if not source_path.is_file():
        raise CheckError(f"{source_path}: missing; --kernels must hold the vLLM sdist's files")
    names = {"postprocess_mamba_fused_kernel", "precopy_mamba_align_fused_kernel"}
    names |= {"batch_memcpy_kernel", "_copy_mamba_state_block", "_memcpy_u64_tiled"}
    pieces = _jit_pieces(source_path.read_text(), names, keep=("_TEMPORAL_TILES",))
    missing = [n for n in sorted(names) if f"def {n}(" not in "\n".join(pieces)]
    if missing:
        raise CheckError(f"{source_path}: no kernel {', '.join(missing)}; another vLLM release?")
    return _load_extract(source_path, pieces, "vllm_mamba_align_kernels", work)


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path else []  # a package: submodules import from path
    sys.modules[name] = module
    return module


class _Platform:
    """What the FLA and SSD files ask vLLM's platform: which GPU vendor and model, to
    pick configs and code paths. Under the interpreter: no GPU."""

    @staticmethod
    def _gpu() -> bool:
        return torch.cuda.is_available() and not interpreting()

    def is_cuda_alike(self) -> bool:
        return self._gpu()

    def is_cuda(self) -> bool:
        return self._gpu() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return self._gpu() and torch.version.hip is not None

    @staticmethod
    def is_cpu() -> bool:
        # False even under the interpreter: ssd_combined.py would swap in vLLM's CPU
        # scan, and the check is of the Triton kernels.
        return False

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if self._gpu() else "cpu"

    def get_device_capability(self, device_id: int = 0) -> Any:
        major, minor = torch.cuda.get_device_capability(device_id) if self._gpu() else (0, 0)
        return types.SimpleNamespace(major=major, minor=minor)

    def is_device_capability(self, capability: int, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        return self._gpu() and cap.major * 10 + cap.minor == capability


def _dispatcher_with_warmup(*, warmup_inputs: Any, kernel: Any = None) -> Any:
    """vLLM 0.34.0's ``triton_kernel_dispatcher_with_warmup`` (l2norm's launch), without
    the warm-up: the decorated function returns ``(grid, launch kwargs[, outputs])``
    and each of its own arguments (defaults filled in) binds to the first of the
    kernel's arguments named ``x``, ``x_ptr``, ``X`` or ``X_PTR`` unless the launch
    kwargs name that one, as vLLM's binding plan does. Its stride binding is left
    out (l2norm has no stride arguments; a kernel that had would fail to launch)."""
    del warmup_inputs
    import inspect

    if kernel is None:
        raise CheckError("the warm-up dispatcher stand-in takes a kernel= (l2norm's form)")

    def decorate(dispatch: Any) -> Any:
        signature = inspect.signature(dispatch)
        jit = kernel
        while not hasattr(jit, "arg_names"):
            jit = jit.fn
        arg_names = set(jit.arg_names)

        def launch(*args: Any, **kwargs: Any) -> Any:
            spec = dispatch(*args, **kwargs)
            grid, launch_kwargs = spec[0], dict(spec[1])
            outputs = spec[2] if len(spec) == 3 else None
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            for name, value in bound.arguments.items():
                candidates = (name, f"{name}_ptr", name.upper(), f"{name}_ptr".upper())
                target = next((c for c in candidates if c in arg_names), None)
                if target is not None and target not in launch_kwargs:
                    launch_kwargs[target] = value
            kernel[grid](**launch_kwargs)
            return outputs

        return launch

    return decorate


def _install_vllm_shims(kernels: Path) -> None:
    """Just what the FLA and SSD ops import from vLLM; the packages' own __init__ files
    are skipped (they also import the layernorm, warm-up and engine machinery the
    kernels do not use)."""
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    if "vllm.triton_utils" in sys.modules:
        return  # already installed in this process
    _package("vllm")
    _package("vllm.third_party", kernels / "vllm/third_party")
    _package("vllm.third_party.flash_linear_attention", kernels / FLA_OPS.parent)
    _package(FLA_PACKAGE, kernels / FLA_OPS)
    _package("vllm.model_executor")
    _package("vllm.model_executor.layers")
    _package("vllm.model_executor.layers.mamba")
    _package(MAMBA_PACKAGE, kernels / MAMBA_OPS)
    triton_utils = _package("vllm.triton_utils")
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = True
    platforms = _package("vllm.platforms")
    platforms.current_platform = _Platform()
    _package("vllm.utils")
    sync = _package("vllm.utils.gpu_sync_debug")
    sync.gpu_sync_allowed = lambda first_only=False: contextlib.nullcontext()
    torch_utils = _package("vllm.utils.torch_utils")

    def async_tensor_h2d(data: Any, device: Any = None, dtype: Any = None, out: Any = None) -> Any:
        return torch.as_tensor(data, dtype=dtype).to(device)

    torch_utils.async_tensor_h2d = async_tensor_h2d
    # 0.34.0's FLA utils ask the shared memory of AMD GPUs this way (else Triton's).
    platform_utils = _package("vllm.utils.platform_utils")

    def cuda_get_device_properties(device: int, names: tuple[str, ...]) -> tuple[Any, ...]:
        props = torch.cuda.get_device_properties(device)
        return tuple(getattr(props, n) for n in names)

    platform_utils.cuda_get_device_properties = cuda_get_device_properties
    # 0.34.0's l2norm launches through the warm-up dispatcher.
    _package("vllm.model_executor.warmup")
    warmup = _package("vllm.model_executor.warmup.jit_warmup")
    warmup.WarmupChoices = lambda *choices: choices
    helper = _package("vllm.model_executor.warmup.jit_warmup_triton_helper")
    helper.DispatchSpec = Any
    helper.TritonWarmupTensor = lambda *args, **kwargs: None
    helper.triton_kernel_dispatcher_with_warmup = _dispatcher_with_warmup


def _install_fallbacks() -> None:
    """``packaging`` (a Triton version test) and ``einops`` (two reshapes in 0.32.0's
    ssd_combined.py) where this Python lacks them: .venv-triton holds torch, Triton
    and numpy only, and a GPU machine may too. The real packages win where present."""
    try:
        import packaging.version  # noqa: F401
    except ImportError:
        import re

        def parse(text: str) -> tuple[int, ...]:
            match = re.match(r"\d+(\.\d+)*", text)
            if match is None:
                raise CheckError(f"cannot read the version {text!r}") from None
            return tuple(int(x) for x in match.group().split("."))

        packaging = _package("packaging")
        packaging.version = types.ModuleType("packaging.version")
        packaging.version.parse = parse
        sys.modules["packaging.version"] = packaging.version
    try:
        import einops  # noqa: F401
    except ImportError:

        def rearrange(t: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
            # The two patterns ssd_combined.py uses (0.34.0 replaced them by these calls).
            if pattern == "... p n -> ... (p n)":
                return t.flatten(-2)
            if pattern == "... (p n) -> ... p n":
                return t.unflatten(-1, (-1, sizes["n"]))
            raise CheckError(f"einops stand-in: pattern {pattern!r} not supported")

        sys.modules["einops"] = types.ModuleType("einops")
        sys.modules["einops"].rearrange = rearrange  # type: ignore[attr-defined]


def load_fla(kernels: Path) -> types.ModuleType:
    """vLLM's FLA chunk module (``chunk_gated_delta_rule`` and the kernels under it)."""
    if not (kernels / FLA_OPS / "chunk.py").is_file():
        raise CheckError(f"{kernels / FLA_OPS}: missing; --kernels must hold the sdist's files")
    # The FLA kernels read this at import: it makes chunk_gated_delta_rule_fwd also
    # return h, the per-chunk states (the same kernels run either way). Set here,
    # not at import of this file, so that importing it elsewhere changes nothing.
    os.environ["GDN_RECOMPUTE_SUPPRESS_LEVEL"] = "3"
    _install_vllm_shims(kernels)
    chunk = importlib.import_module(f"{FLA_PACKAGE}.chunk")
    if interpreting():
        _adapt_to_interpreter(FLA_PACKAGE)
        _scalar_loop_index(f"{FLA_PACKAGE}.chunk_delta_h")
    return chunk


def load_ssd(kernels: Path, work: Path) -> types.ModuleType:
    """vLLM's SSD scan (``mamba_chunk_scan_combined_varlen`` and the kernels under it)."""
    missing = [f for f in SSD_FILES if not (kernels / MAMBA_OPS / f).is_file()]
    if missing:
        raise CheckError(f"{kernels / MAMBA_OPS}: no {', '.join(missing)}")
    _install_vllm_shims(kernels)
    _install_fallbacks()
    # mamba_ssm.py imports vLLM's engine (envs, custom ops, logger); the SSD kernels
    # take only its softplus, extracted verbatim.
    source_path = kernels / MAMBA_OPS / "mamba_ssm.py"
    pieces = _jit_pieces(source_path.read_text(), {"softplus"})
    if len(pieces) != 1:
        raise CheckError(f"{source_path}: {len(pieces)} softplus kernels for Triton 3, not 1")
    _load_extract(source_path, pieces, f"{MAMBA_PACKAGE}.mamba_ssm", work)
    combined = importlib.import_module(f"{MAMBA_PACKAGE}.ssd_combined")
    if interpreting():
        _adapt_to_interpreter(MAMBA_PACKAGE)
    return combined


def _scalar_loop_index(module_name: str) -> None:
    """A loop index is a Python int under the interpreter, a Triton scalar when
    compiled: chunk_delta_h's ``i_t.to(tl.int64)`` needs the latter, so its loops
    yield interpreter scalars (compiled runs do not need this)."""
    from triton.runtime.interpreter import _implicit_cvt

    def scalar_range(*args: Any) -> Any:
        ints = [int(a.handle.data.item()) if hasattr(a, "handle") else int(a) for a in args]
        return (_implicit_cvt(i) for i in range(*ints))

    vars(sys.modules[module_name])["range"] = scalar_range


def _adapt_to_interpreter(package: str) -> None:
    """Two things Triton's interpreter does not do for these modules (compiled runs need
    neither): FLA names some builtins by alias (``exp = tl.exp`` in op.py), and the
    interpreter swaps in its own versions of ``tl.exp`` on the module only, so an
    alias keeps the compiled-only builtin; and autotuning would run every config
    several times to time it. Each alias is made to look ``tl.<name>`` up when
    called; each autotuner keeps its first config."""
    import triton.language as tl

    def via_module(owner: types.ModuleType, name: str) -> Any:
        return lambda *args, **kwargs: getattr(owner, name)(*args, **kwargs)

    for name in list(sys.modules):
        if name.startswith(f"{package}."):
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
    first_configs(package)


def first_configs(package: str) -> None:
    """Every autotuned kernel of the package's modules keeps its first config: under the
    interpreter always; on a GPU with ``--first-config``, which compiles one config
    per kernel instead of timing them all (the choice users' runs make may differ)."""
    from triton.runtime.autotuner import Autotuner

    for name in list(sys.modules):
        if name.startswith(f"{package}."):
            for obj in vars(sys.modules[name]).values():
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


def _half(case: dict[str, Any], names: tuple[str, ...], device: str) -> list[torch.Tensor]:
    """The case's bf16 inputs in the kernels' half precision: bf16 on a GPU, fp16 under
    the interpreter. The interpreter keeps bf16 as raw uint16 bits and does arithmetic
    on the bits (only casts to and from float32 are converted), so there the same
    bf16 values go in as fp16, exactly (the cases hold none below fp16's normal
    range); the kernels then round their intermediates to fp16, finer than bf16."""
    dtype = torch.float16 if interpreting() else torch.bfloat16
    out = []
    for name in names:
        value = case[name].to(dtype)
        if not torch.equal(value.to(case[name].dtype), case[name]):
            raise CheckError(f"{case['name']}: {name} does not convert to {dtype} exactly")
        out.append(value.to(device))
    return out


def _gdn_forward(
    chunk: types.ModuleType, case: dict[str, Any], device: str
) -> tuple[torch.Tensor, ...]:
    """vLLM's chunk_gated_delta_rule forward, as ChunkGatedDeltaRuleFunction runs it
    (l2norm of q and k first): (o, final states, h, the normalised q, k, v, g, beta)."""
    ops = sys.modules[f"{FLA_PACKAGE}.l2norm"]
    q, k, v, beta = _half(case, ("q", "k", "v", "beta"), device)
    g = case["g"].to(device)
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
        cu_seqlens=case["cu_seqlens"].to(device),
    )
    if h is None:
        raise CheckError("chunk_gated_delta_rule_fwd returned no h (GDN_RECOMPUTE_SUPPRESS_LEVEL)")
    return o, final, h, q, k, v, g, beta


def run_gdn(chunk: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    """FLA's forward, keeping h (the state at the start of every 64-token chunk)."""
    o, final, h, q, k, v, g, beta = _gdn_forward(chunk, case, device)
    result = {"final_vk": final.float().cpu(), "h_vk": h[0].float().cpu(), "o": o[0].float().cpu()}
    store = getattr(chunk, "chunk_gated_delta_rule_with_chunk_states", None)
    if store is not None:
        # Files with fix-eagle-fine-prefix-exports: the same forward also storing
        # float32 states (the in-pass exports' source) must leave the output and
        # final states bit for bit, each chunk state must round to h and each
        # final one equal the final state. Every other chunk (the kernel's skip
        # branch taken too), then every sequence's end (the store after its loop).
        num_chunks, num_seqs = h.shape[1], final.shape[0]
        chunks = torch.arange(0, num_chunks, 2)
        sources = torch.cat([chunks, -1 - torch.arange(num_seqs)]).to(device)
        states = torch.full(
            (sources.numel(), *h.shape[2:]), float("nan"), dtype=torch.float32, device=device
        )
        stored_o, stored_final = store(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=case["initial_state_vk"].to(device).contiguous(),
            cu_seqlens=case["cu_seqlens"].to(device),
            chunk_states=states,
            chunk_state_sources=sources,
        )
        picked = states[: chunks.numel()]
        result["stored_states"] = {
            "output_bitwise": bool(torch.equal(stored_o, o)),
            "final_bitwise": bool(torch.equal(stored_final, final)),
            "h_rounds_to_stock": bool(torch.equal(picked.to(h.dtype), h[0, chunks.to(device)])),
            "finals_stored": bool(torch.equal(states[chunks.numel() :], final.float())),
        }
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


def run_gdn_export(chunk: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    """The states at the requested positions of one varlen prefill, from that one
    forward's own h and final states; positions off its chunk grid are refused."""
    o, final, h, *_ = _gdn_forward(chunk, case, device)
    index = sys.modules[f"{FLA_PACKAGE}.index"]
    # FLA's own chunk bookkeeping for varlen input: where each sequence's rows of h begin.
    first_rows = index.prepare_chunk_offsets(case["cu_seqlens"].to(device), FLA_CHUNK).tolist()
    bounds = case["cu_seqlens"].tolist()
    if h.shape[1] != first_rows[-1]:
        raise CheckError(f"{case['name']}: h has {h.shape[1]} chunk rows, not {first_rows[-1]}")
    states, exported, refused = [], [], []
    for n, (start, requested) in enumerate(zip(case["starts"], case["requested"], strict=True)):
        end = start + bounds[n + 1] - bounds[n]
        can, cannot = gdn_export_plan(start, end, requested)
        for source, row in gdn_export_sources(start, end, first_rows[n], can):
            states.append(h[0, row] if source == "h" else final[n])
        exported.append(can)
        refused.append(cannot)
    return {
        "states_vk": torch.stack(states).float().cpu(),
        "exported": exported,
        "refused": refused,
        "h_dtype": str(h.dtype).removeprefix("torch."),
        "o": o[0].float().cpu(),
    }


# --------------------------------------------------------------------------
# (c) the Mamba2 SSD scan
# --------------------------------------------------------------------------


def run_ssd_export(combined: types.ModuleType, case: dict[str, Any], device: str) -> dict[str, Any]:
    """vLLM's Mamba2 prefill scan as MambaMixer2 calls it (dt softplus, dt_bias, D, no z,
    the chunk layout of its metadata builder) with ``return_intermediate_states``, as
    vLLM does when a prefill checkpoints: the state at the end of every chunk. The
    states at the requested positions come from those; the rest are refused."""
    x, dt, b, c = _half(case, ("x", "dt", "B", "C"), device)
    f32 = {n: case[n].to(device=device, dtype=torch.float32) for n in ("A", "D", "dt_bias")}
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    chunk_states = combined.mamba_chunk_scan_combined_varlen(
        x,
        dt,
        f32["A"],
        b,
        c,
        chunk_size=case["chunk_size"],
        cu_seqlens=case["cu_seqlens"].to(device),
        cu_chunk_seqlens=case["cu_chunk_seqlens"].to(device),
        last_chunk_indices=case["last_chunk_indices"].to(device),
        seq_idx=case["seq_idx"].to(device),
        out=out,
        D=f32["D"],
        z=None,
        dt_bias=f32["dt_bias"],
        # vLLM zeroes the rows of sequences without a prior state (torch.where).
        initial_states=case["initial_states"].to(device=device, dtype=torch.float32),
        dt_softplus=True,
        dt_limit=(0.0, float("inf")),
        return_intermediate_states=True,
        # Nemotron-H's SSM cache is float32 (vLLM's default for it).
        state_dtype=torch.float32,
    )
    bounds = case["cu_seqlens"].tolist()
    chunk_bounds = case["cu_chunk_seqlens"].tolist()
    seq_of_chunk = case["seq_idx"].tolist()
    states, exported, refused = [], [], []
    for n, (start, requested) in enumerate(zip(case["starts"], case["requested"], strict=True)):
        chunks = [i for i, s in enumerate(seq_of_chunk) if s == n]
        ends = [chunk_bounds[i + 1] - bounds[n] for i in chunks]
        can, cannot = ssd_export_plan(start, ends, requested)
        states.extend(chunk_states[chunks[j]] for j in can.values())
        exported.append(list(can))
        refused.append(cannot)
    return {
        "states": torch.stack(states).float().cpu(),
        "exported": exported,
        "refused": refused,
        "y": out.float().cpu(),
    }


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
    if "stored_states" in out:
        fields["stored_states"] = out["stored_states"]
        ok = ok and all(out["stored_states"].values())
    return {"ok": ok, "tolerance": tol, **fields}


def _rows_of(requested: list[list[int]], exported: list[list[int]]) -> list[int]:
    """Where each exported position's reference lies: the cases hold one reference
    state per requested position, sequence after sequence, in requested order."""
    rows, at = [], 0
    for wanted, got in zip(requested, exported, strict=True):
        where = {p: at + i for i, p in enumerate(wanted)}
        rows.extend(where[p] for p in got)
        at += len(wanted)
    return rows


def _plan_verdict(case: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """The positions refused must be exactly those the case put off the kernel's grid,
    and every other requested position exported."""
    want_refused = case["off_grid"]
    want_exported = [
        sorted(set(r) - set(o)) for r, o in zip(case["requested"], want_refused, strict=True)
    ]
    return {
        "as_expected": out["refused"] == want_refused and out["exported"] == want_exported,
        "exported": out["exported"],
        "refused": out["refused"],
        "count": sum(len(e) for e in out["exported"]),
    }


def compare_gdn_export(case: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    tol = case["tolerance"]
    plan = _plan_verdict(case, out)
    rows = _rows_of(case["requested"], out["exported"])
    got_kv = out["states_vk"].transpose(-1, -2)  # FLA's [V, K] as the CPU port's [K, V]
    reference = case["reference"]["states_kv"]
    fields: dict[str, Any] = {
        "positions": plan,
        "h_dtype": out["h_dtype"],
        "triton_vs_float64": diff(got_kv, reference[rows]),
    }
    ok = plan["as_expected"] and fields["triton_vs_float64"]["max_rel"] <= tol["states"]
    if "cpu" in case:
        # The kit's CPU export (mod cpu-gdn-prefill-checkpoint) at the same positions;
        # it also holds the refused ones (it cuts the recurrence anywhere): those
        # against the float64 recurrence only.
        cpu = case["cpu"]["states_kv"]
        fields["triton_vs_cpu_export"] = diff(got_kv, cpu[rows])
        fields["cpu_export_vs_float64"] = {
            **diff(cpu, reference),
            "count": int(cpu.shape[0]),
        }
        ok = (
            ok
            and fields["triton_vs_cpu_export"]["max_rel"] <= tol["states"]
            and fields["cpu_export_vs_float64"]["max_rel"] <= tol["states"]
        )
    return {"ok": ok, "tolerance": tol, **fields}


def compare_ssd_export(case: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    tol = case["tolerance"]
    plan = _plan_verdict(case, out)
    rows = _rows_of(case["requested"], out["exported"])
    fields = {
        "positions": plan,
        "states_vs_float64": diff(out["states"], case["reference"]["states"][rows]),
        "output_vs_float64": diff(out["y"], case["reference"]["y"]),
    }
    ok = (
        plan["as_expected"]
        and fields["states_vs_float64"]["max_rel"] <= tol["states"]
        and fields["output_vs_float64"]["max_rel"] <= tol["output"]
    )
    return {"ok": ok, "tolerance": tol, **fields}


RUNNERS = {
    "postprocess": run_postprocess,
    "precopy": run_precopy,
    "batch_memcpy": run_batch_memcpy,
}


def check(
    kernels: Path,
    cases_path: Path,
    device: str,
    kinds: set[str] | None = None,
    only: set[str] | None = None,
    first_config: bool = False,
) -> dict[str, Any]:
    """Run the cases (those of ``kinds``, and of them those named in ``only``)."""
    try:
        cases = torch.load(cases_path, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckError(f"{cases_path}: cannot read the cases ({exc})") from exc
    chosen = [
        c
        for c in cases["cases"]
        if (kinds is None or c["kind"] in kinds) and (only is None or c["name"] in only)
    ]
    if not chosen:
        raise CheckError(f"{cases_path}: no case of kinds {kinds} named {only}")
    needed = {c["kind"] for c in chosen}
    with tempfile.TemporaryDirectory(prefix="kernel-check-") as tmp:
        # Each release's files load only where its cases need them.
        align = load_align_kernels(kernels, Path(tmp)) if needed & set(RUNNERS) else None
        fla = load_fla(kernels) if needed & {"gdn", "gdn_export"} else None
        ssd = load_ssd(kernels, Path(tmp)) if "ssd_export" in needed else None
        if first_config:
            for package in (FLA_PACKAGE, MAMBA_PACKAGE):
                first_configs(package)
        results = []
        for case in chosen:
            start = time.monotonic()
            if case["kind"] == "gdn":
                verdict = compare_gdn(case, run_gdn(fla, case, device))
            elif case["kind"] == "gdn_export":
                verdict = compare_gdn_export(case, run_gdn_export(fla, case, device))
            elif case["kind"] == "ssd_export":
                verdict = compare_ssd_export(case, run_ssd_export(ssd, case, device))
            else:
                verdict = compare_copy(case, RUNNERS[case["kind"]](align, case, device))
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
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "interpreter": interpreting(),
        "autotune": "first config" if first_config or interpreting() else "every config",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "kernels": str(kernels),
        "cpu_port": cases.get("cpu_port", {}),
        "ok": all(r["ok"] for r in results),
        "cases": results,
    }


# --------------------------------------------------------------------------
# the device bundle (make device-check)
# --------------------------------------------------------------------------

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_bundle(
    bundle: Path, device: str, dry_run: bool, first_config: bool = False
) -> dict[str, Any]:
    """Every release of a bundle in a process of its own (each loads its files as
    ``vllm.*``), against the bundle's cases; ``dry_run``: under the interpreter on the
    CPU, only the manifest's tiny cases."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckError(f"{bundle / MANIFEST}: cannot read the manifest ({exc})") from exc
    files = {manifest["cases"]["file"]: manifest["cases"]["sha256"]}
    files |= {r["kernels"]: r["sha256"] for r in manifest["releases"].values()}
    for name, want in files.items():
        path = bundle / name
        if not path.is_file():
            raise CheckError(f"{path}: missing from the bundle")
        if _sha256(path) != want:
            raise CheckError(f"{path}: sha256 differs from {MANIFEST}; rewrite the bundle")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # the compiled kernels
    tiny: dict[str, str] = manifest["tiny"]  # case name: its kind
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        import tarfile

        for version, release in manifest["releases"].items():
            kernels = Path(tmp) / version
            with tarfile.open(bundle / release["kernels"]) as tar:
                tar.extractall(kernels, filter="data")
            kinds = release["kinds"]
            names = {n for n, kind in tiny.items() if kind in kinds}
            if dry_run and not names:
                continue
            command = [
                sys.executable,
                "-W",
                "ignore::RuntimeWarning",  # numpy on masked-off lanes of the interpreter
                str(Path(__file__).resolve()),
                "--kernels",
                str(kernels),
                "--cases",
                str(bundle / manifest["cases"]["file"]),
                "--device",
                device,
                "--kinds",
                ",".join(kinds),
                "--out",
                str(Path(tmp) / f"{version}.json"),
            ]
            if dry_run:
                command += ["--only", ",".join(sorted(names))]
            if first_config:
                command.append("--first-config")
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode not in (0, 1):
                raise CheckError(
                    f"vLLM {version}'s kernels could not run (exit {done.returncode}):\n"
                    f"{done.stderr[-4000:]}"
                )
            results[version] = json.loads((Path(tmp) / f"{version}.json").read_text())
    ran = {c["name"] for r in results.values() for c in r["cases"]}
    if dry_run and ran != set(tiny):
        raise CheckError(f"the dry run ran {sorted(ran)}, the manifest names {sorted(tiny)}")
    return {
        "bundle": str(bundle),
        "made_by": manifest.get("made_by"),
        "device": device,
        "dry_run": dry_run,
        "ok": bool(results) and all(r["ok"] for r in results.values()),
        "releases": results,
    }


def _split(text: str | None) -> set[str] | None:
    return None if text is None else {t for t in text.split(",") if t}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, help="folder with the sdist files")
    parser.add_argument("--cases", type=Path, help="cases.pt from kit.kernels.check")
    parser.add_argument(
        "--bundle", type=Path, help="a bundle folder (cases, kernels per release, manifest)"
    )
    parser.add_argument(
        "--device", help="cpu (TRITON_INTERPRET=1) or cuda (default: cpu, or cuda with --bundle)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="--bundle under the interpreter, tiny cases only"
    )
    parser.add_argument("--kinds", help="comma-separated case kinds to run (default: all)")
    parser.add_argument("--only", help="comma-separated case names to run (default: all)")
    parser.add_argument(
        "--first-config",
        action="store_true",
        help="every autotuned kernel runs its first config (compiles faster on a GPU)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the result JSON file")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401 - only whether it imports; the kernels load it later
    except ImportError as exc:
        _missing("triton", exc)
    if args.bundle is None and (args.kernels is None or args.cases is None):
        parser.error("give --bundle, or --kernels and --cases")
    device = args.device or ("cuda" if args.bundle and not args.dry_run else "cpu")
    if args.dry_run and device != "cpu":
        parser.error("--dry-run runs on the CPU, under the interpreter")
    if args.bundle is None and device == "cpu" and not interpreting():
        print(
            "error: --device cpu needs TRITON_INTERPRET=1 (Triton's interpreter)", file=sys.stderr
        )
        return 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {device}, but torch sees no GPU", file=sys.stderr)
        return 2
    try:
        if args.bundle is not None:
            result = run_bundle(args.bundle, device, args.dry_run, args.first_config)
            cases = [
                {**c, "name": f"{v}/{c['name']}"}
                for v, r in result["releases"].items()
                for c in r["cases"]
            ]
        else:
            result = check(
                args.kernels,
                args.cases,
                device,
                _split(args.kinds),
                _split(args.only),
                args.first_config,
            )
            cases = result["cases"]
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = [c["name"] for c in cases if not c["ok"]]
    print(f"{len(cases) - len(bad)}/{len(cases)} cases within tolerance")
    for name in bad:
        print(f"FAILED: {name}")
    return 1 if bad or not result["ok"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
