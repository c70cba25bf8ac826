"""The sm90 backward's producer warp: K / V once a tile, each step's Q / LSE and dO / Δ by TMA."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync


class ProducerMixin:
    """The producer warp (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def load(
        self,
        gQ_tma,
        gdO_tma,
        gK_tma,
        gV_tma,
        gLSE_tma,
        gDelta_tma,
        sQ,
        sdO,
        sK,
        sV,
        sLSE,
        sDelta,
        tma_Q,
        tma_dO,
        tma_K,
        tma_V,
        tma_LSE,
        tma_Delta,
        pipe_q,
        pipe_do,
        mbar_kv,
        n_block,
        batch,
        work,
        rows,
        kv=None,
    ):
        """K / V, then each step's Q / LSE and dO / Δ. ``kv``: persistent CTAs' (K / V pipeline,
        its state, the Q / dO pipelines' state), both states returned advanced past the tile."""
        t = self.tiles
        head_kv, group, m_min, m_max, _ = work
        offset_q, offset_k = rows
        one = cute.make_layout(1)
        gK = cute.local_tile(self.seq_tile_view(gK_tma, head_kv, batch, offset_k), (t.tile_n, t.head_dim), (n_block, 0))
        gV = cute.local_tile(
            self.seq_tile_view(gV_tma, head_kv, batch, offset_k), (t.tile_n, t.head_dim_v), (n_block, 0)
        )
        tKs, tKg = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        if const_expr(self.persistent):  # K / V also for a tile without steps (the consumers wait for it)
            pipe_kv, kv_state, q_state = kv
            pipe_kv.producer_acquire(kv_state)  # the dK / dV store warps freed it two tiles back
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKg, tKs[None, kv_state.index], tma_bar_ptr=bar)
            cute.copy(tma_V, tVg, tVs[None, kv_state.index], tma_bar_ptr=bar)
            kv_state.advance()
            cute.arch.griddepcontrol_wait()  # (the first tile's: the preprocess may still run)
            for i in cutlass.range(group * (m_max - m_min), unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(
                    gQ_tma,
                    gdO_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    q_state,
                    head,
                    batch,
                    offset_q,
                    m_block,
                )
                q_state.advance()
            return q_state, kv_state
        if m_min < m_max:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.kv_bytes)
            cute.copy(tma_K, tKg, tKs, tma_bar_ptr=mbar_kv)
            cute.copy(tma_V, tVg, tVs, tma_bar_ptr=mbar_kv)
            # LSE and Δ come from the preprocess launch just before (PDL: it may still run)
            cute.arch.griddepcontrol_wait()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
            for i in cutlass.range(group * (m_max - m_min), unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(
                    gQ_tma,
                    gdO_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    state,
                    head,
                    batch,
                    offset_q,
                    m_block,
                )
                state.advance()

    @cute.jit
    def load_step(
        self,
        gQ_tma,
        gdO_tma,
        gLSE_tma,
        gDelta_tma,
        sQ,
        sdO,
        sLSE,
        sDelta,
        tma_Q,
        tma_dO,
        tma_LSE,
        tma_Delta,
        pipe_q,
        pipe_do,
        state,
        head,
        batch,
        offset_q,
        m_block,
    ):
        """One step's Q / LSE and dO / Δ (query block ``m_block`` of ``head``) into the stage of ``state``."""
        pipe_q.producer_acquire(state)
        bar = pipe_q.producer_get_barrier(state)
        self.tma_load_block(tma_Q, gQ_tma, sQ, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(tma_LSE, gLSE_tma, sLSE, head, batch, offset_q, m_block, state.index, bar)
        pipe_do.producer_acquire(state)
        bar = pipe_do.producer_get_barrier(state)
        self.tma_load_block(tma_dO, gdO_tma, sdO, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(tma_Delta, gDelta_tma, sDelta, head, batch, offset_q, m_block, state.index, bar)

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
