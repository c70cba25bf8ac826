"""Plain-text views of catalogue entries (what ``python -m layouts show`` prints).

Small grids are printed whole; bigger ones are cut to their top-left corner, with
each thread's first elements listed instead, so the output stays a screenful.
"""

from __future__ import annotations

from typing import Callable, List

from . import catalogue
from .algebra import TVLayout

MAX_ROWS = 16
MAX_COLS = 32


def grid(rows: int, cols: int, cell: Callable[[int, int], str]) -> str:
    """A labelled table of ``cell(m, n)``, clipped to MAX_ROWS x MAX_COLS."""
    r, c = min(rows, MAX_ROWS), min(cols, MAX_COLS)
    body = [[cell(m, n) for n in range(c)] for m in range(r)]
    width = max(len(str(cols - 1)), max(len(s) for row in body for s in row))
    head = " " * 5 + " ".join(f"{n:>{width}}" for n in range(c)) + (" ..." if c < cols else "")
    lines = [head] + [
        f"{m:>4} " + " ".join(f"{s:>{width}}" for s in row) + (" ..." if c < cols else "") for m, row in enumerate(body)
    ]
    if r < rows:
        lines.append("  ...")
    if (r, c) != (rows, cols):
        lines.append(f"  (top-left {r}x{c} of {rows}x{cols})")
    return "\n".join(lines)


def tv_grid(tv: TVLayout) -> str:
    owners = tv.owners()

    def cell(m, n):
        o = owners[m][n]
        return f"T{o[0][0]}v{o[0][1]}" if o else "."

    out = [f"{tv}  ({tv.num_threads} threads x {tv.num_values} values)", grid(*tv.tile, cell)]
    if tv.tile[1] > MAX_COLS or tv.tile[0] > MAX_ROWS:
        for t in sorted({0, 1, tv.num_threads - 1}):
            out.append(f"  thread {t}: {tv.thread_coords(t)[:8]}")
    return "\n".join(out)


def _access_name(access) -> str:
    if isinstance(access, str):  # a copy / ldmatrix entry of the catalogue
        return access
    return access.label + (f" ({access.detail})" if access.detail else "")


def describe(entry) -> str:
    lines: List[str] = [f"{entry.name} [{entry.kind}]", f"  {entry.description}"]
    if isinstance(entry, catalogue.LayoutEntry):
        lines += [f"layout {entry.layout}", grid(*entry.tile, lambda m, n: str(entry.layout((m, n))))]
    elif isinstance(entry, catalogue.SmemEntry):
        eb, view = entry.elem_bits, entry.view
        lines += [f"layout {entry.layout} ({entry.dtype})"]
        if view is not entry.layout:
            lines += [f"  as rows x the rest: {view}"]
        lines += [
            "element offset per (row, col):",
            grid(*entry.tile, lambda m, n: str(view((m, n)))),
            "bank (4-byte word mod 32) per (row, col):",
            grid(*entry.tile, lambda m, n: str((view((m, n)) * eb // 8 // 4) % 32)),
            "accesses (python -m layouts conflicts NAME counts them):",
        ]
        lines += [f"  {_access_name(a)}" for a in entry.accesses]
    elif isinstance(entry, catalogue.CopyEntry):
        s = entry.spec
        lines += [
            f"spec {s}",
            f"{s.copy_bits}-bit accesses, {entry.memory}, tile {s.tiler[0]}x{s.tiler[1]}",
            tv_grid(entry.tv()),
        ]
    elif isinstance(entry, catalogue.LdMatrixEntry):
        lines += [
            "source (lane -> the 16-byte row it addresses):",
            tv_grid(entry.src_tv()),
            "destination (lane -> fragment registers):",
            tv_grid(entry.dst_tv()),
        ]
    elif isinstance(entry, catalogue.MmaEntry):
        a = entry.atom
        lines += [
            f"{a.name} M,N,K = {a.shape_mnk}",
            "A (M x K):",
            tv_grid(a.a),
            "B (N x K):",
            tv_grid(a.b),
            "C (M x N):",
            tv_grid(a.c),
        ]
        if entry.tiled:
            t = entry.tiled
            lines += [
                f"tiled: warps {t.atom_layout}, permutation {t.permutation}; C over the tile:",
                tv_grid(entry.tiled_c()),
            ]
    return "\n".join(lines)
