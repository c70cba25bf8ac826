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

With ``fuse`` (a ``DropoutAdd``) the row normalised is r = dropout(x + x_bias) + residual
(``dropout_add.py``): the residual joins x in the ring, x_bias is held like gamma, the keep
bits are drawn and stored as a bit mask, and r is stored in its dtype.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.philox import keep_byte_key
from cute_kernels.common.row_reduce import row_allreduce_sum
from layouts.layer_norm import LnFwdTiles

from . import dropout_add as D
from . import rows as R


class LnFwd:
    """Configuration: dtype of x and y; gamma's and beta's dtypes (None: absent); RMSNorm or
    LayerNorm; tiles; the fused dropout + residual add (None: plain norm of x)."""

    def __init__(self, dtype, w_dtype, b_dtype, tiles: LnFwdTiles, is_rms: bool, fuse: D.DropoutAdd = None):
        if is_rms and b_dtype is not None:
            raise ValueError("RMSNorm has no bias")
        if fuse is not None and fuse.x_dtype is not dtype:
            raise ValueError(f"y is in x's dtype {fuse.x_dtype}, got {dtype}")
        self.dtype = dtype
        self.w_dtype = w_dtype
        self.b_dtype = b_dtype
        self.tiles = tiles
        self.is_rms = is_rms
        self.fuse = fuse

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
        mRes: cute.Tensor,  # [rows, N] residual (None: none, or no fusion)
        mXBias: cute.Tensor,  # [N] x_bias (None: none)
        mR: cute.Tensor,  # [rows, N] r out (None without fusion)
        mMask: cute.Tensor,  # [rows, ceil(N / 8)] uint8 keep bits (None without dropout)
        seed,  # Int64, or Int64 [1] on the device (None without dropout)
        offset,  # likewise
        threshold: Int32,  # keep where a 16-bit half >= threshold
        scale: Float32,  # 1 / (1 - p)
        stream: cuda.CUstream,
    ):
        t = self.tiles
        copy_x = t.gmem_copy(self.dtype.width, load=True).build(self.dtype)
        copy_y = t.gmem_copy(self.dtype.width, load=False).build(self.dtype)
        copy_res = copy_r = None
        if const_expr(self.fuse is not None):
            f = self.fuse
            copy_r = t.gmem_copy(f.r_dtype.width, load=False).build(f.r_dtype)
            if const_expr(f.res_dtype is not None):
                copy_res = t.gmem_copy(f.res_dtype.width, load=True).build(f.res_dtype)
        kernel = self.kernel(
            mX, mGamma, mBeta, mY, mMu, mRs, eps, ctas_per_col, copy_x, copy_y,
            mRes, mXBias, mR, mMask, seed, offset, threshold, scale, copy_res, copy_r,
        )  # fmt: skip
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
        mRes: cute.Tensor,
        mXBias: cute.Tensor,
        mR: cute.Tensor,
        mMask: cute.Tensor,
        seed,
        offset,
        threshold: Int32,
        scale: Float32,
        copy_res: cute.TiledCopy,
        copy_r: cute.TiledCopy,
    ):
        t = self.tiles
        stages = t.stages
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
        merged = not self.is_rms and t.one_exchange
        red = R.RowSums.allocate(t, smem, th, num_sums=2 if merged else 1)
        # one exchange: the warps' element counts, for Chan's merge (loop invariants)
        counts = inv_n_w = None
        if const_expr(merged and red.exchange):
            inv_n_w = self.inverse(self.warp_count(n, bidn, th.warp_n))
            counts = []
            for i in cutlass.range_constexpr(-(-red.entries // 32)):
                e = th.lane + 32 * i
                n_e = Float32(0.0)
                if e < red.entries:
                    n_e = self.warp_count(n, e // t.warps_n, e % t.warps_n)
                counts.append((n_e, self.inverse(n_e)))
        inputs = [(self.dtype, copy_x, tXg)]
        fused = None
        if const_expr(self.fuse is not None):
            f = self.fuse
            fused = [
                None if mRes is None else R.partition_rows(copy_res, mRes, t, tidx, load=True),
                R.load_param(mXBias, f.xb_dtype, t, copy_x, tXg, tidx, n, col_tile, col_ok),
                R.partition_rows(copy_r, mR, t, tidx, load=False),
                keep_byte_key(seed, offset, threshold) if f.dropout else None,
            ]
            if const_expr(mRes is not None):
                inputs.append((f.res_dtype, copy_res, fused[0]))
        ring = R.RowRing.allocate(t, smem, th, rows, ctas_per_col, col_tile, col_ok, inputs)
        ring.start()
        parity = Int32(0)  # one exchange a row (RMSNorm, one_exchange): the buffers alternate by row
        for k in cutlass.range(ring.my_blocks, unroll=1):
            ring.load(k + stages - 1)
            rb, row, row_ok, regs = ring.read(k)
            rX = regs[0]
            if const_expr(self.fuse is not None):
                rX = self.dropout_add(regs, fused, mMask, scale, copy_r, th, col_tile, col_ok, rb, row, row_ok, n)

            if const_expr(self.is_rms):
                mu = Float32(0.0)
                var = self.mean_square(rX, red, parity, k, n_f)
            elif const_expr(merged and red.exchange):
                mu, var = self.mean_variance_merged(rX, red, parity, k, n_f, col_ok, inv_n_w, counts)
            else:
                mu, var = self.mean_variance(rX, red, k, n_f, col_ok)
            parity = parity ^ 1
            rs = cute.math.rsqrt(var + eps)

            if row_ok and tid_r == 0 and bidn == 0:
                mRs[row] = rs
                if const_expr(not self.is_rms):
                    mMu[row] = mu
            self.store_y(rX, mu, rs, rGamma, rBeta, copy_y, tYg, rb, row_ok, col_tile, col_ok)
        R.finish(t)

    @cute.jit
    def mean_square(self, rX, red, parity, k, n_f) -> Float32:
        """RMSNorm's mean of x^2 over the row: one all-reduce, through buffer ``parity`` (the
        buffers alternate by row)."""
        s = Float32(0.0)
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            x = rX[it].load().to(Float32)
            s = s + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # the u-th use of a buffer completes its mbarrier's phase u: row k is use k // 2
        return red.allreduce([s], parity, (k >> 1) & 1)[0] / n_f

    @cute.jit
    def mean_variance(self, rX, red, k, n_f, col_ok):
        """LayerNorm's (mean, biased variance) of the row: the sum, then a second pass over the
        registers for the centred squares (no E[x^2] - mean^2 cancellation); two all-reduces,
        through buffers 0 and 1 (shuffles alone within one warp)."""
        mu = red.allreduce([self.row_part_sum(rX)], Int32(0), k & 1)[0] / n_f
        return mu, red.allreduce([self.squares_about(rX, mu, col_ok)], Int32(1), k & 1)[0] / n_f

    @cute.jit
    def mean_variance_merged(self, rX, red, parity, k, n_f, col_ok, inv_n_w, counts):
        """LayerNorm's (mean, biased variance) of a row spread over warps, in one exchange: each
        warp's sum and its centred squares about its own mean (two passes over the registers,
        shuffles), sent together through buffer ``parity``, then Chan's merge
        (``RowSums.moments``). ``inv_n_w``: 1 / the warp's element count of the row."""
        s_w = row_allreduce_sum(self.row_part_sum(rX), 32)
        q = self.squares_about(rX, s_w * inv_n_w, col_ok)
        # the u-th use of a buffer completes its mbarrier's phase u: row k is use k // 2
        red.send([s_w, row_allreduce_sum(q, 32)], parity, (k >> 1) & 1)
        mu, m2 = red.moments(parity, n_f, counts)
        return mu, m2 / n_f

    @cute.jit
    def row_part_sum(self, rX) -> Float32:
        """The sum of this thread's elements of the row (zeros past N)."""
        s = Float32(0.0)
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            s = s + rX[it].load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return s

    @cute.jit
    def squares_about(self, rX, m, col_ok) -> Float32:
        """sum((x - m)^2) over this thread's elements inside the row (zeros past N are not x)."""
        s = Float32(0.0)
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            d = rX[it].load().to(Float32) - m
            part = (d * d).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            s = s + Float32(cutlass.select_(col_ok[it], part, Float32(0.0)))
        return s

    @cute.jit
    def warp_count(self, n, c, w) -> Float32:
        """Elements of the row that warp ``w`` of CTA ``c`` holds: its lanes' vectors that start
        before N (``LnFwdTiles.col_tile`` / ``vector_index``)."""
        t = self.tiles
        vectors = n // t.vec
        total = Int32(0)
        for it in cutlass.range_constexpr(t.ldgs):
            left = vectors - t.vector_index(t.col_tile(it, c), 32 * w)
            left = cutlass.select_(left < 0, Int32(0), left)
            total = total + cutlass.select_(left > 32, Int32(32), left)
        return Float32(total * t.vec)

    @staticmethod
    def inverse(x):
        """1 / x, 0 for x = 0 (a warp with no element of the row)."""
        return cutlass.select_(x > Float32(0.0), Float32(1.0) / x, Float32(0.0))

    @cute.jit
    def store_y(self, rX, mu, rs, rGamma, rBeta, copy_y, tYg, rb, row_ok, col_tile, col_ok):
        """y = (x - mu) * rstd * gamma + beta of this thread's vectors, stored in x's dtype."""
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            y = (rX[it].load().to(Float32) - mu) * rs
            if const_expr(rGamma is not None):
                y = y * rGamma[it].load().to(Float32)
            if const_expr(rBeta is not None):
                y = y + rBeta[it].load().to(Float32)
            rY = cute.make_rmem_tensor_like(rX[it], self.dtype)
            rY.store(y.to(self.dtype))
            if row_ok and col_ok[it]:
                cute.copy(copy_y, rY, tYg[None, 0, 0, rb, col_tile[it]])

    @cute.jit
    def dropout_add(self, regs, fused, mMask, scale, copy_r, th, col_tile, col_ok, rb, row, row_ok, n) -> list:
        """r = dropout(x + x_bias) + residual of this thread's vectors, in r's dtype (zeros past
        N: the ring and x_bias give zeros there), stored with the keep bits; the norm reads it."""
        f, t = self.fuse, self.tiles
        tResg, rXB, tRg, rng = fused
        rR = D.registers_of(regs[0][0], f.r_dtype, t.ldgs)
        for it in cutlass.range_constexpr(t.ldgs):
            v = regs[0][it].load().to(Float32)
            if const_expr(rXB is not None):
                v = v + rXB[it].load().to(Float32)
            if const_expr(f.dropout):
                c0 = D.vector_column(t, th, col_tile, it)
                bits, writes = D.draw_bits(mMask, rng, row, c0, n)
                v = D.apply_keep(v, bits >> cutlass.Uint32(c0 % 8), scale, regs[0][it])
                D.store_bits(mMask, row, c0, bits, row_ok and col_ok[it] and writes)
            if const_expr(tResg is not None):
                v = v + regs[1][it].load().to(Float32)
            rR[it].store(v.to(f.r_dtype))
            if row_ok and col_ok[it]:
                cute.copy(copy_r, rR[it], tRg[None, 0, 0, rb, col_tile[it]])
        return rR
