"""Pictures of catalogue entries (matplotlib, Agg backend): SVG and PNG.

A picture shows a big tile twice: an overview of the whole tile in colour only, and
crops small enough to label every cell (cute-viz's style: thread and value ids in the
cells, a colour per thread), beside a legend strip of the colours.

* plain layout: the index at each coordinate;
* smem tile: the bank of each element (overview, and one swizzle atom labelled), then
  per access a crop of its first instruction: each cell labelled with the lane that
  touches it (T thread, R matrix row, P TMA piece) and its bank, a colour per lane, the
  first phase lit, cells of conflicted phases framed in red;
* tiled copy: thread / value per element (overview and a labelled crop), for global
  copies the warp requests with each element's 32-byte sector;
* MMA: the A, B and C fragments of the atom, and a tiled MMA's C over its tile.

Sizes are fixed by the cells (``LABEL_CELL`` for labelled crops, ``OVERVIEW_INCHES`` for
an overview's longer side), panels flow into rows at most ``MAX_WIDTH`` wide, and titles
are wrapped to their panel, so nothing is clipped and ``figure_pixels`` is exact.
"""

from __future__ import annotations

import colorsys
import math
import textwrap
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from . import analysis, catalogue  # noqa: E402
from .algebra import TVLayout  # noqa: E402

DPI = 100
MAX_WIDTH = 16.0  # inches of a row of panels before the next row starts
MARGIN = 0.3  # inches around the figure and between panels
LABEL_CELL = 0.24  # inches, at least: a cell with a two-line label ("T12" over "V3"), wider for longer ones
SHORT_CELL = 0.22  # a cell with a one-line label of at most 3 characters (a bank)
OVERVIEW_INCHES = 5.0  # the longer side of an unlabelled overview
OVERVIEW_MAX = (128, 256)  # cells an overview shows at most (rows, cols); more are cut
CROP_MAX = (16, 32)  # cells a labelled crop shows at most
ACCESS_CROP_MAX = (16, 64)  # an access's crop: a 128-bit phase of 16-bit elements is 64 wide
CELL_FONT = 6.0  # points
TITLE_FONT = 7.5
HEADER_FONT = 8.0
CHAR = 0.66 / 72  # inches per point of a monospace character's width (0.6 em, hinted up to whole pixels)
LINE = 1.3 / 72  # inches per point of a text line
TICKS = 0.22  # inches above a grid for its column numbers (and left of it for row numbers)


@dataclass
class Panel:
    title: str
    rgb: np.ndarray  # rows x cols x 3 in [0, 1]
    labels: Optional[List[List[str]]] = None
    crossed: Sequence[Tuple[int, int]] = ()  # in panel coordinates
    dim_except: Optional[Sequence[Tuple[int, int]]] = None  # fade every other cell
    origin: Tuple[int, int] = (0, 0)  # tile coordinates of the panel's cell (0, 0): the tick numbers
    outline: Optional[Tuple[int, int, int, int]] = None  # (row, col, rows, cols) of a crop shown elsewhere
    ticks: bool = True
    lines: List[str] = field(default_factory=list)  # the wrapped title (set by ``_wrap``)

    @property
    def rows(self) -> int:
        return self.rgb.shape[0]

    @property
    def cols(self) -> int:
        return self.rgb.shape[1]

    @property
    def cell(self) -> float:
        if self.labels is None:  # the longer side OVERVIEW_INCHES, up to twice that for a thin strip
            long, short = max(self.rows, self.cols), min(self.rows, self.cols)
            return min(0.12, max(OVERVIEW_INCHES / long, min(2 * OVERVIEW_INCHES / long, 1.0 / short)))
        longest = max(len(part) for row in self.labels for s in row for part in s.split("\n"))
        two_lines = any("\n" in s for row in self.labels for s in row)
        if not two_lines and longest <= 3:
            return SHORT_CELL
        return max(LABEL_CELL, 0.07 + longest * CELL_FONT * CHAR)  # the longest line and a margin

    @property
    def grid(self) -> Tuple[float, float]:
        return self.cols * self.cell, self.rows * self.cell

    @property
    def width(self) -> float:
        """The panel's slot: its grid (and row numbers), or its title's widest line."""
        return max(self.grid[0] + TICKS, 2.5)

    @property
    def height(self) -> float:
        return len(self.lines) * TITLE_FONT * LINE + TICKS * self.ticks + self.grid[1]


# ---------------------------------------------------------------------------- colours


def _hue_colour(i: int, golden: bool = True) -> Tuple[float, float, float]:
    """Distinct neighbouring colours for ids (threads, banks): hue by the golden ratio."""
    if not golden:  # banks: a hue wheel, so a swizzle shows as shifted stripes
        return colorsys.hls_to_rgb((i % 32) / 32, 0.72, 0.7)
    light = (0.88, 0.75, 0.82)[i % 3]
    return colorsys.hls_to_rgb((i * 0.6180339887) % 1.0, light * 0.85, 0.55)


def _window(rows: int, cols: int, limit: Tuple[int, int], r0: int = 0, c0: int = 0) -> Tuple[int, int, int, int]:
    return (r0, c0, min(limit[0], rows - r0), min(limit[1], cols - c0))


def _cut(title: str, shape: Tuple[int, int], win: Tuple[int, int, int, int]) -> str:
    r0, c0, rows, cols = win
    if (rows, cols) == shape:
        return title
    span = lambda a, n, what: f"{what} {a}" if n == 1 else f"{what}s {a}-{a + n - 1}"  # noqa: E731
    return f"{title} [{span(r0, rows, 'row')}, {span(c0, cols, 'col')} of {shape[0]}x{shape[1]}]"


# ----------------------------------------------------------------------------- panels


def _tv_panel(title: str, tv: TVLayout, win=None, labelled: bool = True) -> Panel:
    """Thread / value owning each cell of ``win`` (default: the whole tile), colour per thread."""
    r0, c0, rows, cols = win or (0, 0, *tv.tile)
    rgb = np.ones((rows, cols, 3))
    labels = [["" for _ in range(cols)] for _ in range(rows)]
    coords = analysis.tv_table(tv)
    for t in range(tv.num_threads):
        for v in range(tv.num_values):
            m, n = coords[t, v] - (r0, c0)
            if 0 <= m < rows and 0 <= n < cols and not labels[m][n]:
                rgb[m, n] = _hue_colour(t)
                labels[m][n] = f"T{t}\nV{v}"
    return Panel(_cut(title, tv.tile, (r0, c0, rows, cols)), rgb, labels if labelled else None, origin=(r0, c0))


def _tv_panels(title: str, tv: TVLayout) -> List[Panel]:
    """A small tile labelled whole; a big one as an overview beside its labelled top-left crop."""
    if tv.tile[0] <= CROP_MAX[0] and tv.tile[1] <= CROP_MAX[1]:
        return [_tv_panel(title, tv)]
    crop = _window(*tv.tile, (8, CROP_MAX[1]))
    over = _window(*tv.tile, OVERVIEW_MAX)
    overview = _tv_panel(f"{title} (colour = thread)", tv, over, labelled=False)
    overview.outline = crop
    return [overview, _tv_panel(f"{title}, labelled", tv, crop)]


def _index_panel(title: str, layout, rows: int, cols: int) -> Panel:
    vals = np.array([[layout((m, n)) for n in range(cols)] for m in range(rows)])
    cmap = matplotlib.colormaps["viridis"]
    rgb = cmap(vals / max(1, vals.max()))[..., :3] * 0.55 + 0.45
    labelled = rows <= CROP_MAX[0] and cols <= CROP_MAX[1]
    return Panel(title, rgb, [[str(v) for v in row] for row in vals] if labelled else None)


def _bank_rgb(banks: np.ndarray) -> np.ndarray:
    wheel = np.array([_hue_colour(b, golden=False) for b in range(32)])
    return wheel[banks]


def _bank_panels(entry, banks: np.ndarray, outline) -> List[Panel]:
    """The whole tile's banks (colour only when big) and one swizzle atom labelled."""
    from .access import contiguous_axis, swizzle_span

    rows, cols = banks.shape
    title = f"bank of each element  {entry.layout}"
    if rows <= CROP_MAX[0] and cols <= CROP_MAX[1]:
        return [Panel(title, _bank_rgb(banks), [[str(b) for b in r] for r in banks])]
    over = _window(rows, cols, OVERVIEW_MAX)
    overview = Panel(_cut(title, (rows, cols), over), _bank_rgb(banks[: over[2], : over[3]]), outline=outline)
    span = swizzle_span(entry.view)
    wide = min(CROP_MAX[1], span or CROP_MAX[1])  # along the contiguous dimension, 8 lines across it
    atom = _window(rows, cols, (8, wide) if contiguous_axis(entry.view) == 1 else (min(CROP_MAX[0], wide), 8))
    sub = banks[: atom[2], : atom[3]]
    what = "banks of the first swizzle atom" if span else "banks, top left"
    crop = Panel(_cut(what, (rows, cols), atom), _bank_rgb(sub), [[str(b) for b in r] for r in sub])
    return [overview, crop]


def _access_window(rep: analysis.BankConflicts) -> Tuple[int, int, int, int]:
    """The cells of the first instruction's first four phases (capped at CROP_MAX)."""
    instr = rep.first_instruction
    phases = analysis._phases(instr, rep.width_bytes)
    lanes = [lane for p in phases[:4] for lane in p]
    cells = [c for lane in lanes for c in instr.lanes[lane]]
    r0, c0 = min(c[0] for c in cells), min(c[1] for c in cells)
    r1, c1 = max(c[0] for c in cells), max(c[1] for c in cells)
    return (r0, c0, min(ACCESS_CROP_MAX[0], r1 - r0 + 1), min(ACCESS_CROP_MAX[1], c1 - c0 + 1))


def _access_panel(rep: analysis.BankConflicts, banks: np.ndarray) -> Panel:
    """The first instruction of an access, lane and bank per cell, the first phase lit."""
    r0, c0, rows, cols = _access_window(rep)
    rgb = np.ones((rows, cols, 3))
    labels = [["" for _ in range(cols)] for _ in range(rows)]
    for lane, cells in enumerate(rep.first_instruction.lanes):
        for m, n in cells:
            if not (r0 <= m < r0 + rows and c0 <= n < c0 + cols):
                continue
            if labels[m - r0][n - c0]:  # another lane reads the same element (a broadcast): "+"
                labels[m - r0][n - c0] = labels[m - r0][n - c0].replace("\n", "+\n", 1).replace("++", "+")
                continue
            rgb[m - r0, n - c0] = _hue_colour(lane)
            labels[m - r0][n - c0] = f"{rep.lane}{lane}\nb{banks[m, n]}"
    inside = lambda cs: [(m - r0, n - c0) for m, n in cs if r0 <= m < r0 + rows and c0 <= n < c0 + cols]  # noqa: E731
    fit = int((MAX_WIDTH - TICKS) / Panel("", rgb, labels).cell)  # columns that fit a row of the figure
    if cols > fit:
        cols, rgb, labels = fit, rgb[:, :fit], [row[:fit] for row in labels]
    verdict = "conflict-free" if rep.conflict_free else f"{rep.max_degree}-way"
    title = _cut(f"{rep.name}: {verdict}; first instruction, phase 0 lit", banks.shape, (r0, c0, rows, cols))
    return Panel(
        title, rgb, labels, crossed=inside(rep.first_conflicted), dim_except=inside(rep.first_phase), origin=(r0, c0)
    )


LANE_NAMES = {
    "T": "T thread",
    "V": "V value",
    "R": "R wgmma core-matrix row",
    "P": "P TMA piece (16 bytes)",
    "b": "b bank",
    "+": "+ more lanes on the element",
    "W": "W warp request",
    "s": "s its 32-byte sector",
}


def _legend(kind: str, letters: str = "TV") -> Panel:
    """A strip of the colours: banks 0..31, or threads 0..31 (one warp), with what the
    ``letters`` in the cells mean."""
    ids = np.arange(32)[None, :]
    if kind == "bank":
        return Panel(
            "legend: colour = bank (4-byte word mod 32)", _bank_rgb(ids), [[str(i) for i in ids[0]]], ticks=False
        )
    rgb = np.array([[_hue_colour(i) for i in ids[0]]])
    what = ", ".join(LANE_NAMES[c] for c in letters)
    return Panel(f"legend: colour = thread / lane; {what}", rgb, [[f"{i}" for i in ids[0]]], ticks=False)


def _sector_panel(title: str, rep: analysis.Coalescing, tile_rows: int, tile_cols: int) -> Panel:
    _, _, rows, cols = win = _window(tile_rows, tile_cols, (8, CROP_MAX[1]))
    rgb = np.ones((rows, cols, 3))
    labels = [["" for _ in range(cols)] for _ in range(rows)]
    for (m, n), w in rep.cell_warp.items():
        if m < rows and n < cols:
            rgb[m, n] = _hue_colour(w)
            labels[m][n] = f"W{w}\ns{rep.cell_sector[(m, n)]}"
    return Panel(_cut(title, (tile_rows, tile_cols), win), rgb, labels)


# ------------------------------------------------------------------------ per entry


def _smem_panels(entry, reports) -> List[Panel]:
    rows, cols = entry.tile
    table = analysis.offset_table(entry.view, rows, cols)
    banks = (table * entry.elem_bits // 8 // analysis.BANK_BYTES) % analysis.NUM_BANKS
    access = [_access_panel(r, banks) for r in reports if isinstance(r, analysis.BankConflicts)]
    outline = None
    if access:
        p = access[0]
        outline = (*p.origin, p.rows, p.cols)
    letters = "".join(dict.fromkeys(r.lane for r in reports if isinstance(r, analysis.BankConflicts))) + "b"
    if any("+" in s for p in access for row in p.labels for s in row):
        letters += "+"
    legend = [_legend("lane", letters)] if access else []
    return _bank_panels(entry, banks, outline) + [_legend("bank")] + access + legend


def _copy_panels(entry, reports) -> List[Panel]:
    src, dst = entry.src_tv(), entry.dst_tv()
    if src.same_function(dst):
        out = _tv_panels(f"threads {src.layout}", src)
    else:
        out = _tv_panels(f"source {src.layout}", src) + _tv_panels(f"destination {dst.layout}", dst)
    sectors = [r for r in reports if isinstance(r, analysis.Coalescing)]
    for rep in sectors:
        out.append(_sector_panel("warp requests (W) and their 32-byte sectors (s)", rep, *src.tile))
    return out + [_legend("lane", "TVWs" if sectors else "TV")]


def _mma_panels(entry) -> List[Panel]:
    a = entry.atom
    out = [
        _tv_panel(f"A (M x K)  {a.a.layout}", a.a),
        _tv_panel(f"B (N x K)  {a.b.layout}", a.b),
        _tv_panel(f"C (M x N)  {a.c.layout}", a.c),
    ]
    if entry.tiled:
        out += _tv_panels(f"tiled C over {entry.tile[0]}x{entry.tile[1]}  {entry.tiled_c().layout}", entry.tiled_c())
    return out + [_legend("lane", "TV")]


def panels(entry) -> Tuple[List[Panel], List[str]]:
    """The panels of an entry and the figures (analysis summaries) shown with them."""
    reports = analysis.analyse(entry)
    figures = [r.summary() for r in reports] or [f"({analysis.no_access_reason(entry)})"]
    if isinstance(entry, catalogue.LayoutEntry):
        return [_index_panel(f"index  {entry.layout}", entry.layout, *entry.tile)], figures
    if isinstance(entry, catalogue.SmemEntry):
        return _smem_panels(entry, reports), figures
    if isinstance(entry, (catalogue.CopyEntry, catalogue.LdMatrixEntry)):
        return _copy_panels(entry, reports), figures
    if isinstance(entry, catalogue.MmaEntry):
        return _mma_panels(entry), figures
    raise TypeError(f"cannot draw {type(entry).__name__}")


# --------------------------------------------------------------------------- layout


def _wrap(text: str, inches: float, font: float) -> List[str]:
    width = max(20, int(inches / (font * CHAR)))
    return [line for para in text.split("\n") for line in (textwrap.wrap(para, width) or [""])]


def _flow(ps: Sequence[Panel]) -> List[List[Panel]]:
    """Panels left to right, a new row where the next would pass MAX_WIDTH."""
    rows, width = [[]], 0.0
    for p in ps:
        if rows[-1] and width + p.width + MARGIN > MAX_WIDTH:
            rows.append([])
            width = 0.0
        rows[-1].append(p)
        width += p.width + MARGIN
    return rows


def _header(entry, figures: List[str], width: float) -> List[str]:
    return _wrap("\n".join([f"{entry.name} - {entry.description}"] + figures), width - 2 * MARGIN, HEADER_FONT)


def _arrange(entry, ps: List[Panel], figures: List[str]):
    """(figure width, height, header lines, rows of panels) in inches."""
    for p in ps:
        p.lines = _wrap(p.title, p.width, TITLE_FONT)
    rows = _flow(ps)
    width = max(7.0, max(sum(p.width + MARGIN for p in row) + MARGIN for row in rows))
    header = _header(entry, figures, width)
    height = 2 * MARGIN + len(header) * HEADER_FONT * LINE + sum(max(p.height for p in row) + MARGIN for row in rows)
    whole = lambda inches: math.ceil(inches * DPI - 1e-6) / DPI  # noqa: E731  (whole pixels: the PNG's size is exact)
    return whole(width), whole(height), header, rows


def figure_pixels(entry) -> Tuple[int, int]:
    """(width, height) in pixels of the PNG that ``save`` writes for ``entry``."""
    ps, figs = panels(entry)
    w, h, _, _ = _arrange(entry, ps, figs)
    return round(w * DPI), round(h * DPI)


def _tick_step(n: int, cell: float) -> int:
    """Numbers on every step-th row or column: at least 0.2 inches apart, at most 16."""
    step = 1
    while step * cell < 0.2 or n / step > 16:
        step *= 2
    return step


def _draw_panel(fig, p: Panel, left: float, top: float, fig_w: float, fig_h: float) -> None:
    """``p`` with its title's top at ``top`` inches from the figure's bottom."""
    gw, gh = p.grid
    title_h = len(p.lines) * TITLE_FONT * LINE
    fig.text(
        (left + (TICKS if p.ticks else 0)) / fig_w,
        top / fig_h,
        "\n".join(p.lines),
        ha="left",
        va="top",
        fontsize=TITLE_FONT,
        family="monospace",
        linespacing=1.15,
    )
    x0 = left + (TICKS if p.ticks else 0)
    y0 = top - title_h - TICKS * p.ticks - gh
    ax = fig.add_axes([x0 / fig_w, y0 / fig_h, gw / fig_w, gh / fig_h])
    rgb = p.rgb.copy()
    if p.dim_except is not None:
        lit = np.zeros(rgb.shape[:2], bool)
        for m, n in p.dim_except:
            lit[m, n] = True
        rgb[~lit] = rgb[~lit] * 0.3 + 0.7
    ax.imshow(rgb, interpolation="nearest", aspect="auto", extent=(-0.5, p.cols - 0.5, p.rows - 0.5, -0.5))
    _grid_and_ticks(ax, p)
    if p.labels is not None:
        for m in range(p.rows):
            for n in range(p.cols):
                if p.labels[m][n]:
                    ax.text(n, m, p.labels[m][n], ha="center", va="center", fontsize=CELL_FONT, linespacing=0.95)
    if p.crossed:
        ms, ns = zip(*p.crossed)
        # a red frame, not a cross over the label: the label says which lane and bank conflict
        for m, n in p.crossed:
            ax.add_patch(Rectangle((n - 0.47, m - 0.47), 0.94, 0.94, fill=False, edgecolor="red", linewidth=0.9))
    if p.outline:
        r, c, rows, cols = p.outline
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), cols, rows, fill=False, edgecolor="black", linewidth=1.2))
    ax.set_xlim(-0.5, p.cols - 0.5)
    ax.set_ylim(p.rows - 0.5, -0.5)


def _grid_and_ticks(ax, p: Panel) -> None:
    if p.labels is not None:  # cell borders where cells are big enough to read
        ax.set_xticks(np.arange(-0.5, p.cols, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, p.rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.8)
    if not p.ticks:
        ax.set_xticks([])
        ax.set_yticks([])
        return
    xs, ys = range(0, p.cols, _tick_step(p.cols, p.cell)), range(0, p.rows, _tick_step(p.rows, p.cell))
    ax.set_xticks(list(xs), [str(x + p.origin[1]) for x in xs])
    ax.set_yticks(list(ys), [str(y + p.origin[0]) for y in ys])
    ax.tick_params(
        which="both", length=0, labelsize=5.5, top=True, labeltop=True, bottom=False, labelbottom=False, pad=1.5
    )


def render(entry):
    """A matplotlib Figure of ``entry`` (close it with ``plt.close(fig)``)."""
    ps, figs = panels(entry)
    fig_w, fig_h, header, rows = _arrange(entry, ps, figs)
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI)
    fig.text(
        MARGIN / fig_w,
        1 - MARGIN / fig_h,
        "\n".join(header),
        ha="left",
        va="top",
        fontsize=HEADER_FONT,
        family="monospace",
        linespacing=1.15,
    )
    top = fig_h - MARGIN - len(header) * HEADER_FONT * LINE - MARGIN
    for row in rows:
        left = MARGIN
        for p in row:
            _draw_panel(fig, p, left, top, fig_w, fig_h)
            left += p.width + MARGIN
        top -= max(p.height for p in row) + MARGIN
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
