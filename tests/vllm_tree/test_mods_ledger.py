"""mods/README.md's ledger against the mods' manifests: one row per mod directory,
its releases, targets, stages and files exactly as mod.toml says, and an upstream
status and a removal condition for each."""

from __future__ import annotations

from pathlib import Path

from kit.vllm_tree import mods

LEDGER = Path(__file__).resolve().parents[2] / "mods" / "README.md"
COLUMNS = [
    *("mod", "vLLM", "targets", "stages", "files"),
    *("why", "evidence", "upstream", "remove when"),
]


def ledger_rows() -> dict[str, dict[str, str]]:
    lines = LEDGER.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| mod |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == COLUMNS
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(COLUMNS), line[:80]
        row = dict(zip(COLUMNS, cells, strict=True))
        name = row["mod"].strip("`")
        assert name not in rows, f"{name} has two rows"
        rows[name] = row
    return rows


def test_every_mod_has_one_row_and_no_row_lacks_a_mod() -> None:
    assert sorted(ledger_rows()) == sorted(mods.available())


def test_each_row_says_what_the_manifest_says() -> None:
    for name, row in ledger_rows().items():
        manifest = mods.load_mod(name).manifest
        assert row["vLLM"] == ", ".join(manifest["vllm_version"]), name
        assert row["targets"] == ", ".join(manifest["targets"]), name
        assert row["stages"] == ", ".join(manifest["stages"]), name
        assert row["files"] == ", ".join(sorted(manifest["files"])), name


def test_each_row_has_an_upstream_status_and_a_removal_condition() -> None:
    for name, row in ledger_rows().items():
        for column in ("why", "evidence", "upstream", "remove when"):
            assert len(row[column]) > 10, f"{name}: the {column!r} column is empty"
