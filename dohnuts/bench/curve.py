"""The serving curve: decisions/s against p99 for each level of the ledger's latest serving runs,
drawn as a standalone SVG (docs/serving-curve.svg, written by `benchmarks/ledger.py render`).

Plain SVG text, so the docs need no plotting library: the x axis is decisions/s, the y axis p99
latency on a log scale, one colour a run, a filled mark an open-loop level (offered rate beside
it) and a hollow one a closed-loop level (clients beside it), the 100 ms and 500 ms bounds of
the serving issue's targets drawn across.
"""

from __future__ import annotations

import math
import re

WIDTH, HEIGHT, MARGIN = 760, 460, 70
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
LEVEL = re.compile(r"^(open|clients)_(\d+(?:\.\d+)?)_p99_ms$")


def levels(entry: dict) -> list[dict]:
    """The levels of a serving entry's figures: mode ("open" or "closed"), its rate or clients,
    decisions/s and p99 ms; levels with no answer are left out."""
    found = []
    figures = entry["figures"]
    for name, p99 in figures.items():
        match = LEVEL.match(name)
        decisions = figures.get(f"{match[1]}_{match[2]}_decisions_per_second") if match else None
        if match and p99 is not None and decisions:
            found.append({"mode": "open" if match[1] == "open" else "closed", "load": float(match[2]),
                          "decisions_per_second": decisions, "p99_ms": p99})
    return sorted(found, key=lambda level: (level["mode"], level["load"]))


def serving_curve_svg(entries: list[dict], runs: int = 1) -> str | None:
    """The SVG of the latest `runs` serving entries of the ledger (in ledger order) that reached
    their closed loops, which the load harness runs after the open-loop sweep (a run cut short
    before them, an A/B of one setting at a rate or two, stays in figures.md only), or None when
    there is none."""
    serving = [entry for entry in entries if entry.get("workload") == "serving"
               and any(level["mode"] == "closed" for level in levels(entry))][-runs:]
    if not serving:
        return None
    points = [level for entry in serving for level in levels(entry)]
    x_top = _nice(max(level["decisions_per_second"] for level in points) * 1.1)
    y_low = 10 ** math.floor(math.log10(min(min(level["p99_ms"] for level in points), 100)))
    y_high = 10 ** math.ceil(math.log10(max(max(level["p99_ms"] for level in points), 500)))
    top = 48 + 16 * (len(serving) + 1)  # the title and the legend above the plot
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - top - MARGIN

    def x(value: float) -> float:
        return MARGIN + plot_w * value / x_top

    span = math.log10(y_high) - math.log10(y_low)

    def y(value: float) -> float:
        return top + plot_h * (1 - (math.log10(value) - math.log10(y_low)) / span)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">Serving: decisions/s against p99 '
           f'({serving[-1]["shape"]})</text>']
    for step in range(6):
        value = x_top * step / 5
        out.append(f'<line x1="{x(value):.1f}" y1="{top}" x2="{x(value):.1f}" y2="{HEIGHT - MARGIN}" '
                   f'stroke="#eee"/><text x="{x(value):.1f}" y="{HEIGHT - MARGIN + 18}" text-anchor="middle">'
                   f'{value:,.0f}</text>')
    decade = y_low
    while decade <= y_high:
        out.append(f'<line x1="{MARGIN}" y1="{y(decade):.1f}" x2="{WIDTH - MARGIN}" y2="{y(decade):.1f}" '
                   f'stroke="#eee"/><text x="{MARGIN - 8}" y="{y(decade) + 4:.1f}" text-anchor="end">'
                   f'{decade:,.0f}</text>')
        decade *= 10
    for bound in (100, 500):
        out.append(f'<line x1="{MARGIN}" y1="{y(bound):.1f}" x2="{WIDTH - MARGIN}" y2="{y(bound):.1f}" '
                   f'stroke="#888" stroke-dasharray="6 4"/><text x="{WIDTH - MARGIN - 4}" y="{y(bound) - 4:.1f}" '
                   f'text-anchor="end" fill="#666">p99 {bound} ms</text>')
    out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 20}" text-anchor="middle">decisions/s answered</text>')
    out.append(f'<text transform="translate(18 {(top + HEIGHT - MARGIN) / 2}) rotate(-90)" '
               f'text-anchor="middle">p99 latency, ms (log)</text>')
    for number, entry in enumerate(serving):
        colour = COLOURS[number % len(COLOURS)]
        for level in levels(entry):
            cx, cy = x(level["decisions_per_second"]), y(level["p99_ms"])
            fill = colour if level["mode"] == "open" else "white"
            label = f'{level["load"]:g}/s' if level["mode"] == "open" else f'{level["load"]:g} cl.'
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{fill}" stroke="{colour}" '
                       f'stroke-width="2"/><text x="{cx + 8:.1f}" y="{cy - 6:.1f}" fill="{colour}">{label}</text>')
        out.append(f'<text x="{MARGIN}" y="{48 + 16 * number}" fill="{colour}">{entry["run"]} '
                   f'({entry["machine"]})</text>')
    out.append(f'<text x="{MARGIN}" y="{48 + 16 * len(serving)}" fill="#444">filled: open loop, '
               f'offered rate; hollow: closed loop, clients</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice(value: float) -> float:
    """The smallest of 1, 2 or 5 times a power of ten at least `value` (an axis's end)."""
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value)
