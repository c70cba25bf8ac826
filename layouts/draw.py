"""Pictures of catalogue entries (matplotlib, Agg backend): SVG and PNG.

One panel per view, cells coloured and (on grids small enough to read) labelled:

* plain layout: the index at each coordinate;
* smem layout: the bank of each element, coloured by bank, then one panel per
  analysed access with the first phase of its first instruction highlighted and
  every cell read in a conflicted phase crossed out in red;
* tiled copy: thread/value per element coloured by thread (source and destination
  partitions when they differ), and for global copies the warp requests with each
  element's 32-byte sector;
* ldmatrix: source rows and destination fragment; MMA: the A, B and C fragments.

Sizes are fixed by the grid (``cell_inches``), not by ``bbox_inches="tight"``, so a
picture's pixel size is predictable (``figure_pixels``): 8x8 to 128x128 grids all
come out a few hundred to ~2000 pixels wide; text shrinks with the cells and is
dropped below ``MIN_FONT`` points or above ``MAX_LABELS`` cells, the colours stay.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from . import analysis, catalogue  # noqa: E402
from .algebra import TVLayout  # noqa: E402

DPI = 100
MIN_FONT = 3.5  # points; smaller labels are not drawn
MAX_LABELS = 64 * 64  # cells; a bigger grid is drawn unlabelled (at 100 dpi its text would be ~5 px high,
# unreadable, and each label is a matplotlib artist: a 128x128 bank map took 16 s to draw)
GRID_INCHES = 9.0  # the longer side of a panel's grid, before clamping the cell size
MARGIN = 0.55  # inches around and between panels
TITLE_LINE = 0.22  # inches per line of the figure's title block


def cell_inches(rows: int, cols: int) -> float:
    return min(0.5, max(0.05, GRID_INCHES / max(rows, cols)))


@dataclass
class Panel:
    title: str
    rgb: np.ndarray  # rows x cols x 3 in [0, 1]
    labels: Optional[List[List[str]]] = None
    crossed: Sequence[Tuple[int, int]] = ()
    dim_except: Optional[Sequence[Tuple[int, int]]] = None  # fade every other cell

    @property
    def rows(self) -> int:
        return self.rgb.shape[0]

    @property
    def cols(self) -> int:
        return self.rgb.shape[1]


def _hue_colour(i: int, golden: bool = True) -> Tuple[float, float, float]:
    """Distinct neighbouring colours for ids (threads, banks): hue by the golden ratio."""
    if not golden:  # banks: a hue wheel, so a swizzle shows as shifted stripes
        return colorsys.hls_to_rgb((i % 32) / 32, 0.72, 0.7)
    light = (0.88, 0.75, 0.82)[i % 3]
    return colorsys.hls_to_rgb((i * 0.6180339887) % 1.0, light * 0.85, 0.55)


def _tv_panel(title: str, tv: TVLayout) -> Panel:
    M, N = tv.tile
    rgb = np.ones((M, N, 3))
    labels = [["" for _ in range(N)] for _ in range(M)]
    for m, row in enumerate(tv.owners()):
        for n, owners in enumerate(row):
            if not owners:
                continue
            t, v = owners[0]
            rgb[m, n] = _hue_colour(t)
            labels[m][n] = f"T{t}\nV{v}" + (f"+{len(owners) - 1}" if len(owners) > 1 else "")
    return Panel(title, rgb, labels)


def _index_panel(title: str, layout, rows: int, cols: int) -> Panel:
    vals = np.array([[layout((m, n)) for n in range(cols)] for m in range(rows)])
    cmap = matplotlib.colormaps["viridis"]
    rgb = cmap(vals / max(1, vals.max()))[..., :3] * 0.55 + 0.45
    return Panel(title, rgb, [[str(v) for v in row] for row in vals])


def _bank_panel(title: str, banks: dict, rows: int, cols: int, crossed=(), dim_except=None,
                labelled: bool = True) -> Panel:
    rgb = np.ones((rows, cols, 3))
    labels = [["" for _ in range(cols)] for _ in range(rows)]
    for (m, n), b in banks.items():
        rgb[m, n] = _hue_colour(b, golden=False)
        labels[m][n] = str(b)
    return Panel(title, rgb, labels if labelled else None, crossed, dim_except)


def _sector_panel(title: str, rep: analysis.Coalescing, rows: int, cols: int) -> Panel:
    rgb = np.ones((rows, cols, 3))
    labels = [["" for _ in range(cols)] for _ in range(rows)]
    for (m, n), w in rep.cell_warp.items():
        rgb[m, n] = _hue_colour(w)
        labels[m][n] = f"W{w}\ns{rep.cell_sector[(m, n)]}"
    return Panel(title, rgb, labels)


def panels(entry) -> Tuple[List[Panel], List[str]]:
    """The panels of an entry and the figures (analysis summaries) shown with them."""
    reports = analysis.analyse(entry)
    figures = [r.summary() for r in reports]
    if isinstance(entry, catalogue.LayoutEntry):
        rows, cols = entry.tile
        return [_index_panel(f"index  {entry.layout}", entry.layout, rows, cols)], figures
    if isinstance(entry, catalogue.SmemEntry):
        rows, cols = entry.tile
        eb = entry.elem_bits
        banks = {(m, n): (entry.layout((m, n)) * eb // 8 // 4) % 32 for m in range(rows) for n in range(cols)}
        out = [_bank_panel(f"bank per element  {entry.layout}", banks, rows, cols)]
        for rep in reports:
            out.append(_bank_panel(
                f"{rep.access}: {rep.max_degree}-way (first phase lit, conflicts crossed)",
                banks, rows, cols, crossed=sorted(rep.conflicted), dim_except=rep.first_phase,
                labelled=max(rows, cols) <= 32))
        return out, figures
    if isinstance(entry, (catalogue.CopyEntry, catalogue.LdMatrixEntry)):
        src, dst = entry.src_tv(), entry.dst_tv()
        if src.same_function(dst):
            out = [_tv_panel(f"source = destination  {src.layout}", src)]
        else:
            out = [_tv_panel(f"source  {src.layout}", src), _tv_panel(f"destination  {dst.layout}", dst)]
        for rep in reports:
            if isinstance(rep, analysis.Coalescing):
                out.append(_sector_panel("warp requests (W) and 32-byte sectors (s)", rep, *src.tile))
        return out, figures
    if isinstance(entry, catalogue.MmaEntry):
        a = entry.atom
        return [_tv_panel(f"A (M x K)  {a.a.layout}", a.a), _tv_panel(f"B (N x K)  {a.b.layout}", a.b),
                _tv_panel(f"C (M x N)  {a.c.layout}", a.c)], figures
    raise TypeError(f"cannot draw {type(entry).__name__}")


def _title_lines(entry, figures: List[str]) -> List[str]:
    return [f"{entry.name} - {entry.description}"] + figures


def figure_inches(panel_list: Sequence[Panel], title_lines: int) -> Tuple[float, float]:
    widths = [p.cols * cell_inches(p.rows, p.cols) for p in panel_list]
    heights = [p.rows * cell_inches(p.rows, p.cols) for p in panel_list]
    w = sum(widths) + MARGIN * (len(panel_list) + 1)
    h = max(heights) + 2 * MARGIN + TITLE_LINE * (title_lines + 1)
    return max(w, 7.0), h


def figure_pixels(entry) -> Tuple[int, int]:
    """(width, height) in pixels of the PNG that ``save`` writes for ``entry``."""
    ps, figs = panels(entry)
    w, h = figure_inches(ps, len(_title_lines(entry, figs)))
    return round(w * DPI), round(h * DPI)


def _draw_panel(fig, p: Panel, left: float, bottom: float, fig_w: float, fig_h: float) -> None:
    cell = cell_inches(p.rows, p.cols)
    ax = fig.add_axes([left / fig_w, bottom / fig_h, p.cols * cell / fig_w, p.rows * cell / fig_h])
    rgb = p.rgb.copy()
    if p.dim_except is not None:
        lit = np.zeros(rgb.shape[:2], bool)
        for m, n in p.dim_except:
            lit[m, n] = True
        rgb[~lit] = rgb[~lit] * 0.15 + 0.85
    ax.imshow(rgb, interpolation="nearest", aspect="auto", extent=(-0.5, p.cols - 0.5, p.rows - 0.5, -0.5))
    cell_pt = cell * 72
    if max(p.rows, p.cols) <= 64:
        ax.set_xticks(np.arange(-0.5, p.cols, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, p.rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=max(0.2, cell_pt / 40))
    step = max(1, 2 ** math.ceil(math.log2(max(1, max(p.rows, p.cols) / 16))))
    ax.set_xticks(range(0, p.cols, step))
    ax.set_yticks(range(0, p.rows, step))
    ax.tick_params(which="both", length=0, labelsize=6, top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.set_title(p.title, fontsize=8, pad=14, loc="left")
    if p.labels is not None and p.rows * p.cols <= MAX_LABELS:
        lines = max(1, max(s.count("\n") + 1 for row in p.labels for s in row))
        longest = max(1, max(len(part) for row in p.labels for s in row for part in s.split("\n")))
        font = min(10.0, cell_pt * 0.8 / lines, cell_pt * 1.5 / longest)
        if font >= MIN_FONT:
            for m in range(p.rows):
                for n in range(p.cols):
                    if p.labels[m][n]:
                        ax.text(n, m, p.labels[m][n], ha="center", va="center", fontsize=font, linespacing=0.9)
    if p.crossed:
        ms, ns = zip(*p.crossed)
        ax.scatter(ns, ms, marker="x", s=(cell_pt * 0.5) ** 2, c="red", linewidths=max(0.3, cell_pt / 30))
    ax.set_xlim(-0.5, p.cols - 0.5)
    ax.set_ylim(p.rows - 0.5, -0.5)


def render(entry):
    """A matplotlib Figure of ``entry`` (close it with ``plt.close(fig)``)."""
    ps, figs = panels(entry)
    title = _title_lines(entry, figs)
    fig_w, fig_h = figure_inches(ps, len(title))
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI)
    fig.text(MARGIN / fig_w, 1 - 0.5 * MARGIN / fig_h, "\n".join(title), ha="left", va="top", fontsize=8,
             family="monospace")
    left = MARGIN
    for p in ps:
        _draw_panel(fig, p, left, MARGIN, fig_w, fig_h)
        left += p.cols * cell_inches(p.rows, p.cols) + MARGIN
    return fig


def save(entry, png: Optional[str] = None, svg: Optional[str] = None) -> None:
    fig = render(entry)
    try:
        if png:
            fig.savefig(png, dpi=DPI)
        if svg:
            fig.savefig(svg)
    finally:
        plt.close(fig)
