"""The bench's figures, drawn with Pillow (installed with vLLM; matplotlib is not in
the .venv, so the kit draws its few charts itself: axes, ticks, points, lines).

- ``cached-tokens.png``: cached tokens resumed by the follow-up vs the context length
  S, per tree, against the geometry model's prediction and the ideal;
- ``ttft.png``: the cached follow-up's TTFT per repetition, both trees, one panel per
  S, titled with the patched/unpatched ratio's median and its 95 % bootstrap interval
  (min-max for bundles from before the interval) and, where the run has the control
  (``ttft.control_requests``), the control's TTFT dashed and the patched tree's cached
  B / control ratio above the title; both titled with the checkpoint path;
- ``compare.png`` (``kit report A B --figure``): two bundles' ratios side by side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLORS = {"unpatched": (200, 80, 50), "patched": (40, 110, 200)}
GREY = (120, 120, 120)
LIGHT = (225, 225, 225)
BLACK = (0, 0, 0)


def _font(size: int = 14) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (1, 2 or 5 times a power of ten apart)."""
    if high <= low:
        high = low + 1
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.floor(low / step) * step
    ticks = []
    value = start
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


class Axes:
    """One plotting area inside a Pillow image: data coordinates to pixels, ticks, labels."""

    def __init__(
        self,
        draw: ImageDraw.ImageDraw,
        box: tuple[int, int, int, int],
        x: Sequence[float],
        y: Sequence[float],
        title: str = "",
        xlabel: str = "",
        ylabel: str = "",
        xticks: Sequence[float] | None = None,
        xticklabels: Sequence[str] | None = None,
    ) -> None:
        self.draw, (self.left, self.top, self.right, self.bottom) = draw, box
        self.yticks = nice_ticks(min(0.0, min(y)), max(y))
        self.xticks = list(xticks) if xticks is not None else nice_ticks(min(x), max(x))
        self.x0, self.x1 = min(self.xticks), max(self.xticks)
        if self.x0 == self.x1:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        self.y0, self.y1 = self.yticks[0], self.yticks[-1]
        font = _font(13)
        for value in self.yticks:
            py = self.py(value)
            draw.line([self.left, py, self.right, py], fill=LIGHT)
            draw.text((self.left - 6, py), f"{value:g}", fill=BLACK, font=font, anchor="rm")
        labels = xticklabels or [f"{v:g}" for v in self.xticks]
        for value, label in zip(self.xticks, labels, strict=True):
            px = self.px(value)
            draw.line([px, self.bottom, px, self.bottom + 4], fill=BLACK)
            draw.text((px, self.bottom + 6), label, fill=BLACK, font=font, anchor="mt")
        draw.rectangle([self.left, self.top, self.right, self.bottom], outline=BLACK)
        draw.text(((self.left + self.right) / 2, self.top - 8), title, BLACK, _font(14), "md")
        draw.text(((self.left + self.right) / 2, self.bottom + 24), xlabel, BLACK, font, "mt")
        if ylabel:
            draw.text((self.left - 60, self.top - 8), ylabel, fill=BLACK, font=font, anchor="ld")

    def px(self, x: float) -> float:
        pad = 0.05 * (self.right - self.left)
        span = self.right - self.left - 2 * pad
        return self.left + pad + (x - self.x0) / (self.x1 - self.x0) * span

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)

    def line(self, xs, ys, color, width: int = 2, dash: bool = False) -> None:
        points = [(self.px(a), self.py(b)) for a, b in zip(xs, ys, strict=True)]
        if dash:
            for (ax, ay), (bx, by) in zip(points, points[1:], strict=False):
                steps = max(1, int(math.hypot(bx - ax, by - ay) // 8))
                for i in range(0, steps, 2):
                    f0, f1 = i / steps, min(1.0, (i + 1) / steps)
                    self.draw.line(
                        [
                            ax + (bx - ax) * f0,
                            ay + (by - ay) * f0,
                            ax + (bx - ax) * f1,
                            ay + (by - ay) * f1,
                        ],
                        fill=color,
                        width=width,
                    )
        elif len(points) > 1:
            self.draw.line(points, fill=color, width=width)

    def points(self, xs, ys, color, shape: str = "o", size: int = 5, hollow: bool = False) -> None:
        for a, b in zip(xs, ys, strict=True):
            x, y = self.px(a), self.py(b)
            box = [x - size, y - size, x + size, y + size]
            fill, outline = (None, color) if hollow else (color, color)
            if shape == "s":
                self.draw.rectangle(box, fill=fill, outline=outline, width=2)
            elif shape == "x":
                self.draw.line([x - size, y - size, x + size, y + size], fill=color, width=2)
                self.draw.line([x - size, y + size, x + size, y - size], fill=color, width=2)
            else:
                self.draw.ellipse(box, fill=fill, outline=outline, width=2)

    def whisker(self, x: float, low: float, high: float, color) -> None:
        px = self.px(x)
        self.draw.line([px, self.py(low), px, self.py(high)], fill=color, width=2)
        for y in (low, high):
            self.draw.line([px - 4, self.py(y), px + 4, self.py(y)], fill=color, width=2)


def legend(draw: ImageDraw.ImageDraw, x: int, y: int, items: list[tuple[str, tuple, str]]) -> None:
    font = _font(13)
    for i, (label, color, shape) in enumerate(items):
        cy = y + 18 * i
        if shape == "line":
            draw.line([x, cy, x + 18, cy], fill=color, width=2)
        elif shape == "dash":
            draw.line([x, cy, x + 6, cy], fill=color, width=2)
            draw.line([x + 12, cy, x + 18, cy], fill=color, width=2)
        elif shape == "dot":
            draw.ellipse([x + 4, cy - 5, x + 14, cy + 5], fill=color)
        draw.text((x + 24, cy), label, fill=BLACK, font=font, anchor="lm")


def path_label(path: str | None) -> str:
    """The checkpoint path a bench ran on, for a figure's title (older bundles: none)."""
    return f", {path} checkpoints" if path else ""


def cached_tokens_figure(
    summary: list[dict], rows: list[dict], path: Path, checkpoints: str | None = None
) -> Path:
    cached = sorted((s for s in summary if s["kind"] == "cached_B"), key=lambda s: s["S"])
    shared = [s["S"] for s in cached]
    ideal = {r["S"]: r["ideal_cached"] for r in rows if "ideal_cached" in r}
    image = Image.new("RGB", (900, 560), "white")
    draw = ImageDraw.Draw(image)
    where = list(range(len(shared)))
    ax = Axes(
        draw,
        (90, 60, 640, 480),
        where,
        [0.0, *shared],
        title=f"Follow-up B's cached tokens per S{path_label(checkpoints)}",
        xlabel="shared context S (tokens)",
        ylabel="cached tokens",
        xticks=where,
        xticklabels=[str(s) for s in shared],
    )
    for i, s in enumerate(shared):
        # The ideal and S itself as short horizontal marks across each S.
        ax.line([i - 0.3, i + 0.3], [s, s], LIGHT, width=2)
        if s in ideal:
            ax.line([i - 0.3, i + 0.3], [ideal[s]] * 2, GREY, dash=True)
    for tree, color, offset in (
        ("unpatched", COLORS["unpatched"], -0.1),
        ("patched", COLORS["patched"], 0.1),
    ):
        xs = [i + offset for i in where]
        ax.points(xs, [s[tree]["median_cached"] for s in cached], color, "o", 7)
        ax.points(xs, [s[tree]["expected_cached"] for s in cached], BLACK, "x", 4)
    legend(
        draw,
        660,
        80,
        [
            ("unpatched (median)", COLORS["unpatched"], "dot"),
            ("patched (median)", COLORS["patched"], "dot"),
            ("x: geometry model's prediction", BLACK, "none"),
            ("ideal: floor(S/H)*H - H", GREY, "dash"),
            ("S itself", LIGHT, "line"),
        ],
    )
    image.save(path)
    return path


def ttft_figure(
    summary: list[dict],
    rows: list[dict],
    path: Path,
    kind: str = "cached_B",
    checkpoints: str | None = None,
) -> Path:
    lines = sorted((s for s in summary if s["kind"] == kind), key=lambda s: s["S"])
    cols = 2
    panels = max(1, len(lines))
    nrows = math.ceil(panels / cols)
    controlled = any(line.get("ratio_control") for line in lines)
    top = 130 if controlled else 90  # room for the legend and the control's line
    width, height = 1000, top - 10 + 300 * nrows
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text(
        (20, 14),
        f"TTFT per repetition, {kind}{path_label(checkpoints)}",
        fill=BLACK,
        font=_font(16),
    )
    items = [(t, c, "dot") for t, c in COLORS.items()]
    if controlled:
        items += [(f"{t} control", c, "dash") for t, c in COLORS.items()]
    legend(draw, width - 200, 20, items)
    for i, line in enumerate(lines):
        col, row = i % cols, i // cols
        box = (80 + col * 490, top + row * 300, 80 + col * 490 + 390, top + row * 300 + 200)
        sel = [r for r in rows if r["kind"] == kind and r["S"] == line["S"]]
        reps = sorted({r["rep"] for r in sel})
        series = _series(sel, reps)
        control = _series(
            [r for r in rows if r["kind"] == CONTROL_KIND and r["S"] == line["S"]], reps
        )
        control = control if line.get("ratio_control") else {}
        ratio = line["ratio_patched_unpatched"]
        ax = Axes(
            draw,
            box,
            reps,
            [v for vals in (*series.values(), *control.values()) for v in vals if v is not None],
            title=f"S={line['S']}: ratio p/u {ratio['median']:.2f} {spread(ratio)}",
            xlabel="repetition",
            ylabel="ms",
            xticks=reps,
        )
        for tree, color in COLORS.items():
            ax.line(reps, series[tree], color)
            ax.points(reps, series[tree], color, "o", 4)
            shown = [(x, y) for x, y in zip(reps, control.get(tree, []), strict=False) if y]
            if shown:
                xs, ys = zip(*shown, strict=True)
                ax.line(xs, ys, color, dash=True)
                ax.points(xs, ys, color, "o", 4, hollow=True)
        patched = (line.get("ratio_control") or {}).get("patched")
        if patched:
            draw.text(
                ((box[0] + box[2]) / 2, box[1] - 26),
                f"cached B / control, patched: {patched['median']:.2f} {spread(patched)}",
                BLACK,
                _font(13),
                "md",
            )
    image.save(path)
    return path


# The control follow-up of cached B (``kit.bench.ttft.control_requests``).
CONTROL_KIND = "control_B"


def _series(sel: list[dict], reps: list[int]) -> dict[str, list[float | None]]:
    """Per tree, the rows' TTFT in ms at each repetition (None where a tree has none)."""
    return {
        tree: [
            next(
                (1000 * r["ttft_s"] for r in sel if r["tree"] == tree and r["rep"] == rep),
                None,
            )
            for rep in reps
        ]
        for tree in COLORS
    }


def compare_figure(named: list[tuple[str, list[dict]]], path: Path) -> Path:
    """The cached follow-up's patched/unpatched ratio per S for two bundles, median
    with the min-max range; 1.0 (no difference) drawn across."""
    shared = sorted({s["S"] for _, summary in named for s in summary if s["kind"] == "cached_B"})
    values = [
        v
        for _, summary in named
        for s in summary
        if s["kind"] == "cached_B"
        for v in (s["ratio_patched_unpatched"]["max"], 1.0)
    ]
    image = Image.new("RGB", (900, 520), "white")
    draw = ImageDraw.Draw(image)
    ax = Axes(
        draw,
        (90, 60, 640, 440),
        list(range(len(shared))),
        values,
        title="Cached follow-up B: patched / unpatched TTFT, two bundles",
        xlabel="shared context S (tokens)",
        ylabel="ratio",
        xticks=list(range(len(shared))),
        xticklabels=[str(s) for s in shared],
    )
    ax.line([ax.x0, ax.x1], [1.0, 1.0], GREY, width=1)
    shades = [(40, 110, 200), (230, 150, 30)]
    items = []
    for k, ((name, summary), color) in enumerate(zip(named, shades, strict=False)):
        offset = -0.12 if k == 0 else 0.12
        for i, s in enumerate(shared):
            line = next((x for x in summary if (x["S"], x["kind"]) == (s, "cached_B")), None)
            if line is None:
                continue
            r = line["ratio_patched_unpatched"]
            ax.whisker(i + offset, r["min"], r["max"], color)
            ax.points([i + offset], [r["median"]], color, "o", 6)
        items.append((name[:32], color, "dot"))
    legend(draw, 660, 80, items)
    image.save(path)
    return path


def spread(ratio: dict) -> str:
    """The ratio's 95 % bootstrap interval; bundles from before it had only min-max."""
    if "ci95" in ratio:
        return f"[95% CI {ratio['ci95'][0]:.2f}-{ratio['ci95'][1]:.2f}]"
    return f"(min-max {ratio['min']:.2f}-{ratio['max']:.2f})"


def bench_figures(report: dict, rows: list[dict], bundle: Path) -> list[Path]:
    """The bundle's figures (see the module's text), titled with the checkpoint path."""
    path = report.get("path")
    return [
        cached_tokens_figure(report["summary"], rows, bundle / "cached-tokens.png", path),
        ttft_figure(report["summary"], rows, bundle / "ttft.png", checkpoints=path),
    ]
