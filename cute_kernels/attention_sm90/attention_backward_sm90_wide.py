"""Hopper-native attention backward for head dims 192 and 256 (either of Dqk, Dv): the base
kernel with the consumers' products decomposed for 64 keys x 64 queries (``AttentionSm90WideTiles``).

With the base decomposition each warpgroup would hold dK and dV of 64 keys x d in fp32
(2 x d / 2 registers a thread), more than setmaxnreg's 240. Here (FA3's hdim-256 form) both
consumer warpgroups own all 64 keys of the block and split the other dimension of each
product, per query block:

    S^T, dP^T  (64 keys x 64 queries)    warpgroup w: queries 32w .. 32w+31 (m64n32, SS)
    P^T, dS^T -> shared memory           both warpgroups read all of them next
    dV += P^T dO, dK += dS^T Q           warpgroup w: head-dim columns w d/2 .. (w+1) d/2 - 1
                                         (SS, A = P^T / dS^T)
    dQ = dS K, column half h = 0, 1      warpgroup w: columns h d/2 + w d/4 .. (SS), one half
                                         after the other, each staged in sdQ

so a thread holds 2 x d / 4 fp32 of dK / dV (96 / 128 registers; (Dqk + Dv) / 4 when they
differ: dK's columns are Dqk's, dV's Dv's, dQ's Dqk's) and d / 8 of dQ at a
time (a whole half beside dK / dV ran ptxas out of registers: docs/attention_sm90.md). Producer, dQ
store warp (its joint handoff: the store warp adds the whole tile), masks, grouped heads,
deterministic mode, variable lengths, the shared storage and the epilogue are the base's:
P^T lives in the sdS allocation (buffers [0, ds_stages), dS^T in [ds_stages, 2 ds_stages)).
Layouts: layouts/attention_sm90.py.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from cute_kernels.attention.named_barrier import NamedBarrier
from cute_kernels.common.convert import convert_packed
from cute_kernels.common.views import transpose_view

from .arguments import MmaArgs
from .attention_backward_sm90 import AttentionBackwardSm90
from .wgmma import wgmma


@dataclass(frozen=True)
class WideOperands:
    """What every step of a tile shares: the S^T / dP^T operand fragments, accumulator shape and
    (key, query) coordinates, dV / dK's B fragments and accumulators, the P^T / dS^T A fragment,
    dQ's fragments (K's two column halves) and accumulator shape, the register-to-shared copies
    (dQ's two halves), the causal offset, the block's first key and the S^T / dP^T accumulators."""

    tSrK: Any
    tSrQ: Any
    tPrV: Any
    tPrdO: Any
    shape_sdp: Any
    cS_mn: Any
    tVrdO: Any
    tKrQ: Any
    acc_dV: Any
    acc_dK: Any
    tKVrPdS: Any
    tQrdS: Any
    tQrK0: Any
    tQrK1: Any
    shape_dq: Any
    r2s_ds: Any
    thr_r2s_ds: Any
    tdSs: Any
    r2s_dq: Any
    thr_r2s_dq: Any
    tdQs0: Any
    tdQs1: Any
    offset: Any
    key0: Any
    acc_S: Any
    acc_dP: Any


class AttentionBackwardSm90Wide(AttentionBackwardSm90):
    """``AttentionBackwardSm90`` for ``AttentionSm90WideTiles`` (head dims above 128); the
    same configuration (mask, window, deterministic) and arguments."""

    @cute.jit
    def mma(
        self,
        ma: MmaArgs,
        tidx,
        n_block,
        batch,
        work,
        rows,
        seqlen_q,
        seqlen_k,
        softmax_scale,
        window_size,
        feat,
    ):
        """The consumers' steps of one tile, then its dK / dV (the base's ``mma``, a CTA per tile)."""
        t = self.tiles
        steps = work.steps
        wg = cute.arch.make_warp_uniform(tidx // 128)
        scale_log2, cap = self.score_scales(softmax_scale, ma.softcap)
        w = self.wide_operands(ma, tidx, wg, n_block, seqlen_q, seqlen_k)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        if work.m_min < work.m_max:
            cute.arch.mbarrier_wait(ma.mbar_kv, 0)
        # every wgmma group is issued and waited for within its step (none crosses the
        # loop's back edge, which would make ptxas serialise them all); the loop stays
        # outside the if (0 steps without work), as the base's (docs/attention_sm90.md)
        head, m_block = self.work_item(work, 0)
        for i in cutlass.range(steps, unroll=1):
            self.wide_step(
                ma,
                w,
                feat,
                i,
                state,
                head,
                m_block,
                tidx,
                wg,
                n_block,
                seqlen_q,
                seqlen_k,
                window_size,
                scale_log2,
                cap,
            )
            state.advance()
            head, m_block = self.next_work_item(work, head, m_block)

        self.epilogue(
            w.acc_dK,
            w.acc_dV,
            ma.dkv_out,
            ma.sK,
            ma.sV,
            ma.tiled_mma_dkv,
            ma.tiled_mma_dv,
            tidx,
            n_block,
            work.head_kv,
            batch,
            rows,
            seqlen_k,
            softmax_scale,
        )

    @cute.jit
    def wide_operands(self, ma: MmaArgs, tidx, wg, n_block, seqlen_q, seqlen_k) -> WideOperands:
        """The fragments, accumulators and copies every step of a tile shares (``WideOperands``)."""
        t = self.tiles
        d = t.head_dim
        sQ, sdO, sK, sV, sdS, sdQ = ma.sQ, ma.sdO, ma.sK, ma.sV, ma.sdS, ma.sdQ
        tiled_mma_sdp, tiled_mma_dq = ma.tiled_mma_sdp, ma.tiled_mma_dq
        tiled_mma_dkv, tiled_mma_dv = ma.tiled_mma_dkv, ma.tiled_mma_dv

        # S^T = K Q^T, dP^T = V dO^T (all keys, this warpgroup's queries)
        tSrK, tSrQ, tPrV, tPrdO, shape_sdp, cS_mn = self.sdp_operands(tiled_mma_sdp, tidx, wg, sK, sQ, sV, sdO)

        # dV += P^T dO, dK += dS^T Q: A = the (key, query) view of sdS's P / dS buffers
        # (queries contiguous: K-major), B = the transposed views of dO / Q (this warpgroup's
        # columns). The A fragment is the same for both products: all 64 keys x the block's
        # queries, whatever N (Dqk / 2 or Dv / 2) the warpgroup's columns have
        tVrdO, tKrQ, acc_dV, acc_dK = self.dkv_operands(tiled_mma_dkv, tiled_mma_dv, tidx, wg, sQ, sdO)
        wg_dkv = tiled_mma_dkv.get_slice(wg * 128)
        tKVrPdS = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(sdS)))

        # dQ = dS K, columns [0, d/2) then [d/2, d): B = K's MN-major view, one half each
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        half = d // 2
        sKt = transpose_view(sK)
        tQrK0 = wg_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(sKt, (half, t.tile_n), (0, 0))))
        tQrK1 = wg_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(sKt, (half, t.tile_n), (1, 0))))
        shape_dq = thr_dq.partition_shape_C((t.tile_m, half))

        # registers -> shared: P^T and dS^T into sdS's buffers, the dQ halves into sdQ
        r2s_ds = t.r2s_copy_ds(self.dtype, tiled_mma_sdp)
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        tdSs = thr_r2s_ds.partition_D(transpose_view(sdS))
        r2s_dq = t.r2s_copy_dq(tiled_mma_dq)
        thr_r2s_dq = r2s_dq.get_slice(tidx)
        dq_half = (t.tile_m, half, t.dq_stages)
        tdQs0 = thr_r2s_dq.partition_D(cute.local_tile(sdQ, dq_half, (0, 0, 0)))
        tdQs1 = thr_r2s_dq.partition_D(cute.local_tile(sdQ, dq_half, (0, 1, 0)))

        offset = self.mask.causal_offset(seqlen_q, seqlen_k)
        key0 = n_block * t.tile_n
        acc_S = cute.make_rmem_tensor(shape_sdp, Float32)
        acc_dP = cute.make_rmem_tensor(shape_sdp, Float32)
        return WideOperands(
            tSrK=tSrK,
            tSrQ=tSrQ,
            tPrV=tPrV,
            tPrdO=tPrdO,
            shape_sdp=shape_sdp,
            cS_mn=cS_mn,
            tVrdO=tVrdO,
            tKrQ=tKrQ,
            acc_dV=acc_dV,
            acc_dK=acc_dK,
            tKVrPdS=tKVrPdS,
            tQrdS=tQrdS,
            tQrK0=tQrK0,
            tQrK1=tQrK1,
            shape_dq=shape_dq,
            r2s_ds=r2s_ds,
            thr_r2s_ds=thr_r2s_ds,
            tdSs=tdSs,
            r2s_dq=r2s_dq,
            thr_r2s_dq=thr_r2s_dq,
            tdQs0=tdQs0,
            tdQs1=tdQs1,
            offset=offset,
            key0=key0,
            acc_S=acc_S,
            acc_dP=acc_dP,
        )

    @cute.jit
    def wide_step(
        self,
        ma: MmaArgs,
        w: WideOperands,
        feat,
        i,
        state,
        head,
        m_block,
        tidx,
        wg,
        n_block,
        seqlen_q,
        seqlen_k,
        window_size,
        scale_log2,
        cap=None,
    ):
        """Step ``i``: query block ``m_block`` of query head ``head`` (Q / dO in pipeline ``state``),
        its products and the dS / dQ handoffs; the Q / dO stages freed. ``cap``: the softcap's
        ``ScoreCap`` (None without)."""
        t = self.tiles
        stage = state.index
        p_buf = i % t.ds_stages
        ds_buf = t.ds_stages + p_buf
        q0 = m_block * t.tile_m
        self.issue_s(ma.pipe_q, state, ma.tiled_mma_sdp, w.acc_S, w.tSrK, w.tSrQ)
        self.issue_dp(ma.pipe_do, state, ma.tiled_mma_sdp, w.acc_dP, w.tPrV, w.tPrdO)
        # bias values and dropout flags while the tensor cores work (None without)
        rBias, keep = self.block_features(feat, head, i, q0, w.key0, seqlen_q, seqlen_k, w.cS_mn, w.shape_sdp, wg, tidx)
        warpgroup.wait_group(1)
        self.probs(
            w.acc_S,
            w.cS_mn,
            ma.sLSE,
            stage,
            q0,
            w.key0,
            seqlen_q,
            seqlen_k,
            w.offset,
            window_size,
            scale_log2,
            rBias,
            None,
            cap,
        )
        rP = self.p_operand(w.acc_S, w.cS_mn, keep, feat)
        cute.copy(w.r2s_ds, w.thr_r2s_ds.retile(rP), w.tdSs[None, None, None, p_buf])
        warpgroup.wait_group(0)
        self.grad_scores(w.acc_dP, w.acc_S, w.cS_mn, ma.sDelta, stage, keep, feat, None, cap, ma.sLSE, None, rBias)
        rdS = cute.make_rmem_tensor(w.shape_sdp, self.dtype)
        convert_packed(w.acc_dP, rdS)
        cute.copy(w.r2s_ds, w.thr_r2s_ds.retile(rdS), w.tdSs[None, None, None, ds_buf])
        # both warpgroups' query halves written and visible to the async proxy. With
        # two buffers this one barrier a block suffices: a warpgroup writes buffer
        # i % 2 again (block i + 2) only after the other arrived here for block i + 1,
        # which it does after waiting for its block-i products
        cute.arch.fence_view_async_shared()
        self.grad_bias_wait(tidx == 0)  # its last bias-gradient store has read its buffer
        cute.arch.barrier(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        if const_expr(self.grad_bias):
            if tidx == 0:  # dB = dS: the whole block is one TMA box
                self.store_grad_bias(feat, ma.sdS, ds_buf, 0, head, m_block, n_block)

        wgmma(
            ma.tiled_mma_dv,
            w.acc_dV,
            w.tKVrPdS[None, None, None, p_buf],
            w.tVrdO[None, None, None, stage],
            zero_init=False,
        )
        acc_dQ = cute.make_rmem_tensor(w.shape_dq, Float32)
        wgmma(ma.tiled_mma_dq, acc_dQ, w.tQrdS[None, None, None, ds_buf], w.tQrK0, zero_init=True)
        wgmma(
            ma.tiled_mma_dkv,
            w.acc_dK,
            w.tKVrPdS[None, None, None, ds_buf],
            w.tKrQ[None, None, None, stage],
            zero_init=False,
        )
        warpgroup.wait_group(1)  # dV and dQ's first half done
        ma.pipe_do.consumer_release(state)
        # dQ -> sdQ for the store warp's reduce-add of the whole tile, one half at a
        # time (with dK running): both halves' accumulators at once would not fit
        buf = i % t.dq_stages
        cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=t.dq_handoff_threads)
        cute.copy(w.r2s_dq, w.thr_r2s_dq.retile(acc_dQ), w.tdQs0[None, None, None, buf])
        wgmma(ma.tiled_mma_dq, acc_dQ, w.tQrdS[None, None, None, ds_buf], w.tQrK1, zero_init=True)
        warpgroup.wait_group(0)
        cute.copy(w.r2s_dq, w.thr_r2s_dq.retile(acc_dQ), w.tdQs1[None, None, None, buf])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=t.dq_handoff_threads)
        ma.pipe_q.consumer_release(state)
