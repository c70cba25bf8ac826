"""LayerNorm / RMSNorm forward, after Apex's ``ln_fwd_kernel`` (fast_layer_norm).

Per row, in fp32 from registers (the row is read from global memory once):

    mu   = mean(x)                       (RMSNorm: mu = 0)
    var  = mean((x - mu)^2)              (RMSNorm: mean(x^2)); biased, as torch's
    rstd = rsqrt(var + eps)
    y    = (x - mu) * rstd * gamma + beta

mean (LayerNorm) and rstd are stored in fp32, one per row, as the backward reads them.
The grid, the ring and the row all-reduce are shared with the backward (``rows.py``): rows
are grid-strided over a persistent grid of ``ctas_per_col`` CTAs (times ``ctas_per_row``
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
        ldgs, stages = t.ldgs, t.stages
        th = R.row_thread(t)
        tidx, bidn, tid_r = th.tidx, th.bidn, th.tid_r
        rows, n = mX.shape
        n_f = Float32(n)
        tXg = R.partition_rows(copy_x, mX, t, tidx, load=True)
        tYg = R.partition_rows(copy_y, mY, t, tidx, load=False)
        col_tile, col_ok = R.vector_columns(t, th, n)
        rGamma = R.load_param(mGamma, self.w_dtype, t, copy_x, tXg, tidx, n, col_tile, col_ok)
        rBeta = R.load_param(mBeta, self.b_dtype, t, copy_x, tXg, tidx, n, col_tile, col_ok)

        smem = cutlass.memory.SmemAllocator()
        red = R.RowSums.allocate(t, smem, th, num_sums=1)
        ring = R.RowRing.allocate(t, smem, th, rows, ctas_per_col, col_tile, col_ok, [(self.dtype, copy_x, tXg)])
        ring.start()
        parity = Int32(0)  # RMSNorm: one all-reduce a row, so the buffers alternate by row
        for k in cutlass.range(ring.my_blocks, unroll=1):
            ring.load(k + stages - 1)
            rb, row, row_ok, (rX,) = ring.read(k)

            mu = Float32(0.0)
            if const_expr(self.is_rms):
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    x = rX[it].load().to(Float32)
                    s = s + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                # the u-th use of a buffer completes its mbarrier's phase u: row k is use k // 2
                var = red.allreduce([s], parity, (k >> 1) & 1)[0] / n_f
                parity = parity ^ 1
            else:
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    s = s + rX[it].load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                mu = red.allreduce([s], Int32(0), k & 1)[0] / n_f
                s = Float32(0.0)
                for it in cutlass.range_constexpr(ldgs):
                    d = rX[it].load().to(Float32) - mu
                    part = (d * d).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s = s + Float32(cutlass.select_(col_ok[it], part, Float32(0.0)))  # zeros past N are not x
                var = red.allreduce([s], Int32(1), k & 1)[0] / n_f
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
        R.finish(t)
