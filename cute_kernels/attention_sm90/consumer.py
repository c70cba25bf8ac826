"""The sm90 backward's consumer warpgroups: a tile's walk over its steps (``mma``) and its end
(``finish_tile``: the last steps, the dK / dV epilogue)."""

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .arguments import MmaArgs
from .operands import StepEnv


class ConsumerMixin:
    """``mma`` and ``finish_tile`` of ``AttentionBackwardSm90``."""

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
        kv_state=None,
        state=None,
        carry=None,
    ):
        """The consumers' steps of one tile, then its dK / dV. Persistent CTAs: ``kv_state``, the
        K / V pipeline's state, and ``state``, the Q / dO pipelines', both returned advanced past
        the tile with the steps done so far; ma.sK / ma.sV are then the tile's buffer. ``carry``
        (carry_dq): ``Carry``: step 0 computes the previous tile's last dQ on its K, dS buffers
        and named barriers alternate with the CTA's step count, and dK is staged in a dS buffer."""
        t = self.tiles
        steps = work.steps
        wg = cute.arch.make_warp_uniform(tidx // 128)
        scale_log2, cap = self.score_scales(softmax_scale, ma.softcap)

        # S^T = K Q^T, dP^T = V dO^T (this warpgroup's 64 keys); dV += P^T dO, dK += dS^T Q (B operands
        # the transposed views of dO / Q); dQ = dS K; registers -> shared: dS^T into sdS, dQ into sdQ
        done = Int32(0)
        sK_both = None
        if const_expr(carry is not None):
            done, sK_both = carry.done, carry.sK_both
        full_ops = self.step_operands(ma, tidx, wg, sK_both=sK_both)
        acc_dV, acc_dK = self.dkv_accumulators(ma.tiled_mma_dkv, ma.tiled_mma_dv, tidx)

        offset = self.mask.causal_offset(seqlen_q, seqlen_k)
        key0 = n_block * t.tile_n
        if const_expr(self.persistent):
            state_next = state  # (no overlap with dq_defer)
        else:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            state_next = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        # overlap "none": S^T is issued at the top of each step. "s" / "sdp" issue the next
        # step's S^T (and dP^T) behind this step's dK; ptxas does not follow wgmma groups
        # across the loop's back edge and serialises every wgmma of the kernel (warnings
        # C7514 / C7515; also when the issue is made unconditional with a repeated last Q
        # block). Measured: d128 gains 16% without it, d64 loses 4% (docs/attention_sm90.md).
        prefetch = const_expr(t.overlap != "none")
        if const_expr(self.persistent):
            ma.pipe_kv.consumer_wait(kv_state)  # also for a tile without steps (dK / dV zeros)
        elif work.m_min < work.m_max:
            cute.arch.mbarrier_wait(ma.mbar_kv, 0)
            if const_expr(prefetch):
                self.issue_s(ma.pipe_q, state_next, ma.tiled_mma_sdp, full_ops.acc_S, full_ops.tSrK, full_ops.tSrQ)
                if const_expr(t.overlap == "sdp"):
                    self.issue_dp(
                        ma.pipe_do, state_next, ma.tiled_mma_sdp, full_ops.acc_dP, full_ops.tPrV, full_ops.tPrdO
                    )
                state_next.advance()
        env = StepEnv(
            pipe_q=ma.pipe_q,
            pipe_do=ma.pipe_do,
            state_next=state_next,
            sLSE=ma.sLSE,
            sDelta=ma.sDelta,
            sdS=ma.sdS,
            feat=feat,
            tiled_mma_dkv=ma.tiled_mma_dkv,
            tiled_mma_dv=ma.tiled_mma_dv,
            acc_dV=acc_dV,
            acc_dK=acc_dK,
            wg=wg,
            tidx=tidx,
            n_block=n_block,
            key0=key0,
            offset=offset,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            window_size=window_size,
            scale_log2=scale_log2,
            cap=cap,
            steps=steps,
            carry=carry,
            kv_state=kv_state if const_expr(self.persistent) else None,
            done=done,
        )
        # the loop stays outside that if (it runs 0 steps without work): nested in it, ptxas
        # spilled 384 bytes in d64 and the kernel ran ~10% slower (docs/attention_sm90.md)
        head, m_block = self.work_item(work, 0)
        # carry_dq counts the CTA's steps (dS buffers and barriers alternate with it)
        first_step = done if const_expr(carry is not None) else 0
        if const_expr(self.tail_m > 0):
            # the partial last query block on products tail_m queries wide, its step peeled out of
            # the loops of whole blocks (one loop taking either kind of step made ptxas rebuild the
            # whole blocks' wgmma descriptors every step: ~40 instructions a step more)
            tail_operands = functools.partial(self.tail_operands, ma, tidx, wg)
            self.steps_with_tail(full_ops, env, work, state, head, m_block, seqlen_q, tail_operands)
        else:
            for i in cutlass.range(first_step, first_step + steps, unroll=1):
                self.block_step(full_ops, env, i, state, head, m_block)
                state.advance()
                head, m_block = self.next_work_item(work, head, m_block)
        return self.finish_tile(ma, full_ops, env, state, work, batch, rows, softmax_scale)

    @cute.jit
    def finish_tile(self, ma: MmaArgs, full_ops, env, state, work, batch, rows, softmax_scale):
        """After a tile's steps: with dq_defer the last block's dQ, then dK / dV: staged in the
        tile's K / V buffer for the store warps (persistent CTAs; returns the pipelines' states
        and the CTA's step count, ``mma``'s), else stored (``epilogue``)."""
        t = self.tiles
        acc_dK, acc_dV, tidx, wg, steps = env.acc_dK, env.acc_dV, env.tidx, env.wg, env.steps
        if const_expr(t.dq_defer and env.carry is None):
            # the last block's dQ (computed without a block, and not staged, when there is none)
            last = steps - 1
            if steps > 0:
                self.ds_half_barrier(1 - wg, last, False)
            acc_dQ = self.issue_dq(
                ma.tiled_mma_dq, full_ops.shape_dq, full_ops.tQrdS, full_ops.tQrK, (last + t.ds_stages) % t.ds_stages
            )
            warpgroup.wait_group(0)
            if steps > 0:
                self.stage_dq(acc_dQ, full_ops.r2s_dq, full_ops.thr_r2s_dq, full_ops.tdQs, last % t.dq_stages, wg)
        if const_expr(self.persistent):
            # dK / dV staged in this tile's K / V buffer for the store warps, which free it
            kv_state = env.kv_state
            done = env.done
            acc_dK.store(acc_dK.load() * softmax_scale)
            if const_expr(env.carry is not None):
                # K stays for the next step 0: dK goes to the dS buffer the last block left free
                done += steps
                self.stage_dkv(
                    acc_dK,
                    acc_dV,
                    env.carry.sdK_both[None, None, done % t.ds_stages],
                    ma.sV,
                    ma.tiled_mma_dkv,
                    ma.tiled_mma_dv,
                    tidx,
                )
            else:
                self.stage_dkv(acc_dK, acc_dV, ma.sK, ma.sV, ma.tiled_mma_dkv, ma.tiled_mma_dv, tidx)
            self.dkv_staged_barrier(kv_state.index, True)
            kv_state.advance()
            return state, kv_state, done
        self.epilogue(
            acc_dK,
            acc_dV,
            ma.dkv_out,
            ma.sK,
            ma.sV,
            ma.tiled_mma_dkv,
            ma.tiled_mma_dv,
            tidx,
            env.n_block,
            work.head_kv,
            batch,
            rows,
            env.seqlen_k,
            softmax_scale,
        )
