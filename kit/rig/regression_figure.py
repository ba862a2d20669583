"""The regression grid as a picture: one strip of cells per checkpoint path and tree.

Each cell is one grid case (in the table's order); its colour says how much of
the ideal the follow-up resumed at: green at the ideal, amber part of it, red
nothing (a case whose ideal is 0 is grey). Speculative cases that lose tokens
to speculation alone (the EAGLE-specific loss) get a dark mark under the cell.
Drawn from the committed ``regression.json`` tables, so it needs no vLLM:
``python -m kit.rig.regression_figure results/regression`` writes ``grid.png`` for
each release's tables: there and in each ``<release>/`` folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from kit.geometry.geometry_model import REGIMES
from kit.plot import BLACK, GREY, _font
from kit.rig.regress import DEFAULT_RETENTION, figure_title

GREEN = (60, 160, 80)
AMBER = (235, 170, 40)
RED = (205, 60, 50)
CELL_W, CELL_H, MARK_H, LABEL_W, GAP = 4, 18, 4, 230, 8


def _colour(hit: int, ideal: int) -> tuple[int, int, int]:
    if ideal <= 0:
        return GREY
    if hit >= ideal:
        return GREEN
    return AMBER if hit > 0 else RED


def strips_of(table: dict) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """(label, [(hit, ideal, eagle-specific loss?) per case]) for one regime's table:
    one strip per tree column (``<stage>/<hashing>``), every release alike."""
    rows = table["rows"]
    keys = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    return [
        (key, [(r[key]["hit"], r[key]["ideal"], (r[key]["eagle_loss"] or 0) > 0) for r in rows])
        for key in keys
    ]


def draw(title: str, panels: list[tuple[str, list]], path: Path) -> Path:
    """``panels``: (regime, strips) pairs; one block of strips per regime."""
    width = LABEL_W + max(len(s[1]) for _, strips in panels for s in strips) * CELL_W + 20
    strip_h = CELL_H + MARK_H + 4
    height = 60 + sum(22 + len(strips) * strip_h + GAP for _, strips in panels) + 40
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    pen.text((10, 10), title, fill=BLACK, font=_font(16))
    y = 40
    for regime, strips in panels:
        pen.text((10, y), f"checkpoint path: {regime}", fill=BLACK, font=_font(14))
        y += 22
        for label, cells in strips:
            pen.text((10, y + CELL_H // 2), label, fill=BLACK, font=_font(13), anchor="lm")
            for i, (hit, ideal, eagle_loss) in enumerate(cells):
                x = LABEL_W + i * CELL_W
                pen.rectangle([x, y, x + CELL_W - 1, y + CELL_H], fill=_colour(hit, ideal))
                if eagle_loss:
                    pen.rectangle(
                        [x, y + CELL_H + 1, x + CELL_W - 1, y + CELL_H + MARK_H], fill=BLACK
                    )
            y += strip_h
        y += GAP
    legend = "green: at the ideal   amber: part of it   red: nothing   grey: ideal 0   "
    legend += "black mark: lost to speculation alone"
    pen.text((10, y + 8), legend, fill=BLACK, font=_font(13))
    image.save(path)
    return path


def figure_for(folder: Path, title: str) -> Path | None:
    """``grid.png`` in ``folder`` from its split table and the internal ones beside it."""
    panels = []
    for regime in REGIMES:
        table = folder / ("" if regime == "split" else regime) / "regression.json"
        if table.is_file():
            panels.append((regime, strips_of(json.loads(table.read_text()))))
    if not panels:
        return None
    return draw(title, panels, folder / "grid.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tables", type=Path, help="results/regression")
    args = parser.parse_args(argv)
    if not (args.tables / "regression.json").is_file():
        print(f"error: no regression.json in {args.tables}; run make regress", file=sys.stderr)
        return 2
    folders = [args.tables]
    folders += sorted(
        p
        for p in args.tables.iterdir()
        if (p / "regression.json").is_file() and p.name not in REGIMES
    )
    written = []
    for folder in folders:
        table = json.loads((folder / "regression.json").read_text())
        title = figure_title(table["vllm_version"], table.get("retention", DEFAULT_RETENTION))
        written.append(figure_for(folder, title))
    for path in written:
        if path:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
