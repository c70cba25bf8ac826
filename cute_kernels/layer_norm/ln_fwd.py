"""LayerNorm / RMSNorm forward, after Apex's ``ln_fwd_kernel`` (fast_layer_norm).

Per row, in fp32 from registers (the row is read from global memory once):

    mu   = mean(x)                       (RMSNorm: mu = 0)
    var  = mean((x - mu)^2)              (RMSNorm: mean(x^2)); biased, as torch's
    rstd = rsqrt(var + eps)
    y    = (x - mu) * rstd * gamma + beta

mean (LayerNorm) and rstd are stored in fp32, one per row, as the backward reads them.
The grid, the ring and the row all-reduce are the backward's (``ln_bwd.py``): rows are
grid-strided over a persistent grid of ``ctas_per_col`` CTAs (times ``ctas_per_row``
along a row, one cluster); each thread holds ``ldgs`` vectors of ``vec`` elements at
Apex's interleaving; x arrives through a cp.async ring in shared memory, each thread
reading back only its own vectors; gamma and beta are loaded into registers once per CTA.

The variance is a second pass over the registers (no cancellation of E[x^2] - mu^2), so
LayerNorm all-reduces twice per row: the sum, then the centred sum of squares. Each
all-reduce runs through warp shuffles, then shared memory across the warps of a row, then
distributed shared memory across the CTAs of a cluster; every participant adds the same
values in the same order, so all agree bit for bit. Two exchange buffers alternate: all-
reduce r uses buffer r % 2 (LayerNorm: the sum buffer 0, the squares buffer 1).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.dsmem import store_async_cluster, store_cluster
from cute_kernels.common.row_reduce import row_allreduce_sum
from layouts.layer_norm import LnFwdTiles

from . import rows as R


class LnFwd:
    """Configuration: dtype of x and y; gamma's and beta's dtypes (None: absent); RMSNorm or
    LayerNorm; tiles."""

    def __init__(self, dtype, w_dtype, b_dtype, tiles: LnFwdTiles, is_rms: bool):
        if is_rms and b_dtype is not None:
            raise ValueError("RMSNorm has no bias")
        self.dtype = dtype
        self.w_dtype = w_dtype
        self.b_dtype = b_dtype
        self.tiles = tiles
        self.is_rms = is_rms

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [rows, N]
        mGamma: cute.Tensor,  # [N] (None: no weight)
        mBeta: cute.Tensor,  # [N] (None: no bias)
        mY: cute.Tensor,  # [rows, N], x's dtype
        mMu: cute.Tensor,  # [rows] fp32 mean (None for RMSNorm)
        mRs: cute.Tensor,  # [rows] fp32 rstd
        eps: Float32,
        ctas_per_col: Int32,
        stream: cuda.CUstream,
    ):
        t = self.tiles
        copy_x = t.gmem_copy(self.dtype.width, load=True).build(self.dtype)
        copy_y = t.gmem_copy(self.dtype.width, load=False).build(self.dtype)
        kernel = self.kernel(mX, mGamma, mBeta, mY, mMu, mRs, eps, ctas_per_col, copy_x, copy_y)
        R.launch(kernel, t, ctas_per_col, stream)

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mGamma: cute.Tensor,
        mBeta: cute.Tensor,
        mY: cute.Tensor,
        mMu: cute.Tensor,
        mRs: cute.Tensor,
        eps: Float32,
        ctas_per_col: Int32,
        copy_x: cute.TiledCopy,
        copy_y: cute.TiledCopy,
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
        n_f = Float32(n)

        # (rpc, tpr * vec, row blocks, column tiles): a column tile is one vector per thread
        tile = t.tile
        tXg = copy_x.get_slice(tidx).partition_S(cute.local_tile(mX, tile, (None, None)))
        tYg = copy_y.get_slice(tidx).partition_D(cute.local_tile(mY, tile, (None, None)))

        # Column tile and first column of each of this thread's vectors; the vector
        # divides N, so a vector is wholly inside the row or wholly past it.
        col_tile = [it * cpr + bidn for it in range(ldgs)]
        col_ok = [(col_tile[it] * tpr + tid_r) * vec < n for it in range(ldgs)]

        rGamma = self.load_param(mGamma, self.w_dtype, copy_x, tXg, tidx, n, col_tile, col_ok)
        rBeta = self.load_param(mBeta, self.b_dtype, copy_x, tXg, tidx, n, col_tile, col_ok)

        smem = cutlass.memory.SmemAllocator()
        exchange = warps_n > 1 or cpr > 1
        sRed = None
        mbar = None
        if const_expr(exchange):
            # [buffer, rank in cluster, row of CTA, warp of row]: each warp's partial sum
            sRed = smem.allocate_tensor(
                Float32, cute.make_ordered_layout((2, cpr, rpc, warps_n), order=(3, 2, 1, 0)), byte_alignment=16
            )
        if const_expr(t.exchange_mbarriers):
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

        # The ring: ``stages`` row blocks of x in flight per CTA. Each thread copies, then
        # reads back, only its own vectors: no barrier, just wait_group.
        ring, ring_order = t.ring()
        sX = smem.allocate_tensor(self.dtype, cute.make_ordered_layout(ring, order=ring_order), byte_alignment=16)
        tXs = copy_x.get_slice(tidx).partition_D(sX)  # (CPY, 1, 1, ldgs, stages)

        num_row_blocks = cute.ceil_div(rows, rpc)
        # row blocks of this CTA: bidm, bidm + ctas_per_col, ... (all threads of a cluster agree)
        my_blocks = cute.ceil_div(num_row_blocks - bidm, ctas_per_col)
        for k in cutlass.range_constexpr(stages - 1):
            self.load_block(k, bidm, ctas_per_col, my_blocks, rows, row_in_cta, col_tile, col_ok, copy_x, tXg, tXs)
        parity = Int32(0)  # RMSNorm: one all-reduce a row, so the buffers alternate by row
        for k in cutlass.range(my_blocks, unroll=1):
            self.load_block(
                k + stages - 1, bidm, ctas_per_col, my_blocks, rows, row_in_cta, col_tile, col_ok, copy_x, tXg, tXs
            )
            cute.arch.cp_async_wait_group(stages - 1)  # block k has landed
            stage = k % stages
            rb = bidm + k * ctas_per_col
            row = rb * rpc + row_in_cta
            row_ok = row < rows
            rX = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0]) for _ in range(ldgs)]
            for it in cutlass.range_constexpr(ldgs):
                cute.autovec_copy(tXs[None, 0, 0, it, stage], rX[it])
                if not (row_ok and col_ok[it]):  # past the tensor: contributes zeros
                    rX[it].fill(0.0)
            red = (sRed, mbar, row_in_cta, warp_n, bidn, lane, tidx)

            mu = Float32(0.0)
            if const_expr(self.is_rms):
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    x = rX[it].load().to(Float32)
                    s = s + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                # the u-th use of a buffer completes its mbarrier's phase u: row k is use k // 2
                var = self.allreduce(s, red, parity, (k >> 1) & 1) / n_f
                parity = parity ^ 1
            else:
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    s = s + rX[it].load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                mu = self.allreduce(s, red, Int32(0), k & 1) / n_f
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    d = rX[it].load().to(Float32) - mu
                    part = (d * d).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s = s + Float32(cutlass.select_(col_ok[it], part, Float32(0.0)))  # zeros past N are not x
                var = self.allreduce(s, red, Int32(1), k & 1) / n_f
            rs = cute.math.rsqrt(var + eps)

            if row_ok and tid_r == 0 and bidn == 0:
                mRs[row] = rs
                if const_expr(not self.is_rms):
                    mMu[row] = mu
            for it in cutlass.range_constexpr(ldgs):
                y = (rX[it].load().to(Float32) - mu) * rs
                if const_expr(rGamma is not None):
                    y = y * rGamma[it].load().to(Float32)
                if const_expr(rBeta is not None):
                    y = y + rBeta[it].load().to(Float32)
                rY = cute.make_rmem_tensor_like(rX[it])
                rY.store(y.to(self.dtype))
                if row_ok and col_ok[it]:
                    cute.copy(copy_y, rY, tYg[None, 0, 0, rb, col_tile[it]])
        cute.arch.cp_async_wait_group(0)  # nothing may land after the CTA exits
        if const_expr(t.exchange_mbarriers):
            # A CTA's last st.async into a peer may still be in flight when it is done;
            # once all CTAs arrived here, each has waited for everything sent to it.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def allreduce(self, s: Float32, red, buf: Int32, phase: Int32) -> Float32:
        """Sum of ``s`` over the row's threads (every CTA of its cluster), through exchange
        buffer ``buf``, whose mbarrier (st.async exchange) completes phase parity ``phase``.

        Buffer ``buf`` is reused two all-reduces later. No overwrite before it is read: a
        peer sends all-reduce r+2 into it only after its wait for r+1, which needs every warp
        of this CTA to have sent r+1, which each does after reading r (sync_warp orders all
        lanes' reads before lane 0's sends). A complete_tx landing before this CTA's
        arrive.expect_tx only makes the tx-count negative for a while: the phase also needs
        the arrival. Through barriers, r+2's writes follow r+1's barrier, which every thread
        reaches after reading r.
        """
        t = self.tiles
        sRed, mbar, row_in_cta, warp_n, bidn, lane, tidx = red
        s = row_allreduce_sum(s, t.lanes_per_row)
        if const_expr(t.warps_n > 1 or t.ctas_per_row > 1):
            if const_expr(t.exchange_mbarriers):
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + buf, t.red_bytes)
                cute.arch.sync_warp()
                if lane == 0:
                    ptr = sRed.iterator + cute.crd2idx((buf, bidn, row_in_cta, warp_n), sRed.layout)
                    for peer in cutlass.range_constexpr(t.ctas_per_row):  # itself included
                        store_async_cluster(ptr, mbar + buf, s, Int32(peer))
                cute.arch.mbarrier_wait(mbar + buf, phase)
            else:
                if lane == 0:
                    coord = (buf, bidn, row_in_cta, warp_n)
                    if const_expr(t.ctas_per_row > 1):
                        ptr = sRed.iterator + cute.crd2idx(coord, sRed.layout)
                        for peer in cutlass.range_constexpr(t.ctas_per_row):
                            store_cluster(ptr, s, Int32(peer))
                    else:
                        sRed[coord] = s
                if const_expr(t.ctas_per_row > 1):
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                else:
                    cute.arch.sync_threads()
            total = Float32(0.0)
            for rank in cutlass.range_constexpr(t.ctas_per_row):
                for w in cutlass.range_constexpr(t.warps_n):
                    total = total + sRed[(buf, rank, row_in_cta, w)]
            s = total
        return s

    @cute.jit
    def load_block(self, k, bidm, ctas_per_col, my_blocks, rows, row_in_cta, col_tile, col_ok, copy_x, tXg, tXs):
        """Start copying this CTA's ``k``-th row block into ring stage k % stages; one commit group."""
        t = self.tiles
        rb = bidm + k * ctas_per_col
        row = rb * t.rows_per_cta + row_in_cta
        stage = k % t.stages
        if k < my_blocks and row < rows:
            for it in cutlass.range_constexpr(t.ldgs):
                if col_ok[it]:
                    cute.copy(copy_x, tXg[None, 0, 0, rb, col_tile[it]], tXs[None, 0, 0, it, stage])
        cute.arch.cp_async_commit_group()  # empty groups keep the count uniform

    @cute.jit
    def load_param(self, mP, dtype: cutlass.Constexpr, copy_x, tXg, tidx, n, col_tile, col_ok):
        """gamma or beta in ``dtype``, laid out as this thread's vectors of x (zeros past N);
        None without it."""
        if const_expr(mP is None):
            return None
        t = self.tiles
        mRows = cute.make_tensor(mP.iterator, cute.make_layout((t.rows_per_cta, n), stride=(0, 1)))
        tPg = copy_x.get_slice(tidx).partition_S(cute.local_tile(mRows, t.tile, (0, None)))
        rP = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], dtype) for _ in range(t.ldgs)]
        for it in cutlass.range_constexpr(t.ldgs):
            rP[it].fill(0.0)
            if col_ok[it]:
                cute.autovec_copy(tPg[None, 0, 0, col_tile[it]], rP[it])
        return rP
