"""Tensor views that move no data, shared by the attention kernels (sm80- and sm90-structured)."""

import cutlass.cute as cute


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """The (cols x rows [x stages]) view of a (rows x cols [x stages]) shared tile (no data moves)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """``t`` with its modes reordered (e.g. [B, S, H, D] -> (S, D, H, B) for a TMA tile)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(modes)))


def rows_view(t: cute.Tensor, rows: int) -> cute.Tensor:
    """The first ``rows`` rows of a (rows x cols [x stages]) shared tile, its other modes whole
    (no data moves; with a swizzle, ``rows`` a multiple of its atom's rows)."""
    sizes = [cute.size(t, mode=[m]) for m in range(cute.rank(t))]
    stride, step = [], 1
    for n in sizes:
        stride.append(step)
        step *= n
    return cute.composition(t, cute.make_layout((rows, *sizes[1:]), stride=tuple(stride)))
