"""The sm90 backward consumers' steps: a block's products and softmax gradient, the dS / dQ
handoffs (pds_split, dq_defer, carry_dq) and their named barriers."""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from cute_kernels.attention.named_barrier import NamedBarrier, cyclic, named_barrier
from cute_kernels.attention.softcap import cap_scores
from cute_kernels.common.convert import convert_packed
from cute_kernels.common.log2_units import LOG2_E
from layouts.attention_sm90 import (
    GRAD_BIAS_BOX_KEYS,
)

from .wgmma import acc_as_operand_a, acc_mn_layout, wgmma


class ConsumerStepsMixin:
    """One consumer step and its handoffs (``AttentionBackwardSm90``'s configuration).

    With ``tail_m`` (d128's tiles, the host's choice per sequence length) the partial last query
    block's step runs on tiled MMAs tail_m queries wide (``tail_operands``, ``steps_with_tail``):
    its S^T / dP^T / dQ^T need 16-64 columns of 80 and dV / dK one to four k-blocks of five.

    ``carry_dq`` (persistent CTAs over equal tiles, asked for where tiles are short): a tile's
    last block's dQ is the next tile's step 0 product (with ``dq_defer`` step 0 had none), on the
    finished tile's K, which stays in its buffer until then; that tile's dK is staged in the dS
    buffer its next block writes, and the store warps read it out first (``NamedBarrier.DS_FREE``) and
    free the K / V buffer once step 0 is done with K (``NamedBarrier.K_FREE``). The CTA's last tile runs
    its last dQ after the loop (``carried_dq_tail``)."""

    @cute.jit
    def steps_with_tail(self, full_ops, env, work, state, head, m_block, seqlen_q, tail_operands):
        """``mma``'s steps with ``tail_m``: each query head's walk (``work_item``'s order: from
        its rotation round) as the whole blocks before the partial one, the partial block on
        ``tail_operands()``'s products, the whole blocks after it. A key block whose query blocks
        stop short of the partial one (a window) walks whole blocks only."""
        t = self.tiles
        group, m_min, m_max, rot = work.group, work.m_min, work.m_max, work.rot
        blocks = m_max - m_min
        m_tail = seqlen_q // t.tile_m  # the partial block (the caller's tail_m says there is one)
        before = blocks
        after = Int32(0)
        if m_min <= m_tail and m_tail < m_max:
            before = m_tail - m_min
            if const_expr(self.rotates):
                before = before - rot
                if before < 0:
                    before = before + blocks
            after = blocks - before - 1
        i = Int32(0)
        # (one loop of whole blocks run twice a head, before and after the partial block: with a
        # second copy of it ptxas built that copy's wgmma descriptors less well, +17 instructions a step)
        for _g in cutlass.range(group, unroll=1):
            for part in cutlass.range(2, unroll=1):
                run = cutlass.select_(part == 0, before, after)
                for _b in cutlass.range(run, unroll=1):
                    self.block_step(full_ops, env, i, state, head, m_block)
                    state.advance()
                    head, m_block = self.next_work_item(work, head, m_block)
                    i = i + 1
                if part == 0 and before < blocks:
                    self.block_step(tail_operands(), env, i, state, head, m_block)
                    state.advance()
                    head, m_block = self.next_work_item(work, head, m_block)
                    i = i + 1

    @cute.jit
    def block_step(self, ops, env, i, state, head, m_block):
        """The consumers' step ``i``: query block ``m_block`` of query head ``head`` (Q / dO in
        pipeline ``state``). ``ops``: ``StepOperands`` of a whole block, or ``tail_operands``'
        for a partial last block; ``env``: ``StepEnv``, what every step shares. S^T and dP^T,
        P^T and dS^T in registers here; the products on them and the handoffs of dS and dQ in
        ``deferred_step`` (dq_defer), ``split_step`` (pds_split) or ``joint_step``."""
        t = self.tiles
        prefetch = const_expr(t.overlap != "none")
        stage = state.index
        ds_stage = i % t.ds_stages
        q0 = m_block * t.tile_m
        if const_expr(not prefetch):
            self.issue_s(env.pipe_q, state, ops.tiled_mma_sdp, ops.acc_S, ops.tSrK, ops.tSrQ)
        lse = self.read_stats(env.sLSE, stage, ops.cS_mn) if const_expr(t.stats_early) else None
        # S^T (and with overlap "sdp" dP^T) of this block are in flight already
        if const_expr(t.overlap != "sdp"):
            self.issue_dp(env.pipe_do, state, ops.tiled_mma_sdp, ops.acc_dP, ops.tPrV, ops.tPrdO)
        # bias values and dropout flags while the tensor cores work (None without)
        rBias, keep = self.block_features(
            env.feat, head, i, q0, env.key0, env.seqlen_q, env.seqlen_k, ops.cS_mn, ops.shape_sdp, env.wg, env.tidx
        )

        warpgroup.wait_group(1)
        self.probs(
            ops.acc_S,
            ops.cS_mn,
            env.sLSE,
            stage,
            q0,
            env.key0,
            env.seqlen_q,
            env.seqlen_k,
            env.offset,
            env.window_size,
            env.scale_log2,
            rBias,
            lse,
            env.cap,
        )
        delta = self.read_stats(env.sDelta, stage, ops.cS_mn) if const_expr(t.stats_early) else None
        warpgroup.wait_group(0)
        self.grad_scores(
            ops.acc_dP, ops.acc_S, ops.cS_mn, env.sDelta, stage, keep, env.feat, delta, env.cap, env.sLSE, lse, rBias
        )
        # (converted before the dP^T wait instead, ptxas sinks it below the wait: same SASS)
        rP = self.p_operand(ops.acc_S, ops.cS_mn, keep, env.feat)

        # dV += P^T dO (P^T from registers); dS^T -> sdS; once both warpgroups' halves are
        # there (and visible to the async proxy): dQ = dS K, then dK += dS^T Q, so dQ can
        # leave while dK runs. With dq_defer the dQ is the previous block's (deferred_step)
        rdS = cute.make_rmem_tensor(ops.shape_sdp, self.dtype)
        if const_expr(t.dq_defer):
            convert_packed(ops.acc_dP, rdS)
        else:
            if const_expr(t.ds_before_dv):
                convert_packed(ops.acc_dP, rdS)
                cute.copy(ops.r2s_ds, ops.thr_r2s_ds.retile(rdS), ops.tdSs[None, None, None, ds_stage])
            wgmma(
                env.tiled_mma_dv,
                env.acc_dV,
                cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout)),
                ops.tVrdO[None, None, None, stage],
                zero_init=False,
            )
            if const_expr(not t.ds_before_dv):
                convert_packed(ops.acc_dP, rdS)
                cute.copy(ops.r2s_ds, ops.thr_r2s_ds.retile(rdS), ops.tdSs[None, None, None, ds_stage])
            cute.arch.fence_view_async_shared()
        # the bias gradient's stores of this block's dS (grad_bias), the key boxes to name
        store_dbias = functools.partial(
            self.store_grad_bias,
            feat=env.feat,
            sdS=env.sdS,
            buf=ds_stage,
            head=head,
            m_block=m_block,
            n_block=env.n_block,
        )
        if const_expr(t.dq_defer):
            self.deferred_step(ops, env, i, state, rP, rdS)
        elif const_expr(t.pds_split):
            self.split_step(ops, env, i, state, ds_stage, rdS, store_dbias)
        else:
            self.joint_step(ops, env, i, state, ds_stage, rdS, store_dbias)

    @cute.jit
    def split_step(self, ops, env, i, state, ds_stage, rdS, store_dbias):
        """``block_step``'s products with ``pds_split``: dK and dQ (``dq_dk_split``), the Q / dO
        stages freed, the next block's S^T issued (overlap), dQ staged."""
        t = self.tiles
        acc_dQ = self.dq_dk_split(
            env.wg,
            state.index,
            ds_stage,
            ops.tiled_mma_dq,
            env.tiled_mma_dkv,
            env.acc_dK,
            rdS,
            ops.tKrQ,
            ops.tQrdS,
            ops.tQrK,
            ops.shape_dq,
            env.tidx,
            store_dbias,
        )
        env.pipe_do.consumer_release(state)
        env.pipe_q.consumer_release(state)
        if const_expr(t.overlap != "none"):
            if i + 1 < env.steps:
                self.issue_s(env.pipe_q, env.state_next, ops.tiled_mma_sdp, ops.acc_S, ops.tSrK, ops.tSrQ)
                env.state_next.advance()
        self.stage_dq(acc_dQ, ops.r2s_dq, ops.thr_r2s_dq, ops.tdQs, i % t.dq_stages, env.wg)

    @cute.jit
    def joint_step(self, ops, env, i, state, ds_stage, rdS, store_dbias):
        """``block_step``'s products behind one barrier of both warpgroups (dS written): the bias
        gradient's stores, dQ then dK issued, dQ staged while dK runs, the next block's S^T (and
        dP^T) issued behind dK (overlap), the Q / dO stages freed."""
        t = self.tiles
        stage = state.index
        tidx = env.tidx
        self.grad_bias_wait(tidx == 0)
        cute.arch.barrier(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        if const_expr(self.grad_bias):
            if tidx == 0:  # both halves are written
                store_dbias(boxes=list(range(t.tile_n // GRAD_BIAS_BOX_KEYS)))
        acc_dQ = self.issue_dq(ops.tiled_mma_dq, ops.shape_dq, ops.tQrdS, ops.tQrK, ds_stage)
        wgmma(
            env.tiled_mma_dkv,
            env.acc_dK,
            cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
            ops.tKrQ[None, None, None, stage],
            zero_init=False,
        )
        warpgroup.wait_group(1)  # dV and dQ done
        env.pipe_do.consumer_release(state)

        # dQ -> sdQ for the store warp's reduce-add, while dK runs
        self.stage_dq(acc_dQ, ops.r2s_dq, ops.thr_r2s_dq, ops.tdQs, i % t.dq_stages, env.wg)
        # the next block's S^T (and dP^T) go to the tensor cores behind dK
        if const_expr(t.overlap != "none"):
            if i + 1 < env.steps:
                self.issue_s(env.pipe_q, env.state_next, ops.tiled_mma_sdp, ops.acc_S, ops.tSrK, ops.tSrQ)
                if const_expr(t.overlap == "sdp"):
                    self.issue_dp(env.pipe_do, env.state_next, ops.tiled_mma_sdp, ops.acc_dP, ops.tPrV, ops.tPrdO)
                    warpgroup.wait_group(2)  # dK done
                else:
                    warpgroup.wait_group(1)
                env.state_next.advance()
            else:
                warpgroup.wait_group(0)
        else:
            warpgroup.wait_group(0)
        env.pipe_q.consumer_release(state)

    @cute.jit
    def probs(
        self,
        acc_S,
        cS_mn,
        sLSE,
        stage,
        q0,
        key0,
        seqlen_q,
        seqlen_k,
        offset,
        window_size,
        scale_log2,
        rBias=None,
        lse=None,
        cap=None,
    ):
        """P^T = exp(S^T * scale [+ B^T] - LSE) in place of S^T, zero where masked (after the exp:
        LSE may be +-inf there); computed as exp2 with sLSE in log2 units. ``cS_mn``: (key, query)
        in the block of each value, rows x columns. ``lse``: the columns' LSE already read
        (``read_stats``), else read here. ``cap`` (softcap): S^T becomes tanh(S^T scale / c) first,
        and ``scale_log2`` is c log2(e)."""
        if const_expr(cap is not None):
            cap_scores(acc_S, cap.tanh_scale)
        S = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        B = None
        if const_expr(self.has_bias):
            B = cute.make_tensor(rBias.iterator, acc_mn_layout(rBias.layout))
        need_mask = self.mask.needs_masking(q0, key0, seqlen_q, seqlen_k, offset, window_size)
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            q_local = cS_mn[0, c][1]
            # already in log2 units: one multiply a column less
            lse_log2 = lse[c] if const_expr(lse is not None) else sLSE[q_local, stage]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                x = S[r, c] * scale_log2 - lse_log2
                if const_expr(self.has_bias):  # in log2 units, as the scores
                    x = x + B[r, c].to(Float32) * LOG2_E
                S[r, c] = cute.math.exp2(x, fastmath=True)
        if need_mask:
            self.mask.apply_transposed(S, cS_mn, q0, key0, seqlen_q, seqlen_k, offset, window_size)

    @cute.jit
    def grad_scores(
        self,
        acc_dP,
        acc_P,
        cS_mn,
        sDelta,
        stage,
        keep=None,
        feat=None,
        delta=None,
        cap=None,
        sLSE=None,
        lse=None,
        rB=None,
    ):
        """dS^T = P^T (dP^T - Δ) in place of dP^T (P undropped; with dropout dP^T is first
        the dropped product's gradient Z∘dP^T). ``delta``: the columns' Δ already read. ``cap``
        (softcap): times 1 - tanh², tanh recovered from P with the columns' LSE (``lse`` as read,
        else from ``sLSE``) and the bias fragment ``rB`` (``capped``)."""
        P = cute.make_tensor(acc_P.iterator, acc_mn_layout(acc_P.layout))
        dP = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
        B = None
        if const_expr(cap is not None and self.has_bias):
            B = cute.make_tensor(rB.iterator, acc_mn_layout(rB.layout))
        rows = cute.size(dP, mode=[0])
        for c in cutlass.range_constexpr(cute.size(dP, mode=[1])):
            d = delta[c] if const_expr(delta is not None) else sDelta[cS_mn[0, c][1], stage]
            lse_log2 = None
            if const_expr(cap is not None):
                lse_log2 = lse[c] if const_expr(lse is not None) else sLSE[cS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(rows):
                dp = dP[r, c]
                if const_expr(self.dropout):
                    dp = self.dropped(keep, c * rows + r, dp, feat)
                ds = P[r, c] * (dp - d)
                if const_expr(cap is not None):
                    ds = self.capped(ds, P[r, c], lse_log2, cap, B, r, c)
                dP[r, c] = ds

    @cute.jit
    def read_stats(self, s, stage, cS_mn):
        """LSE or Δ of the fragment's query columns from stage ``stage`` into registers."""
        vals = []
        for c in cutlass.range_constexpr(cute.size(cS_mn, mode=[1])):
            vals.append(s[cS_mn[0, c][1], stage])
        return vals

    @cute.jit
    def stage_dq(self, acc_dQ, r2s_dq, thr_r2s_dq, tdQs, buf, wg):
        """dQ -> staging buffer ``buf`` for the store warp's reduce-add."""
        handoff = self.tiles.dq_handoff_threads
        if const_expr(self.tiles.dq_per_wg):
            # only this warpgroup and the store warp meet
            if wg == 0:
                cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
            else:
                cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY_WG1, number_of_threads=handoff)
            cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQs[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)
            else:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL_WG1, number_of_threads=handoff)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
            cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQs[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)

    @cute.jit
    def dq_dk_split(
        self,
        wg,
        stage,
        ds_stage,
        tiled_mma_dq,
        tiled_mma_dkv,
        acc_dK,
        rdS,
        tKrQ,
        tQrdS,
        tQrK,
        shape_dq,
        tidx,
        store_dbias,
    ):
        """dS handoff by two one-way barriers: each warpgroup announces its half of dS, issues
        dK (registers only) and only then waits for the other half, so the wait overlaps dK.
        A warpgroup announces block i+1 after its dQ of block i completed (and, with the bias
        gradient, its store of the other half of block i has read it), which keeps the two dS
        buffers safe. ``store_dbias``: the bias gradient's stores of the block (``block_step``).
        Returns dQ with dK and dQ both done."""
        t = self.tiles
        storing = tidx % 128 == 0  # the bias gradient: this warpgroup's thread that stores the other half
        self.grad_bias_wait(storing)
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        else:
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.PDS_WG1, number_of_threads=t.num_mma_threads)
        wgmma(
            tiled_mma_dkv,
            acc_dK,
            cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
            tKrQ[None, None, None, stage],
            zero_init=False,
        )
        if wg == 0:
            cute.arch.barrier(barrier_id=NamedBarrier.PDS_WG1, number_of_threads=t.num_mma_threads)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        if const_expr(self.grad_bias):
            if storing:  # the other warpgroup's keys: its half is written and fenced
                store_dbias(boxes=1 - wg)
        if const_expr(t.dq_wait_dkv):
            warpgroup.wait_group(0)  # P^T / dS^T operand registers free before dQ's accumulator
        acc_dQ = self.issue_dq(tiled_mma_dq, shape_dq, tQrdS, tQrK, ds_stage)
        warpgroup.wait_group(0)
        return acc_dQ

    @cute.jit
    def deferred_step(self, ops, env, i, state, rP, rdS):
        """The products of step ``i`` once its dS is in registers (``dq_defer``): this block's
        dS^T stored (after the other warpgroup announced block i - 1, a step ago as a rule: it
        announces a block only once its dQ of the block before has read the buffer written
        here), the previous block's dQ and this block's dV issued, this half announced once
        that dQ has read its buffer (the other warpgroup writes block i + 1 there), dK issued
        and the previous block's dQ staged, then the Q / dO stages freed. Step 0 has no previous
        block: its dQ product runs on the unused buffer and is dropped, which keeps the wgmma
        groups the same every step (ptxas serialises wgmmas whose issue depends on a branch).
        Returns with all done. With carry_dq ``i`` counts the CTA's steps and the previous block
        may be the previous tile's last (dQ then runs on that tile's K); its dS buffer is the one
        the store warps read the previous tile's dK from."""
        tQrK = ops.tQrK
        tile_first = None  # carry_dq: the CTA's step count at the tile's step 0
        if const_expr(env.carry is not None):
            # step 0's product is the previous tile's last block, on that tile's K
            kb = env.kv_state.index
            tQrK = ops.tQrK_both[None, None, None, cutlass.select_(i > env.done, kb, 1 - kb)]
            tile_first = env.done
        self.deferred_products(ops, env, i, state.index, rP, rdS, tQrK, tile_first)
        env.pipe_do.consumer_release(state)
        env.pipe_q.consumer_release(state)

    @cute.jit
    def deferred_products(self, ops, env, g, stage, rP, rdS, tQrK, tile_first=None):
        """``deferred_step``'s products and handoffs of step ``g`` (Q / dO in ``stage``), dQ on
        ``tQrK``; ``tile_first`` (carry_dq): the tile's first step."""
        t = self.tiles
        wg = env.wg
        tiled_mma_dq, tiled_mma_dv, tiled_mma_dkv = ops.tiled_mma_dq, env.tiled_mma_dv, env.tiled_mma_dkv
        acc_dV, acc_dK = env.acc_dV, env.acc_dK
        r2s_ds, thr_r2s_ds, tdSs = ops.r2s_ds, ops.thr_r2s_ds, ops.tdSs
        r2s_dq, thr_r2s_dq, tdQs = ops.r2s_dq, ops.thr_r2s_dq, ops.tdQs
        n_handoff = t.dkv_handoff_threads
        prev = g - 1
        if g > 0:
            self.ds_half_barrier(1 - wg, prev, False)
            if const_expr(tile_first is not None):
                if g == tile_first:  # the tile's step 0: the previous tile's dK has left this buffer
                    named_barrier(NamedBarrier.DS_FREE, n_handoff, False)
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSs[None, None, None, cyclic(g, t.ds_stages)])
        acc_dQ = self.issue_dq(tiled_mma_dq, ops.shape_dq, ops.tQrdS, tQrK, cyclic(g + t.ds_stages - 1, t.ds_stages))
        wgmma(
            tiled_mma_dv,
            acc_dV,
            cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout)),
            ops.tVrdO[None, None, None, stage],
            zero_init=False,
        )
        warpgroup.wait_group(1)  # dQ of block i - 1 done: its dS buffer is read
        if const_expr(tile_first is not None):
            if g > 0:
                if g == tile_first:  # ... and the previous tile's K: its buffer may be refilled
                    named_barrier(NamedBarrier.K_FREE, n_handoff, True)
        cute.arch.fence_view_async_shared()
        self.ds_half_barrier(wg, g, True)
        wgmma(
            tiled_mma_dkv,
            acc_dK,
            cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
            ops.tKrQ[None, None, None, stage],
            zero_init=False,
        )
        if g > 0:
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, cyclic(prev, t.dq_stages), wg)
        warpgroup.wait_group(0)

    @cute.jit
    def carried_dq_tail(self, sK, sdS, sdQ, tiled_mma_dq, tidx, done, kv_state, any_tile):
        """carry_dq, after the CTA's last tile: that tile's last block's dQ (on its K, still in
        its buffer), staged for the store warp; then the K buffer is released. A CTA without
        tiles issues the product on whatever the buffers hold and stages nothing (no wgmma
        under a branch)."""
        t = self.tiles
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tQrdS, tQrK, shape_dq = self.dq_operands(tiled_mma_dq, tidx, wg, sK, sdS)
        r2s_dq, thr_r2s_dq, tdQs = self.dq_staging(tiled_mma_dq, tidx, sdQ)
        last = done - 1
        if any_tile:
            self.ds_half_barrier(1 - wg, last, False)
        acc_dQ = self.issue_dq(
            tiled_mma_dq,
            shape_dq,
            tQrdS,
            tQrK[None, None, None, 1 - kv_state.index],
            (last + t.ds_stages) % t.ds_stages,
        )
        warpgroup.wait_group(0)
        if any_tile:
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, last % t.dq_stages, wg)
            named_barrier(NamedBarrier.K_FREE, t.dkv_handoff_threads, True)

    @cute.jit
    def dkv_staged_barrier(self, buffer, arrive: cutlass.Constexpr):
        """Persistent CTAs: the consumers have staged a tile's dK / dV in K / V buffer
        ``buffer`` (``arrive``), or the store warps wait for it. An id per buffer: the consumers
        stage into a buffer again only after the store warps freed it."""
        n = self.tiles.dkv_handoff_threads
        if buffer == 0:
            named_barrier(NamedBarrier.DKV_STAGED, n, arrive)
        else:
            named_barrier(NamedBarrier.DKV_STAGED_BUF1, n, arrive)

    @cute.jit
    def ds_half_barrier(self, owner, i, arrive: cutlass.Constexpr):
        """``dq_defer``: warpgroup ``owner``'s half of block i's dS is written and fenced:
        announced by it (``arrive``) or waited for by the other warpgroup. Static ids (a
        register id makes ptxas reserve all 16), alternating by step."""
        n = self.tiles.num_mma_threads
        if owner == 0:
            if cyclic(i, 2) == 0:
                named_barrier(NamedBarrier.PDS, n, arrive)
            else:
                named_barrier(NamedBarrier.PDS_ODD, n, arrive)
        else:
            if cyclic(i, 2) == 0:
                named_barrier(NamedBarrier.PDS_WG1, n, arrive)
            else:
                named_barrier(NamedBarrier.PDS_WG1_ODD, n, arrive)
