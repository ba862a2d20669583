"""The fix as a user of a GDN backend it moves into the pass meets it: split before, pass after.

``make regress`` compares the trees within one checkpoint regime. On a backend
whose prefill exports nothing from the pass (Triton/FLA, HIP, CuteDSL, AITER
FlyDSL, XPU's fused SYCL op, CPU GDN), the unpatched tree runs the split path; with
``MOVES_INTO_PASS`` in the patched tree, the fix switched on and EAGLE/MTP, the
same backend exports every kept state on the 64-token grid instead. Without
speculation the patched tree stays split (the mod's gate), so a k = 0 case is
patched split against unpatched split.

``build`` pairs the measurements ``make regress`` already made: the unpatched
tree's split rows against the patched tree's internal-grid rows (k > 0) or split
rows (k = 0), per hashing. It reports the engine steps the fix adds to a cold
prompt and to a later turn (the split path's chunk ends are what the pass saves),
the hits (``regress.fix_effect``), and the EAGLE-specific loss against the same
patched tree without speculation. ``failures``, as within a regime: a step the
fix adds, a case it makes ``WORSE``, a later turn's sibling resuming lower. One
prefill chunk keeps no state at the last block boundary below its prompt
checkpoint, where the split path ends a chunk (vLLM's own FlashInfer path makes
that trade), so the fix exports that boundary's state too; without it 10 grid
cases with lookahead hashes resume 16 tokens lower than unpatched.
"""

from __future__ import annotations

from collections import Counter

from kit.rig import regress

# The mod that moves Triton, HIP, CuteDSL, AITER FlyDSL, XPU SYCL and CPU GDN from
# the split path into the pass.
MOVES_INTO_PASS = "fix-eagle-fine-prefix-exports"
BEFORE, AFTER = "split", "internal-grid"


def applies(reports: dict[str, dict]) -> bool:
    """Whether ``reports`` (regime -> ``regress.build``'s report) hold both regimes
    and a patched tree that carries ``MOVES_INTO_PASS``."""
    return {BEFORE, AFTER} <= set(reports) and all(
        MOVES_INTO_PASS in reports[r]["mods"].get("patched", []) for r in (BEFORE, AFTER)
    )


def _later_turns(before: list[dict], after: list[dict]) -> dict:
    """A later turn's chunk ends and its sibling's hit, unpatched split against
    patched grid (``later_turns.verdicts`` rows of each regime)."""
    split = {(r["block"], r["num_spec"], r["user_len"]): r for r in before}
    extra, lower = [], []
    for row in after:
        base = split[(row["block"], row["num_spec"], row["user_len"])]
        name = f"B{row['block']}-k{row['num_spec']}-user{row['user_len']}"
        if row["chunk_ends_u_p"][1] > base["chunk_ends_u_p"][0]:
            extra.append(name)
        if row["sibling_hit_u_p"][1] < base["sibling_hit_u_p"][0]:
            lower.append(name)
    return {"turns": len(after), "extra_steps": extra, "sibling_lower": lower}


def build(reports: dict[str, dict]) -> dict:
    """The view, per hashing both regimes measured (``applies`` holds)."""
    before, after = reports[BEFORE], reports[AFTER]
    grid_rows = {r["case"]: r for r in after["rows"]}
    plain_of = regress.without_speculation()
    split_rows = {r["case"]: r for r in before["rows"]}
    view: dict = {"before": BEFORE, "after": AFTER, "hashings": {}}
    for hashing in before["fix_effect"]:
        if hashing not in after["fix_effect"]:
            continue
        u, p = f"unpatched/{hashing}", f"patched/{hashing}"
        effects: Counter = Counter()
        steps: Counter = Counter()
        worse, losses = [], []
        for row in before["rows"]:
            patched = (grid_rows[row["case"]] if row["k"] else row)[p]
            base = row[u]
            added = patched["a_steps"] - base["a_steps"]
            steps["added" if added > 0 else "saved" if added < 0 else "same"] += 1
            effect = regress.fix_effect(base["ideal"], base["hit"], patched["hit"])
            effects[effect] += 1
            if effect == "WORSE":
                worse.append(
                    {"case": row["case"], "unpatched": base["hit"], "patched": patched["hit"]}
                )
            if row["k"]:
                plain = split_rows[plain_of[row["case"]]][p]["hit"]
                losses.append(
                    regress.loss_beyond_entitlement(
                        patched["hit"],
                        plain,
                        patched["ideal"],
                        before["unit"],
                        hashing == "lookahead",
                    )
                )
        view["hashings"][hashing] = {
            "cold_steps": dict(steps),
            "fix_effect": dict(effects),
            "worse": worse,
            "eagle_specific_loss": regress.loss_totals(losses),
            "later_turns": _later_turns(
                before["later_turns"][hashing], after["later_turns"][hashing]
            ),
        }
    return view


def failures(view: dict) -> list[str]:
    """A cold prompt or a later turn the fix makes take an engine step more, a
    follow-up it makes resume lower, a later turn's sibling resuming lower."""
    found = []
    for hashing, part in view["hashings"].items():
        if part["worse"]:
            found.append(f"{hashing} hashes: {len(part['worse'])} WORSE: {part['worse']}")
        siblings = part["later_turns"]["sibling_lower"]
        if siblings:
            found.append(f"{hashing} hashes: later turns' siblings resume lower: {siblings}")
        added = part["cold_steps"].get("added")
        if added:
            found.append(f"{hashing} hashes: {added} cold prompts take a step more")
        turns = part["later_turns"]["extra_steps"]
        if turns:
            found.append(f"{hashing} hashes: later turns take a step more: {turns}")
    return found


def render(view: dict) -> list[str]:
    """The view as a Markdown section."""
    lines = [
        "## Triton, HIP, CuteDSL, AITER FlyDSL, XPU SYCL and CPU GDN: unpatched on the "
        "split path, patched in the pass",
        "",
        f"With `{MOVES_INTO_PASS}`, the fix on and EAGLE/MTP, these backends export every "
        f"kept state from the pass; unpatched they run the split path. Unpatched `{BEFORE}` "
        f"against patched `{AFTER}` (k = 0: patched `{BEFORE}`, the mod's gate). A step the "
        "fix adds, a WORSE hit or a sibling resuming lower fails the run.",
        "",
        "| hashing | cold prompts: steps fewer / same / more | fix effect "
        "| WORSE cases (unpatched → patched) | EAGLE-specific loss, patched (cases, tokens) "
        "| later turns: a step more / sibling lower |",
        "|---|---|---|---|---|---|",
    ]
    for hashing, part in view["hashings"].items():
        steps = part["cold_steps"]
        worse = ", ".join(f"{w['case']} ({w['unpatched']} → {w['patched']})" for w in part["worse"])
        loss = part["eagle_specific_loss"]
        turns = part["later_turns"]
        lines.append(
            f"| {hashing} "
            f"| {steps.get('saved', 0)} / {steps.get('same', 0)} / {steps.get('added', 0)} "
            f"| {part['fix_effect']} | {worse or 'none'} | {loss['cases']}, {loss['tokens']} "
            f"| {len(turns['extra_steps'])} / {len(turns['sibling_lower'])} of {turns['turns']} |"
        )
    return lines
