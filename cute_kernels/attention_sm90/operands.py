"""The sm90 backward consumers' operands: wgmma fragments, accumulators and register-to-shared
copies of a step (``StepOperands``), what a tile's steps share (``StepEnv``), and the issue of
the products."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_kernels.common.views import rows_view, transpose_view

from .wgmma import acc_mn_layout, wgmma


@dataclass(frozen=True)
class StepOperands:
    """One kind of consumer step's products (``block_step``): tiled MMAs, operand fragments,
    accumulators and register-to-shared copies of a whole query block, or of a partial one
    (``tail_operands``)."""

    tiled_mma_sdp: Any
    acc_S: Any
    acc_dP: Any
    tSrK: Any
    tSrQ: Any
    tPrV: Any
    tPrdO: Any
    shape_sdp: Any
    cS_mn: Any
    tVrdO: Any
    tKrQ: Any
    tiled_mma_dq: Any
    tQrdS: Any
    tQrK: Any
    tQrK_both: Any
    shape_dq: Any
    r2s_ds: Any
    thr_r2s_ds: Any
    tdSs: Any
    r2s_dq: Any
    thr_r2s_dq: Any
    tdQs: Any


@dataclass(frozen=True)
class StepEnv:
    """What every consumer step of a tile shares (``mma``, ``block_step``)."""

    pipe_q: Any
    pipe_do: Any
    state_next: Any
    sLSE: Any
    sDelta: Any
    sdS: Any
    feat: Any
    tiled_mma_dkv: Any
    tiled_mma_dv: Any
    acc_dV: Any
    acc_dK: Any
    wg: Any
    tidx: Any
    n_block: Any
    key0: Any
    offset: Any
    seqlen_q: Any
    seqlen_k: Any
    window_size: Any
    scale_log2: Any
    cap: Any  # ScoreCap (softcap) or None
    steps: Any
    carry: Any
    kv_state: Any
    done: Any


class OperandsMixin:
    """Operand fragments and product issue (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def sdp_operands(self, tiled_mma_sdp, tidx, wg, sK, sQ, sV, sdO, tile_m: cutlass.Constexpr = None):
        """S^T = K Q^T, dP^T = V dO^T: the warpgroup's operand fragments, the thread's
        accumulator shape and the (key, query) coordinate of each accumulator value as
        rows x columns (``tile_m``: a partial block's queries, else the tiles')."""
        t = self.tiles
        tile_m = t.tile_m if const_expr(tile_m is None) else tile_m
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        shape_sdp = thr_sdp.partition_shape_C((t.tile_n, tile_m))
        cS = thr_sdp.partition_C(cute.make_identity_tensor((t.tile_n, tile_m)))
        return tSrK, tSrQ, tPrV, tPrdO, shape_sdp, cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))

    @cute.jit
    def dkv_operands(self, tiled_mma_dkv, tiled_mma_dv, tidx, wg, sQ, sdO):
        """dV += P^T dO, dK += dS^T Q: the B fragments (transposed views of dO / Q) and the
        zeroed dV, dK accumulators (the A operand, P^T / dS^T, differs per kernel).
        ``tiled_mma_dkv`` is dK's product (N = Dqk), ``tiled_mma_dv`` dV's (N = Dv)."""
        tVrdO, tKrQ = self.dkv_b_operands(tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO)
        acc_dV, acc_dK = self.dkv_accumulators(tiled_mma_dkv, tiled_mma_dv, tidx)
        return tVrdO, tKrQ, acc_dV, acc_dK

    @cute.jit
    def dkv_accumulators(self, tiled_mma_dkv, tiled_mma_dv, tidx):
        """The thread's zeroed dV and dK accumulators."""
        t = self.tiles
        acc_dV = cute.make_rmem_tensor(
            tiled_mma_dv.get_slice(tidx).partition_shape_C((t.tile_n, t.head_dim_v)), Float32
        )
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.get_slice(tidx).partition_shape_C((t.tile_n, t.head_dim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        return acc_dV, acc_dK

    @cute.jit
    def dkv_b_operands(self, tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO):
        """dV += P^T dO, dK += dS^T Q: the warpgroup's B fragments, the transposed views of dO / Q."""
        wg_dk = tiled_mma_dkv.get_slice(wg * 128)
        wg_dv = tiled_mma_dv.get_slice(wg * 128)
        tVrdO = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tKrQ = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))
        return tVrdO, tKrQ

    @cute.jit
    def step_operands(self, ma, tidx, wg, tile_m: cutlass.Constexpr = None, sK_both=None):
        """``block_step``'s ``StepOperands`` over blocks of ``tile_m`` queries of ``MmaArgs`` ``ma``
        (the tiles' by default; a partial block's with its own S^T / dP^T / dQ^T tiled MMAs and
        the shared tiles' first rows, ``tail_operands``). ``sK_both``: carry_dq's two K buffers
        (dQ's K fragments over both)."""
        tiled_mma_sdp, tiled_mma_dq, tiled_mma_dkv, tiled_mma_dv = (
            ma.tiled_mma_sdp,
            ma.tiled_mma_dq,
            ma.tiled_mma_dkv,
            ma.tiled_mma_dv,
        )
        sQ, sdO, sK, sV, sdS, sdQ = ma.sQ, ma.sdO, ma.sK, ma.sV, ma.sdS, ma.sdQ
        tSrK, tSrQ, tPrV, tPrdO, shape_sdp, cS_mn = self.sdp_operands(tiled_mma_sdp, tidx, wg, sK, sQ, sV, sdO, tile_m)
        tVrdO, tKrQ = self.dkv_b_operands(tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO)
        tQrdS, tQrK, shape_dq = self.dq_operands(tiled_mma_dq, tidx, wg, sK, sdS, tile_m)
        tQrK_both = None
        if const_expr(sK_both is not None):
            tQrK_both = self.dq_operands(tiled_mma_dq, tidx, wg, sK_both, sdS)[1]
        r2s_ds = self.tiles.r2s_copy_ds(self.dtype, tiled_mma_sdp)
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        tdSs = thr_r2s_ds.partition_D(transpose_view(sdS))
        r2s_dq, thr_r2s_dq, tdQs = self.dq_staging(tiled_mma_dq, tidx, sdQ)
        acc_S = cute.make_rmem_tensor(shape_sdp, Float32)
        acc_dP = cute.make_rmem_tensor(shape_sdp, Float32)
        return StepOperands(
            tiled_mma_sdp=tiled_mma_sdp,
            acc_S=acc_S,
            acc_dP=acc_dP,
            tSrK=tSrK,
            tSrQ=tSrQ,
            tPrV=tPrV,
            tPrdO=tPrdO,
            shape_sdp=shape_sdp,
            cS_mn=cS_mn,
            tVrdO=tVrdO,
            tKrQ=tKrQ,
            tiled_mma_dq=tiled_mma_dq,
            tQrdS=tQrdS,
            tQrK=tQrK,
            tQrK_both=tQrK_both,
            shape_dq=shape_dq,
            r2s_ds=r2s_ds,
            thr_r2s_ds=thr_r2s_ds,
            tdSs=tdSs,
            r2s_dq=r2s_dq,
            thr_r2s_dq=thr_r2s_dq,
            tdQs=tdQs,
        )

    @cute.jit
    def tail_operands(self, ma, tidx, wg):
        """``step_operands`` for a partial last query block (``tail_m``): S^T, dP^T and dQ^T
        tail_m queries wide (their own tiled MMAs), dV / dK over tail_m queries (the first
        k-blocks of Q / dO's transposed views), the shared tiles' first tail_m rows (the TMA
        loads fill whole blocks, zeros past the end; the store warp adds the whole staging
        buffer, whose rows past tail_m land beyond the sequence, in the accumulator's padding
        or past its end)."""
        tail_tiles = dataclasses.replace(self.tiles, tile_m=self.tail_m)
        sQ_t, sdO_t, sdS_t, sdQ_t = (rows_view(x, self.tail_m) for x in (ma.sQ, ma.sdO, ma.sdS, ma.sdQ))
        tail = dataclasses.replace(
            ma,
            tiled_mma_sdp=tail_tiles.tiled_mma_sdp(self.dtype),
            tiled_mma_dq=tail_tiles.tiled_mma_dq(self.dtype),
            sQ=sQ_t,
            sdO=sdO_t,
            sdS=sdS_t,
            sdQ=sdQ_t,
        )
        return self.step_operands(tail, tidx, wg, self.tail_m)

    @cute.jit
    def dq_operands(self, tiled_mma_dq, tidx, wg, sK, sdS, tile_m: cutlass.Constexpr = None):
        """dQ = dS K: the warpgroup's operand fragments (dS's and K's, with their stage / buffer
        modes) and the thread's accumulator shape. With ``dq_swapab`` dQ^T = K^T dS^T: A = K's
        (d, keys) view, B = dS (queries, keys). ``tile_m``: a partial block's queries."""
        t = self.tiles
        tile_m = t.tile_m if const_expr(tile_m is None) else tile_m
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        if const_expr(t.dq_swapab):
            tQrK = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sK)))
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            shape_dq = thr_dq.partition_shape_C((t.head_dim, tile_m))
        else:
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
            shape_dq = thr_dq.partition_shape_C((tile_m, t.head_dim))
        return tQrdS, tQrK, shape_dq

    @cute.jit
    def dq_staging(self, tiled_mma_dq, tidx, sdQ):
        """The copy of the dQ accumulator into the staging buffers sdQ and this thread's part of
        them (transposed with ``dq_swapab``)."""
        r2s_dq = self.tiles.r2s_copy_dq(tiled_mma_dq)
        thr_r2s_dq = r2s_dq.get_slice(tidx)
        return (
            r2s_dq,
            thr_r2s_dq,
            thr_r2s_dq.partition_D(transpose_view(sdQ) if const_expr(self.tiles.dq_swapab) else sdQ),
        )

    @cute.jit
    def issue_dq(self, tiled_mma_dq, shape_dq, tQrdS, tQrK, ds_stage):
        """dQ = dS K of dS buffer ``ds_stage`` into a fresh accumulator (dQ^T = K^T dS^T with
        ``dq_swapab``), issued, not waited for."""
        acc_dQ = cute.make_rmem_tensor(shape_dq, Float32)
        if const_expr(self.tiles.dq_swapab):
            wgmma(tiled_mma_dq, acc_dQ, tQrK, tQrdS[None, None, None, ds_stage], zero_init=True)
        else:
            wgmma(tiled_mma_dq, acc_dQ, tQrdS[None, None, None, ds_stage], tQrK, zero_init=True)
        return acc_dQ

    @cute.jit
    def issue_s(self, pipe_q, state, tiled_mma_sdp, acc_S, tSrK, tSrQ):
        """S^T = K Q^T of the block in pipeline ``state``: one wgmma group."""
        pipe_q.consumer_wait(state)
        wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)

    @cute.jit
    def issue_dp(self, pipe_do, state, tiled_mma_sdp, acc_dP, tPrV, tPrdO):
        """dP^T = V dO^T of the block in pipeline ``state``: one wgmma group."""
        pipe_do.consumer_wait(state)
        wgmma(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, state.index], zero_init=True)
