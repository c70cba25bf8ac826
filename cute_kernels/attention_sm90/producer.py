"""The sm90 backward's producer warp: K / V once a tile, each step's Q / LSE and dO / Δ by TMA."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from .arguments import LoadArgs


class ProducerMixin:
    """The producer warp (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def load(self, la: LoadArgs, n_block, batch, work, rows, kv_state=None, q_state=None):
        """K / V, then each step's Q / LSE and dO / Δ. Persistent CTAs: ``kv_state``, the K / V
        pipeline's state, and ``q_state``, the Q / dO pipelines', both returned advanced past the
        tile."""
        t = self.tiles
        one = cute.make_layout(1)
        gK = cute.local_tile(
            self.seq_tile_view(la.gK_tma, work.head_kv, batch, rows.offset_k), (t.tile_n, t.head_dim), (n_block, 0)
        )
        gV = cute.local_tile(
            self.seq_tile_view(la.gV_tma, work.head_kv, batch, rows.offset_k), (t.tile_n, t.head_dim_v), (n_block, 0)
        )
        tKs, tKg = cpasync.tma_partition(la.tma_K, 0, one, cute.group_modes(la.sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(la.tma_V, 0, one, cute.group_modes(la.sV, 0, 2), cute.group_modes(gV, 0, 2))

        if const_expr(self.persistent):  # K / V also for a tile without steps (the consumers wait for it)
            la.pipe_kv.producer_acquire(kv_state)  # the dK / dV store warps freed it two tiles back
            bar = la.pipe_kv.producer_get_barrier(kv_state)
            cute.copy(la.tma_K, tKg, tKs[None, kv_state.index], tma_bar_ptr=bar)
            cute.copy(la.tma_V, tVg, tVs[None, kv_state.index], tma_bar_ptr=bar)
            kv_state.advance()
            cute.arch.griddepcontrol_wait()  # (the first tile's: the preprocess may still run)
            for i in cutlass.range(work.steps, unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(la, q_state, head, batch, rows.offset_q, m_block)
                q_state.advance()
            return q_state, kv_state
        if work.m_min < work.m_max:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(la.mbar_kv, self.kv_bytes)
            cute.copy(la.tma_K, tKg, tKs, tma_bar_ptr=la.mbar_kv)
            cute.copy(la.tma_V, tVg, tVs, tma_bar_ptr=la.mbar_kv)
            # LSE and Δ come from the preprocess launch just before (PDL: it may still run)
            cute.arch.griddepcontrol_wait()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
            for i in cutlass.range(work.steps, unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(la, state, head, batch, rows.offset_q, m_block)
                state.advance()

    @cute.jit
    def load_step(self, la: LoadArgs, state, head, batch, offset_q, m_block):
        """One step's Q / LSE and dO / Δ (query block ``m_block`` of ``head``) into the stage of ``state``."""
        la.pipe_q.producer_acquire(state)
        bar = la.pipe_q.producer_get_barrier(state)
        self.tma_load_block(la.tma_Q, la.gQ_tma, la.sQ, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(la.tma_LSE, la.gLSE_tma, la.sLSE, head, batch, offset_q, m_block, state.index, bar)
        la.pipe_do.producer_acquire(state)
        bar = la.pipe_do.producer_get_barrier(state)
        self.tma_load_block(la.tma_dO, la.gdO_tma, la.sdO, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(la.tma_Delta, la.gDelta_tma, la.sDelta, head, batch, offset_q, m_block, state.index, bar)

    @cute.jit
    def tma_load_block(self, atom, g_tma, s, head, batch, offset_q, m_block, stage, bar):
        """Query block ``m_block`` of ``head`` (rows x head dim, or a statistic's rows) into stage
        ``stage``. Statistics are [sequences, H, rows] also with varlen (no packed offset)."""
        t = self.tiles
        if const_expr(cute.rank(s) == 3):  # (rows, d, stages): Q's d is Dqk, dO's Dv
            tile = (t.tile_m, cute.size(s, mode=[1]))
            g = cute.local_tile(self.seq_tile_view(g_tma, head, batch, offset_q), tile, (m_block, 0))
            ts, tg = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
        else:  # (rows, stages)
            g = cute.local_tile(g_tma[None, head, batch], (t.tile_m,), (m_block,))
            ts, tg = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 1), cute.group_modes(g, 0, 1)
            )
        cute.copy(atom, tg, ts[None, stage], tma_bar_ptr=bar)
