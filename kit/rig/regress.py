"""`make regress [VLLM=<release>]`: the geometry grid on every tree of one vLLM release.

One path for every release pins.toml names, the pinned one included: its trees by
stage (``kit.vllm_tree.releases.trees_of``: stock, unpatched and, where a fix is
made for the release, patched), each measured in a process of its own (vLLM is
imported once per process; ``measure`` is that process's work), in every
checkpoint regime and with every hashing the release has:

- ``lookahead``: a release's default hashing where each key also covers the L tokens
  the drafter reads past it (no one-unit drop for EAGLE/MTP);
- ``legacy``: no lookahead tokens (``hash_lookahead`` 0): a release's default where
  it has no lookahead hashes, else ``disable_lookahead_block_hashes`` (what KV
  connectors get). Which a release has is read from what it measures, never from
  its name.

Columns are ``<stage>/<hashing>``, the stock tree's ``stock/<hashing>``. Each
case's cell in a column has one verdict, the same words for every release:

- ``ok``: the follow-up resumed at the ideal: the last hash boundary B shares,
  less EAGLE's unit with legacy hashes, including the L lookahead tokens with
  lookahead hashes (``lookahead_ideal``);
- ``loss``: below the ideal, where the geometry model (``expected``) puts it;
- ``DIFFERS``: a hit the geometry model does not predict for that tree (with its
  switch: patched or not, read from the tree's mods) and hashing;
- ``STALE STATE``: B resumed from a state not made by its own prefix.

Two words against the ideal and two failures, because a table is read for two
things: where each tree stands against what is possible (ok/loss), and whether
the measurement is to be trusted (DIFFERS/STALE STATE, in capitals so they stand
out). The stock tree (the release as installed) is not what the model describes
(the model is of the unpatched tree, which carries the defect fixes): it gets
``ok``/``loss``/``STALE STATE`` and is compared with unpatched case by case
(``stock_against_unpatched``), and never fails the run.

Beside the verdicts, per hashing: the fix's effect on each case, patched against
unpatched (``fix_effect``: ``fixed`` unpatched below the ideal and patched at it,
``better`` higher but short of it, ``same``, ``WORSE``); the EAGLE-specific loss
(the hit without speculation, less what EAGLE is entitled to, minus the hit); a
conversation's later turns (``kit.rig.later_turns``); and whether the cache
geometry (``sched_harness.cache_geometry``: block and page sizes, block counts) is
the same on every tree.

One failure rule (``failures``): the run fails (exit 1) on a ``DIFFERS`` or
``STALE STATE`` on unpatched or patched, a case the fix makes ``WORSE``, a later
turn that is not ``ok``, or a cache geometry that is not the same on every tree.

Prefix-cache retention (vLLM's ``prefix_cache_retention_interval``, docs/retention.md)
is one more dimension (``--retention``, ``make regress RETENTION=``): ``dense``
(``DEFAULT_RETENTION``, every committed table before it: every block state a chunk
end reaches), ``0`` (``vllm serve``'s default: replay boundaries only) or ``N``
(every N blocks of each case's block size: the grid's blocks differ, and vLLM takes
only a multiple of the block). Each row records the interval it ran at and the
verdicts read it; the later turns stay dense whatever the grid's (their table says so).

Results: ``regression.json`` and ``regression.md`` per regime and ``grid.png``
under ``--out`` (default ``results/regression/``, a release other than the pinned
one in its ``<release>/`` folder, a retention other than the default in a
``retention-<0|N-blocks>/`` folder below that: ``releases.regression_dir``); the
split regime at the top, the internal ones in ``internal-1/`` and ``internal-grid/``. Where the
patched tree moves a backend from the split path into the pass, the split table
also pairs the two regimes as its users meet them (``kit.rig.moved_to_pass``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from kit import schema
from kit.geometry.geometry_cases import all_cases
from kit.geometry.geometry_model import Case, expected, lookahead_ideal
from kit.paths import ROOT
from kit.rig import later_turns
from kit.vllm_tree import pins, releases, trees

HASHINGS = ("lookahead", "legacy")
STOCK_LABEL = "stock"
FAILING = ("DIFFERS", "STALE STATE")

# The grid's prefix-cache retention when `make regress` is not told one: dense, as
# every committed table before retention was a dimension (docs/retention.md). A
# retention is None (dense), 0 (vllm serve's default) or N > 0: every N blocks.
DEFAULT_RETENTION: int | None = None
DENSE_WORD = "dense"


class RetentionError(ValueError):
    """A retention `make regress` cannot run: printed as one line, exit status 2."""

    exit_code = 2


def parse_retention(text: str) -> int | None:
    """``--retention``'s word: ``dense`` -> None, ``0`` -> 0, ``N`` -> N (blocks)."""
    word = text.strip().lower()
    if word == DENSE_WORD:
        return None
    if word.isdecimal() and word.isascii():
        return int(word)
    raise RetentionError(
        f"retention {text!r}: give 0 (vllm serve's default), dense, or a positive "
        "number of blocks N (an interval of every N blocks), e.g. RETENTION=0"
    )


def retention_interval(retention: int | None, block: int) -> int | None:
    """vLLM's ``prefix_cache_retention_interval`` for a case of block size ``block``."""
    return retention * block if retention else retention


def retention_text(retention: int | None) -> str:
    """A retention in words, as the tables name it."""
    if retention is None:
        return "dense (every block state a chunk end reaches)"
    if retention == 0:
        return "0 (vllm serve's default: replay boundaries only)"
    return f"every {retention} blocks (interval {retention} x the case's block size)"


def measure(
    model_dir: Path,
    fix: bool,
    lookahead_hashes: bool = True,
    checkpoints: str = "split",
    retention: int | None = DEFAULT_RETENTION,
) -> dict:
    """Run in a process whose ``vllm`` is the tree under test (``trees.prepare`` done);
    ``checkpoints``: the regime; ``retention``: the grid's prefix-cache retention
    (None, the default: dense, as every committed table; 0: ``vllm serve``'s default;
    N > 0: every N blocks, ``retention_interval``; docs/retention.md). Each row
    records vLLM's ``prefix_cache_retention_interval`` it ran at, and the verdicts
    read it (the geometry model's ``retention``); the later turns stay dense."""
    import vllm

    from kit.rig.sched_harness import cache_geometry, run_case, tree_exports_block_boundary

    rows = {}
    geometry = {}
    boundary = tree_exports_block_boundary()
    for case_id, case in all_cases(checkpoints):
        interval = retention_interval(retention, case.block)
        rig, a, b, bounds = run_case(
            model_dir, case, fix=fix, lookahead_hashes=lookahead_hashes, retention=interval
        )
        rows[case_id] = {
            "a_chunk_ends": rig.chunk_ends[a.request_id],
            # B's engine steps from its hit: a follow-up's cost in steps.
            "b_chunk_ends": rig.chunk_ends[b.request_id],
            "b_len": len(b.prompt),
            "fa_match": bounds.fa_match,
            "fa_eagle": bounds.fa_eagle,
            "hit": b.hit,
            "state_ok": b.resumed_from_own_prefix(),
            "fa_partials": rig.partial_entries_of(a.request_id, 0),
            "mamba_partials": rig.partial_entries_of(a.request_id, 1),
            "hash_lookahead": getattr(rig.vllm_config, "num_hash_lookahead_tokens", 0),
            # Whether the layer took the fix's states as exports (else chunk ends).
            "layer_extra_exports": bool(
                getattr(
                    rig.kv_cache_config.kv_cache_groups[1].kv_cache_spec,
                    "prefill_checkpoint_extra_exports",
                    False,
                )
            ),
            # Whether the fix exports the last block boundary (else only a chunk end).
            "fix_exports_block_boundary": boundary,
        }
        if interval is not None:
            rows[case_id]["retention"] = interval
        geometry[f"B{case.block}-k{case.num_spec}"] = cache_geometry(rig)
    return {
        "vllm_file": vllm.__file__,
        "checkpoints": checkpoints,
        "retention": retention,
        "rows": rows,
        "geometry": geometry,
        # Dense whatever the grid's retention (later_turns.RETENTION).
        "later_turns": later_turns.measure(model_dir, fix, lookahead_hashes, checkpoints),
    }


def tree_record(tree: trees.Tree) -> dict:
    """What a table says of the tree a measurement ran on."""
    return {
        "stage": tree.name,
        "release": tree.release,
        "patched": tree.patched,
        "stock": tree.stock,
        "from_sdist": tree.from_sdist,
    }


def image_tree_record(stage: str, record: dict | None) -> dict:
    """``tree_record`` of an image's own vllm, from the image's record
    (``kit.images.image_stage``: release and mods)."""
    record = record or {}
    return {
        "stage": stage,
        "release": record.get("vllm_version"),
        "patched": trees.carries_fix([m["name"] for m in record.get("mods", [])]),
        "stock": False,
        "from_sdist": False,
    }


def figure_title(version: str, retention: int | None = DEFAULT_RETENTION) -> str:
    """``grid.png``'s title: the release, and a retention other than the default."""
    title = f"Follow-up resume per grid case, vLLM {version}"
    return (
        title
        if retention == DEFAULT_RETENTION
        else f"{title}, retention {retention_arg(retention)}"
    )


def retention_arg(retention: int | None) -> str:
    """``--retention``'s word for a retention (``parse_retention``'s inverse)."""
    return DENSE_WORD if retention is None else str(retention)


def measure_on(
    tree: trees.Tree,
    model_dir: Path,
    legacy_hashes: bool = False,
    checkpoints: str = "split",
    retention: int | None = DEFAULT_RETENTION,
) -> dict:
    """Every geometry, measured in a subprocess that imports exactly this tree's vllm and
    is told on its command line what the tree is (``Tree.child_args``: the fix's switch
    on a patched tree, the release plugin on a tree from an sdist)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kit.rig.regress_cli", "measure"]
        cmd += ["--model-dir", str(model_dir), "--out", out.name, "--checkpoints", checkpoints]
        cmd += [f"--retention={retention_arg(retention)}"]
        cmd += tree.child_args()
        cmd += ["--legacy-hashes"] if legacy_hashes else []
        subprocess.run(cmd, check=True, env=tree.env(VLLM_LOGGING_LEVEL="ERROR"), cwd=ROOT)
        data = schema.unstamp("regress-measure", json.loads(Path(out.name).read_text()), out.name)
    if not data["vllm_file"].startswith(str(tree.package)):
        raise RuntimeError(f"{tree}: measured {data['vllm_file']}, not this tree")
    if data.get("retention") != retention:
        raise RuntimeError(f"{tree}: measured retention {data.get('retention')}, not {retention}")
    data["mods_record"] = tree.mods_record()
    data["tree"] = tree_record(tree)
    return data


def measure_many(
    runs: dict[Hashable, tuple[trees.Tree, bool, str]],
    model_dir: Path,
    retention: int | None = DEFAULT_RETENTION,
) -> dict[Hashable, dict]:
    """``measure_on(tree, model_dir, legacy_hashes, checkpoints, retention)`` for each key,
    as many at once as there are cores: each is its own single-threaded process."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = {
            key: pool.submit(measure_on, tree, model_dir, legacy, regime, retention)
            for key, (tree, legacy, regime) in runs.items()
        }
        return {key: job.result() for key, job in jobs.items()}


def hashing_of(data: dict) -> str:
    """The hashing a measurement ran with, as it measured: lookahead tokens or none."""
    return "lookahead" if any(r["hash_lookahead"] for r in data["rows"].values()) else "legacy"


def eagle_specific_loss(
    case: Case, hit: int, hit_without_spec: int, lookahead: int = 0
) -> int | None:
    """What speculation alone costs: (the same A and B without it, less what EAGLE
    is entitled to) - hit.

    None without speculation. With legacy hashes EAGLE is entitled to drop one
    unit; with lookahead hashes to stop at the last boundary B shares together
    with its lookahead tokens. Anything beyond is lost only because drafting is on.
    """
    if not case.eagle:
        return None
    ideal = lookahead_ideal(case, lookahead)
    return loss_beyond_entitlement(hit, hit_without_spec, ideal, case.unit, bool(lookahead))


def loss_beyond_entitlement(
    hit: int, hit_without_spec: int, ideal: int, unit: int, lookahead: bool
) -> int:
    """``eagle_specific_loss`` of a speculative case, from its ideal (which carries
    the lookahead) and unit: for a table's cells, whose case is not at hand."""
    if lookahead:
        return min(hit_without_spec, ideal) - hit
    return max(hit_without_spec - unit, 0) - hit


def without_speculation() -> dict[str, str]:
    """Each case id -> the id of the same geometry with k = 0."""
    cases = all_cases()
    plain = {(c.block, c.shared, c.tail): cid for cid, c in cases if c.num_spec == 0}
    return {cid: plain[(c.block, c.shared, c.tail)] for cid, c in cases}


def loss_totals(losses: list[int | None]) -> dict[str, int]:
    """Cases that lose tokens to speculation alone, and how many tokens in all."""
    return {
        "cases": sum((x or 0) > 0 for x in losses),
        "tokens": sum(max(x or 0, 0) for x in losses),
    }


def as_measured(case: Case, row: dict) -> Case:
    """The case with the layer the rig declared: a release whose builder writes no
    extra states takes the fix's states as chunk ends."""
    extra = row.get("layer_extra_exports", case.geometry.layer_extra_exports)
    boundary = row.get("fix_exports_block_boundary", case.geometry.fix_exports_block_boundary)
    return replace(
        case,
        geometry=replace(
            case.geometry, layer_extra_exports=extra, fix_exports_block_boundary=boundary
        ),
    )


def verdict(case: Case, row: dict, patched: bool | None) -> str:
    """One cell's verdict; ``patched`` None: a stock tree, which the model does not describe."""
    if not row["state_ok"]:
        return "STALE STATE"
    lookahead = row["hash_lookahead"]
    if (
        patched is not None
        and row["hit"]
        != expected(as_measured(case, row), patched, lookahead, row.get("retention")).hit
    ):
        return "DIFFERS"
    return "ok" if row["hit"] >= lookahead_ideal(case, lookahead) else "loss"


def fix_effect(ideal: int, unpatched: int, patched: int) -> str:
    """The patched tree's hit against the unpatched tree's, in one case."""
    if patched < unpatched:
        return "WORSE"
    if unpatched < ideal <= patched:
        return "fixed"
    return "better" if patched > unpatched else "same"


def column(data: dict, hashing: str) -> str:
    tree = data["tree"]
    return f"{STOCK_LABEL if tree['stock'] else tree['stage']}/{hashing}"


def _roles(measured: dict[tuple[str, str], dict], hashing: str) -> dict[str, dict]:
    """The trees of one hashing by what they are (read from the trees, not their names):
    ``stock``, ``base`` (the modelled tree without the fix) and ``fix``."""
    roles = {}
    for (_, h), data in measured.items():
        if h != hashing:
            continue
        tree = data["tree"]
        roles["stock" if tree["stock"] else "fix" if tree["patched"] else "base"] = data
    return roles


def build(version: str, measured: dict[tuple[str, str], dict], checkpoints: str = "split") -> dict:
    """The table of one release and regime from its measurements, keyed (stage, hashing)."""
    cases = all_cases(checkpoints)
    plain_of = without_speculation()
    hashings = [h for h in HASHINGS if any(key[1] == h for key in measured)]
    roles = {h: _roles(measured, h) for h in hashings}
    paired = [h for h in hashings if {"base", "fix"} <= set(roles[h])]
    rows = []
    for case_id, case in cases:
        line: dict = {
            "case": case_id,
            "B_phys": case.block,
            "S": case.shared,
            "S_mod_H": case.shared % case.unit,
            "k": case.num_spec,
            "U": case.tail,
        }
        for (_, hashing), data in measured.items():
            row = data["rows"][case_id]
            tree = data["tree"]
            base = data["rows"][plain_of[case_id]]["hit"]
            patched = None if tree["stock"] else tree["patched"]
            cell = {
                "hit": row["hit"],
                "ideal": lookahead_ideal(case, row["hash_lookahead"]),
                "fa": [row["fa_match"], row["fa_eagle"]],
                "eagle_loss": eagle_specific_loss(case, row["hit"], base, row["hash_lookahead"]),
                # A's engine steps: its chunk ends (a cold prompt's cost in steps).
                "a_steps": len(row["a_chunk_ends"]),
                "verdict": verdict(case, row, patched),
            }
            if "b_chunk_ends" in row:  # measured before B's steps were recorded: none
                cell["b_steps"] = len(row["b_chunk_ends"])
                cell["b_len"] = row["b_len"]
            if patched is not None:
                model = expected(
                    as_measured(case, row), patched, row["hash_lookahead"], row.get("retention")
                )
                cell["expected"] = model.hit
            line[column(data, hashing)] = cell
        for hashing in paired:
            u = roles[hashing]["base"]["rows"][case_id]
            p = roles[hashing]["fix"]["rows"][case_id]
            ideal = lookahead_ideal(case, u["hash_lookahead"])
            line[f"fix_effect/{hashing}"] = fix_effect(ideal, u["hit"], p["hit"])
        rows.append(line)
    modelled = [column(d, h) for (_, h), d in measured.items() if not d["tree"]["stock"]]
    stock = [column(d, h) for (_, h), d in measured.items() if d["tree"]["stock"]]
    later = {
        h: later_turns.verdicts(roles[h]["base"]["later_turns"], roles[h]["fix"]["later_turns"])
        for h in paired
    }
    geometries = {column(d, h): d["geometry"] for (_, h), d in measured.items()}
    first = next(iter(geometries.values()))
    # Read from what was measured (a measurement from before retention was a
    # dimension has none: dense).
    retentions = {d.get("retention", DEFAULT_RETENTION) for d in measured.values()}
    if len(retentions) != 1:
        raise RuntimeError(
            f"the trees measured different retentions: {sorted(map(str, retentions))}"
        )
    return {
        "vllm_version": version,
        "checkpoints": checkpoints,
        # None: dense; 0: vllm serve's default; N: every N blocks (each row's "retention":
        # the interval in tokens). The later turns: later_turns.RETENTION.
        "retention": retentions.pop(),
        "later_turns_retention": later_turns.RETENTION,
        "from_sdist": releases.from_sdist(version),
        "sdist_sha256": releases.release_pins(version)["sdist_sha256"],
        "hashings": hashings,
        "trees": {d["tree"]["stage"]: d["tree"] for d in measured.values()},
        "mods": {
            d["tree"]["stage"]: [m["name"] for m in d["mods_record"]["mods"]]
            for d in measured.values()
        },
        "unit": cases[0][1].unit,
        "rows": rows,
        "summary": {k: dict(Counter(r[k]["verdict"] for r in rows)) for k in modelled},
        "stock": {k: dict(Counter(r[k]["verdict"] for r in rows)) for k in stock},
        "stock_against_unpatched": {
            h: _stock_against_unpatched(rows, roles[h], h)
            for h in hashings
            if {"stock", "base"} <= set(roles[h])
        },
        "fix_effect": {h: dict(Counter(r[f"fix_effect/{h}"] for r in rows)) for h in paired},
        "eagle_specific_loss": {
            k: loss_totals([r[k]["eagle_loss"] for r in rows]) for k in modelled
        },
        "resumed_steps": {k: resumed_steps(rows, k) for k in modelled},
        "cold_extra_steps": {
            h: cold_extra_steps(rows, column(roles[h]["base"], h), column(roles[h]["fix"], h))
            for h in paired
        },
        "later_turns": later,
        "later_turns_summary": {h: later_turns.summary(rows) for h, rows in later.items()},
        "geometry_identical": all(g == first for g in geometries.values()),
        "geometry_differs": sorted(k for k, g in geometries.items() if g != first),
        "geometry": first,
        "run": {
            "trees": {d["tree"]["stage"]: d["mods_record"] for d in measured.values()},
            "pins_sha256": pins.file_sha256(),
        },
    }


def resumed_steps(rows: list[dict], col: str) -> dict[str, int]:
    """Engine steps of every speculative case's follow-up B that resumed inside a
    block (the fix is on only under EAGLE/MTP): how many took one, and how many
    took more while the rest of B stays in the block it resumed in (the prompt
    checkpoint's stop, which the fix's in-pass export removes where the layer
    exports) or crosses a block boundary (the mid-block stop: the boundary
    state needs a chunk end). Empty for a table measured before B's steps."""
    out = {"one_step": 0, "more_within_block": 0, "more_across_boundary": 0}
    for r in rows:
        cell = r[col]
        hit, block = cell["hit"], r["B_phys"]
        if "b_steps" not in cell:
            return {}
        if not r["k"] or not hit % block:
            continue
        if cell["b_steps"] == 1:
            out["one_step"] += 1
        elif (hit // block + 1) * block >= cell["b_len"]:
            out["more_within_block"] += 1
        else:
            out["more_across_boundary"] += 1
    return out


def cold_extra_steps(rows: list[dict], base: str, fix: str) -> dict[str, int]:
    """Engine steps the fix adds to a cold prompt (producer A), over the grid: the
    most in one case and in how many cases it adds any."""
    extra = [r[fix]["a_steps"] - r[base]["a_steps"] for r in rows]
    return {"max": max(extra, default=0), "cases": sum(e > 0 for e in extra)}


def _stock_against_unpatched(rows: list[dict], role: dict[str, dict], hashing: str) -> dict:
    """Where the stock tree resumes other than the unpatched one (the model's tree)."""
    stock, base = column(role["stock"], hashing), column(role["base"], hashing)
    differs = [r["case"] for r in rows if r[stock]["hit"] != r[base]["hit"]]
    return {"same": len(rows) - len(differs), "differs": differs}


def failures(report: dict) -> list[str]:
    """The one failure rule, every release: what fails the run (empty: it passes)."""
    found = [
        f"{key}: {count} {word}"
        for key, summary in report["summary"].items()
        for word, count in summary.items()
        if word in FAILING
    ]
    found += [
        f"fix effect, {h} hashes: {effects['WORSE']} WORSE"
        for h, effects in report["fix_effect"].items()
        if effects.get("WORSE")
    ]
    found += [
        f"later turns, {h} hashes: {summary}"
        for h, summary in report["later_turns_summary"].items()
        if set(summary) - {"ok"}
    ]
    if not report["geometry_identical"]:
        found.append(f"cache geometry differs on {', '.join(report['geometry_differs'])}")
    return found


REGIME_NOTE = (
    "Checkpoint regimes: `split` = the scheduler ends a prefill chunk where a Mamba/GDN "
    "state is kept (Qwen GDN on every GDN backend until the release whose FlashInfer GDN "
    "exports states; from it every other GDN backend without the fix's exports); "
    "`internal-1` = the layer exports the state from inside one forward pass at "
    "any offset (Mamba2, e.g. Nemotron-H); `internal-grid` = the same on lcm(H, 64) (Qwen "
    "GDN on FlashInfer, on Hopper, Blackwell and GB10, from the release whose FlashInfer GDN "
    "exports states; Triton, HIP, CuteDSL, AITER FlyDSL, XPU SYCL and CPU GDN with "
    "fix-eagle-fine-prefix-exports, the fix on and EAGLE/MTP)."
)

READING = (
    "Verdicts per cell (every release alike): `ok` = resumed at the ideal (the last hash "
    "boundary B shares, less EAGLE's unit with legacy hashes, including the lookahead "
    "tokens with lookahead hashes); `loss` = below it, where the geometry model puts it; "
    "`DIFFERS` = a hit the geometry model does not predict for that tree and hashing; "
    "`STALE STATE` = B resumed from a state not made by its own prefix. Stock (the release "
    "as installed, no mod) is not what the model describes and is compared with unpatched "
    "instead. The run fails on DIFFERS or STALE STATE on unpatched or patched, a case the "
    "fix makes WORSE, a later turn that is not ok, or a cache geometry that differs between "
    "trees. `eagle_loss` = (the same A and B without speculation, less what EAGLE is "
    "entitled to) - hit: what speculation alone costs."
)


def regime_dir(out: Path, regime: str) -> Path:
    """The split tables at the top of a release's folder; the internal ones beside them."""
    return out if regime == "split" else out / regime


def table_columns(report: dict) -> list[str]:
    """The table's tree columns, stock first."""
    return [*report["stock"], *report["summary"]]


def terminal_table(report: dict) -> list[list]:
    """One line per case: its hits (ideal) and verdicts per column."""
    keys = table_columns(report)
    return [
        [r["case"]]
        + [f"{r[k]['hit']} ({r[k]['ideal']})" for k in keys]
        + [r[k]["verdict"] for k in keys]
        + [r.get(f"fix_effect/{h}", "-") for h in report["fix_effect"]]
        for r in report["rows"]
    ]


def table_headers(report: dict) -> list[str]:
    keys = table_columns(report)
    return [
        "case",
        *(f"{k} hit (ideal)" for k in keys),
        *keys,
        *(f"fix effect/{h}" for h in report["fix_effect"]),
    ]


def render(report: dict, sections: Sequence[str] = ()) -> str:
    """The table as Markdown, then ``sections``' lines (a view built beside it)."""
    from tabulate import tabulate

    source = (
        f"from its sdist (sha256 {report['sdist_sha256'][:12]})"
        if report["from_sdist"]
        else "the .venv's CPU wheel"
    )
    mods_line = "; ".join(
        f"{STOCK_LABEL if report['trees'][stage]['stock'] else stage}: {', '.join(names) or 'none'}"
        for stage, names in report["mods"].items()
    )
    if not any(t["patched"] for t in report["trees"].values()):
        mods_line += " (no fix made for this release: unpatched only)"
    retention = report.get("retention", DEFAULT_RETENTION)
    later_retention = report.get("later_turns_retention", later_turns.RETENTION)
    return "\n".join(
        [
            f"# Regression on vLLM {report['vllm_version']} ({source}), checkpoint regime "
            f"`{report['checkpoints']}`, retention {retention_arg(retention)}",
            "",
            f"Prefix-cache retention (`prefix_cache_retention_interval`, docs/retention.md): "
            f"the grid at {retention_text(retention)}; the later turns at "
            f"{retention_text(later_retention)}.",
            "",
            READING,
            "",
            REGIME_NOTE,
            "",
            f"H = {report['unit']}. Hashings measured: {', '.join(report['hashings'])}.",
            "",
            f"Mods: {mods_line}.",
            "",
            f"Summary: {report['summary']}",
            "",
            f"Fix effect (patched against unpatched): {report['fix_effect']}",
            "",
            f"Stock: {report['stock']}; against unpatched: "
            + str(
                {
                    h: {"same": s["same"], "differs": len(s["differs"])}
                    for h, s in report["stock_against_unpatched"].items()
                }
            ),
            "",
            f"EAGLE-specific loss (cases, tokens): {report['eagle_specific_loss']}",
            "",
            "Engine steps the fix adds to a cold prompt (A's chunk ends, patched minus "
            f"unpatched; most in one case, cases with any): {report['cold_extra_steps']}",
            "",
            "Engine steps of a follow-up B that resumed inside a block, speculative cases "
            "(one; more with B's rest inside that block; more across a block boundary): "
            f"{report.get('resumed_steps', {})}",
            "",
            f"Cache geometry identical across trees: {report['geometry_identical']}.",
            "",
            tabulate(terminal_table(report), headers=table_headers(report), tablefmt="github"),
            "",
            *(
                line
                for hashing, rows in report["later_turns"].items()
                for line in later_turns.render(f"{hashing} hashes", rows)
            ),
            *(["", *sections] if sections else []),
        ]
    )
