"""Drive vLLM's real Scheduler and KV-cache manager for a hybrid model with simulated outputs.

The cache layout is the one a hybrid GDN/Mamba + full-attention model gets in
``mamba_cache_mode="align"``: one full-attention group and one Mamba group with
the same physical block size, prefix matching every ``prefix_match_unit``
tokens. The model runner is replaced by ``MambaStateLedger``, which applies the
align-mode state placement rule and the scheduler's block copies, so every
cached Mamba state is known by the exact token prefix that produced it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    eagle_proof_margin,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kit.geometry.geometry_cases import prompts
from kit.geometry.geometry_model import UNIT, Case, Geometry
from kit.vllm_tree import mods

FULL_GROUP = 0
MAMBA_GROUP = 1
MAX_MODEL_LEN = 65536
EOS_TOKEN_ID = 2


@dataclass(frozen=True)
class Violation:
    """A chunk (or a resume) that started from a state another prefix made."""

    request_id: str
    step: int
    kind: str  # "resume" or "chunk"
    position: int  # tokens the state should cover
    state_covers: int | None  # tokens the state held covers (None: no state recorded)
    same_prefix: bool  # the state's tokens are a prefix of the request's (a truncated state)


@dataclass(frozen=True)
class Boundaries:
    """Where a follow-up would resume, measured group by group.

    ``fa_match``: longest full-attention match without the EAGLE drop;
    ``fa_eagle``: the same lookup with the drop applied (equal when no
    speculation); ``hit``: the reconciled hit the coordinator hands the
    scheduler, whose Mamba state the suite checks through ``ResumeRecord``.
    """

    fa_match: int
    fa_eagle: int
    hit: int


@functools.lru_cache(maxsize=4)
@functools.cache
def fix_switches() -> dict[str, bool]:
    """The fix's CacheConfig fields, from the mod made for the release imported here."""
    import vllm

    return mods.switch_fields("cpu", Path(vllm.__file__).parent)


def model_config(model_dir: str) -> ModelConfig:
    return ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )


# ``prefix_cache_retention_interval`` when a rig is not told one: vLLM's
# ``KVCacheConfig`` default, dense retention (every chunk end keeps its state). A
# ``vllm serve`` runs ``CacheConfig``'s default instead, 0: only the replay
# boundaries and shared-prefix junctions (docs/retention.md).
DENSE = None


def check_retention(retention: int | None, geo: Geometry) -> None:
    """0, None (dense) or a positive multiple of the scheduler block size (the
    physical block here: both groups share it), as vLLM's coordinator requires."""
    if retention is None:
        return
    if isinstance(retention, bool) or not isinstance(retention, int):
        raise TypeError(f"retention {retention!r}: 0, None or a multiple of {geo.block}")
    if retention < 0 or retention % geo.block:
        raise ValueError(
            f"retention {retention}: 0, None (dense) or a positive multiple of the "
            f"scheduler block size {geo.block}"
        )


def tree_has_lookahead_hashes() -> bool:
    """Whether this vLLM hashes EAGLE/MTP prompts with lookahead block hashes, which
    ``disable_lookahead_block_hashes`` turns back into the 0.32.0 hashing."""
    return any(
        f.name == "disable_lookahead_block_hashes" for f in dataclasses.fields(SpeculativeConfig)
    )


def build_vllm_config(
    model_dir: Path,
    geo: Geometry,
    fix: bool = False,
    lookahead_hashes: bool = True,
    retention: int | None = DENSE,
    max_num_seqs: int = 16,
) -> VllmConfig:
    mc = model_config(str(model_dir))
    spec = None
    if geo.num_spec:
        legacy = {}
        if not lookahead_hashes:
            if not tree_has_lookahead_hashes():
                raise ValueError("this vLLM has no lookahead block hashes to disable")
            legacy = {"disable_lookahead_block_hashes": True}
        spec = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=geo.num_spec,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
            **legacy,
        )
    return VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=geo.budget,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        cache_config=CacheConfig(
            block_size=geo.block,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            prefix_match_unit=geo.unit,
            prefix_cache_retention_interval=retention,
            **(fix_switches() if fix else {}),
        ),
        speculative_config=spec,
    )


def tree_writes_extra_exports() -> bool:
    """Whether this tree's checkpoint builder hands a layer the fix's extra states
    (0.32.0 patched; 0.34.0 patched through ``fix-eagle-fine-prefix-exports``)."""
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    return "extra_exports" in {f.name for f in dataclasses.fields(MambaPrefillCheckpointMetadata)}


# Cold prompts whose one chunk runs past their last cacheable block boundary:
# (prompt tokens, block, that boundary), in blocks below, at and above the grid.
BOUNDARY_PROBES = ((584, 384, 384), (230, 64, 192), (2200, 2144, 2144), (1100, 528, 1056))


def tree_exports_block_boundary() -> bool:
    """Whether this tree's fix also exports the last cacheable block boundary where a
    chunk runs past it (0.34.0's lookahead port), asked of its own export rule on the
    prompts of ``BOUNDARY_PROBES``. The geometry model has one flag for it, so a tree
    that exports it on some of them and not on others is refused, not misread."""
    from vllm.v1 import kv_cache_interface

    rule = getattr(kv_cache_interface, "get_mamba_eagle_fix_exports", None)
    if rule is None:
        return False
    # Positional: the pinned release's rule takes no lookahead argument.
    answers = {b in rule(0, n, n, block, UNIT, False, 64) for n, block, b in BOUNDARY_PROBES}
    if len(answers) > 1:
        raise RuntimeError(
            "this tree's fix exports the last block boundary for some prompts only "
            f"({BOUNDARY_PROBES}); the geometry model cannot describe it"
        )
    return answers.pop()


def extra_exports(geo: Geometry) -> dict[str, bool]:
    """The spec field of a layer that writes more states per row than the prompt
    checkpoint (``cpu-gdn-prefill-checkpoint``, FlashInfer GDN with
    ``fix-eagle-fine-prefix-exports``; trees without it lack the field). Declared
    only where the tree's builder writes them: a scheduler that planned exports
    nobody writes would key nothing (publish after write) and lose the states."""
    field_name = "prefill_checkpoint_extra_exports"
    if field_name not in {f.name for f in dataclasses.fields(MambaSpec)}:
        return {}
    return {
        field_name: geo.checkpoint_alignment is not None
        and geo.layer_extra_exports
        and tree_writes_extra_exports()
    }


def kv_cache_config(geo: Geometry, num_blocks: int, retention: int | None = DENSE) -> KVCacheConfig:
    """``retention``: ``prefix_cache_retention_interval`` (None: dense, 0: semantic
    checkpoints only, as ``vllm serve`` runs; a multiple of the block: periodic)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        prefix_cache_retention_interval=retention,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attn"],
                FullAttentionSpec(
                    block_size=geo.block,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["gdn"],
                MambaSpec(
                    block_size=geo.block,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                    num_speculative_blocks=geo.num_spec,
                    # The internal regimes: the layer exports one state per prefill
                    # from inside the forward pass (as Mamba2 and FlashInfer GDN declare).
                    num_prefill_checkpoint_blocks=int(geo.checkpoint_alignment is not None),
                    prefill_checkpoint_alignment=geo.checkpoint_alignment,
                    **extra_exports(geo),
                ),
            ),
        ],
    )


@dataclass
class MambaStateLedger:
    """What a Mamba block holds, as the token prefix that produced it.

    Align mode saves the running state after a step into the request's block
    ``(end - 1) // block_size``; the scheduler's block copies move states
    between blocks before the step runs.
    """

    block_size: int
    prefix_of_block: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def apply_copies(self, copies) -> None:
        for copy in copies or ():
            src = self.prefix_of_block.get(copy.src_block_id)
            if src is None:
                self.prefix_of_block.pop(copy.dst_block_id, None)
            else:
                self.prefix_of_block[copy.dst_block_id] = src

    def record_step(self, request: Request, mamba_block_ids: list[int], end: int) -> None:
        block_id = mamba_block_ids[(end - 1) // self.block_size]
        self.prefix_of_block[block_id] = tuple(request.all_token_ids[:end])

    def record_export(self, request: Request, block_id: int, position: int) -> None:
        """An internal checkpoint: the layer wrote the state after ``position`` tokens."""
        self.prefix_of_block[block_id] = tuple(request.all_token_ids[:position])


class CheckpointWriter:
    """Where the worker exports internal prefill checkpoints in a step.

    Runs vLLM's own ``MambaPrefillCheckpointBuilder`` (what the Mamba2 and GDN
    metadata builders call, in lockstep with the scheduler and ``MambaManager``)
    on the step's sequence and query lengths and the requests' Mamba block table.
    """

    def __init__(self, vllm_config: VllmConfig, spec: MambaSpec) -> None:
        from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointBuilder

        self.builder = MambaPrefillCheckpointBuilder(vllm_config, spec)

    def exports(
        self,
        rows: list[tuple[Request, int, list[int]]],
        step_exports: dict[str, dict[int, list[tuple[int, int]]]] | None = None,
    ) -> list[tuple[Request, int, int]]:
        """``rows``: (request, tokens scheduled this step, its Mamba block ids), after
        ``schedule()``; ``step_exports``: the scheduler output's
        ``mamba_checkpoint_exports`` (the patched tree's extra states, each in a block
        outside the block table), handed to the builder as the model runner does.
        Returns (request, block id, checkpoint position) per export."""
        from types import SimpleNamespace

        if not rows:
            return []
        seq_lens = [req.num_computed_tokens for req, _, _ in rows]
        starts = [0]
        for _, n, _ in rows:
            starts.append(starts[-1] + n)
        width = max(len(ids) for _, _, ids in rows)
        table = torch.zeros((len(rows), max(width, 1)), dtype=torch.int64)
        for i, (_, _, ids) in enumerate(rows):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        loc = torch.tensor(starts, dtype=torch.int32)
        meta = SimpleNamespace(
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc_cpu=loc,
            query_start_loc=loc,
            block_table_tensor=table,
            # A declared field of CommonAttentionMetadata where the tree exports
            # the fix's states (0.34.0); read with getattr elsewhere (0.32.0).
            mamba_checkpoint_exports=None,
        )
        if step_exports:
            by_row = {
                i: step_exports[req.request_id][MAMBA_GROUP]
                for i, (req, _, _) in enumerate(rows)
                if MAMBA_GROUP in step_exports.get(req.request_id, {})
            }
            if by_row:
                meta.mamba_checkpoint_exports = by_row
        built = self.builder.build(meta, list(range(len(rows))))
        if built is None:
            return []
        out = []
        for i, (req, n, _) in enumerate(rows):
            start = seq_lens[i] - n
            offset = int(built.checkpoint_offsets[i])
            if offset:
                out.append((req, int(built.state_indices[i]), start + offset))
            extra = getattr(built, "extra_exports", None)
            for offset, block_id in extra[i] if extra else ():
                out.append((req, block_id, start + offset))
        return out


@dataclass
class ResumeRecord:
    """Where a request resumed (``hit``), the state it resumed from, how it ended."""

    request_id: str
    hit: int
    state_prefix: tuple[int, ...] | None
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    final_computed: int = 0

    def resumed_from_own_prefix(self) -> bool:
        """The state oracle's verdict: the state is exactly the first ``hit`` prompt tokens."""
        if self.hit == 0:
            return True
        return self.state_prefix == self.prompt[: self.hit]


class SchedulerRig:
    """One real Scheduler over a hybrid cache, prompts in, simulated tokens out."""

    def __init__(
        self,
        model_dir: Path,
        geo: Geometry,
        *,
        num_blocks: int = 4096,
        fix: bool = False,
        lookahead_hashes: bool = True,
        mamba_spec: MambaSpec | None = None,
        retention: int | None = DENSE,
        max_num_seqs: int = 16,
    ) -> None:
        """``fix`` turns on fix-eagle-fine-prefix's switch (only the patched tree has it);
        ``lookahead_hashes=False``: releases after 0.32.0 with their legacy hashing;
        ``mamba_spec``: a real layer's spec for the Mamba group (e.g. Mamba2's,
        ``kit.rig.nemotron_h``) instead of the one the geometry's regime declares;
        ``retention``: ``prefix_cache_retention_interval`` in both the CacheConfig and
        the KVCacheConfig (None, the default: dense; 0: ``vllm serve``'s default);
        ``max_num_seqs``: the most requests one step schedules."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        init_none_hash(sha256)
        check_retention(retention, geo)
        self.geo = geo
        self.retention = retention
        self.vllm_config = build_vllm_config(
            model_dir, geo, fix, lookahead_hashes, retention, max_num_seqs
        )
        self.kv_cache_config = kv_cache_config(geo, num_blocks, retention)
        if mamba_spec is not None:
            if mamba_spec.block_size != geo.block:
                raise ValueError(
                    f"the layer's spec has block {mamba_spec.block_size}, the geometry {geo.block}"
                )
            self.kv_cache_config.kv_cache_groups[MAMBA_GROUP].kv_cache_spec = mamba_spec
        if geo.num_spec and hasattr(self.vllm_config, "num_hash_lookahead_tokens"):
            # From 0.33.0 only groups flagged here count as EAGLE groups once
            # lookahead hashes clear the drop; the engine's KV-cache planning
            # flags the group holding the MTP draft layer, i.e. full attention.
            self.kv_cache_config.kv_cache_groups[FULL_GROUP].is_eagle_group = True
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        register_all_kvcache_specs(self.vllm_config)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=geo.block,
            hash_block_size=geo.unit,
            log_stats=True,
        )
        self.manager = self.scheduler.kv_cache_manager
        self.coordinator = self.manager.coordinator
        self.ledger = MambaStateLedger(geo.block)
        # The engine core resolves these for the workers; the checkpoint builder reads them.
        cache = self.vllm_config.cache_config
        cache.hash_block_size = geo.unit
        cache.cache_hit_alignment_tokens = self.coordinator._cache_hit_alignment_tokens
        self.exporter = (
            CheckpointWriter(
                self.vllm_config, self.kv_cache_config.kv_cache_groups[MAMBA_GROUP].kv_cache_spec
            )
            if geo.checkpoint_alignment is not None
            else None
        )
        # Releases after 0.32.0 hash each unit together with the tokens the drafter
        # reads past it (lookahead hashes); the engine builds its hasher so.
        lookahead = getattr(self.vllm_config, "num_hash_lookahead_tokens", 0)
        self.block_hasher = get_request_block_hasher(
            geo.unit, sha256, *([lookahead] if lookahead else [])
        )
        self.chunk_ends: dict[str, list[int]] = {}
        # The patched tree's extra exports the scheduler planned, per request:
        # the positions of the fix's states written from inside a step.
        self.fix_exports: dict[str, list[int]] = {}
        # Every state the layer wrote from inside a step (vLLM's own checkpoint
        # and the fix's), per request: which prompts took the internal path.
        self.exports: dict[str, list[int]] = {}
        # This step's writes: (request ID, position, block ID).
        self._written: list[tuple[str, int, int]] = []
        self.partial_entries: list[tuple[str, int, int]] = []
        self._next_id = 0
        self._count_partial_entries()

    def _count_partial_entries(self) -> None:
        """Record every partial (sub-block) entry the pool registers, per request."""
        pool = self.manager.block_pool
        register = pool.cache_partial_block

        def counted(request, block, num_tokens, kv_cache_group_id, *args, **kwargs):
            key = register(request, block, num_tokens, kv_cache_group_id, *args, **kwargs)
            if key is not None:
                self.partial_entries.append((request.request_id, kv_cache_group_id, num_tokens))
            return key

        pool.cache_partial_block = counted

    # -- requests ---------------------------------------------------------
    def make_request(self, tokens: list[int], max_tokens: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        self._next_id += 1
        return Request(
            request_id=f"r{self._next_id}",
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )

    # -- measurement ------------------------------------------------------
    def boundaries(self, tokens: list[int]) -> Boundaries:
        """Per-group lookups for a prompt, without scheduling it."""
        request = self.make_request(tokens)
        max_len = request.num_tokens - 1
        hashes = request.block_hashes
        coord = self.coordinator
        fa_manager = coord.single_type_managers[FULL_GROUP]
        fa_cls = type(fa_manager)

        def fa_lookup(drop: bool) -> int:
            if drop:
                # The coordinator looks one margin past the candidate, then drops.
                margin = eagle_proof_margin(
                    fa_manager.block_size,
                    coord.hash_block_size,
                    coord.enable_partial_hash_hits and fa_cls.supports_fine_grained_hash_lookup,
                )
                length = min(max_len + margin, len(hashes) * coord.hash_block_size)
            else:
                length = max_len
            _, hit = fa_cls.find_longest_cache_hit(
                block_hashes=hashes,
                max_length=length,
                kv_cache_group_ids=[FULL_GROUP],
                block_pool=fa_manager.block_pool,
                kv_cache_spec=fa_manager.kv_cache_spec,
                drop_eagle_block=drop,
                alignment_tokens=coord._cache_hit_alignment_tokens,
                dcp_world_size=1,
                pcp_world_size=1,
            )
            return hit

        _, hit, _ = coord.find_longest_cache_hit(hashes, max_len)
        return Boundaries(
            fa_match=fa_lookup(False),
            fa_eagle=fa_lookup(bool(self.geo.num_spec)),
            hit=hit,
        )

    # -- driving ----------------------------------------------------------
    def run(self, tokens: list[int], max_tokens: int = 1) -> ResumeRecord:
        """Submit a prompt, run it to completion, return where it resumed from."""
        request = self.make_request(tokens, max_tokens)
        self.scheduler.add_request(request)
        record: ResumeRecord | None = None
        ends: list[int] = []
        for _ in range(10_000):
            if request.is_finished():
                break
            out = self.scheduler.schedule()
            self.ledger.apply_copies(out.kv_cache_block_copies)
            sampled: list[list[int]] = []
            for new in out.scheduled_new_reqs:
                if new.req_id == request.request_id:
                    record = self._resume_record(request, new.num_computed_tokens)
            self.record_writes(out)
            for req_id in out.num_scheduled_tokens:
                req = self.scheduler.requests[req_id]
                # schedule() has already advanced num_computed_tokens.
                end = req.num_computed_tokens
                if end <= req.num_prompt_tokens:
                    ends.append(end)
                sampled.append([self.reply_token(req)] if end >= req.num_tokens else [])
            self.scheduler.update_from_output(out, self._runner_output(out, sampled))
        else:
            raise RuntimeError(f"request {request.request_id} did not finish")
        assert record is not None
        record.prompt = tuple(request.prompt_token_ids)
        record.output = tuple(request.output_token_ids)
        record.final_computed = request.num_computed_tokens
        self.chunk_ends[request.request_id] = ends
        return record

    def drive(self, arrivals) -> list:
        """Run many requests at once (``kit.rig.stress.Arrival``: added before a given step),
        to completion; every resume and every prefill chunk is checked against the
        ledger. Returns the ``Violation`` list (empty: every state right)."""
        pending = sorted(arrivals, key=lambda a: a.step)
        live: list[Request] = []
        violations: list[Violation] = []

        def check(req: Request, step: int, kind: str, position: int) -> None:
            mamba_ids = self.manager.get_block_ids(req.request_id)[MAMBA_GROUP]
            held = self.ledger.prefix_of_block.get(mamba_ids[(position - 1) // self.geo.block])
            want = tuple(req.all_token_ids[:position])
            if held != want:
                violations.append(
                    Violation(
                        req.request_id,
                        step,
                        kind,
                        position,
                        None if held is None else len(held),
                        held is not None and want[: len(held)] == held,
                    )
                )

        for step in range(100_000):
            while pending and pending[0].step <= step:
                arrival = pending.pop(0)
                req = self.make_request(list(arrival.tokens), arrival.max_tokens)
                self.scheduler.add_request(req)
                live.append(req)
            if not pending and all(r.is_finished() for r in live):
                return violations
            out = self.scheduler.schedule()
            self.ledger.apply_copies(out.kv_cache_block_copies)
            resumed = {new.req_id for new in out.scheduled_new_reqs if new.num_computed_tokens}
            for req_id, n in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[req_id]
                start = req.num_computed_tokens - n
                if 0 < start < req.num_prompt_tokens:
                    check(req, step, "resume" if req_id in resumed else "chunk", start)
            self.record_writes(out)
            sampled = []
            for req_id in out.num_scheduled_tokens:
                req = self.scheduler.requests[req_id]
                done = req.num_computed_tokens >= req.num_tokens
                sampled.append([self.reply_token(req)] if done else [])
            self.scheduler.update_from_output(out, self._runner_output(out, sampled))
        raise RuntimeError("requests did not finish in 100,000 steps")

    def _runner_output(self, out, sampled: list[list[int]]) -> ModelRunnerOutput:
        ids = list(out.num_scheduled_tokens)
        fields = {
            "req_ids": ids,
            "req_id_to_index": {rid: i for i, rid in enumerate(ids)},
            "sampled_token_ids": sampled,
            "logprobs": None,
            "prompt_logprobs_dict": {},
            "pooler_output": [],
            # The fix's exports the worker wrote in this step (trees that key
            # them only once reported: publish after write).
            "mamba_checkpoint_exports_written": self.written_fix_exports(out),
        }
        # 0.34.0 dropped req_id_to_index; pass what this release declares.
        declared = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        return ModelRunnerOutput(**{k: v for k, v in fields.items() if k in declared})

    def record_writes(self, out) -> None:
        """The Mamba states one step writes: internal checkpoints, then each running state."""
        rows = [
            (
                self.scheduler.requests[req_id],
                n,
                self.manager.get_block_ids(req_id)[MAMBA_GROUP],
            )
            for req_id, n in out.num_scheduled_tokens.items()
        ]
        self._written = []
        if self.exporter is not None:
            step_exports = getattr(out, "mamba_checkpoint_exports", None)
            for req_id, groups in (step_exports or {}).items():
                positions = [p for p, _ in groups.get(MAMBA_GROUP, ())]
                self.fix_exports.setdefault(req_id, []).extend(positions)
            for req, block_id, position in self.exporter.exports(rows, step_exports):
                self.ledger.record_export(req, block_id, position)
                self.exports.setdefault(req.request_id, []).append(position)
                self._written.append((req.request_id, position, block_id))
        for req, _, mamba_ids in rows:
            # schedule() has already advanced num_computed_tokens.
            self.ledger.record_step(req, mamba_ids, req.num_computed_tokens)

    def written_fix_exports(self, out) -> dict[str, list[int]] | None:
        """Of the step's ``mamba_checkpoint_exports``, the positions the builder
        wrote (``record_writes`` ran the step), per request, as a worker reports them:
        a dict for every step with exports (None: a runner that does not report)."""
        planned = getattr(out, "mamba_checkpoint_exports", None) or {}
        written: dict[str, list[int]] = {}
        for req_id, position, block_id in self._written:
            if (position, block_id) in planned.get(req_id, {}).get(MAMBA_GROUP, ()):
                written.setdefault(req_id, []).append(position)
        return written if planned else None

    def _resume_record(self, req: Request, hit: int) -> ResumeRecord:
        prefix = None
        if hit:
            mamba_ids = self.manager.get_block_ids(req.request_id)[MAMBA_GROUP]
            prefix = self.ledger.prefix_of_block.get(mamba_ids[(hit - 1) // self.geo.block])
        return ResumeRecord(req.request_id, hit, prefix)

    @staticmethod
    def reply_token(req: Request) -> int:
        """Deterministic simulated sample: distinct per position, never EOS."""
        return 3000 + req.num_tokens % 997

    def keyed_positions_of(self, request_id: str, group: int) -> list[int]:
        """Distinct positions a request keyed through ``cache_partial_block`` in a
        group, block boundaries included (where the fix exports a boundary's state
        into a block of its own, it is keyed so: ``partial_entries_of`` leaves it out)."""
        return sorted({n for rid, g, n in self.partial_entries if rid == request_id and g == group})

    def mamba_states_keyed_at(self, tokens: list[int], position: int) -> list[tuple[int, ...]]:
        """What every Mamba block keyed at ``position`` of ``tokens`` holds, as the
        ledger's token prefix: exactly ``[tokens[:position]]`` when the key is right
        and held once (no stale block under the same key)."""
        key = make_block_hash_with_group_id(
            self.make_request(tokens).block_hashes[position // self.geo.unit - 1], 1
        )
        pool = self.scheduler.kv_cache_manager.block_pool
        return [
            self.ledger.prefix_of_block.get(block.block_id, ())
            for block in pool.blocks
            if pool.cached_block_hash_to_block.contain(key, block.block_id)
        ]

    def partial_entries_of(self, request_id: str, group: int) -> list[int]:
        """Distinct sub-block positions a request registered in a group."""
        return sorted(
            {
                n
                for rid, g, n in self.partial_entries
                if rid == request_id and g == group and n % self.geo.block
            }
        )


def run_case(
    model_dir: Path,
    case: Case,
    fix: bool = False,
    lookahead_hashes: bool = True,
    mamba_spec: MambaSpec | None = None,
    retention: int | None = DENSE,
) -> tuple[SchedulerRig, ResumeRecord, ResumeRecord, Boundaries]:
    """Run producer A to completion, measure B's per-group boundaries, then run B.

    ``fix`` turns on the patched tree's switch; on the unpatched tree it fails loudly.
    ``retention``: ``prefix_cache_retention_interval`` (None: dense, the default).
    """
    return run_pair(
        model_dir,
        case,
        *prompts(case),
        fix=fix,
        lookahead_hashes=lookahead_hashes,
        mamba_spec=mamba_spec,
        retention=retention,
    )


def run_pair(
    model_dir: Path,
    case: Case,
    a_tokens: list[int],
    b_tokens: list[int],
    fix: bool = False,
    lookahead_hashes: bool = True,
    mamba_spec: MambaSpec | None = None,
    retention: int | None = DENSE,
) -> tuple[SchedulerRig, ResumeRecord, ResumeRecord, Boundaries]:
    """``run_case`` for prompts other than the grid's: the case gives the cache geometry."""
    rig = SchedulerRig(
        model_dir,
        case.geometry,
        fix=fix,
        lookahead_hashes=lookahead_hashes,
        mamba_spec=mamba_spec,
        retention=retention,
    )
    a = rig.run(a_tokens)
    bounds = rig.boundaries(b_tokens)
    b = rig.run(b_tokens)
    return rig, a, b, bounds


def cache_geometry(rig: SchedulerRig) -> dict[str, object]:
    """Block sizes, page sizes and block counts as the real scheduler and manager hold them."""
    coord = rig.coordinator
    return {
        "scheduler_block_size": rig.scheduler.block_size,
        "hash_block_size": rig.scheduler.hash_block_size,
        "coordinator_block_size": coord.scheduler_block_size,
        "group_block_sizes": [m.block_size for m in coord.single_type_managers],
        "page_sizes": [
            g.kv_cache_spec.page_size_bytes for g in rig.kv_cache_config.kv_cache_groups
        ],
        "num_blocks": rig.manager.block_pool.num_gpu_blocks,
        "partial_hash_hits": coord.enable_partial_hash_hits,
    }
