"""cpu-gdn-prefill-checkpoint: states exported inside one forward pass equal the split schedule's.

The same batch runs twice through vLLM's real CPU GDN custom op
(``cpu_gdn_attention_core``, its metadata from the real
``GDNAttentionMetadataBuilder``):

- internal: one step; the layer's spec declares a prefill checkpoint block,
  so the builder hands each row its checkpoint offset and block, and the op
  writes the conv window and the recurrent state there;
- split: no checkpoint blocks (today's path); each row with a checkpoint runs
  as two chunks ending at the checkpoint, the state after the first chunk
  being the state the split schedule caches.

The conv window, the recurrent state, the final running state and every
output token must be bit for bit equal: the export runs the same kernels on
the same pieces from the same initial states, so any difference is a bug.
Activations are bfloat16 (the CPU kernels and the op accept nothing else),
recurrent states float32 (the CPU bench's ``mamba_ssm_cache_dtype``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm

gdn_cpu = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
if not hasattr(gdn_cpu, "_export_conv_checkpoints"):
    pytest.skip("cpu-gdn-prefill-checkpoint is not applied to this tree", allow_module_level=True)

from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.forward_context import override_forward_context  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (  # noqa: E402
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator  # noqa: E402
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

BLOCK = 64  # Mamba block (tokens)
UNIT = 16  # prefix_match_unit: the hash block and the checkpoint grid
K_HEADS, V_HEADS, HEAD_DIM = 1, 2, 64  # the CPU chunk kernel takes head_dim 64 or 128
WIDTH = 4  # conv kernel
NUM_SLOTS = 128
MAX_COLS = 8  # block-table columns: prompts up to 512 tokens
PREFIX = "model.layers.0.linear_attn"


class Layer:
    """What the op reads from the GDN layer, with the layer's own qkv split."""

    rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv

    def __init__(self, num_spec: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.prefix = PREFIX
        self.tp_size = 1
        self.head_k_dim = self.head_v_dim = HEAD_DIM
        self.key_dim = HEAD_DIM * K_HEADS
        self.value_dim = HEAD_DIM * V_HEADS
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.activation = "silu"
        self.conv1d = torch.nn.Module()
        weight = torch.randn(self.conv_dim, 1, WIDTH, generator=gen) * 0.5
        self.conv1d.weight = torch.nn.Parameter(weight.bfloat16(), requires_grad=False)
        self.conv1d.bias = None
        # As the loader does: on AVX-512 BF16 / Arm BF16 CPUs the conv weight is
        # packed for the C++ conv kernels and the plain one kept beside it.
        dispatch_cpu_unquantized_gemm(self.conv1d, remove_weight=False)
        self.A_log = torch.randn(V_HEADS, generator=gen)
        self.dt_bias = torch.randn(V_HEADS, generator=gen).bfloat16()
        conv_shape, ssm_shape = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, K_HEADS, V_HEADS, HEAD_DIM, HEAD_DIM, WIDTH, num_spec
        )
        self.kv_cache = [
            torch.randn(NUM_SLOTS, *conv_shape, generator=gen).bfloat16(),
            torch.randn(NUM_SLOTS, *ssm_shape, generator=gen),
        ]

    def conv_view(self) -> torch.Tensor:
        """The conv state as (slot, dim, time), whatever the cache layout."""
        return gdn_cpu._conv_buffer_view(self)

    def clone(self) -> Layer:
        twin = object.__new__(Layer)
        twin.__dict__.update(self.__dict__)
        twin.kv_cache = [t.clone() for t in self.kv_cache]
        return twin


@dataclass
class Row:
    """One request in the step: its tokens ``start .. end``.

    ``spec``: a speculative decode row (1 + k tokens). A one-token row with
    ``start > 0`` is a plain decode; anything longer is a prefill chunk.
    """

    start: int
    end: int
    spec: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def prefill(self) -> bool:
        return not self.spec and self.length > 1


@dataclass
class Request:
    row: Row
    qkv: torch.Tensor  # (end, conv_dim): the conv input of every position
    a: torch.Tensor  # (end, V_HEADS)
    b: torch.Tensor


# Per batch row: the (offset into the row's query, destination slot) pairs.
Exports = dict[int, list[tuple[int, int]]]


def vllm_config(model_dir: Path, num_spec: int) -> VllmConfig:
    mc = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=BLOCK * MAX_COLS,
        seed=0,
    )
    spec = None
    if num_spec:
        spec = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=num_spec,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )
    config = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=BLOCK * MAX_COLS,
            max_model_len=BLOCK * MAX_COLS,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            prefix_match_unit=UNIT,
        ),
        speculative_config=spec,
    )
    # The engine resolves these from the KV cache groups: here the hash block is
    # the unit, as in the kit's servers.
    config.cache_config.hash_block_size = UNIT
    config.cache_config.cache_hit_alignment_tokens = UNIT
    return config


def mamba_spec(num_spec: int, checkpoints: bool) -> MambaSpec:
    conv_shape, ssm_shape = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, K_HEADS, V_HEADS, HEAD_DIM, HEAD_DIM, WIDTH, num_spec
    )
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=(conv_shape, ssm_shape),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type="gdn_attention",
        mamba_cache_mode="align",
        num_speculative_blocks=num_spec,
    )
    if not checkpoints:
        return spec
    # What the patched layer declares when switched on.
    return replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)


def build_metadata(
    config: VllmConfig,
    spec: MambaSpec,
    rows: list[Row],
    tables: torch.Tensor,
    num_spec: int,
    step_exports: Exports | None = None,
) -> object:
    """The real builder's GDN metadata for one step over ``rows``.

    ``step_exports``: (offset, block) per batch row, handed to the builder as the
    patched model runner hands it the scheduler's ``mamba_checkpoint_exports``."""
    lens = [r.length for r in rows]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([r.end for r in rows], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=num_tokens,
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=tables,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        is_prefilling=torch.tensor([r.prefill for r in rows]),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    if step_exports:
        common.mamba_checkpoint_exports = {  # type: ignore[attr-defined]
            i: [(rows[i].start + o, dst) for o, dst in points] for i, points in step_exports.items()
        }
    builder = GDNAttentionMetadataBuilder(spec, [PREFIX], config, torch.device("cpu"))
    spec_kwargs: dict[str, torch.Tensor] = {}
    if num_spec:
        spec_kwargs = {
            "num_accepted_tokens": torch.tensor(
                [1 + num_spec if r.spec else 1 for r in rows], dtype=torch.int32
            ),
            "num_decode_draft_tokens_cpu": torch.tensor(
                [num_spec if r.spec else -1 for r in rows], dtype=torch.int32
            ),
        }
    return builder.build(0, common, **spec_kwargs)


def run_layer(
    layer: Layer, metadata: object, requests: list[Request], rows: list[Row]
) -> list[torch.Tensor]:
    """One call of the op for ``layer`` on ``metadata``; each row's outputs."""
    parts = {
        name: torch.cat(
            [getattr(q, name)[r.start : r.end] for q, r in zip(requests, rows, strict=True)]
        )
        for name in ("qkv", "a", "b")
    }
    out = torch.zeros(parts["qkv"].size(0), V_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    context = SimpleNamespace(
        no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata}
    )
    with override_forward_context(context):  # type: ignore[arg-type]
        gdn_cpu.cpu_gdn_attention_core(parts["qkv"], parts["b"], parts["a"], out, layer.prefix)
    return list(out.split([r.length for r in rows]))


def run_step(
    config: VllmConfig,
    spec: MambaSpec,
    layer: Layer,
    requests: list[Request],
    rows: list[Row],
    tables: torch.Tensor,
    num_spec: int,
    step_exports: Exports | None = None,
) -> tuple[list[torch.Tensor], object]:
    """One call of the op over ``rows``; returns each row's outputs and the metadata."""
    metadata = build_metadata(config, spec, rows, tables, num_spec, step_exports)
    return run_layer(layer, metadata, requests, rows), metadata


def builder_exports(metadata: object) -> Exports:
    """The checkpoints the real builder hands the op, by batch row."""
    checkpoint = metadata.checkpoint  # type: ignore[attr-defined]
    if checkpoint is None:
        return {}
    rows = checkpoint.request_rows.tolist()
    slots = checkpoint.state_indices.tolist()
    exports: Exports = {
        row: [(offset, slot)]
        for row, offset, slot in zip(rows, checkpoint.offsets, slots, strict=True)
        if offset > 0
    }
    # The patched tree's further states per row (fix-eagle-fine-prefix).
    extra = getattr(checkpoint, "extra_exports", None)
    for row, points in zip(rows, extra, strict=True) if extra is not None else ():
        if points:
            exports[row] = sorted(exports.get(row, []) + points)
    return exports


class Scenario:
    """A batch, its block tables and the states before the step, for both schedules."""

    def __init__(self, model_dir: Path, rows: list[Row], num_spec: int, seed: int) -> None:
        self.rows, self.num_spec = rows, num_spec
        gen = torch.Generator().manual_seed(seed)
        self.config = vllm_config(model_dir, num_spec)
        self.layer = Layer(num_spec, seed)
        self.initial = [t.clone() for t in self.layer.kv_cache]
        self.requests = [
            Request(
                row,
                (torch.randn(row.end, self.layer.conv_dim, generator=gen)).bfloat16(),
                torch.randn(row.end, V_HEADS, generator=gen).bfloat16(),
                torch.randn(row.end, V_HEADS, generator=gen).bfloat16(),
            )
            for row in rows
        ]
        free = list(range(1, NUM_SLOTS))  # 0 is the null block
        random.Random(seed).shuffle(free)
        # Internal schedule: a distinct block per column, as align mode allocates;
        # the running state is already in the block of the step's last token
        # (the worker's pre-step copy put it there).
        self.tables = torch.tensor(
            [[free.pop() for _ in range(MAX_COLS + num_spec)] for _ in rows], dtype=torch.int32
        )
        # Split schedule: each prefill row keeps its running state in one slot of
        # its own through both chunks (a chunk end's block copy is a byte copy),
        # starting from the same initial state.
        self.split_tables = self.tables.clone()
        self.split_layer = self.layer.clone()
        self.split_slot: dict[int, int] = {}
        for i, row in enumerate(rows):
            if row.prefill:
                slot = free.pop()
                self.split_slot[i] = slot
                self.split_tables[i] = slot
                running = self.running_block(i)
                for cache in self.split_layer.kv_cache:
                    cache[slot] = cache[running]
        self.spare = free  # slots nobody's table names

    def running_block(self, i: int) -> int:
        return int(self.tables[i, (self.rows[i].end - 1) // BLOCK])

    def run_internal(
        self, step_exports: Exports | None = None
    ) -> tuple[list[torch.Tensor], Exports]:
        outs, metadata = run_step(
            self.config,
            mamba_spec(self.num_spec, checkpoints=True),
            self.layer,
            self.requests,
            self.rows,
            self.tables,
            self.num_spec,
            step_exports,
        )
        return outs, builder_exports(metadata)

    def run_split(self, exports: Exports) -> tuple[list[torch.Tensor], dict[tuple[int, int], list]]:
        """Chunks ending at every exported offset; the states at those ends."""
        cuts = {
            i: sorted({row.start + o for o, _ in exports.get(i, [])}) + [row.end]
            for i, row in enumerate(self.rows)
        }
        done = {i: row.start for i, row in enumerate(self.rows)}
        outs: dict[int, list[torch.Tensor]] = {i: [] for i in cuts}
        states: dict[tuple[int, int], list] = {}
        spec = mamba_spec(self.num_spec, checkpoints=False)
        for step in range(max(len(c) for c in cuts.values())):
            batch = [i for i, c in cuts.items() if step < len(c)]
            rows = [replace(self.rows[i], start=done[i], end=cuts[i][step]) for i in batch]
            step_outs, metadata = run_step(
                self.config,
                spec,
                self.split_layer,
                [self.requests[i] for i in batch],
                rows,
                self.split_tables[batch],
                self.num_spec,
            )
            assert metadata.checkpoint is None  # type: ignore[attr-defined]
            for i, row, out in zip(batch, rows, step_outs, strict=True):
                outs[i].append(out)
                done[i] = row.end
                if row.end < self.rows[i].end:
                    slot = self.split_slot[i]
                    states[(i, row.end - self.rows[i].start)] = [
                        self.split_layer.conv_view()[slot].clone(),
                        self.split_layer.kv_cache[1][slot].clone(),
                    ]
        return [torch.cat(outs[i]) for i in range(len(self.rows))], states


# The bound where the two schedules run different kernels (see below), relative
# to the largest entry: torch's own bfloat16 tolerance (rtol 1.6e-2, i.e. 2^-6),
# since both kernels take bfloat16 inputs.
KERNEL_TOLERANCE = 2.0**-6


def check_against_split(scenario: Scenario, exports: Exports, internal_outs: list) -> None:
    """Every exported state, final state and output equals the split schedule's.

    Bit for bit, with one exception the split schedule itself causes: when its
    last chunk is a single token (a checkpoint one token before the chunk end),
    vLLM's builder files that chunk as a decode, so the split schedule runs it
    through the recurrent-update kernel while the export runs the same token
    through the chunk kernel, as any unsplit prefill does. The checkpoint state
    is still exact; the last token's output and the final recurrent state are
    held to ``KERNEL_TOLERANCE`` of their largest entry (measured over 13 seeds:
    the final state within 7e-3 of it, the output within 2 bfloat16 steps).
    """
    split_outs, split_states = scenario.run_split(exports)
    layer, split = scenario.layer, scenario.split_layer
    history = WIDTH - 1
    written: set[int] = set()
    for i, row in enumerate(scenario.rows):
        # The exported states first: they are what this mod adds.
        for offset, dst in exports.get(i, []):
            conv, ssm = split_states[(i, offset)]
            assert torch.equal(layer.kv_cache[1][dst], ssm), (
                f"row {i}: checkpoint recurrent state at offset {offset} differs: "
                f"max |d| {(layer.kv_cache[1][dst] - ssm).abs().max():.3g}"
            )
            assert torch.equal(layer.conv_view()[dst, :, :history], conv[:, :history]), (
                f"row {i}: checkpoint conv window at offset {offset} differs"
            )
            written.add(dst)
        last_cut = max((row.start + o for o, _ in exports.get(i, [])), default=row.start)
        decode_tail = row.prefill and last_cut > row.start and row.end - last_cut == 1
        exact = len(internal_outs[i]) - int(decode_tail)
        assert torch.equal(internal_outs[i][:exact], split_outs[i][:exact]), (
            f"row {i}: outputs differ"
        )
        if decode_tail:
            got, want = internal_outs[i][exact:].float(), split_outs[i][exact:].float()
            bound = KERNEL_TOLERANCE * want.abs().max()
            assert (got - want).abs().max() <= bound, f"row {i}: last output too far"
        if row.prefill:
            mine, theirs = scenario.running_block(i), scenario.split_slot[i]
            final, want = layer.kv_cache[1][mine], split.kv_cache[1][theirs]
            if decode_tail:
                bound = KERNEL_TOLERANCE * want.abs().max()
                assert (final - want).abs().max() <= bound, f"row {i}: final state too far"
            else:
                assert torch.equal(final, want), f"row {i}: final recurrent state differs"
            assert torch.equal(
                layer.conv_view()[mine, :, :history], split.conv_view()[theirs, :, :history]
            ), f"row {i}: final conv window differs"
            written.add(mine)
        else:
            for slot in scenario.tables[i].tolist():
                written.add(slot)
                for a, b in zip(layer.kv_cache, split.kv_cache, strict=True):
                    assert torch.equal(a[slot], b[slot]), f"decode row {i}: slot {slot} differs"
    # Nothing else moved: every other block of the internal run is as it was.
    for slot in set(range(NUM_SLOTS)) - written - set(scenario.split_slot.values()):
        for cache, old in zip(layer.kv_cache, scenario.initial, strict=True):
            assert torch.equal(cache[slot], old[slot]), f"slot {slot} written by the export"


# -- the batches ---------------------------------------------------------------
MODES = {
    # name: (draft tokens, spec decode rows in the batch)
    "no-spec": (0, False),  # the fast path: decodes and prefills in one batch
    "mtp-prefill": (1, False),  # MTP configured, a batch without drafts
    "mtp-mixed": (1, True),  # prefills beside speculative decodes
}


def random_rows(rng: random.Random, num_spec: int, with_spec: bool) -> list[Row]:
    """Decodes first (the runner reorders them so), then prefill chunks that
    start from scratch or on a unit boundary with a state, some long enough
    for a checkpoint, some not."""
    rows = []
    for _ in range(rng.randint(0, 2)):
        start = rng.randrange(1, 300)
        rows.append(Row(start, start + 1))
    if with_spec:
        for _ in range(rng.randint(1, 2)):
            start = rng.randrange(1, 300)
            rows.append(Row(start, start + 1 + num_spec, spec=True))
    for _ in range(rng.randint(2, 4)):
        start = rng.choice([0, 0, rng.randrange(1, 12) * UNIT])
        end = min(start + rng.randint(2, 320), BLOCK * MAX_COLS)
        rows.append(Row(start, max(end, start + 2)))
    return rows


def check(model_dir: Path, rows: list[Row], num_spec: int, seed: int) -> Exports:
    scenario = Scenario(model_dir, rows, num_spec, seed)
    outs, exports = scenario.run_internal()
    check_against_split(scenario, exports, outs)
    return exports


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_export_equals_split_schedule(tiny_model_dir: Path, mode: str, seed: int) -> None:
    num_spec, with_spec = MODES[mode]
    rng = random.Random(f"{mode}-{seed}")
    rows = random_rows(rng, num_spec, with_spec)
    # A long prefill in every batch, so every batch exports something.
    rows.append(Row(0, rng.randint(2 * BLOCK, BLOCK * MAX_COLS)))
    exports = check(tiny_model_dir, rows, num_spec, seed)
    assert exports, "the builder gave no row a checkpoint: the batch tests nothing"
    assert all(rows[i].prefill for i in exports)


# Checkpoint positions p the issue names, each as the real rules place it:
# without EAGLE's drop p = floor((N - 1) / H) * H, with it floor(N / H) * H - H.
POSITIONS = {
    # name: (draft tokens, row, p)
    "first-block": (1, Row(0, 70), 48),  # only the drop puts p in block 0 of a valid row
    "block-boundary": (0, Row(0, 80), 64),
    "block-boundary-mtp": (1, Row(0, 90), 64),
    "one-before-chunk-end": (0, Row(0, 97), 96),
    "resumed-mid-block": (0, Row(16, 150), 144),
    "resumed-on-boundary": (1, Row(64, 300), 272),
    "long-pieces": (0, Row(0, 512), 496),
}


@pytest.mark.parametrize("name", POSITIONS)
def test_export_at_named_positions(tiny_model_dir: Path, name: str) -> None:
    num_spec, row, position = POSITIONS[name]
    # Beside a row without a checkpoint and (no drafts) a decode.
    rows = ([Row(40, 41)] if num_spec == 0 else []) + [row, Row(0, 30)]
    exports = check(tiny_model_dir, rows, num_spec, seed=len(name))
    index = rows.index(row)
    assert [offset for offset, _ in exports[index]] == [position - row.start]
    assert set(exports) == {index}


def late_by_one(points: list[list[tuple[int, int]]] | None) -> list | None:
    return points and [[(o + 1, dst) for o, dst in row] for row in points]


def test_export_at_a_wrong_position_fails_the_check(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check is not blind: the export one token late is caught."""
    real = gdn_cpu._prefill_checkpoints
    monkeypatch.setattr(gdn_cpu, "_prefill_checkpoints", lambda *a: late_by_one(real(*a)))
    scenario = Scenario(tiny_model_dir, [Row(0, 80), Row(0, 200)], 0, seed=1)
    outs, exports = scenario.run_internal()
    assert len(exports) == 2
    with pytest.raises(AssertionError, match="row 0: checkpoint recurrent state at offset 64"):
        check_against_split(scenario, exports, outs)


def test_conv_window_at_a_wrong_position_fails_the_check(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conv window is checked on its own: only it one token late is caught."""
    real = gdn_cpu._export_conv_checkpoints

    def late(*args: object, **kwargs: object) -> None:
        *head, points = args
        real(*head, late_by_one(points), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gdn_cpu, "_export_conv_checkpoints", late)
    scenario = Scenario(tiny_model_dir, [Row(0, 80), Row(0, 200)], 1, seed=2)
    outs, exports = scenario.run_internal()
    assert len(exports) == 2
    with pytest.raises(AssertionError, match="row 0: checkpoint conv window at offset"):
        check_against_split(scenario, exports, outs)


# -- several states per row (what the fix under EAGLE needs) ---------------------
def add_exports(
    monkeypatch: pytest.MonkeyPatch, scenario: Scenario, wanted: dict[int, list[int]]
) -> Exports:
    """Make the op export more offsets per batch row than vLLM's metadata holds
    (one); returns them with the blocks they go to."""
    spare = iter(scenario.spare)
    extra: Exports = {i: [(o, next(spare)) for o in offsets] for i, offsets in wanted.items()}
    real = gdn_cpu._prefill_checkpoints

    def with_extra(checkpoint: object, first_row: int, num_rows: int) -> list | None:
        if checkpoint is None:  # the split schedule's steps: nothing declared
            return real(checkpoint, first_row, num_rows)
        points = real(checkpoint, first_row, num_rows) or [[] for _ in range(num_rows)]
        batch_rows = checkpoint.request_rows.tolist()  # type: ignore[attr-defined]
        for j in range(num_rows):
            points[j] = points[j] + extra.get(batch_rows[first_row + j], [])
        return points if any(points) else None

    monkeypatch.setattr(gdn_cpu, "_prefill_checkpoints", with_extra)
    return extra


def check_with_extra(
    monkeypatch: pytest.MonkeyPatch, scenario: Scenario, wanted: dict[int, list[int]]
) -> Exports:
    extra = add_exports(monkeypatch, scenario, wanted)
    outs, exports = scenario.run_internal()
    for i, points in extra.items():
        exports[i] = sorted(exports.get(i, []) + points)
    check_against_split(scenario, exports, outs)
    return exports


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_several_exports_per_row(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str, seed: int
) -> None:
    """Up to three more states per prefill row, anywhere in the row (2 tokens in
    reaches into the initial conv window). Even offsets: no chunk of the split
    schedule is a single token, which vLLM would run as a decode."""
    num_spec, with_spec = MODES[mode]
    rng = random.Random(f"several-{mode}-{seed}")
    rows = random_rows(rng, num_spec, with_spec) + [Row(0, rng.randint(2 * BLOCK, 500))]
    scenario = Scenario(tiny_model_dir, rows, num_spec, seed)
    wanted = {
        i: rng.sample(range(2, row.length - 1, 2), min(rng.randint(1, 3), (row.length - 2) // 2))
        for i, row in enumerate(rows)
        if row.prefill and row.length >= 4
    }
    exports = check_with_extra(monkeypatch, scenario, wanted)
    assert max(len(points) for points in exports.values()) >= 2


@pytest.mark.parametrize("num_spec", [0, 1])
def test_fix_positions_exported_in_one_pass(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_spec: int
) -> None:
    """The prompt checkpoint p, the predecessor one unit below it and the state
    one unit below the last block boundary inside the prompt, from one step."""
    row = Row(0, 230)
    p = {0: 224, 1: 208}[num_spec]  # floor(229/16)*16; with the drop floor(230/16)*16 - 16
    below_boundary = (row.end - 1) // BLOCK * BLOCK - UNIT  # 176
    scenario = Scenario(tiny_model_dir, [row, Row(0, 40)], num_spec, seed=7)
    exports = check_with_extra(monkeypatch, scenario, {0: [p - UNIT, below_boundary]})
    assert [o for o, _ in exports[0]] == [below_boundary, p - UNIT, p]


def extra_exports_route() -> bool:
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    return "extra_exports" in MambaPrefillCheckpointMetadata.__dataclass_fields__


@pytest.mark.parametrize("num_spec", [0, 1])
def test_fix_states_through_vllm_metadata(tiny_model_dir: Path, num_spec: int) -> None:
    """The patched tree's route end to end in the worker: the scheduler's
    (position, block) pairs on the common metadata, vLLM's builder turning them
    into ``extra_exports``, the op writing each; one pass, equal to the split
    schedule. A second row, resumed mid-prompt, takes only the fix's states."""
    if not extra_exports_route():
        pytest.skip("the unpatched tree has no extra_exports (fix-eagle-fine-prefix)")
    rows = [Row(0, 230), Row(3 * UNIT, 3 * UNIT + 40)]
    p = {0: 224, 1: 208}[num_spec]
    below_boundary = (rows[0].end - 1) // BLOCK * BLOCK - UNIT  # 176
    scenario = Scenario(tiny_model_dir, rows, num_spec, seed=11)
    spare = iter(scenario.spare)
    wanted = {0: [(p - UNIT, next(spare)), (below_boundary, next(spare))], 1: [(24, next(spare))]}
    outs, exports = scenario.run_internal(wanted)
    assert [o for o, _ in exports[0]] == [below_boundary, p - UNIT, p]
    assert exports[1] == wanted[1]  # no column for vLLM's own: the fix's state alone
    check_against_split(scenario, exports, outs)


# -- one read and one plan per KV cache group and step ------------------------------
def interleaved_groups(
    model_dir: Path, num_spec: int
) -> tuple[list[Scenario], list[list[torch.Tensor]], list[object]]:
    """Two KV cache groups in one step, their layers interleaved as vLLM places them
    (``layers[i::num_groups]``: group 0, group 1, group 0): group 0 a batch of two
    prefills and a short one, group 1 (blocks and metadata of its own) one prefill,
    whose pieces tile its tokens. Returns the scenarios (group 0's first layer in
    ``scenario.layer``), the outputs of the three layers and the two metadata objects."""
    groups = [
        Scenario(model_dir, [Row(0, 230), Row(3 * UNIT, 3 * UNIT + 40), Row(0, 40)], num_spec, 21),
        Scenario(model_dir, [Row(0, 230)], num_spec, 22),
    ]
    twin = groups[0].layer.clone()  # group 0's second layer: same weights and blocks
    twin.prefix = "model.layers.2.linear_attn"
    spec = mamba_spec(num_spec, checkpoints=True)
    metadata = [build_metadata(g.config, spec, g.rows, g.tables, num_spec) for g in groups]
    outs = [
        run_layer(layer, metadata[g], groups[g].requests, groups[g].rows)
        for g, layer in ((0, groups[0].layer), (1, groups[1].layer), (0, twin))
    ]
    for a, b in zip(twin.kv_cache, groups[0].layer.kv_cache, strict=True):
        assert torch.equal(a, b), "group 0's second layer: blocks differ from its first's"
    return groups, outs, metadata


@pytest.mark.parametrize("num_spec", [0, 1])
def test_each_group_reads_and_plans_once_per_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, num_spec: int
) -> None:
    """The checkpoints are read, and the pieces planned, once per metadata object
    (a KV cache group's step), even with the groups' layers interleaved; each
    group's exports equal the split schedule, and a layer that reuses its group's
    plan ends bit for bit as the layer that made it."""
    reads: list[object] = []
    plans: list[list] = []
    real_read, real_plan = gdn_cpu._prefill_checkpoints, gdn_cpu._piece_calls

    def read(checkpoint: object, *rows: int) -> object:
        reads.append(checkpoint)
        return real_read(checkpoint, *rows)

    def plan(*args: object) -> list:
        plans.append(real_plan(*args))
        return plans[-1]

    monkeypatch.setattr(gdn_cpu, "_prefill_checkpoints", read)
    monkeypatch.setattr(gdn_cpu, "_piece_calls", plan)
    groups, outs, metadata = interleaved_groups(tiny_model_dir, num_spec)
    assert list(map(id, reads)) == [id(m.checkpoint) for m in metadata]  # type: ignore[attr-defined]
    assert len(plans) == 3 and plans[2] is plans[0] and plans[1] is not plans[0]
    assert len(plans[1]) == 2 and all(call.run is not None for call in plans[1])
    assert all(map(torch.equal, outs[2], outs[0])), "group 0's second layer: outputs differ"
    for group, group_outs, meta in zip(groups, outs[:2], metadata, strict=True):
        exports = builder_exports(meta)
        assert exports, "no row has a checkpoint: the step tests nothing"
        check_against_split(group, exports, group_outs)


def test_a_read_kept_past_its_metadata_fails_the_check(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read is kept on its metadata object for a reason: kept per row layout
    alone (one step's read served to the next step, or to another group with the
    same rows), group 1 writes its exports into group 0's blocks, and the check
    catches it."""
    kept: dict[tuple[int, int], object] = {}
    real = gdn_cpu._prefill_checkpoints

    def by_rows_only(checkpoint: object, first_row: int, num_rows: int) -> object:
        if checkpoint is None:
            return None
        if (first_row, num_rows) not in kept:
            kept[(first_row, num_rows)] = real(checkpoint, first_row, num_rows)
        return kept[(first_row, num_rows)]

    monkeypatch.setattr(gdn_cpu, "_step_checkpoints", by_rows_only)
    groups = [Scenario(tiny_model_dir, [Row(0, 230)], 1, seed) for seed in (31, 32)]
    spec = mamba_spec(1, checkpoints=True)
    for group in groups:
        meta = build_metadata(group.config, spec, group.rows, group.tables, 1)
        outs = run_layer(group.layer, meta, group.requests, group.rows)
    with pytest.raises(AssertionError, match="row 0: checkpoint recurrent state at offset 208"):
        check_against_split(groups[1], builder_exports(meta), outs)


def test_fix_state_at_a_wrong_position_fails_the_check(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same route with the op writing the fix's state one token late is caught."""
    if not extra_exports_route():
        pytest.skip("the unpatched tree has no extra_exports (fix-eagle-fine-prefix)")
    real = gdn_cpu._prefill_checkpoints
    monkeypatch.setattr(gdn_cpu, "_prefill_checkpoints", lambda *a: late_by_one(real(*a)))
    scenario = Scenario(tiny_model_dir, [Row(3 * UNIT, 3 * UNIT + 40)], 0, seed=12)
    wanted = {0: [(24, scenario.spare[0])]}
    outs, exports = scenario.run_internal(wanted)
    assert exports == wanted
    with pytest.raises(AssertionError, match="row 0: checkpoint recurrent state at offset 24"):
        check_against_split(scenario, exports, outs)


# -- the switch ------------------------------------------------------------------
# Builds real Qwen GDN layers (one TP rank, gloo) with the variable unset, "0" and
# "1" in turn, in one process of its own so the distributed state stays there.
LAYER_SCRIPT = """
import json, os, sys, tempfile
from pathlib import Path
import vllm
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from test_cpu_gdn_checkpoint_export import vllm_config

config = vllm_config(Path(sys.argv[1]), 1)
declared = {"vllm": vllm.__file__}
with set_current_vllm_config(config):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method="file://" + tempfile.mktemp(),
    )
    initialize_model_parallel(1, 1)
    for i, value in enumerate(["unset", "0", "1"]):
        os.environ.pop("VLLM_CPU_GDN_PREFILL_CHECKPOINT", None)
        if value != "unset":
            os.environ["VLLM_CPU_GDN_PREFILL_CHECKPOINT"] = value
        layer = QwenGatedDeltaNetAttention(
            config.model_config.hf_text_config, config, prefix=f"model.layers.{i}.linear_attn"
        )
        os.environ.pop("VLLM_CPU_GDN_PREFILL_CHECKPOINT", None)  # read at construction
        spec = layer.get_kv_cache_spec(config)
        declared[value] = [spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment]
print(json.dumps(declared))
"""


def test_declared_only_when_switched_on(tiny_model_dir: Path) -> None:
    """Off by default (the split path; the bench switches it on itself), on with
    VLLM_CPU_GDN_PREFILL_CHECKPOINT=1, read when the layer is built."""
    here = Path(__file__).resolve()
    path = [str(Path(vllm.__file__).parent.parent), str(here.parents[2]), str(here.parent)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_GDN_PREFILL_CHECKPOINT"}
    env["PYTHONPATH"] = os.pathsep.join(path)
    done = subprocess.run(
        [sys.executable, "-c", LAYER_SCRIPT, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    declared = json.loads(done.stdout.strip().splitlines()[-1])
    assert declared.pop("vllm") == vllm.__file__  # the tree under test
    assert declared == {"unset": [0, None], "0": [0, None], "1": [1, 1]}
