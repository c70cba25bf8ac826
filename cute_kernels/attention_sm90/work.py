"""A tile's work in the sm90 backward: the (query head, query block) steps of a key block, in
the order every role walks them, and the views of one sequence's rows."""

import cutlass.cute as cute
from cutlass import Int32, const_expr

from .arguments import Work


class WorkMixin:
    """Steps of a key block (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def tile_work(self, sched, tile, group, seqlen_q, seqlen_k, window_size):
        """Persistent CTAs: (key block, batch, ``Work``) of tile ``tile``."""
        n_block, head_kv, batch = self.scheduler.coords_of(sched, tile)
        return n_block, batch, self.work_of(n_block, head_kv, group, seqlen_q, seqlen_k, window_size)

    @cute.jit
    def work_of(self, n_block, head_kv, group, seqlen_q, seqlen_k, window_size):
        """``Work`` of key block ``n_block``: its steps walk the group's query heads, each from query block first + rotation round to
        it (``work_item``; the rotation is 0 unless ``rotates``)."""
        m_min, m_max = self.mask.m_block_range(n_block, seqlen_q, seqlen_k, window_size)
        rot = Int32(0)
        if const_expr(self.rotates):
            rot = n_block * (m_max - m_min) // cute.ceil_div(seqlen_k, self.tiles.tile_n)
        return Work(head_kv, group, m_min, m_max, rot)

    @cute.jit
    def seq_tile_view(self, g, head, batch, row0):
        """(rows, d) view of one head of one sequence: the batch index, or with varlen the
        packed rows from ``row0`` on (a TMA coordinate tensor or a global tensor alike)."""
        if const_expr(self.varlen):
            return cute.domain_offset((row0, 0), g[None, None, head, 0])
        return g[None, None, head, batch]

    @cute.jit
    def work_item(self, work, i):
        """(query head, query block) of the CTA's i-th step."""
        m_min, m_max = work.m_min, work.m_max
        g = i // (m_max - m_min)
        r = i - g * (m_max - m_min)
        if const_expr(self.rotates):
            r = r + work.rot
            if r >= m_max - m_min:
                r = r - (m_max - m_min)
        return work.head_kv * work.group + g, m_min + r

    @cute.jit
    def next_work_item(self, work, head, m_block):
        """The step after (head, m_block) in ``work_item``'s order, without its division (the
        consumers carry the pair from step to step: ~20 instructions a step less)."""
        m_min, m_max, rot = work.m_min, work.m_max, work.rot
        m_block = m_block + 1
        if const_expr(self.rotates):
            if m_block == m_max:
                m_block = m_min
            if m_block == m_min + rot:  # round to where the head began
                head = head + 1
        else:
            if m_block == m_max:
                m_block = m_min
                head = head + 1
        return head, m_block
