"""The causal / sliding-window mask of the attention kernels, in one place.

Mask types: 0 none, 1 causal from the top-left, 2 causal from the bottom-right. With the
causal offset (0, or Sk - Sq from the bottom-right) key k sees query q when k <= q + offset;
a sliding window (causal masks only) also needs q + offset - window_size < k. Positions past
the sequences (q >= Sq, k >= Sk) are masked too.

The configuration is compile-time where the kernel specialises on it (a Python int / bool),
or runtime values (an Int32 mask type, windows on where window_size > 0) where one kernel
serves every mask. Compile-time flags fold away; the predicates combine with short-circuit
``or`` (selects) for a compile-time mask and with bitwise ops on the runtime flags otherwise
(the forms the kernels were tuned with: the generated code stays theirs).

Coordinates may be global (a block's first query / key plus the element's place in it) or
local to a block (first query / key 0, the sequence bounds and the offset shifted by the
block's corner): the predicates only compare differences.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.host_or_dsl import align_up, cdiv_trunc, ceil_div, max_, min_, or_, select

NO_MASK = 0
CAUSAL_TOP_LEFT = 1
CAUSAL_BOTTOM_RIGHT = 2


def _zero(like):
    """0 as an Int32 in a kernel, a Python int on the host (the block ranges run on both)."""
    return 0 if isinstance(like, int) else Int32(0)


@dataclass(frozen=True)
class AttentionMask:
    """``tile_m`` queries x ``tile_n`` keys a block. ``mask_type``: 0 / 1 / 2 (a Python int), or
    an Int32 read at runtime. ``has_window``: a Python bool, or None for a runtime window (on
    where window_size > 0). ``varlen``: a grid sized for the longest sequence may give a key
    block past its sequence's keys (``m_block_range`` then has none)."""

    tile_m: int
    tile_n: int
    mask_type: Any = NO_MASK
    has_window: Any = False
    varlen: bool = False

    @property
    def static(self) -> bool:
        """Whether the mask type is known at compile time."""
        return isinstance(self.mask_type, int)

    @property
    def causal(self):
        """Python bool (compile time) or Boolean (runtime)."""
        return self.mask_type != NO_MASK

    def windowed(self, window_size):
        """Python bool (compile time) or Boolean (runtime: window_size > 0)."""
        return window_size > 0 if self.has_window is None else self.has_window

    @cute.jit
    def causal_offset(self, seqlen_q, seqlen_k, shift=None):
        """Key k sees query q when k <= q + offset (plus ``shift``: a block's corner, for
        coordinates local to the block)."""
        offset = _zero(seqlen_q) if const_expr(shift is None) else shift
        if const_expr(self.static):
            if const_expr(self.mask_type == CAUSAL_BOTTOM_RIGHT):
                offset = seqlen_k - seqlen_q if const_expr(shift is None) else offset + (seqlen_k - seqlen_q)
        else:
            if self.mask_type == CAUSAL_BOTTOM_RIGHT:
                offset += seqlen_k - seqlen_q
        return offset

    def masked(self, q, k, seqlen_q, seqlen_k, offset, window_size):
        """Whether query q does not see key k (or either lies past its sequence)."""
        if self.static:
            m = cutlass.or_(q >= seqlen_q, k >= seqlen_k)
            m = cutlass.or_(m, k > q + offset) if self.causal else m
            return cutlass.or_(m, k <= q + offset - window_size) if self.has_window else m
        # runtime flags: the visible set as a conjunction (no selects between the cuts)
        seen = (k < seqlen_k) & (q < seqlen_q)
        seen = seen & ~(self.causal & (k > q + offset))
        return ~(seen & ~(self.windowed(window_size) & (k <= q + offset - window_size)))

    def needs_masking(self, q0, key0, seqlen_q, seqlen_k, offset, window_size):
        """Whether the block of queries q0 .. q0 + tile_m - 1 and keys key0 .. key0 + tile_n - 1
        has any masked element (an edge: a sequence end, the diagonal, the window's far side)."""
        m, n = self.tile_m, self.tile_n
        if self.static:
            need = cutlass.or_(q0 + m > seqlen_q, key0 + n > seqlen_k)
            need = cutlass.or_(need, key0 + n - 1 > q0 + offset) if self.causal else need
            return cutlass.or_(need, key0 <= q0 + m - 1 + offset - window_size) if self.has_window else need
        need = (seqlen_k - key0 < n) | (seqlen_q - q0 < m)
        need = need | (self.causal & (q0 + offset - key0 < n - 1))
        return need | (self.windowed(window_size) & (q0 + offset - key0 - window_size + m - 1 >= 0))

    def crosses_diagonal(self, q0, key0, offset, window_size):
        """Whether a block inside the sequences (compile-time mask) has an element past the
        diagonal or the window's far side: the forward's interior key blocks, whose keys all
        lie before the sequence end and whose rows past the query end are never stored. False
        at compile time without a causal mask or a window (the check and the apply fold away)."""
        m, n = self.tile_m, self.tile_n
        need = key0 + n - 1 > q0 + offset if self.causal else False
        if self.has_window:
            need = cutlass.or_(need, key0 <= q0 + m - 1 + offset - window_size)
        return need

    @cute.jit
    def m_block_range(self, n_block, seqlen_q, seqlen_k, window_size):
        """Query blocks [m_min, m_max) that see key block ``n_block`` (the backward's walk;
        causal: from the diagonal on; a window also ends them where the block's last key
        leaves it)."""
        zero = _zero(n_block)
        m_max = cute.ceil_div(seqlen_q, self.tile_m)
        m_min = zero
        if const_expr(self.varlen):
            if n_block * self.tile_n >= seqlen_k:  # the grid covers the longest sequence's keys
                m_max = zero
        if const_expr(self.mask_type != NO_MASK):
            offset = self.causal_offset(seqlen_q, seqlen_k)
            first_q = n_block * self.tile_n - offset
            if first_q > 0:
                m_min = first_q // self.tile_m
            if const_expr(self.has_window):
                last_q = n_block * self.tile_n + self.tile_n - 1 - offset + window_size - 1
                m_last = zero
                if last_q >= 0:
                    m_last = last_q // self.tile_m + 1
                if m_last < m_max:
                    m_max = m_last
        return m_min, m_max

    @cute.jit
    def n_block_range(self, m_block, seqlen_q, seqlen_k, window_size):
        """Key blocks [n_min, n_max) that query block ``m_block`` sees (the forward's walk, the
        mirror of ``m_block_range``: causal ends them at the block's last query's diagonal, a
        window starts them where its first query's window begins)."""
        zero = _zero(m_block)
        n_max = cute.ceil_div(seqlen_k, self.tile_n)
        n_min = zero
        if const_expr(self.mask_type != NO_MASK):
            offset = self.causal_offset(seqlen_q, seqlen_k)
            last_k = m_block * self.tile_m + self.tile_m - 1 + offset
            n_last = zero
            if last_k >= 0:
                n_last = last_k // self.tile_n + 1
            if n_last < n_max:
                n_max = n_last
            if const_expr(self.has_window):
                first_k = m_block * self.tile_m + offset - window_size + 1
                if first_k > 0:
                    n_min = first_k // self.tile_n
        return n_min, n_max

    @cute.jit
    def apply_transposed(self, S, coords, q0, key0, seqlen_q, seqlen_k, offset, window_size):
        """Zero the masked values of a (key, query) fragment ``S`` (rows x columns, as S^T of the
        backward's K Q^T); ``coords``: each value's (key, query) in the block."""
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            q = q0 + coords[0, c][1]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                k = key0 + coords[r, c][0]
                if self.masked(q, k, seqlen_q, seqlen_k, offset, window_size):
                    S[r, c] = Float32(0.0)

    @cute.jit
    def apply(self, S, cS, t0S, q0, key0, seqlen_k, offset, window_size):
        """-inf on the masked values of a (query, key) fragment ``S`` (rows x columns, as S of a
        forward's Q K^T; rows past the sequence are left, nothing reads them). ``cS``, ``t0S``:
        the thread's and thread 0's (query, key) in the block of each value. Columns are compared as
        thread 0's, compile-time constants, against limits shifted by the thread's column
        offset, so no per-value coordinate stays live in a register (a compile-time mask)."""
        col_off = cS[0, 0][1]
        seqlen_limit = seqlen_k - key0 - col_off
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            diagonal = q0 + cS[r, 0][0] + offset - key0 - col_off  # the row's last key seen, shifted
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                col = t0S[0, c][1]
                masked = col >= seqlen_limit
                if const_expr(self.causal):
                    masked = masked or col > diagonal
                if const_expr(self.has_window):
                    masked = masked or col <= diagonal - window_size
                if masked:
                    S[r, c] = -Float32.inf

    # ---- the memory-efficient backward's walk ------------------------------------------------
    # PyTorch's kernel_backward.h walks, for each key block, the query blocks that see it, with
    # its own formulas: these are they, in the C++'s order and rounding (so the kernel traced
    # from them stays the C++ port's). Unlike ``m_block_range`` (the sm90 backward's form:
    # cute.jit, block indices, Python ``if``), they are plain Python over host ints and DSL Int32
    # alike (``cute_kernels/common/host_or_dsl.py``: every choice a ``select``), answer in query
    # rows (a block's first query), and read the mask type and the window at runtime
    # (window_size 0: no window; ``has_window`` is not consulted). ``tile_m`` / ``tile_n`` are
    # the C++'s kBlockSizeI / kBlockSizeJ; users: ``cute_kernels/mem_eff_attention/iteration.py``.

    def query_end(self, seqlen_q):
        """getQueryEnd: seqlen_q rounded up to whole query blocks (the end of a key block's walk,
        and ``first_query_for_key``'s answer for a key block that no query sees)."""
        return align_up(seqlen_q, self.tile_m)

    def walk_offset(self, seqlen_q, seqlen_k):
        """``causal_offset`` as the C++'s shift: a select on the mask type (0 from the top-left,
        seqlen_k - seqlen_q from the bottom-right)."""
        return select(self.mask_type == CAUSAL_BOTTOM_RIGHT, seqlen_k - seqlen_q, 0)

    def first_query_for_key(self, key_start, seqlen_q, seqlen_k, window_size):
        """getSmallestQueryForKey: the first query block (as its first row, a multiple of tile_m)
        with an unmasked element in the key block starting at key ``key_start``; ``query_end``
        when the mask hides the whole key block; 0 without a mask."""
        shift = self.walk_offset(seqlen_q, seqlen_k)
        window = select(window_size == 0, seqlen_q + seqlen_k, window_size)
        last_key_for_block = min_(key_start + self.tile_n, seqlen_k) - 1
        first_query = key_start - shift
        last_query = last_key_for_block - shift + window - 1
        empty = or_(last_query < 0, first_query >= seqlen_q)
        # Clamped to >= 0 before dividing (as the C++), so floor == trunc.
        first_block = (max_(0, first_query) // self.tile_m) * self.tile_m
        masked = select(empty, self.query_end(seqlen_q), first_block)
        return select(self.mask_type == NO_MASK, 0, masked)

    def last_query_for_key(self, key_start, seqlen_q, seqlen_k, window_size):
        """The last query row that sees the key block starting at ``key_start`` through a window
        (its last key's window's far end; may be past the queries or negative). Meaningful with
        window_size > 0 only: incrIteration's stop for a windowed walk."""
        shift = self.walk_offset(seqlen_q, seqlen_k)
        last_key_for_block = min_(key_start + self.tile_n, seqlen_k) - 1
        return last_key_for_block - shift + window_size - 1

    def key_blocks_for_query(self, query_start, seqlen_q, seqlen_k, window_size):
        """How many key blocks have an unmasked element for the query block starting at row
        ``query_start`` (getNumParallelBlocksForQuery before its min with the key splits):
        every key block without a mask; with one, those from the first query's window start to
        the last query's diagonal, in C++ integer arithmetic (truncating division)."""
        bj = self.tile_n
        shift = self.walk_offset(seqlen_q, seqlen_k)
        last_query_for_block = min_(query_start + self.tile_m, seqlen_q) - 1
        last_key_for_block = min_(last_query_for_block + shift, seqlen_k - 1)
        no_window = window_size == 0
        first_key_for_block = select(no_window, 0, max_(query_start - window_size + 1 + shift, 0))
        # last_key_for_block may be negative here: C++ truncates (the result is then
        # overridden by the `< 0` test below, but keep C++ arithmetic anyway).
        last_kb = cdiv_trunc(last_key_for_block, bj)
        masked_blocks = select(no_window, last_kb + 1, last_kb - first_key_for_block // bj + 1)
        masked_blocks = select(or_(last_key_for_block < 0, first_key_for_block >= seqlen_k), 0, masked_blocks)
        return select(self.mask_type == NO_MASK, ceil_div(seqlen_k, bj), masked_blocks)
