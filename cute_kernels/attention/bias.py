"""An additive attention bias B [B, H, Sq, Sk] read into a thread's score fragment, in the
fragment's orientation: queries as rows (a forward's S) or keys as rows (a backward's S^T)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def load_bias_fragment(gB, B, coords, q0, key0, seqlen_q, seqlen_k, keys_as_rows: cutlass.Constexpr):
    """B of one head (``gB``: (Sq, Sk)) into the fragment ``B`` (rows x columns) whose values sit at
    ``coords`` in the block at (q0, key0): (key, query) pairs with ``keys_as_rows``, else
    (query, key). Positions past the sequences read the last row / key instead (never out of
    bounds: the caller masks them)."""
    if cutlass.const_expr(keys_as_rows):
        for c in cutlass.range_constexpr(cute.size(B, mode=[1])):
            q = cutlass.min(q0 + coords[0, c][1], seqlen_q - 1)
            for r in cutlass.range_constexpr(cute.size(B, mode=[0])):
                B[r, c] = gB[q, cutlass.min(key0 + coords[r, c][0], seqlen_k - 1)]
    else:
        for r in cutlass.range_constexpr(cute.size(B, mode=[0])):
            q = cutlass.min(q0 + coords[r, 0][0], seqlen_q - 1)
            for c in cutlass.range_constexpr(cute.size(B, mode=[1])):
                B[r, c] = gB[q, cutlass.min(key0 + coords[r, c][1], seqlen_k - 1)]
