"""LayerNorm / RMSNorm backward, after Apex's ``ln_bwd_kernel`` (fast_layer_norm).

Per row, with the forward's mean mu and rstd (RMSNorm: mu = 0):

    y  = (x - mu) * rstd          dy = gamma * dz
    dx = rstd * (dy - mean(dy * y) * y - mean(dy))      (RMSNorm: no mean(dy) term)

and per CTA the column partials dgamma_part = sum dz * y, dbeta_part = sum dz over its
rows, which ``LnBwdFinalize`` reduces. The persistent grid, each thread's vectors of a row,
the cp.async ring (of x and dz) and the row all-reduce are shared with the forward
(``rows.py``). The all-reduce of (sum dy, sum dy*y) runs through warp shuffles, then shared
memory across the warps of a row, then distributed shared memory across the CTAs of a
cluster; every participant adds the same values in the same order, so all agree bit for
bit and the results are deterministic. Across a cluster the sums travel by ``st.async``
and each CTA waits on a transaction-count mbarrier of its own
(``tiles.cluster_exchange == "mbarrier"``), or by plain remote stores followed by a full
cluster barrier per row (``"barrier"``).

With ``fuse`` (a ``DropoutAdd``) x is r = dropout(x0 + x_bias) + residual and the kernel goes
on from the norm's input gradient (``dropout_add.py``): the incoming gradient of r (prenorm)
joins the ring and is added, dresidual = dr is stored, dx0 = dr * keep / (1 - p) from the
forward's bit mask, and dx_bias's column partials are kept beside dgamma's and dbeta's.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.column_partials import ColumnPartials
from layouts.layer_norm import LnBwdTiles

from . import dropout_add as D
from . import rows as R


class LnBwd:
    """Configuration: dtypes of x/dx, dz, gamma; RMSNorm or LayerNorm; which grads; tiles; the
    fused dropout + residual add (None: plain norm; x is then r and dx is x0's, ``fuse.x_dtype``)."""

    def __init__(
        self,
        in_dtype,
        out_dtype,
        w_dtype,
        tiles: LnBwdTiles,
        is_rms: bool,
        has_gamma: bool,
        has_dbeta: bool,
        fuse: D.DropoutAdd = None,
    ):
        self.fuse = fuse
        self.dx_dtype = in_dtype if fuse is None else fuse.x_dtype
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
        mDRIn: cute.Tensor,  # [rows, N] incoming gradient of r (fused, prenorm; else None)
        mMask: cute.Tensor,  # [rows, ceil(N / 8)] uint8 keep bits (fused dropout; else None)
        mDRes: cute.Tensor,  # [rows, N] dresidual (fused with a residual; else None)
        mDXBiasPart: cute.Tensor,  # [ctas_per_col, N] fp32 (fused with x_bias; else None)
        scale: Float32,  # 1 / (1 - p)
        stream: cuda.CUstream,
    ):
        t = self.tiles
        copy_x = t.gmem_copy(self.in_dtype.width, load=True).build(self.in_dtype)
        copy_dz = t.gmem_copy(self.out_dtype.width, load=True).build(self.out_dtype)
        copy_dx = t.gmem_copy(self.dx_dtype.width, load=False).build(self.dx_dtype)
        copy_drin = copy_dres = None
        if const_expr(self.fuse is not None):
            f = self.fuse
            if const_expr(f.dr_dtype is not None):
                copy_drin = t.gmem_copy(f.dr_dtype.width, load=True).build(f.dr_dtype)
            if const_expr(f.res_dtype is not None):
                copy_dres = t.gmem_copy(f.res_dtype.width, load=False).build(f.res_dtype)
        kernel = self.kernel(
            mX, mDZ, mGamma, mMu, mRs, mDX, mDGammaPart, mDBetaPart, ctas_per_col, copy_x, copy_dz, copy_dx,
            mDRIn, mMask, mDRes, mDXBiasPart, scale, copy_drin, copy_dres,
        )  # fmt: skip
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
        mDRIn: cute.Tensor,
        mMask: cute.Tensor,
        mDRes: cute.Tensor,
        mDXBiasPart: cute.Tensor,
        scale: Float32,
        copy_drin: cute.TiledCopy,
        copy_dres: cute.TiledCopy,
    ):
        t = self.tiles
        ldgs, rpc, stages = t.ldgs, t.rows_per_cta, t.stages
        th = R.row_thread(t)
        tidx, bidm, row_in_cta = th.tidx, th.bidm, th.row_in_cta
        rows, n = mX.shape
        inv_n = Float32(1.0) / Float32(n)
        tXg = R.partition_rows(copy_x, mX, t, tidx, load=True)
        tDZg = R.partition_rows(copy_dz, mDZ, t, tidx, load=True)
        tDXg = R.partition_rows(copy_dx, mDX, t, tidx, load=False)
        col_tile, col_ok = R.vector_columns(t, th, n)
        rGamma = None
        if const_expr(self.has_gamma):
            rGamma = R.load_param(mGamma, self.w_dtype, t, copy_x, tXg, tidx, n, col_tile, col_ok)

        # fp32 column sums of this thread's vectors over all the rows it visits
        acc_dzy = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], Float32) for _ in range(ldgs)]
        acc_dz = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0, 0], Float32) for _ in range(ldgs)]
        for it in cutlass.range_constexpr(ldgs):
            acc_dzy[it].fill(0.0)
            acc_dz[it].fill(0.0)
        fused = None
        if const_expr(self.fuse is not None):
            # (incoming dr's view, dresidual's view, dx_bias's column sums)
            fused = [
                None if mDRIn is None else R.partition_rows(copy_drin, mDRIn, t, tidx, load=True),
                None if mDRes is None else R.partition_rows(copy_dres, mDRes, t, tidx, load=False),
                None,
            ]
            if const_expr(mDXBiasPart is not None):
                fused[2] = D.registers_of(tXg[None, 0, 0, 0, 0], Float32, ldgs)
                for it in cutlass.range_constexpr(ldgs):
                    fused[2][it].fill(0.0)

        smem = cutlass.memory.SmemAllocator()
        red = R.RowSums.allocate(t, smem, th, num_sums=2)  # (sum dy, sum dy*y)
        inputs = [(self.in_dtype, copy_x, tXg), (self.out_dtype, copy_dz, tDZg)]
        if const_expr(mDRIn is not None):
            inputs.append((self.fuse.dr_dtype, copy_drin, fused[0]))
        ring = R.RowRing.allocate(t, smem, th, rows, ctas_per_col, col_tile, col_ok, inputs)
        ring.start()
        parity = Int32(0)
        # The row statistics are loaded one row block ahead: loaded after the wait, their
        # latency was exposed once per row.
        mu, rs = self.row_stats(mMu, mRs, (bidm * rpc + row_in_cta), rows)
        for k in cutlass.range(ring.my_blocks, unroll=1):
            ring.load(k + stages - 1)
            mu_next, rs_next = self.row_stats(mMu, mRs, (bidm + (k + 1) * ctas_per_col) * rpc + row_in_cta, rows)
            rb, row, row_ok, regs = ring.read(k)
            rX, rDZ = regs[0], regs[1]
            keep = None
            if const_expr(self.fuse is not None and self.fuse.dropout):
                # issued before the row's reductions, which hide their latency
                keep = [
                    D.read_bits(mMask, row, D.vector_column(t, th, col_tile, it), row_ok and col_ok[it])
                    for it in range(ldgs)
                ]

            s_dy, s_dyy = self.row_part_sums(rX, rDZ, rGamma, mu, rs, acc_dzy, acc_dz)
            # buffer ``parity`` is reused every second row; its mbarrier phase flips then
            sums = red.allreduce([s_dy, s_dyy], parity, (k >> 1) & 1)
            if const_expr(red.exchange):
                parity = parity ^ 1  # the other buffer next time: one barrier per row
            self.store_dx(
                rX, rDZ, rGamma, mu, rs, sums[0] * inv_n, sums[1] * inv_n, copy_dx, tDXg,
                (regs, keep, fused, scale, copy_dres), rb, row_ok, col_ok, col_tile,
            )  # fmt: skip
            mu = mu_next
            rs = rs_next
        R.finish(t)
        self.store_column_partials(
            acc_dzy, acc_dz, fused, mDGammaPart, mDBetaPart, mDXBiasPart, smem, th, col_tile, col_ok
        )

    @cute.jit
    def row_part_sums(self, rX, rDZ, rGamma, mu, rs, acc_dzy, acc_dz) -> tuple:
        """This thread's share of sum(dy) and sum(dy * y) of the row; its column sums of dz * y
        (dgamma) and dz (dbeta) advanced by the row."""
        s_dy = Float32(0.0)
        s_dyy = Float32(0.0)
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            y, dz, dy = self.normalized(rX[it], rDZ[it], rGamma, it, mu, rs)
            s_dyy = s_dyy + (dy * y).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            acc_dzy[it].store(acc_dzy[it].load() + dz * y)
            if const_expr(not self.is_rms):
                s_dy = s_dy + dy.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(self.has_dbeta):
                acc_dz[it].store(acc_dz[it].load() + dz)
        return s_dy, s_dyy

    @cute.jit
    def store_dx(self, rX, rDZ, rGamma, mu, rs, mdy, mdyy, copy_dx, tDXg, fuse_args, rb, row_ok, col_ok, col_tile):
        """dx = (dy - (y * mean(dy y) + mean(dy))) * rstd of this thread's vectors (RMSNorm: no
        mean(dy) term), through the fused dropout + add's gradients (``fuse_args``: the ring's
        registers, the keep bits, the fused views, 1 / (1 - p), dresidual's copy), stored."""
        for it in cutlass.range_constexpr(self.tiles.ldgs):
            y, dz, dy = self.normalized(rX[it], rDZ[it], rGamma, it, mu, rs)
            if const_expr(self.is_rms):
                dx = (dy - y * mdyy) * rs
            else:
                dx = (dy - (y * mdyy + mdy)) * rs
            if const_expr(self.fuse is not None):
                regs, keep, fused, scale, copy_dres = fuse_args
                dx = self.dropout_add_grads(dx, it, regs, keep, fused, scale, copy_dres, rb, row_ok, col_ok, col_tile)
            rDX = cute.make_rmem_tensor_like(rX[it], self.dx_dtype)
            rDX.store(dx.to(self.dx_dtype))
            if row_ok and col_ok[it]:
                cute.copy(copy_dx, rDX, tDXg[None, 0, 0, rb, col_tile[it]])

    @cute.jit
    def store_column_partials(
        self, acc_dzy, acc_dz, fused, mDGammaPart, mDBetaPart, mDXBiasPart, smem, th, col_tile, col_ok
    ):
        """This CTA's column sums -> row ``bidm`` of the partials (Apex's WARPS_M fold)."""
        t = self.tiles
        tpr, vec, ldgs, rpc = t.threads_per_row, t.vec, t.ldgs, t.rows_per_cta
        tidx, bidm, row_in_cta, tid_r = th.tidx, th.bidm, th.row_in_cta, th.tid_r
        outs = []
        if const_expr(self.has_gamma):
            outs.append((acc_dzy, mDGammaPart))
        if const_expr(self.has_dbeta):
            outs.append((acc_dz, mDBetaPart))
        if const_expr(mDXBiasPart is not None):
            outs.append((fused[2], mDXBiasPart))
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
    def dropout_add_grads(
        self, dx, it: cutlass.Constexpr, regs, keep, fused, scale, copy_dres, rb, row_ok, col_ok, col_tile
    ):
        """From the norm's input gradient ``dx`` (fp32, vector ``it``): dr = dx + dr_in, stored as
        dresidual; dx0 = dr * keep / (1 - p) returned and added to dx_bias's column sums."""
        f = self.fuse
        tDRIng, tDResg, acc_dxb = fused
        dr = dx
        if const_expr(tDRIng is not None):
            dr = dr + regs[2][it].load().to(Float32)
        if const_expr(tDResg is not None):
            rDRes = cute.make_rmem_tensor_like(regs[0][it], f.res_dtype)
            rDRes.store(dr.to(f.res_dtype))
            if row_ok and col_ok[it]:
                cute.copy(copy_dres, rDRes, tDResg[None, 0, 0, rb, col_tile[it]])
        dx0 = dr
        if const_expr(f.dropout):
            dx0 = D.apply_keep(dr, keep[it], scale, regs[0][it])
        if const_expr(acc_dxb is not None):
            if row_ok and col_ok[it]:  # past N the norm's dx is not zero
                acc_dxb[it].store(acc_dxb[it].load() + dx0)
        return dx0

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
