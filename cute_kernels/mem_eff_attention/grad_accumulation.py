"""The memory-efficient backward's gradient accumulation through its workspaces: MatmulGradQ
into ``GradQTempStorage`` (lock, counter, fp32 partials; the last contributor writes dQ), and
above a head dim of 256 the column loops of MatmulGradV / MatmulGradK / MatmulGradQ."""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.views import transpose_view
from layouts.mem_eff_attention import GMEM_TILE_ACCESS, GRAD_Q_HEADER_WORDS

from .iteration import (
    get_num_parallel_blocks_for_query,
    get_query_start,
    incr_iteration,
    is_last_key_for_query,
)
from .warp_mma import col_chunk, gemm_smem


def _operands(thr_mma, s2r_a, s2r_b, sA, sB):
    """One matmul's register fragments and ldmatrix sources for shared A (M x K) and B
    (N x K); a third (stage) mode of either tile is kept in the sources, dropped in the
    fragments."""
    first = lambda t: t[None, None, 0] if cute.rank(t) == 3 else t  # noqa: E731
    rA = thr_mma.make_fragment_A(thr_mma.partition_A(first(sA)))
    rB = thr_mma.make_fragment_B(thr_mma.partition_B(first(sB)))
    if s2r_a is None:  # SIMT: the MMA's own partitions, loaded element by element
        return rA, rB, thr_mma.partition_A(sA), thr_mma.partition_B(sB)
    return rA, rB, s2r_a.partition_S(sA), s2r_b.partition_S(sB)


def _view(ns: SimpleNamespace) -> SimpleNamespace:
    # A @cute.jit call inside staged control flow rebinds the attributes of the
    # namespaces it is given to values of that region; callers keep their own copy.
    return SimpleNamespace(**vars(ns))


class GradAccumulationMixin:
    """dQ (and dK / dV above a head dim of 256) accumulation (``AttentionBackwardKernel``'s
    configuration)."""

    # --------------------------------------------------------------------- GradQ
    @cute.jit
    def grad_q(self, p, it, s, m, query_start, key_start, num_queries_in_block, num_splits_key, split_key, tidx):
        cfg = self.cfg
        acc = cute.make_rmem_tensor(m.thr_dq.partition_shape_C((cfg.block_size_i, cfg.max_k)), Float32)
        n = cute.size(acc)
        storage = p.workspace_gq[query_start // cfg.block_size_i, None]
        lock = cute.recast_ptr(storage.iterator, dtype=Int32)
        counter = lock + 1
        gmem_tile = self.frag_gmem_tile(storage.iterator + GRAD_Q_HEADER_WORDS, tidx, n)
        acc_view = cute.make_tensor(acc.iterator, cute.make_layout((GMEM_TILE_ACCESS, n // GMEM_TILE_ACCESS)))
        split = num_splits_key > 1
        # The first contribution to a query block (one split, key block 0) finds
        # nothing in the workspace: nothing to load, and it may store instead of add.
        first = (~split) & (key_start == 0)
        is_last = is_last_key_for_query(it, query_start, key_start)

        if const_expr(cfg.grad_q_atomic):
            acc.fill(0.0)
            gemm_smem(m.mma_dq, acc, m.gq_rA, m.gq_rB, m.gq_sA, m.gq_sB, m.s2r_a_dq, m.s2r_b_dq)
            if split:
                self.red_add_gmem_tile(acc_view, gmem_tile)
                if is_last:  # the counter orders every split's adds before the reader
                    cute.arch.fence_acq_rel_gpu()
                    is_last = self.count_contribution(it, s, counter, query_start, tidx)
                    if is_last:
                        cute.arch.fence_acq_rel_gpu()
                        cute.autovec_copy(gmem_tile, acc_view)
            elif is_last:
                if ~first:  # the earlier key blocks' sum (this thread's own adds)
                    cute.arch.fence_acq_rel_gpu()
                    prev = cute.make_fragment_like(acc_view)
                    cute.autovec_copy(gmem_tile, prev)
                    acc_view.store(acc_view.load() + prev.load())
            elif first:
                cute.autovec_copy(acc_view, gmem_tile)
            else:
                self.red_add_gmem_tile(acc_view, gmem_tile)
        else:
            if split:  # AtomicLock::acquire: one split at a time on this query block
                if tidx == 0:
                    old = cute.arch.atomic_cas(lock, cmp=Int32(0), val=split_key + 1, sem="acquire", scope="gpu")
                    while old != 0:
                        cute.arch.inline_ptx("nanosleep.u32 40;")
                        old = cute.arch.atomic_cas(lock, cmp=Int32(0), val=split_key + 1, sem="acquire", scope="gpu")
                cute.arch.barrier()
                cute.arch.fence_acq_rel_gpu()  # see the previous holder's partials
            if first:
                acc.fill(0.0)
            else:
                cute.autovec_copy(gmem_tile, acc_view)
            gemm_smem(m.mma_dq, acc, m.gq_rA, m.gq_rB, m.gq_sA, m.gq_sB, m.s2r_a_dq, m.s2r_b_dq)
            if split & is_last:
                is_last = self.count_contribution(it, s, counter, query_start, tidx)
            if ~is_last:
                cute.autovec_copy(acc_view, gmem_tile)
                if split:  # AtomicLock::release after every thread's partials are out
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.barrier()
                    if tidx == 0:
                        cute.arch.atomic_exch(lock, Int32(0), sem="release", scope="gpu")
        if is_last:
            # The last contributor writes dQ (no release: nobody comes after it).
            self.write_grad_q_chunk(_view(p), acc, m.coord_q, query_start, 0, num_queries_in_block)

    @cute.jit
    def count_contribution(self, it, s, counter, query_start, tidx) -> cutlass.Boolean:
        """This split is done with the query block: bump its counter; True for the
        split that completes it (that one writes dQ)."""
        cute.arch.barrier()  # every thread's partials are out (each fenced its own)
        if tidx == 0:
            last = Int32(0)
            adds = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu") + 1
            if adds == get_num_parallel_blocks_for_query(it, query_start):
                last = Int32(1)
            s.flag[0] = last
        cute.arch.barrier()
        return s.flag[0] != 0

    @cute.jit
    def red_add_gmem_tile(self, frag: cute.Tensor, gmem: cute.Tensor):
        """gmem += frag with fire-and-forget reductions, ``grad_q_red_floats`` per instruction."""
        w = self.cfg.grad_q_red_floats
        for k in cutlass.range_constexpr(cute.size(frag, mode=[1])):
            for h in cutlass.range_constexpr(GMEM_TILE_ACCESS // w):
                src = cute.make_tensor(frag.iterator + k * GMEM_TILE_ACCESS + h * w, cute.make_layout(w))
                dst = gmem[None, k].iterator + h * w
                if const_expr(w == 1):
                    cute.arch.red(dst, src[0], op="add", dtype=Float32, sem="relaxed", scope="gpu")
                else:
                    cute.arch.red(dst, src.load(), op="add", dtype=Float32, sem="relaxed", scope="gpu")

    # ----------------------------------------------------------- write_frags_to_gmem
    @cute.jit
    def write_frags_to_gmem(self, p, m, acc_dk, acc_dv, key_start, num_keys_in_block, tidx):
        """dK_j, dV_j from registers (zeros for a key block no query attends)."""
        for e in cutlass.range_constexpr(cute.size(acc_dk)):
            r, c = m.coord_kv[e]
            if r < num_keys_in_block:
                if c < p.head_dim:
                    p.grad_key[key_start + r, c] = acc_dk[e].to(self.dtype)
                if c < p.head_dim_value:
                    p.grad_value[key_start + r, c] = acc_dv[e].to(self.dtype)

    # ------------------------------------------ head dims above 256: column loops
    def frag_gmem_tile(self, ptr, tidx, num_elements: int) -> cute.Tensor:
        """``GmemTile`` at ``ptr``: this thread's fragment of one column chunk, 4 floats
        per 128-bit access (element e of thread t at (e // 4) * 4 * threads + 4 * t + e % 4)."""
        threads = self.cfg.num_threads
        layout = cute.make_layout(
            (GMEM_TILE_ACCESS, threads, num_elements // GMEM_TILE_ACCESS),
            stride=(1, GMEM_TILE_ACCESS, GMEM_TILE_ACCESS * threads),
        )
        return cute.make_tensor(ptr, layout)[None, tidx, None]

    @cute.jit
    def accumulate_grad_kv(
        self, p, it, is_grad_k: cutlass.Constexpr, sA, sB_rows, query_start, key_start, num_keys_in_block, m, tidx
    ):
        """MatmulGradV (dV_j += attn_T dO_i) or MatmulGradK (dK_j += tmp_T Q_i), one column
        chunk of the head dim at a time (not output_in_rf).

        ``sB_rows`` is dO_i (or Q_i) as (queries, max_k). Each chunk's accumulator starts
        from zeros at the key block's first query block, else from this thread's own
        fragment in the workspace (``workspace_gv`` / ``workspace_gk``: one split owns the
        key block, so the load / add / store needs no synchronisation); the last query
        block writes the chunk of dV_j (dK_j) from registers, the others store it back.
        """
        cfg = self.cfg
        cols = cfg.grad_col_tile
        is_first_query = query_start == get_query_start(it, key_start)
        next_query, next_key = incr_iteration(it, query_start, key_start)
        is_last_query = (next_key != key_start) | (next_query >= p.num_queries)
        head_dim = p.head_dim if const_expr(is_grad_k) else p.head_dim_value
        out = p.grad_key if const_expr(is_grad_k) else p.grad_value
        workspace = p.workspace_gk if const_expr(is_grad_k) else p.workspace_gv
        coord = m.thr_dkv.partition_C(cute.make_identity_tensor((cfg.block_size_j, cols)))
        for col_block in cutlass.range_constexpr(cfg.num_col_blocks):
            col = col_block * cols
            if col < head_dim:  # chunks past this head dim hold only zero padding
                sB = transpose_view(col_chunk(sB_rows, cols, col_block))
                rA, rB, tsA, tsB = _operands(m.thr_dkv, m.s2r_a_dkv, m.s2r_b_dkv, sA, sB)
                acc = cute.make_rmem_tensor(m.thr_dkv.partition_shape_C((cfg.block_size_j, cols)), Float32)
                n = cute.size(acc)
                gmem_tile = self.frag_gmem_tile(workspace + col_block * cfg.block_size_j * cols, tidx, n)
                acc_view = cute.make_tensor(acc.iterator, cute.make_layout((GMEM_TILE_ACCESS, n // GMEM_TILE_ACCESS)))
                if is_first_query:
                    acc.fill(0.0)
                else:
                    cute.autovec_copy(gmem_tile, acc_view)
                gemm_smem(m.mma_dkv, acc, rA, rB, tsA, tsB, m.s2r_a_dkv, m.s2r_b_dkv)
                if is_last_query:
                    for e in cutlass.range_constexpr(n):
                        r, c = coord[e]
                        if (r < num_keys_in_block) & (col + c < head_dim):
                            out[key_start + r, col + c] = acc[e].to(self.dtype)
                else:
                    cute.autovec_copy(acc_view, gmem_tile)

    @cute.jit
    def zfill_grad_kv(self, p, m, key_start, num_keys_in_block, tidx):
        """dK_j = dV_j = 0 for a key block no query block visits (not output_in_rf)."""
        cfg = self.cfg
        cols = cfg.grad_col_tile
        coord = m.thr_dkv.partition_C(cute.make_identity_tensor((cfg.block_size_j, cols)))
        zero = Float32(0.0).to(self.dtype)
        for col_block in cutlass.range_constexpr(cfg.num_col_blocks):
            col = col_block * cols
            for e in cutlass.range_constexpr(cute.size(coord)):
                r, c = coord[e]
                if r < num_keys_in_block:
                    if col + c < p.head_dim:
                        p.grad_key[key_start + r, col + c] = zero
                    if col + c < p.head_dim_value:
                        p.grad_value[key_start + r, col + c] = zero

    @cute.jit
    def grad_q_columns(self, p, it, s, m, query_start, key_start, num_queries_in_block, num_splits_key, tidx):
        """MatmulGradQ (dQ_i += dS K_j) one column chunk of the head dim at a time (not
        output_in_rf): ``grad_q``'s reductions into GradQTempStorage per chunk (chunk c
        at c * block_size_i * grad_col_tile, each in GmemTile order); with split keys the
        counter is bumped once after every chunk's adds and the last split reads every
        chunk back to write dQ."""
        cfg = self.cfg
        cols = cfg.grad_col_tile
        chunk_words = cfg.block_size_i * cols
        storage = p.workspace_gq[query_start // cfg.block_size_i, None]
        counter = cute.recast_ptr(storage.iterator, dtype=Int32) + 1
        tiles = storage.iterator + GRAD_Q_HEADER_WORDS
        split = num_splits_key > 1
        first = (~split) & (key_start == 0)
        is_last = is_last_key_for_query(it, query_start, key_start)
        coord = m.thr_dq.partition_C(cute.make_identity_tensor((cfg.block_size_i, cols)))
        tmp_t = transpose_view(s.tmp)
        for col_block in cutlass.range_constexpr(cfg.num_col_blocks):
            col = col_block * cols
            if col < p.head_dim:
                k_t = transpose_view(col_chunk(s.k, cols, col_block))
                rA, rB, tsA, tsB = _operands(m.thr_dq, m.s2r_a_dq, m.s2r_b_dq, tmp_t, k_t)
                acc = cute.make_rmem_tensor(m.thr_dq.partition_shape_C((cfg.block_size_i, cols)), Float32)
                n = cute.size(acc)
                gmem_tile = self.frag_gmem_tile(tiles + col_block * chunk_words, tidx, n)
                acc_view = cute.make_tensor(acc.iterator, cute.make_layout((GMEM_TILE_ACCESS, n // GMEM_TILE_ACCESS)))
                acc.fill(0.0)
                gemm_smem(m.mma_dq, acc, rA, rB, tsA, tsB, m.s2r_a_dq, m.s2r_b_dq)
                if split:
                    self.red_add_gmem_tile(acc_view, gmem_tile)
                elif is_last:
                    if ~first:  # the earlier key blocks' sum (this thread's own adds)
                        cute.arch.fence_acq_rel_gpu()
                        prev = cute.make_fragment_like(acc_view)
                        cute.autovec_copy(gmem_tile, prev)
                        acc_view.store(acc_view.load() + prev.load())
                    self.write_grad_q_chunk(_view(p), acc, coord, query_start, col, num_queries_in_block)
                elif first:
                    cute.autovec_copy(acc_view, gmem_tile)
                else:
                    self.red_add_gmem_tile(acc_view, gmem_tile)
        if split & is_last:  # the counter orders every split's adds before the reader
            cute.arch.fence_acq_rel_gpu()
            if self.count_contribution(it, _view(s), counter, query_start, tidx):
                cute.arch.fence_acq_rel_gpu()
                for col_block in cutlass.range_constexpr(cfg.num_col_blocks):
                    col = col_block * cols
                    if col < p.head_dim:
                        acc = cute.make_rmem_tensor(m.thr_dq.partition_shape_C((cfg.block_size_i, cols)), Float32)
                        n = cute.size(acc)
                        gmem_tile = self.frag_gmem_tile(tiles + col_block * chunk_words, tidx, n)
                        acc_view = cute.make_tensor(
                            acc.iterator, cute.make_layout((GMEM_TILE_ACCESS, n // GMEM_TILE_ACCESS))
                        )
                        cute.autovec_copy(gmem_tile, acc_view)
                        self.write_grad_q_chunk(_view(p), acc, coord, query_start, col, num_queries_in_block)

    @cute.jit
    def write_grad_q_chunk(self, p, acc, coord, query_start, col, num_queries_in_block):
        for e in cutlass.range_constexpr(cute.size(acc)):
            r, c = coord[e]
            if (r < num_queries_in_block) & (col + c < p.head_dim):
                p.grad_query[query_start + r, col + c] = acc[e].to(self.dtype)
