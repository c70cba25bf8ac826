"""LayerNorm / RMSNorm backward, after Apex's ``ln_bwd_kernel`` (fast_layer_norm).

Per row, with the forward's mean mu and rstd (RMSNorm: mu = 0):

    y  = (x - mu) * rstd          dy = gamma * dz
    dx = rstd * (dy - mean(dy * y) * y - mean(dy))      (RMSNorm: no mean(dy) term)

and per CTA the column partials dgamma_part = sum dz * y, dbeta_part = sum dz over its
rows, which ``LnBwdFinalize`` reduces. Rows are grid-strided over a persistent grid
of ``ctas_per_col`` CTAs (times ``ctas_per_row`` along a row). Each thread holds
``ldgs`` vectors of ``vec`` elements of a row, Apex's interleaving: vector ``it`` of
thread ``t`` of CTA ``bidn`` starts at column ((it * CTAS_PER_ROW + bidn) *
THREADS_PER_ROW + t) * vec. The row all-reduce of (sum dy, sum dy*y) runs through warp
shuffles, then shared memory across the warps of a row, then distributed shared memory
across the CTAs of a cluster; every participant adds the same values in the same
order, so all agree bit for bit and the results are deterministic. Across a cluster the
sums travel by ``st.async`` and each CTA waits on a transaction-count mbarrier of its
own (``tiles.cluster_exchange == "mbarrier"``), or by plain remote stores followed by a
full cluster barrier per row (``"barrier"``).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.column_partials import ColumnPartials
from cute_kernels.common.dsmem import store_async_cluster2, store_cluster
from cute_kernels.common.row_reduce import row_allreduce_sum
from layouts.layer_norm import LnBwdTiles

from . import rows as R


class LnBwd:
    """Configuration: dtypes of x/dx, dz, gamma; RMSNorm or LayerNorm; which grads; tiles."""

    def __init__(self, in_dtype, out_dtype, w_dtype, tiles: LnBwdTiles, is_rms: bool, has_gamma: bool, has_dbeta: bool):
        self.in_dtype = in_dtype
        self.out_dtype = out_dtype
        self.w_dtype = w_dtype
        self.tiles = tiles
        self.is_rms = is_rms
        self.has_gamma = has_gamma
        self.has_dbeta = has_dbeta

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [rows, N] input of the forward
        mDZ: cute.Tensor,  # [rows, N] gradient of the output
        mGamma: cute.Tensor,  # [N] weight (None: no affine weight)
        mMu: cute.Tensor,  # [rows] fp32 mean (None for RMSNorm)
        mRs: cute.Tensor,  # [rows] fp32 rstd
        mDX: cute.Tensor,  # [rows, N]
        mDGammaPart: cute.Tensor,  # [ctas_per_col, N] fp32 (None without weight)
        mDBetaPart: cute.Tensor,  # [ctas_per_col, N] fp32 (None without bias)
        ctas_per_col: Int32,
        stream: cuda.CUstream,
    ):
        t = self.tiles
        copy_x = t.gmem_copy(self.in_dtype.width, load=True).build(self.in_dtype)
        copy_dz = t.gmem_copy(self.out_dtype.width, load=True).build(self.out_dtype)
        copy_dx = t.gmem_copy(self.in_dtype.width, load=False).build(self.in_dtype)
        kernel = self.kernel(
            mX, mDZ, mGamma, mMu, mRs, mDX, mDGammaPart, mDBetaPart, ctas_per_col, copy_x, copy_dz, copy_dx
        )
        R.launch(kernel, t, ctas_per_col, stream)

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mDZ: cute.Tensor,
        mGamma: cute.Tensor,
        mMu: cute.Tensor,
        mRs: cute.Tensor,
        mDX: cute.Tensor,
        mDGammaPart: cute.Tensor,
        mDBetaPart: cute.Tensor,
        ctas_per_col: Int32,
        copy_x: cute.TiledCopy,
        copy_dz: cute.TiledCopy,
        copy_dx: cute.TiledCopy,
    ):
        t = self.tiles
        cpr, tpr, vec, ldgs = t.ctas_per_row, t.threads_per_row, t.vec, t.ldgs
        rpc, stages, warps_n = t.rows_per_cta, t.stages, t.warps_n
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        bidn = bid % cpr
        bidm = bid // cpr
        row_in_cta = tidx // tpr
        tid_r = tidx % tpr
        warp_n = tid_r // 32
        lane = cute.arch.lane_idx()
        rows, n = mX.shape
        inv_n = Float32(1.0) / Float32(n)

        # (rpc, tpr * vec, row blocks, column tiles): a column tile is one vector per thread
        tile = t.tile
        tXg = copy_x.get_slice(tidx).partition_S(cute.local_tile(mX, tile, (None, None)))
        tDZg = copy_dz.get_slice(tidx).partition_S(cute.local_tile(mDZ, tile, (None, None)))
        tDXg = copy_dx.get_slice(tidx).partition_D(cute.local_tile(mDX, tile, (None, None)))

        # Column tile and first column of each of this thread's vectors; the vector
        # divides N, so a vector is wholly inside the row or wholly past it.
        col_tile = [it * cpr + bidn for it in range(ldgs)]
        col_ok = [(col_tile[it] * tpr + tid_r) * vec < n for it in range(ldgs)]

        rGamma = None
        if const_expr(self.has_gamma):
            mGammaRows = cute.make_tensor(mGamma.iterator, cute.make_layout((rpc, n), stride=(0, 1)))
            gGamma = cute.local_tile(mGammaRows, tile, (0, None))
            tGg = copy_x.get_slice(tidx).partition_S(gGamma)  # thread/value layout of x
            rGamma = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], self.w_dtype) for _ in range(ldgs)]
            for it in cutlass.range_constexpr(ldgs):
                rGamma[it].fill(0.0)
                if col_ok[it]:
                    cute.autovec_copy(tGg[None, 0, 0, col_tile[it]], rGamma[it])

        # fp32 column sums of this thread's vectors over all the rows it visits
        acc_dzy = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], Float32) for _ in range(ldgs)]
        acc_dz = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], Float32) for _ in range(ldgs)]
        for it in cutlass.range_constexpr(ldgs):
            acc_dzy[it].fill(0.0)
            acc_dz[it].fill(0.0)

        smem = cutlass.memory.SmemAllocator()
        exchange = warps_n > 1 or cpr > 1
        use_mbar = t.exchange_mbarriers
        sRed = None
        mbar = None
        if const_expr(exchange):
            # [buffer, rank in cluster, row of CTA, warp of row, (sum dy, sum dy*y)]
            sRed = smem.allocate_tensor(
                Float32,
                cute.make_ordered_layout((2, cpr, rpc, warps_n, 2), order=(4, 3, 2, 1, 0)),
                byte_alignment=16,
            )
        if const_expr(use_mbar):
            # one per sRed buffer: the local arrive.expect_tx plus every entry's complete_tx
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            if tidx == 0:
                cute.arch.mbarrier_init(mbar, 1)
                cute.arch.mbarrier_init(mbar + 1, 1)
            cute.arch.mbarrier_init_fence()
        if const_expr(cpr > 1):
            # every CTA of the cluster runs (and has its mbarriers initialised) before
            # anyone writes into its shared memory
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        # The ring: ``stages`` row blocks of x and dz in flight per CTA. Each thread
        # copies, then reads back, only its own vectors: no barrier, just wait_group.
        ring, ring_order = t.ring()
        sX = smem.allocate_tensor(self.in_dtype, cute.make_ordered_layout(ring, order=ring_order), byte_alignment=16)
        sDZ = smem.allocate_tensor(self.out_dtype, cute.make_ordered_layout(ring, order=ring_order), byte_alignment=16)
        tXs = copy_x.get_slice(tidx).partition_D(sX)  # (CPY, 1, 1, ldgs, stages)
        tDZs = copy_dz.get_slice(tidx).partition_D(sDZ)

        num_row_blocks = cute.ceil_div(rows, rpc)
        # row blocks of this CTA: bidm, bidm + ctas_per_col, ... (all threads agree)
        my_blocks = cute.ceil_div(num_row_blocks - bidm, ctas_per_col)
        for k in cutlass.range_constexpr(stages - 1):
            self.load_block(
                k,
                bidm,
                ctas_per_col,
                my_blocks,
                rows,
                row_in_cta,
                col_tile,
                col_ok,
                copy_x,
                copy_dz,
                tXg,
                tDZg,
                tXs,
                tDZs,
            )
        parity = Int32(0)
        # The row statistics are loaded one row block ahead: loaded after the wait, their
        # latency was exposed once per row.
        mu, rs = self.row_stats(mMu, mRs, (bidm * rpc + row_in_cta), rows)
        for k in cutlass.range(my_blocks, unroll=1):
            self.load_block(
                k + stages - 1,
                bidm,
                ctas_per_col,
                my_blocks,
                rows,
                row_in_cta,
                col_tile,
                col_ok,
                copy_x,
                copy_dz,
                tXg,
                tDZg,
                tXs,
                tDZs,
            )
            mu_next, rs_next = self.row_stats(mMu, mRs, (bidm + (k + 1) * ctas_per_col) * rpc + row_in_cta, rows)
            cute.arch.cp_async_wait_group(stages - 1)  # block k has landed
            stage = k % stages
            rb = bidm + k * ctas_per_col
            row = rb * rpc + row_in_cta
            row_ok = row < rows
            rX = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0]) for _ in range(ldgs)]
            rDZ = [cute.make_rmem_tensor_like(tDZg[None, 0, 0, 0, 0]) for _ in range(ldgs)]
            for it in cutlass.range_constexpr(ldgs):
                cute.autovec_copy(tXs[None, 0, 0, it, stage], rX[it])
                cute.autovec_copy(tDZs[None, 0, 0, it, stage], rDZ[it])
                if not (row_ok and col_ok[it]):  # past the tensor: contributes zeros
                    rX[it].fill(0.0)
                    rDZ[it].fill(0.0)

            # this thread's share of sum(dy) and sum(dy * y); the column partials
            s_dy = Float32(0.0)
            s_dyy = Float32(0.0)
            for it in cutlass.range_constexpr(ldgs):
                y, dz, dy = self.normalized(rX[it], rDZ[it], rGamma, it, mu, rs)
                s_dyy = s_dyy + (dy * y).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                acc_dzy[it].store(acc_dzy[it].load() + dz * y)
                if const_expr(not self.is_rms):
                    s_dy = s_dy + dy.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if const_expr(self.has_dbeta):
                    acc_dz[it].store(acc_dz[it].load() + dz)
            sums = [row_allreduce_sum(s_dy, t.lanes_per_row), row_allreduce_sum(s_dyy, t.lanes_per_row)]

            if const_expr(exchange):
                # each warp's sums to every CTA of the row; then all add them in one order
                if const_expr(use_mbar):
                    # Buffer ``parity`` is reused every second row; its mbarrier phase
                    # flips then. No overwrite before it is read: a peer sends row k+2 into
                    # it only after its wait for row k+1, which needs every warp of this CTA
                    # to have sent row k+1, which each does after reading row k (sync_warp
                    # orders all lanes' reads before lane 0's sends). A complete_tx landing
                    # before this CTA's arrive.expect_tx only makes the tx-count negative
                    # for a while: the phase also needs the arrival.
                    if tidx == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + parity, t.red_bytes)
                    cute.arch.sync_warp()
                    if lane == 0:
                        ptr = sRed.iterator + cute.crd2idx((parity, bidn, row_in_cta, warp_n, 0), sRed.layout)
                        for peer in cutlass.range_constexpr(cpr):  # itself included
                            store_async_cluster2(ptr, mbar + parity, sums[0], sums[1], Int32(peer))
                    cute.arch.mbarrier_wait(mbar + parity, (k >> 1) & 1)
                else:
                    if lane == 0:
                        for j in cutlass.range_constexpr(2):
                            coord = (parity, bidn, row_in_cta, warp_n, j)
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
                for j in cutlass.range_constexpr(2):
                    total = Float32(0.0)
                    for rank in cutlass.range_constexpr(cpr):
                        for w in cutlass.range_constexpr(warps_n):
                            total = total + sRed[(parity, rank, row_in_cta, w, j)]
                    sums[j] = total
                parity = parity ^ 1  # the other buffer next time: one barrier per row

            mdy = sums[0] * inv_n
            mdyy = sums[1] * inv_n
            for it in cutlass.range_constexpr(ldgs):
                y, dz, dy = self.normalized(rX[it], rDZ[it], rGamma, it, mu, rs)
                if const_expr(self.is_rms):
                    dx = (dy - y * mdyy) * rs
                else:
                    dx = (dy - (y * mdyy + mdy)) * rs
                rDX = cute.make_rmem_tensor_like(rX[it])
                rDX.store(dx.to(self.in_dtype))
                if row_ok and col_ok[it]:
                    cute.copy(copy_dx, rDX, tDXg[None, 0, 0, rb, col_tile[it]])
            mu = mu_next
            rs = rs_next
        cute.arch.cp_async_wait_group(0)  # nothing may land after the CTA exits
        if const_expr(use_mbar):
            # A CTA's last st.async into a peer may still be in flight when it is done;
            # once all CTAs arrived here, each has waited for everything sent to it.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

        # This CTA's column sums -> row ``bidm`` of the partials (Apex's WARPS_M fold).
        outs = []
        if const_expr(self.has_gamma):
            outs.append((acc_dzy, mDGammaPart))
        if const_expr(self.has_dbeta):
            outs.append((acc_dz, mDBetaPart))
        if const_expr(rpc == 1):
            for acc, mPart in outs:
                for it in cutlass.range_constexpr(ldgs):
                    if col_ok[it]:
                        vcol = col_tile[it] * tpr + tid_r
                        dst = cute.local_tile(mPart[bidm, None], (vec,), (vcol,))
                        cute.autovec_copy(acc[it], cute.make_tensor(dst.iterator, acc[it].layout))
        else:
            # the CTA's rows hold different rows' sums: fold them through shared memory
            cols = t.cols_per_cta
            fold = ColumnPartials(rpc, cols, t.num_threads)
            for acc, mPart in outs:
                sAcc = smem.allocate_tensor(
                    Float32, cute.make_ordered_layout((rpc, cols), order=(1, 0)), byte_alignment=16
                )
                for it in cutlass.range_constexpr(ldgs):
                    dst = cute.local_tile(sAcc[row_in_cta, None], (vec,), (it * tpr + tid_r,))
                    cute.autovec_copy(acc[it], cute.make_tensor(dst.iterator, acc[it].layout))
                cute.arch.sync_threads()
                fold.store(sAcc, mPart, bidm, Int32(0), tidx)  # one CTA covers the row: column tile 0

    @cute.jit
    def load_block(
        self,
        k,
        bidm,
        ctas_per_col,
        my_blocks,
        rows,
        row_in_cta,
        col_tile,
        col_ok,
        copy_x,
        copy_dz,
        tXg,
        tDZg,
        tXs,
        tDZs,
    ):
        """Start copying this CTA's ``k``-th row block into ring stage k % stages; one commit group."""
        t = self.tiles
        rb = bidm + k * ctas_per_col
        row = rb * t.rows_per_cta + row_in_cta
        stage = k % t.stages
        if k < my_blocks and row < rows:
            for it in cutlass.range_constexpr(t.ldgs):
                if col_ok[it]:
                    cute.copy(copy_x, tXg[None, 0, 0, rb, col_tile[it]], tXs[None, 0, 0, it, stage])
                    cute.copy(copy_dz, tDZg[None, 0, 0, rb, col_tile[it]], tDZs[None, 0, 0, it, stage])
        cute.arch.cp_async_commit_group()  # empty groups keep the count uniform

    @cute.jit
    def row_stats(self, mMu, mRs, row, rows):
        """(mean, rstd) of ``row`` (RMSNorm: mean 0); zeros past the last row."""
        mu = Float32(0.0)
        rs = Float32(0.0)
        if row < rows:
            rs = mRs[row]
            if const_expr(not self.is_rms):
                mu = mMu[row]
        return mu, rs

    def normalized(self, rX, rDZ, rGamma, it: cutlass.Constexpr, mu, rs):
        """(y, dz, dy) of one vector in fp32."""
        x = rX.load().to(Float32)
        dz = rDZ.load().to(Float32)
        if const_expr(self.is_rms):
            y = x * rs
        else:
            y = (x - mu) * rs
        dy = dz
        if const_expr(self.has_gamma):
            dy = dz * rGamma[it].load().to(Float32)
        return y, dz, dy
