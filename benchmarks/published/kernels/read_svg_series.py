"""Read the data series of a matplotlib SVG line chart from its vector coordinates (how
quack-torch-compile-h100.csv was read from Dao-AILab/quack's bf16_kernel_benchmarks_single_row.svg).

Usage: python benchmarks/published/kernels/read_svg_series.py CHART.svg
For each panel (`axes_N` group, titled by its text comments, e.g. "RMSNorm (BF16)") prints every
polyline of at least 5 points as its legend colour and its points' y values in the y axis' units.
The y scale comes from the panel's y ticks: matplotlib writes each tick's label as a comment
(`<!-- 3350 -->`) beside its marker's position; the first and last ticks fix the linear map. The
legend (`legend_1`) names each colour. The chart comes from the source repository at the commit
the kernels README names (git show).
"""

from __future__ import annotations

import re
import sys


def series(svg: str) -> dict[str, dict[str, list[float]]]:
    legend = svg[svg.find('<g id="legend_1">'):]
    names, colour = {}, None
    for c, label in re.findall(r'stroke: (#[0-9a-f]+)|<!-- ([^>]*) -->', legend):
        if c:
            colour = c
        elif colour:
            names[colour], colour = label, None
    out: dict[str, dict[str, list[float]]] = {}
    ticks = None
    for panel in re.split(r'<g id="axes_\d+">', svg)[1:]:
        found = re.findall(r'<g id="ytick_\d+">.*?<use xlink:href="#[^"]+" x="[^"]+" y="([^"]+)".*?<!-- (\d+) -->',
                           panel, re.S)
        ticks = found or ticks  # panels sharing the y axis draw its ticks once
        (y0, v0), (y1, v1) = (float(ticks[0][0]), float(ticks[0][1])), (float(ticks[-1][0]), float(ticks[-1][1]))
        title = (re.findall(r'<!-- ([^>]*\([A-Z0-9]+\)) -->', panel) or ["?"])[-1]
        for d, style in re.findall(r'<g id="line2d_\d+">\s*<path d="([^"]+)"[^>]*style="([^"]*)"', panel):
            pts = re.findall(r'([\d.]+) ([\d.]+)', d)
            c = re.search(r'stroke: (#[0-9a-f]+)', style)
            if len(pts) >= 5 and c:
                vals = [v0 + (float(y) - y0) * (v1 - v0) / (y1 - y0) for _, y in pts]
                out.setdefault(title, {})[names.get(c.group(1), c.group(1))] = vals
    return out


if __name__ == "__main__":
    for title, lines in series(open(sys.argv[1]).read()).items():
        for name, vals in lines.items():
            print(f"{title} | {name} | " + ", ".join(f"{v:.0f}" for v in vals))
