"""Read bar heights off a matplotlib bar chart by pixel (how the DeepCompile benchmark's FSDP bars
in deepspeed-deepcompile.toml were read).

Usage: python benchmarks/published/read_chart_bars.py CHART.png R,G,B [R,G,B ...]
For each colour (a bar's fill as drawn, e.g. 107,188,107 for matplotlib's green at alpha 0.7 on
white), prints every bar standing on the x axis, left to right: its centre column and its height
in the y axis' units. The y scale comes from the horizontal grey gridlines (one step = one tick,
100 units on those charts: pass --step to change it); 0 lies one grid step below the lowest
gridline (the axis hides it). A bar's top is its first row of the colour, less half a pixel for
the antialiased edge. Legend patches, which do not reach the axis, are skipped.
The charts come from the source repository at the commit its [source] names (git show).
"""

from __future__ import annotations

import argparse

from PIL import Image


def _runs(values: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][-1] + 1:
            out[-1].append(v)
        else:
            out.append([v])
    return out


def gridlines(px, height: int, x: int) -> list[float]:
    """Rows of the grey gridlines at column x (centres of each run of grey pixels)."""
    grey = [y for y in range(height) if px[x, y][0] == px[x, y][1] == px[x, y][2] and 150 <= px[x, y][0] <= 200]
    return [sum(r) / len(r) for r in _runs(grey)]


def bars(path: str, colour: tuple[int, int, int], step_units: float = 100.0,
         grid_x: int = 140) -> list[tuple[int, float]]:
    im = Image.open(path).convert("RGB")
    width, height = im.size
    px = im.load()
    grid = gridlines(px, height, grid_x)
    step = (grid[-1] - grid[0]) / (len(grid) - 1)
    zero = grid[-1] + step
    cols = [x for x in range(width) if any(px[x, y] == colour for y in range(0, height, 2))]
    out = []
    for run in _runs(cols):
        if len(run) < 10:
            continue
        x = run[len(run) // 2]
        ys = [y for y in range(height) if px[x, y] == colour]
        if max(ys) < zero - 4:  # a legend patch
            continue
        out.append((x, round((zero - (min(ys) - 0.5)) / step * step_units, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chart")
    ap.add_argument("colours", nargs="+", help="R,G,B of a bar fill")
    ap.add_argument("--step", type=float, default=100.0, help="y units per gridline step")
    a = ap.parse_args()
    for c in a.colours:
        rgb = tuple(int(v) for v in c.split(","))
        print(c, bars(a.chart, rgb, a.step))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
