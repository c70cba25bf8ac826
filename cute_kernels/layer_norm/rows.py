"""What the LayerNorm / RMSNorm forward and backward row kernels share (Apex's kernel traits).

Rows are grid-strided over a persistent grid of ``ctas_per_col`` CTAs (times ``ctas_per_row``
along a row, one cluster). Each thread holds ``ldgs`` vectors of ``vec`` elements of a row, at
Apex's interleaving: vector ``it`` of thread ``t`` of CTA ``bidn`` starts at column
((it * CTAS_PER_ROW + bidn) * THREADS_PER_ROW + t) * vec. Row blocks arrive through a cp.async
ring in shared memory (``RowRing``).
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from layouts.layer_norm import SMEM_CARVEOUT, RowTiles


def launch(kernel, tiles: RowTiles, ctas_per_col, stream):
    """Launch a row kernel on its persistent grid of ``ctas_per_col`` CTAs (times
    ``ctas_per_row`` where a row spans a cluster)."""
    cpr = tiles.ctas_per_row
    shape = {"grid": [ctas_per_col, 1, 1]}
    if cpr > 1:
        shape = {"grid": [ctas_per_col * cpr, 1, 1], "cluster": [cpr, 1, 1]}
    kernel.launch(
        **shape,
        block=[tiles.num_threads, 1, 1],
        min_blocks_per_mp=tiles.ctas_per_sm,
        preferred_smem_carveout=SMEM_CARVEOUT,
        stream=stream,
    )


class RowThread(NamedTuple):
    """This thread's place: CTA ``bidn`` of its row's cluster, row block ``bidm`` of the grid;
    row ``row_in_cta`` of the CTA, thread ``tid_r`` of that row, in warp ``warp_n`` of it."""

    tidx: Int32
    bidn: Int32
    bidm: Int32
    row_in_cta: Int32
    tid_r: Int32
    warp_n: Int32
    lane: Int32


def row_thread(tiles: RowTiles) -> RowThread:
    tidx, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    bidn = bid % tiles.ctas_per_row
    bidm = bid // tiles.ctas_per_row
    row_in_cta = tidx // tiles.threads_per_row
    tid_r = tidx % tiles.threads_per_row
    return RowThread(tidx, bidn, bidm, row_in_cta, tid_r, tid_r // 32, cute.arch.lane_idx())


def vector_columns(tiles: RowTiles, th: RowThread, n) -> tuple:
    """(column tiles, whether inside the row) of this thread's vectors; the vector divides N,
    so a vector is wholly inside the row or wholly past it."""
    col_tile = [it * tiles.ctas_per_row + th.bidn for it in range(tiles.ldgs)]
    col_ok = [(col_tile[it] * tiles.threads_per_row + th.tid_r) * tiles.vec < n for it in range(tiles.ldgs)]
    return col_tile, col_ok


def partition_rows(copy, mT: cute.Tensor, tiles: RowTiles, tidx, load: bool):
    """This thread's view of a [rows, N] tensor: (CPY, 1, 1, row blocks, column tiles), a
    column tile being one vector per thread."""
    thr = copy.get_slice(tidx)
    tiled = cute.local_tile(mT, tiles.tile, (None, None))
    return thr.partition_S(tiled) if load else thr.partition_D(tiled)


@cute.jit
def load_param(mP, dtype: cutlass.Constexpr, tiles: RowTiles, copy_x, tXg, tidx, n, col_tile, col_ok):
    """A [N] parameter (gamma, beta) in ``dtype`` held in registers, laid out as this thread's
    vectors of x (zeros past N); None without it."""
    if const_expr(mP is None):
        return None
    mRows = cute.make_tensor(mP.iterator, cute.make_layout((tiles.rows_per_cta, n), stride=(0, 1)))
    tPg = copy_x.get_slice(tidx).partition_S(cute.local_tile(mRows, tiles.tile, (0, None)))
    rP = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], dtype) for _ in range(tiles.ldgs)]
    for it in cutlass.range_constexpr(tiles.ldgs):
        rP[it].fill(0.0)
        if col_ok[it]:
            cute.autovec_copy(tPg[None, 0, 0, col_tile[it]], rP[it])
    return rP


@dataclass(frozen=True)
class RowRing:
    """The cp.async ring: ``stages`` row blocks of each input in flight per CTA (this CTA's row
    blocks: bidm, bidm + ctas_per_col, ...). Each thread copies, then reads back, only its own
    vectors: no barrier, just wait_group. Frozen: the kernels' dynamic loops only read it."""

    tiles: RowTiles
    th: RowThread
    rows: Int32
    ctas_per_col: Int32
    col_tile: list
    col_ok: list
    inputs: list  # (copy, tXg, tXs (CPY, 1, 1, ldgs, stages)) of each input
    my_blocks: Int32  # all threads of a cluster agree

    @staticmethod
    def allocate(tiles: RowTiles, smem, th: RowThread, rows, ctas_per_col, col_tile, col_ok, inputs) -> "RowRing":
        """``inputs``: (dtype, copy, tXg) of each [rows, N] input, ``tXg`` its ``partition_rows``."""
        shape, order = tiles.ring()
        rings = [
            smem.allocate_tensor(dtype, cute.make_ordered_layout(shape, order=order), byte_alignment=16)
            for dtype, _, _ in inputs
        ]
        parts = [(copy, tXg, copy.get_slice(th.tidx).partition_D(s)) for (_, copy, tXg), s in zip(inputs, rings)]
        num_row_blocks = cute.ceil_div(rows, tiles.rows_per_cta)
        my_blocks = cute.ceil_div(num_row_blocks - th.bidm, ctas_per_col)
        return RowRing(tiles, th, rows, ctas_per_col, col_tile, col_ok, parts, my_blocks)

    @cute.jit
    def start(self):
        """The first ``stages - 1`` row blocks."""
        for k in cutlass.range_constexpr(self.tiles.stages - 1):
            self.load(k)

    @cute.jit
    def load(self, k):
        """Start copying this CTA's ``k``-th row block into ring stage k % stages; one commit group."""
        t = self.tiles
        rb = self.th.bidm + k * self.ctas_per_col
        row = rb * t.rows_per_cta + self.th.row_in_cta
        stage = k % t.stages
        if k < self.my_blocks and row < self.rows:
            for it in cutlass.range_constexpr(t.ldgs):
                if self.col_ok[it]:
                    for copy, tXg, tXs in self.inputs:
                        cute.copy(copy, tXg[None, 0, 0, rb, self.col_tile[it]], tXs[None, 0, 0, it, stage])
        cute.arch.cp_async_commit_group()  # empty groups keep the count uniform

    @cute.jit
    def read(self, k):
        """Wait for row block ``k``: (rb, row, row_ok, each input's vectors of this thread in
        registers, zeros past the tensor)."""
        t = self.tiles
        cute.arch.cp_async_wait_group(t.stages - 1)  # block k has landed
        stage = k % t.stages
        rb = self.th.bidm + k * self.ctas_per_col
        row = rb * t.rows_per_cta + self.th.row_in_cta
        row_ok = row < self.rows
        regs = [[cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0]) for _ in range(t.ldgs)] for _, tXg, _ in self.inputs]
        for it in cutlass.range_constexpr(t.ldgs):
            for rIn, (_, _, tXs) in zip(regs, self.inputs):
                cute.autovec_copy(tXs[None, 0, 0, it, stage], rIn[it])
            if not (row_ok and self.col_ok[it]):  # past the tensor: contributes zeros
                for rZero in regs:
                    rZero[it].fill(0.0)
        return rb, row, row_ok, regs


def finish(tiles: RowTiles):
    """Before the CTA exits: nothing of the ring may land after it, and (st.async exchange) a
    CTA's last st.async into a peer may still be in flight when it is done; once all CTAs
    arrived here, each has waited for everything sent to it."""
    cute.arch.cp_async_wait_group(0)
    if tiles.exchange_mbarriers:
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
