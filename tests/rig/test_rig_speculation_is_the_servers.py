"""The scheduler rig speculates as a ``vllm serve`` of the bench does.

Every regression case, stress run and table of ``make regress`` that concerns
EAGLE/MTP goes through ``SchedulerRig``, whose ``SpeculativeConfig`` is vLLM's
own (``kit/rig/sched_harness.py``). Two guards that it stays the server's:

- vLLM's own ``EngineArgs`` parse the CPU default's server arguments
  (``serve_args.cpu_serve_args``) into the config a server resolves; the rig's
  config for the same geometry must resolve the same speculation (method, draft
  tokens, EAGLE, block drop, lookahead hashes), hash unit, cache mode and, asked
  for the server's retention, the same retention.
- No test or kit module sets a speculation value a config resolves by hand (an
  attribute assignment or ``setattr`` on a scheduler, manager or config), so no
  case runs settings no server reaches.

Runs on whichever tree ``KIT_TREE`` picks (0.32.0's or 0.34.0's config code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kit.bench import serve_args
from kit.geometry.geometry_model import Geometry
from kit.rig.sched_harness import SchedulerRig

pytestmark = [pytest.mark.cpu, pytest.mark.tree]

ROOT = Path(__file__).resolve().parents[2]
# The server arguments vLLM's EngineArgs does not take: the API server's own.
FRONTEND_ONLY = ["--enable-prompt-tokens-details"]
# What a speculative config resolves, on any of the pinned releases.
SPECULATION_FIELDS = (
    "method",
    "num_speculative_tokens",
    "disable_eagle_block_drop",
    "disable_lookahead_block_hashes",
)
RESOLVED = (
    "use_eagle",
    "use_eagle_block_drop",
    "num_lookahead_tokens",
    "num_hash_lookahead_tokens",
    "num_prefill_lookahead",
    "num_prefill_lookahead_tokens",
    "num_speculative_tokens",
)
_SET_BY_HAND = re.compile(
    r"\.(?:" + "|".join(RESOLVED) + r")\s*=(?!=)"
    r"|setattr\([^,]+,\s*[\"'](?:" + "|".join(RESOLVED) + r")[\"']"
)


def _servers_config(model_dir: Path, num_spec: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = serve_args.cpu_serve_args(model_dir, 2048, 16, num_spec)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed, rest = parser.parse_known_args(args)
    assert rest == FRONTEND_ONLY, f"server arguments the engine would not see: {rest}"
    return EngineArgs.from_cli_args(parsed).create_engine_config()


@pytest.mark.parametrize(
    ("model", "num_spec"),
    [("tiny_model_dir", 1), ("tiny_model_dir", 3), ("tiny_multi_mtp_dir", 3)],
    ids=["mtp-k1", "mtp-k3", "three-mtp-modules-k3"],
)
def test_the_rig_resolves_the_servers_speculation(
    request: pytest.FixtureRequest, model: str, num_spec: int
) -> None:
    model_dir = request.getfixturevalue(model)
    server = _servers_config(model_dir, num_spec)
    retention = server.cache_config.prefix_cache_retention_interval
    rig = SchedulerRig(model_dir, Geometry(2048, 16, num_spec), retention=retention)
    ours = rig.vllm_config
    theirs, mine = server.speculative_config, ours.speculative_config
    assert type(mine) is type(theirs)
    for field in SPECULATION_FIELDS:
        assert getattr(mine, field, None) == getattr(theirs, field, None), field
    assert mine.use_eagle() == theirs.use_eagle()
    # What the config resolves from them, where the release has it.
    for resolved in ("num_hash_lookahead_tokens", "num_prefill_lookahead_tokens"):
        assert getattr(ours, resolved, None) == getattr(server, resolved, None), resolved
    for field in ("prefix_match_unit", "mamba_cache_mode", "prefix_cache_retention_interval"):
        assert getattr(ours.cache_config, field) == getattr(server.cache_config, field), field
    # The scheduler vLLM builds from the rig's config takes the drafter's lookahead.
    assert rig.scheduler.num_lookahead_tokens == num_spec


def test_no_speculation_value_is_set_by_hand() -> None:
    me = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("kit", "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != me
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _SET_BY_HAND.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "build a SpeculativeConfig instead:\n" + "\n".join(found)


def test_the_guard_sees_a_value_set_by_hand() -> None:
    assert _SET_BY_HAND.search("scheduler.use_eagle = True")
    assert _SET_BY_HAND.search('monkeypatch.setattr(sched, "num_lookahead_tokens", 3)')
    assert not _SET_BY_HAND.search("assert scheduler.use_eagle == True")
    assert not _SET_BY_HAND.search('getattr(cfg, "num_hash_lookahead_tokens", 0)')
