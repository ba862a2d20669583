"""A PNG of the TTFT summary: median bars with min-max whiskers, per request kind and tree.

Drawn with Pillow (already a vLLM dependency) so the kit needs no plotting library.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {"unpatched": (200, 90, 60), "patched": (50, 120, 200)}
ROW_H, BAR_H, LEFT, RIGHT, TOP = 34, 12, 190, 40, 40


def ttft_plot(summary: list[dict], path: Path) -> Path:
    width = 900
    height = TOP + ROW_H * len(summary) + 40
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    peak = max(s[t]["max_ms"] for s in summary for t in COLORS) or 1.0
    scale = (width - LEFT - RIGHT) / peak
    draw.text((10, 10), "TTFT median (bar) and min-max (whisker), ms", fill="black")
    for x, (tree, color) in enumerate(COLORS.items()):
        draw.rectangle([width - 220 + 110 * x, 10, width - 210 + 110 * x, 20], fill=color)
        draw.text((width - 205 + 110 * x, 8), tree, fill="black")
    for i, s in enumerate(summary):
        y = TOP + i * ROW_H
        draw.text((10, y + 8), f"S={s['S']} {s['kind']}", fill="black")
        for j, (tree, color) in enumerate(COLORS.items()):
            stats = s[tree]
            top = y + j * (BAR_H + 2)
            draw.rectangle([LEFT, top, LEFT + stats["median_ms"] * scale, top + BAR_H], fill=color)
            mid = top + BAR_H // 2
            draw.line(
                [LEFT + stats["min_ms"] * scale, mid, LEFT + stats["max_ms"] * scale, mid],
                fill="black",
            )
    draw.line([LEFT, height - 30, width - RIGHT, height - 30], fill="black")
    draw.text((LEFT, height - 25), "0", fill="black")
    draw.text((width - RIGHT - 60, height - 25), f"{peak:.0f} ms", fill="black")
    image.save(path)
    return path


def bench_figures(report: dict, rows: list[dict], bundle: Path) -> list[Path]:
    return [ttft_plot(report["summary"], bundle / "ttft.png")]
