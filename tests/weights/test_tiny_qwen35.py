"""The primary model's architecture (Qwen3.5/3.6-MoE: Gated DeltaNet + global GQA
attention + native MTP) on the CPU: the tiny seeded checkpoint
(``write_tiny_model(arch="qwen3_5_moe")``) served by a real ``vllm serve`` on the
patched tree, language-model-only, with MTP (one draft token), align mode,
prefix caching and H = 16.

vLLM 0.32.0 serves it; what it needs that the Qwen3-Next default does not is
``--language-model-only`` and, where no torchvision is installed (the kit's venv
and images), the kit's torchvision stand-in on the server's PYTHONPATH: the
first tests pin why. Tree-independent (the Qwen3.5 files are the same in both
trees), so it runs once, in the patched-tree pass of `make test`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit.bench import serve_args, ttft
from kit.bench.openai_client import cache_config_info
from kit.bench.serve import Server
from kit.geometry.geometry_model import Geometry, expected
from kit.loopback import urlopen
from kit.vllm_tree import trees
from kit.weights.tiny_model import (
    TINY_CONFIG,
    WEIGHTS,
    needs_vision_stand_in,
    serve_env,
    serve_extra_args,
    weights_sha256,
    write_tiny_model,
    write_vision_stand_in,
)

pytestmark = [pytest.mark.cpu]

ARCH = "qwen3_5_moe"
UNIT = 16
NO_TORCHVISION = importlib.util.find_spec("torchvision") is None


@pytest.fixture(scope="module")
def tree() -> trees.Tree:
    return trees.pinned("patched")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5") / "m", True, arch=ARCH)


def test_checkpoint_is_the_qwen3_6_layout(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5_moe"
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["mtp_num_hidden_layers"] == 1
    assert text["layer_types"] == TINY_CONFIG["layer_types"]
    with safe_open(str(model_dir / WEIGHTS), "pt") as f:
        names = set(f.keys())
    for name in (
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.0.linear_attn.in_proj_z.weight",
        "model.language_model.layers.0.linear_attn.in_proj_b.weight",
        "model.language_model.layers.0.linear_attn.in_proj_a.weight",
        "model.language_model.layers.3.self_attn.q_proj.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
        "mtp.fc.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
    ):
        assert name in names, name
    assert not [n for n in names if "visual" in n]  # served language-model-only


def test_checkpoint_is_seeded(model_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", weights=True, arch=ARCH)
    assert weights_sha256(again) == weights_sha256(model_dir)
    assert (again / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


def _import_qwen3_5(tree: trees.Tree, extra_path: list[str]) -> subprocess.CompletedProcess:
    env = tree.env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *extra_path])
    code = (
        "import vllm.model_executor.models.qwen3_5, vllm.model_executor.models.qwen3_5_mtp; "
        "import vllm.model_executor.models.qwen3_5 as m; print(m.__file__)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not NO_TORCHVISION, reason="a torchvision is installed here")
def test_qwen3_5_code_does_not_import_without_torchvision(tree: trees.Tree) -> None:
    """The finding: vLLM 0.32.0's Qwen3.5 module (the text-only classes and the MTP
    drafter too) imports qwen3_vl, whose line 38 imports transformers' Qwen2-VL
    image processor module, which imports torchvision at module level."""
    done = _import_qwen3_5(tree, [])
    assert done.returncode != 0
    err = done.stderr
    assert "ModuleNotFoundError: No module named 'torchvision'" in err
    assert re.search(r"models/qwen3_5\.py\", line 88, in <module>", err), err[-3000:]
    assert re.search(r"models/qwen3_vl\.py\", line 38, in <module>", err), err[-3000:]
    assert "qwen2_vl/image_processing_qwen2_vl.py" in err
    assert needs_vision_stand_in(ARCH) and not needs_vision_stand_in("qwen3_next")


def test_qwen3_5_code_imports_with_the_stand_in(tree: trees.Tree, tmp_path: Path) -> None:
    done = _import_qwen3_5(tree, [str(write_vision_stand_in(tmp_path / "stand-in"))])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(tree.package))


def _spec_decode_drafts(url: str) -> float:
    with urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert found, "no vllm:spec_decode_num_draft_tokens_total in /metrics"
    return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tree: trees.Tree, model_dir: Path):
    home = tmp_path_factory.mktemp("qwen3_5-server")
    args = (
        serve_args.cpu_serve_args(model_dir, serve_args.CPU_BLOCK, UNIT, 1)
        + serve_args.fix_flags("cpu")
        + serve_extra_args(ARCH)
    )
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **serve_env(ARCH, home / "stand-in", tree.search_path)}
    with Server(
        "patched", args, home / "server.log", tree=tree, env=env, startup_timeout=900, fix=True
    ) as srv:
        yield srv
    assert not srv.alive()


@pytest.mark.slow
@pytest.mark.parametrize("shared", [1007, 2159])
def test_follow_up_hits_as_the_geometry_predicts(server: Server, shared: int) -> None:
    """S tokens + "." (13), then the same S + 48 others: the cached-token counts are
    the geometry model's, with the block the server reports; the cached answer is
    the cold one's."""
    reported = cache_config_info(server.url)
    assert reported["unit"] == UNIT
    geo = Geometry(reported["block"], UNIT, 1, serve_args.CPU_BATCHED_TOKENS)
    drafts_before = _spec_decode_drafts(server.url)
    rows = {r["kind"]: r for r in ttft.pair_requests(server, "patched", 0, shared, geo)}
    want = expected(ttft.bench_case(geo, shared), patched=True).hit
    assert rows["cold_A"]["cached_tokens"] == 0
    assert rows["cached_B"]["cached_tokens"] == want, (reported, rows["cached_B"])
    assert rows["cached_B"]["metrics_hits"] == want
    assert rows["cold_B"]["cached_tokens"] == 0
    assert rows["cached_B"]["oracle"]["verdict"] == "same", rows["cached_B"]["oracle"]
    # The MTP drafter (vLLM's Qwen3_5MoeMTP, loaded from the mtp.* weights) ran.
    assert _spec_decode_drafts(server.url) > drafts_before


@pytest.mark.slow
def test_block_is_the_cpu_defaults(server: Server) -> None:
    # Same GDN state sizes and the same pinned SSM dtype as the Qwen3-Next default.
    # Retention 0: vllm serve's default, which the bench records and predicts under.
    assert cache_config_info(server.url) == {
        "block": serve_args.CPU_BLOCK,
        "unit": UNIT,
        "retention": 0,
    }
