"""Persistent CTAs of the sm90 backward: every role's walk over the CTA's tiles."""

import dataclasses
from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from cute_kernels.attention.named_barrier import NamedBarrier, named_barrier
from cute_kernels.attention.seqlen_info import Rows

from .backward_config import (
    CONSUMER_REGS_PERSISTENT,
    DKV_STORE_WARPS,
    PRODUCER_REGS_PERSISTENT,
)

from .arguments import Carry, LoadArgs, MmaArgs, StoreArgs


@dataclass(frozen=True)
class TileWalk:
    """What every role of a persistent CTA walks its tiles by: the tiles (``total``), the CTA's
    first and the grid's size (its stride), the rows (no varlen: 0), the scheduler's parameters,
    the query heads a key head serves, the lengths, the window and, with ``dynamic_tiles``, the
    ``TileRing`` (else None)."""

    total: Any
    first: Any
    step: Any
    rows: Any
    sched: Any
    group: Any
    seqlen_q: Any
    seqlen_k: Any
    window_size: Any
    ring_args: Any


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
        load_args: LoadArgs,
        store_args: StoreArgs,
        mma_args: MmaArgs,
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
        rows = Rows(Int32(0), Int32(0))
        walk = TileWalk(total, first, step, rows, sched, group, seqlen_q, seqlen_k, window_size, tiles_args)
        ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, max(t.tile_ring, 1))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS_PERSISTENT)
            # (each role returns its ring state: it advances in place, and the tracer carries it
            # out of the role's branch only where the branch rebinds it)
            if warp_idx == 0:
                ring = self.producer_tiles(walk, load_args)
            if warp_idx == 1:
                ring = self.store_dq_tiles(walk, store_args, ring)
            if warp_idx >= DKV_STORE_WARPS[0]:
                ring = self.store_dkv_tiles(walk, store_args, mma_args, sdK_carry, warp_idx, tidx, ring)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS_PERSISTENT)
            ring = self.consumer_tiles(walk, mma_args, sdK_carry, tidx, softmax_scale, ring)

    @cute.jit
    def producer_tiles(self, walk, la: LoadArgs):
        """The producer warp: each tile's K / V and steps (``load``), and with ``dynamic_tiles``
        the tiles taken from the counter, handed to the other warps (the end too)."""
        t = self.tiles
        total, first, step, rows = walk.total, walk.first, walk.step, walk.rows
        ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, max(t.tile_ring, 1))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.kv_buffers)
        tile = first
        while tile < total:
            ring = self.scheduler.publish_tile(walk.ring_args, tile, ring)
            n_block, batch, work = self.walk_tile(walk, tile)
            state, kv_state = self.load(la, n_block, batch, work, rows, kv_state, state)
            tile = self.scheduler.fetch_tile(walk.ring_args, tile, step)
        ring = self.scheduler.publish_tile(walk.ring_args, total, ring)  # the end, for the other warps
        return ring

    @cute.jit
    def store_dq_tiles(self, walk, sa: StoreArgs, ring):
        """The dQ-store warp: each tile's reduce-adds (``store_dq``), store_first's last stored
        block published after the CTA's last tile."""
        total, first, step, rows = walk.total, walk.first, walk.step, walk.rows
        pending = Int32(-1)  # store_first: published across tiles
        tile, ring = self.scheduler.take_tile(walk.ring_args, first - step, step, ring)
        while tile < total:
            n_block, batch, work = self.walk_tile(walk, tile)
            pending = self.store_dq(sa, n_block, batch, work, rows, walk.seqlen_q, walk.seqlen_k, pending)
            tile, ring = self.scheduler.take_tile(walk.ring_args, tile, step, ring)
        if const_expr(self.store_first):
            self.publish_stored(sa.dq_first.flags, pending, cute.arch.lane_idx(), 0)
        return ring

    @cute.jit
    def store_dkv_tiles(self, walk, sa: StoreArgs, ma: MmaArgs, sdK_carry, warp_idx, tidx, ring):
        """The dK / dV store warps: each tile's dK / dV from the K / V buffer the consumers staged
        them in, while the consumers go on with the next tile; then the buffer is free for the
        producer. With zero_ahead they zero the dQ accumulator's blocks ahead, too."""
        t = self.tiles
        sched, group, seqlen_q, seqlen_k = walk.sched, walk.group, walk.seqlen_q, walk.seqlen_k
        total, first, step = walk.total, walk.first, walk.step
        mdK, mdV = ma.dkv_out.mdK, ma.dkv_out.mdV
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
        store_threads = t.dkv_store_threads
        store_tidx = tidx - 32 * DKV_STORE_WARPS[0]
        done = Int32(0)  # carry_dq: the steps of the tiles before (dK's dS buffer)
        tile, ring = self.scheduler.take_tile(walk.ring_args, first - step, step, ring)
        zeroing = warp_idx - DKV_STORE_WARPS[0]  # zero_ahead: this warp's share of the owned blocks
        if const_expr(self.zero_ahead):
            cute.arch.griddepcontrol_wait()  # (the flags' zeroing is before the preprocess)
            if const_expr(self.dynamic_tiles):
                # causal: every block at the start, from a counter of zeroing jobs (a CTA
                # learns its next tile only near the end of the current one)
                self.zero_jobs(sa.dq_first, walk.ring_args.counter.iterator + 1, sched, group, seqlen_q)
            else:
                if tile < total:
                    self.zero_owned(sa.dq_first, sched, tile, group, seqlen_q, seqlen_k, zeroing)
        while tile < total:
            if const_expr(self.zero_ahead and not self.dynamic_tiles):
                # the CTA's next tile's blocks: the tiles that add there run a round later
                if tile + step < total:
                    self.zero_owned(sa.dq_first, sched, tile + step, group, seqlen_q, seqlen_k, zeroing)
            n_block, batch, work = self.walk_tile(walk, tile)
            head_kv = work.head_kv
            b = kv_state.index
            self.dkv_staged_barrier(b, False)
            if const_expr(self.carry_dq):
                # dK first: the consumers' next block writes its dS where dK is staged
                done += work.steps
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
                    ma.sV[None, None, b], mdV, store_tidx, store_threads, n_block, head_kv, batch, Int32(0), seqlen_k
                )
                # K stays until the consumers' product on it (the next tile's step 0) is done
                named_barrier(NamedBarrier.K_FREE, t.dkv_handoff_threads, False)
            else:
                self.store_staged_dkv(
                    ma.sK[None, None, b],
                    ma.sV[None, None, b],
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
            ma.pipe_kv.consumer_release(kv_state)
            kv_state.advance()
            tile, ring = self.scheduler.take_tile(walk.ring_args, tile, step, ring)
        return ring

    @cute.jit
    def consumer_tiles(self, walk, ma: MmaArgs, sdK_carry, tidx, softmax_scale, ring):
        """The consumer warpgroups: each tile's steps on its K / V buffer (``mma``); with carry_dq
        the CTA's last block's dQ after the last tile."""
        t = self.tiles
        total, first, step, rows = walk.total, walk.first, walk.step, walk.rows
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
        done = Int32(0)  # carry_dq: the steps of the tiles before
        tile, ring = self.scheduler.take_tile(walk.ring_args, first - step, step, ring)
        while tile < total:
            n_block, batch, work = self.walk_tile(walk, tile)
            b = kv_state.index
            state, kv_state, done = self.mma(
                dataclasses.replace(ma, sK=ma.sK[None, None, b], sV=ma.sV[None, None, b]),
                tidx - 128,
                n_block,
                batch,
                work,
                rows,
                walk.seqlen_q,
                walk.seqlen_k,
                softmax_scale,
                walk.window_size,
                None,
                kv_state,
                state,
                carry=Carry(done, ma.sK, sdK_carry) if const_expr(self.carry_dq) else None,
            )
            tile, ring = self.scheduler.take_tile(walk.ring_args, tile, step, ring)
        if const_expr(self.carry_dq):
            self.carried_dq_tail(ma.sK, ma.sdS, ma.sdQ, ma.tiled_mma_dq, tidx - 128, done, kv_state, first < total)
        return ring

    @cute.jit
    def walk_tile(self, walk, tile):
        """(key block, batch, ``Work``) of tile ``tile`` (``tile_work``)."""
        return self.tile_work(walk.sched, tile, walk.group, walk.seqlen_q, walk.seqlen_k, walk.window_size)
