"""Persistent CTAs of the sm90 backward: every role's walk over the CTA's tiles."""

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from cute_kernels.attention.named_barrier import NamedBarrier, named_barrier

from .backward_config import (
    CONSUMER_REGS_PERSISTENT,
    DKV_STORE_WARPS,
    PRODUCER_REGS_PERSISTENT,
)


class PersistentRolesMixin:
    """The roles of a persistent CTA (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def persistent_roles(
        self,
        warp_idx,
        tidx,
        sched,
        group,
        seqlen_q,
        seqlen_k,
        window_size,
        softmax_scale,
        tiles_args,
        load_args,
        store_args,
        mma_args,
        sdK_carry,
    ):
        """Persistent CTAs (``self.persistent``): CTA c runs tiles c, c + grid, ... in launch
        order (key blocks of a head side by side, as the hardware would place them), or with
        ``dynamic_tiles`` tile c, then whichever the tile counter hands out next (grid + k, in
        the heavy-first order of causal masks: list scheduling, as the hardware does it for a
        CTA per tile). The Q / dO pipelines run on across tiles; K / V alternate between two
        buffers, so the producer loads the next tile's while this one runs. The consumers stage a
        tile's dK / dV in its buffer and go on with the next tile; warps 2 and 3 store them to
        global memory and free the buffer (measured: ~2 us of a 24 us CTA at 8x16x1024x64 waited
        for K / V, ~1 us stored dK / dV; docs/attention_sm90.md)."""
        t = self.tiles
        total = sched.total
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        rows = (Int32(0), Int32(0))
        ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, max(t.tile_ring, 1))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS_PERSISTENT)
            if warp_idx == 0:
                ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, max(t.tile_ring, 1))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.kv_buffers)
                tile = first
                while tile < total:
                    ring = self.scheduler.publish_tile(tiles_args, tile, ring)
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    state, kv_state = self.load(
                        *load_args[:-1], None, n_block, batch, work, rows, kv=(load_args[-1], kv_state, state)
                    )
                    tile = self.scheduler.fetch_tile(tiles_args, tile, step)
                ring = self.scheduler.publish_tile(tiles_args, total, ring)  # the end, for the other warps
            if warp_idx == 1:
                gdQ_tma, sdQ, tma_dQ, mSemaphore, dq_first = store_args
                pending = Int32(-1)  # store_first: published across tiles
                tile, ring = self.scheduler.take_tile(tiles_args, first - step, step, ring)
                while tile < total:
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    pending = self.store_dq(
                        gdQ_tma,
                        sdQ,
                        tma_dQ,
                        mSemaphore,
                        n_block,
                        batch,
                        work,
                        rows,
                        seqlen_q,
                        seqlen_k,
                        None,
                        dq_first,
                        pending,
                    )
                    tile, ring = self.scheduler.take_tile(tiles_args, tile, step, ring)
                if const_expr(self.store_first):
                    self.publish_stored(dq_first[0], pending, cute.arch.lane_idx(), 0)
            if warp_idx >= DKV_STORE_WARPS[0]:
                # each tile's dK / dV from the K / V buffer the consumers staged them in, while
                # the consumers go on with the next tile; then the buffer is free for the producer
                pipe_kv = load_args[-1]
                sK, sV = load_args[8], load_args[9]
                mdK, mdV, _ = mma_args[6]
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
                store_threads = t.dkv_store_threads
                store_tidx = tidx - 32 * DKV_STORE_WARPS[0]
                done = Int32(0)  # carry_dq: the steps of the tiles before (dK's dS buffer)
                tile, ring = self.scheduler.take_tile(tiles_args, first - step, step, ring)
                zeroing = warp_idx - DKV_STORE_WARPS[0]  # zero_ahead: this warp's share of the owned blocks
                if const_expr(self.zero_ahead):
                    cute.arch.griddepcontrol_wait()  # (the flags' zeroing is before the preprocess)
                    if const_expr(self.dynamic_tiles):
                        # causal: every block at the start, from a counter of zeroing jobs (a CTA
                        # learns its next tile only near the end of the current one)
                        self.zero_jobs(store_args[4], tiles_args.counter.iterator + 1, sched, group, seqlen_q)
                    else:
                        if tile < total:
                            self.zero_owned(store_args[4], sched, tile, group, seqlen_q, seqlen_k, zeroing)
                while tile < total:
                    if const_expr(self.zero_ahead and not self.dynamic_tiles):
                        # the CTA's next tile's blocks: the tiles that add there run a round later
                        if tile + step < total:
                            self.zero_owned(store_args[4], sched, tile + step, group, seqlen_q, seqlen_k, zeroing)
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    head_kv = work[0]
                    b = kv_state.index
                    self.dkv_staged_barrier(b, False)
                    if const_expr(self.carry_dq):
                        # dK first: the consumers' next block writes its dS where dK is staged
                        done += work[1] * (work[3] - work[2])
                        self.store_staged_tile(
                            sdK_carry[None, None, done % t.ds_stages],
                            mdK,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                        if tile + step < total:
                            named_barrier(NamedBarrier.DS_FREE, t.dkv_handoff_threads, True)
                        self.store_staged_tile(
                            sV[None, None, b],
                            mdV,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                        # K stays until the consumers' product on it (the next tile's step 0) is done
                        named_barrier(NamedBarrier.K_FREE, t.dkv_handoff_threads, False)
                    else:
                        self.store_staged_dkv(
                            sK[None, None, b],
                            sV[None, None, b],
                            mdK,
                            mdV,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                    pipe_kv.consumer_release(kv_state)
                    kv_state.advance()
                    tile, ring = self.scheduler.take_tile(tiles_args, tile, step, ring)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS_PERSISTENT)
            sQ, sdO, sdS, sdQ, sLSE, sDelta, dkv_out, mma_sdp, mma_dkv, mma_dv, mma_dq, pipe_q, pipe_do, _ = mma_args
            pipe_kv = load_args[-1]
            sK, sV = load_args[8], load_args[9]
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
            done = Int32(0)  # carry_dq: the steps of the tiles before
            tile, ring = self.scheduler.take_tile(tiles_args, first - step, step, ring)
            while tile < total:
                n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                b = kv_state.index
                state, kv_state, done = self.mma(
                    sQ,
                    sdO,
                    sK[None, None, b],
                    sV[None, None, b],
                    sdS,
                    sdQ,
                    sLSE,
                    sDelta,
                    dkv_out,
                    mma_sdp,
                    mma_dkv,
                    mma_dv,
                    mma_dq,
                    pipe_q,
                    pipe_do,
                    None,
                    tidx - 128,
                    n_block,
                    batch,
                    work,
                    rows,
                    seqlen_q,
                    seqlen_k,
                    softmax_scale,
                    window_size,
                    None,
                    kv=(pipe_kv, kv_state, state),
                    carry=(done, sK, sdK_carry) if const_expr(self.carry_dq) else None,
                )
                tile, ring = self.scheduler.take_tile(tiles_args, tile, step, ring)
            if const_expr(self.carry_dq):
                self.carried_dq_tail(sK, sdS, sdQ, mma_dq, tidx - 128, done, kv_state, first < total)
