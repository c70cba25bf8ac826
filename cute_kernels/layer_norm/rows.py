"""What the LayerNorm / RMSNorm forward and backward row kernels share (Apex's kernel traits).

Rows are grid-strided over a persistent grid of ``ctas_per_col`` CTAs (times ``ctas_per_row``
along a row, one cluster). Each thread holds ``ldgs`` vectors of ``vec`` elements of a row, at
Apex's interleaving: vector ``it`` of thread ``t`` of CTA ``bidn`` starts at column
((it * CTAS_PER_ROW + bidn) * THREADS_PER_ROW + t) * vec. Row blocks arrive through a cp.async
ring in shared memory (``RowRing``); per-row sums are all-reduced over the row's threads
(``RowSums``): warp shuffles, then shared memory across the warps of a row, then distributed
shared memory across the CTAs of a cluster.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.dsmem import store_async_cluster, store_cluster
from cute_kernels.common.row_reduce import row_allreduce_sum
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
    col_tile = [tiles.col_tile(it, th.bidn) for it in range(tiles.ldgs)]
    col_ok = [tiles.vector_index(col_tile[it], th.tid_r) * tiles.vec < n for it in range(tiles.ldgs)]
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


def _exchanges(tiles: RowTiles) -> bool:
    """Whether a row's sums leave its warp (through shared memory)."""
    return tiles.warps_n > 1 or tiles.ctas_per_row > 1


@cute.jit
def _init_mbarriers(mbar, tidx):
    if tidx == 0:
        cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init(mbar + 1, 1)
    cute.arch.mbarrier_init_fence()


@dataclass(frozen=True)
class RowSums:
    """All-reduce of ``num_sums`` fp32 values a thread over the threads of its row (every CTA of
    its cluster): warp shuffles, then each warp's sums to every CTA of the row through one of two
    alternating exchange buffers ``sRed`` [buffer, rank in cluster, row of CTA, warp of row(,
    sum)]; then all add them in one order, so all agree bit for bit. Across a cluster the sums
    travel by ``st.async`` onto a transaction-count mbarrier per buffer of the receiving CTA
    (``tiles.exchange_mbarriers``), or by plain remote stores followed by a cluster barrier.
    Frozen: the kernels' dynamic loops only read it."""

    tiles: RowTiles
    th: RowThread
    num_sums: int
    sRed: cute.Tensor  # None where a row is one warp's
    mbar: cute.Pointer  # None but for the st.async exchange

    @property
    def exchange(self) -> bool:
        return _exchanges(self.tiles)

    @staticmethod
    def allocate(tiles: RowTiles, smem, th: RowThread, num_sums: int) -> "RowSums":
        sRed = None
        mbar = None
        if _exchanges(tiles):
            shape = (2, tiles.ctas_per_row, tiles.rows_per_cta, tiles.warps_n) + ((num_sums,) if num_sums > 1 else ())
            order = tuple(reversed(range(len(shape))))
            sRed = smem.allocate_tensor(Float32, cute.make_ordered_layout(shape, order=order), byte_alignment=16)
        if tiles.exchange_mbarriers:
            # one per sRed buffer: the local arrive.expect_tx plus every entry's complete_tx
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            _init_mbarriers(mbar, th.tidx)
        if tiles.ctas_per_row > 1:
            # every CTA of the cluster runs (and has its mbarriers initialised) before
            # anyone writes into its shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        return RowSums(tiles, th, num_sums, sRed, mbar)

    def _sum_mode(self, j) -> tuple:
        """The trailing sRed coordinate of sum ``j`` (none when there is one sum)."""
        return (j,) if self.num_sums > 1 else ()

    @cute.jit
    def allreduce(self, sums: list, buf, phase) -> list:
        """The row totals of ``sums``, through exchange buffer ``buf``, whose mbarrier (st.async
        exchange) completes phase parity ``phase``.

        Buffer ``buf`` is reused two all-reduces later. No overwrite before it is read: a peer
        sends all-reduce r+2 into it only after its wait for r+1, which needs every warp of this
        CTA to have sent r+1, which each does after reading r (sync_warp orders all lanes' reads
        before lane 0's sends). A complete_tx landing before this CTA's arrive.expect_tx only
        makes the tx-count negative for a while: the phase also needs the arrival. Through
        barriers, r+2's writes follow r+1's barrier, which every thread reaches after reading r.
        """
        t = self.tiles
        sums = [row_allreduce_sum(s, t.lanes_per_row) for s in sums]
        if const_expr(self.exchange):
            self.send(sums, buf, phase)
            sums = [self.total(buf, j) for j in range(self.num_sums)]
        return sums

    @cute.jit
    def send(self, values: list, buf, phase):
        """Each warp's ``values`` (one per sum, alike in all its lanes) to every CTA of the row,
        through buffer ``buf``; returns once all warps' have arrived here (``allreduce``'s
        reuse rules)."""
        if const_expr(self.tiles.exchange_mbarriers):
            self.send_async(values, buf, phase)
        else:
            self.send_with_barrier(values, buf)

    @cute.jit
    def send_async(self, sums: list, buf, phase):
        """Each warp's sums to every CTA by st.async; wait until all have arrived here."""
        th, sRed, mbar = self.th, self.sRed, self.mbar
        if th.tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + buf, self.exchange_bytes)
        cute.arch.sync_warp()
        if th.lane == 0:
            coord = (buf, th.bidn, th.row_in_cta, th.warp_n) + self._sum_mode(0)
            ptr = sRed.iterator + cute.crd2idx(coord, sRed.layout)
            for peer in cutlass.range_constexpr(self.tiles.ctas_per_row):  # itself included
                store_async_cluster(ptr, mbar + buf, sums, Int32(peer))
        cute.arch.mbarrier_wait(mbar + buf, phase)

    @cute.jit
    def send_with_barrier(self, sums: list, buf):
        """Each warp's sums to every CTA by plain stores; then a barrier."""
        th, sRed, cpr = self.th, self.sRed, self.tiles.ctas_per_row
        if th.lane == 0:
            for j in cutlass.range_constexpr(self.num_sums):
                coord = (buf, th.bidn, th.row_in_cta, th.warp_n) + self._sum_mode(j)
                if const_expr(cpr > 1):
                    ptr = sRed.iterator + cute.crd2idx(coord, sRed.layout)
                    for peer in cutlass.range_constexpr(cpr):
                        store_cluster(ptr, sums[j], Int32(peer))
                else:
                    sRed[coord] = sums[j]
        if const_expr(cpr > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    @property
    def exchange_bytes(self) -> int:
        """Bytes one exchange brings to a CTA: every CTA's, every warp's values for its rows."""
        return self.tiles.exchange_bytes(self.num_sums)

    @property
    def entries(self) -> int:
        """A row's entries in an exchange buffer: one per warp of each CTA of the cluster."""
        return self.tiles.ctas_per_row * self.tiles.warps_n

    @cute.jit
    def entry(self, buf, e, j) -> Float32:
        """Value ``j`` of entry ``e`` (CTA e // warps_n, warp e % warps_n) of this thread's row."""
        w = self.tiles.warps_n
        return self.sRed[(buf, e // w, self.th.row_in_cta, e % w) + self._sum_mode(j)]

    @cute.jit
    def moments(self, buf, n_f, counts) -> tuple:
        """(mean, M2) of this thread's row from every warp's exchanged (sum s_e, sum of squares
        q_e about its own mean): Chan's parallel merge, M2 = sum_e q_e + (s_e - n_e mean)^2 / n_e,
        exact to rounding (no E[x^2] - mean^2 cancellation). Lane l takes entries l, l + 32,
        ... (``counts``: their (n_e, 1 / n_e), zeros for none) and the warp adds them by
        shuffles: every warp of the row computes the same, so all agree bit for bit."""
        parts = []
        s_sum = Float32(0.0)
        for i in cutlass.range_constexpr(len(counts)):
            e = self.th.lane + 32 * i
            s_e, q_e = Float32(0.0), Float32(0.0)
            if e < self.entries:
                s_e, q_e = self.entry(buf, e, 0), self.entry(buf, e, 1)
            parts.append((s_e, q_e))
            s_sum = s_sum + s_e
        mean = row_allreduce_sum(s_sum, 32) / n_f
        m2 = Float32(0.0)
        for i in cutlass.range_constexpr(len(counts)):
            (s_e, q_e), (n_e, inv_n_e) = parts[i], counts[i]
            d = s_e - n_e * mean
            m2 = m2 + (q_e + d * d * inv_n_e)
        return mean, row_allreduce_sum(m2, 32)

    @cute.jit
    def total(self, buf, j) -> Float32:
        """Sum ``j`` of the row over every CTA's, every warp's entry, in one order."""
        total = Float32(0.0)
        for rank in cutlass.range_constexpr(self.tiles.ctas_per_row):
            for w in cutlass.range_constexpr(self.tiles.warps_n):
                total = total + self.sRed[(buf, rank, self.th.row_in_cta, w) + self._sum_mode(j)]
        return total


def finish(tiles: RowTiles):
    """Before the CTA exits: nothing of the ring may land after it, and (st.async exchange) a
    CTA's last st.async into a peer may still be in flight when it is done; once all CTAs
    arrived here, each has waited for everything sent to it."""
    cute.arch.cp_async_wait_group(0)
    if tiles.exchange_mbarriers:
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
