"""``AttentionBackwardKernel``: PyTorch's memory-efficient attention backward in CuTe.

Seed: ``kernel_backward.h`` (PyTorch, originally xformers). The structure and names
are the C++'s, Python-cased:

- ``attention_kernel``: a CTA = (split of the keys, head, batch) — the grid is
  (num_splits_key, heads, batches). It computes Δ for its queries
  (``kernel_computes_delta``), then for each of its key blocks j walks the query
  blocks i the iteration order gives (``iteration.py``: ``get_query_start``,
  ``incr_iteration``), calling ``process_block_ij``; dK_j / dV_j accumulate in
  registers (``output_in_rf``) and ``write_frags_to_gmem`` stores them. Above a
  head dim of 256 (not ``output_in_rf``) the gradient matmuls loop over column
  chunks of the head dim and dK_j / dV_j accumulate in the workspace
  (``accumulate_grad_kv``, the C++'s ``accumulate_in_gmem``); a key block no query
  sees gets zeros (``zfill_grad_kv``).
- ``process_block_ij``: MatmulQK (attn_T = K_j Q_iᵀ; scale, causal / window mask,
  exp(· - LSE) into shared memory), MatmulGradV (dV_j += attn_T dO_i), MatmulDOIVJ
  (dPᵀ = V_j dO_iᵀ; dS = (dP - Δ)·P, times the softmax scale, into shared memory as
  tmp_T), MatmulGradQ (dQ_i += dS K_j through the ``GradQTempStorage`` workspace:
  lock, counter, fp32 partials; the last contributor writes dQ), MatmulGradK
  (dK_j += dSᵀ Q_i).
- ``advance_to_block``: the (batch, head) views, variable lengths (cu_seqlens) and the
  workspace slice.

Bias and dropout (compile-time flags of the config, so the plain kernel pays nothing):

- ``has_bias``: BiasLoader tiles B_ij (queries x keys, rows of the bias's own strides)
  into shared memory, one query block ahead (cp.async when aligned, else element by
  element); it is added to the scaled logits before the mask and the LSE.
- ``grad_bias``: BiasGradEpilogue: dB_ij = dS_ij (before the softmax scale) is staged in
  the bias tile and stored with 128-bit writes.
- ``apply_dropout``: each step draws Zij (keep flags, ``ZijSharedStorage``) with curand's
  Philox4x32-10 as torch's forward did (``common/philox.py``: per thread one skipahead
  to (query, key) and four uniforms per draw), then keeps them as a bit mask in
  registers: dV_j += (P∘Z)ᵀ dO_i, dP = Z∘(dO_i V_jᵀ), with Z = 0 or 1 / (1 - p).

Layouts, swizzles, copy atoms and MMA atoms come from ``layouts/mem_eff_attention.py``.
"""

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, Uint64, const_expr

from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.seqlen_info import SeqlenInfo
from cute_kernels.attention_bwd_prepost.compute_delta import compute_delta
from cute_kernels.common.log2_units import LOG2_E
from cute_kernels.common.philox import keep_flags_quads, philox_scalar
from cute_kernels.common.views import transpose_view
from layouts.attention_bwd_prepost import ComputeDeltaTiles

from .config import AttentionBackwardConfig
from .grad_accumulation import GradAccumulationMixin, _operands, _view
from .iteration import (
    IterationParams,
    get_query_start,
    incr_iteration,
)
from .shared_storage import make_shared_storage
from .warp_mma import gemm_smem


class AttentionBackwardKernel(GradAccumulationMixin):
    """One configuration (``AttentionBackwardConfig``) for one dtype, compiled once.

    ``varlen``: cu_seqlens_q / cu_seqlens_k are given (batch 1, packed rows).
    ``kernel_computes_delta``: Δ = rowsum(dO∘O) is computed here into ``mDelta``;
    otherwise ``mDelta`` holds Δ on entry (the op computes it once when keys are split,
    instead of once per split as the C++ does).
    """

    def __init__(self, dtype, cfg: AttentionBackwardConfig, varlen: bool, kernel_computes_delta: bool):
        if dtype.width != cfg.elem_bits:
            raise ValueError(f"config is for {cfg.elem_bits}-bit elements, dtype is {dtype}")
        if not cfg.output_in_rf and not (cfg.is_half and cfg.grad_q_atomic):
            raise NotImplementedError(
                "dK/dV accumulated in the workspace (kOutputInRF = false) needs fp16/bf16 and grad_q_atomic"
            )
        if cfg.preload:
            raise NotImplementedError("kPreload is not implemented (stages_q prefetches Q_i / dO_i instead)")
        if cfg.has_bias and varlen:
            raise NotImplementedError("attention bias with cu_seqlens is not supported (as the C++)")
        self.dtype = dtype
        self.cfg = cfg
        self.varlen = varlen
        self.kernel_computes_delta = kernel_computes_delta
        # Δ rows per pass: at least num_threads / 4 (compute_delta puts <= 4 threads on a row)
        self.delta_rows = max(cfg.block_size_i, cfg.num_threads // 4)
        self.delta_tiles = ComputeDeltaTiles(
            cfg.elem_bits, cfg.vec, cfg.max_k, num_threads=cfg.num_threads, block_i=self.delta_rows
        )

    @cute.jit
    def __call__(
        self,
        mQuery: cute.Tensor,  # [B, Mq, H, K]   (varlen: B = 1, rows packed)
        mKey: cute.Tensor,  # [B, Mk, H, K]
        mValue: cute.Tensor,  # [B, Mk, H, Kv]
        mOutput: cute.Tensor,  # [B, Mq, H, Kv]
        mGradOutput: cute.Tensor,  # [B, Mq, H, Kv]
        mLogsumexp: cute.Tensor,  # [B (varlen: sequences), H, >= Mq] fp32
        mDelta: cute.Tensor,  # [B (varlen: sequences), H, >= Mq] fp32: written (kernel_computes_delta) or read
        mGradQuery: cute.Tensor,  # like mQuery
        mGradKey: cute.Tensor,  # like mKey
        mGradValue: cute.Tensor,  # like mValue
        mWorkspace: cute.Tensor,  # [B * H, query blocks, GradQTempStorage words] fp32
        mWorkspaceGradKV: cute.Tensor,  # [B * H, splits, 2 * grad_kv_accum_words] fp32, None when output_in_rf
        mCuSeqlensQ: cute.Tensor,  # [sequences + 1] int32, or None
        mCuSeqlensK: cute.Tensor,
        mBias: cute.Tensor,  # [B, H, Mq, Mk] (any strides, 0 for broadcast dims), or None
        mGradBias: cute.Tensor,  # [B, H, Mq, Mk] rows 128-bit aligned, or None
        scale: Float32,
        custom_mask_type: Int32,
        window_size: Int32,
        num_splits_key: Int32,
        # dropout (None without): philox seed / offset (Int64, or Int64 [1] device tensors),
        # p and 1 / (1 - p) (Float32), Mq * Mk of the forward's batch-head offsets (Int64)
        philox_seed,
        philox_offset,
        dropout_p,
        dropout_scale,
        dropout_bh_elems,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        SharedStorage = make_shared_storage(cfg, self.dtype)
        num_batches = mLogsumexp.shape[0]
        self.kernel(
            mQuery,
            mKey,
            mValue,
            mOutput,
            mGradOutput,
            mLogsumexp,
            mDelta,
            mGradQuery,
            mGradKey,
            mGradValue,
            mWorkspace,
            mWorkspaceGradKV,
            mCuSeqlensQ,
            mCuSeqlensK,
            mBias,
            mGradBias,
            scale,
            custom_mask_type,
            window_size,
            philox_seed,
            philox_offset,
            dropout_p,
            dropout_scale,
            dropout_bh_elems,
            SharedStorage,
        ).launch(
            grid=[num_splits_key, mQuery.shape[2], num_batches],
            block=[cfg.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=cfg.min_blocks_per_sm,
            stream=stream,
        )

    # ------------------------------------------------------------------ advance_to_block
    def advance_to_block(self, batch, head, t: SimpleNamespace) -> SimpleNamespace:
        """The (batch, head) slices of every tensor, as the C++ advances its pointers.

        With cu_seqlens the rows of sequence ``batch`` start at cu_seqlens[batch];
        LSE and Δ keep per-sequence rows.
        """
        b = SimpleNamespace()
        if const_expr(self.varlen):
            seq = SeqlenInfo.create(batch, None, None, t.mCuSeqlensQ, t.mCuSeqlensK)
            q_start, k_start = seq.offset_q, seq.offset_k
            b.num_queries, b.num_keys = seq.seqlen_q, seq.seqlen_k
            rows_q = lambda m: cute.domain_offset((q_start, 0), m[0, None, head, None])  # noqa: E731
            rows_k = lambda m: cute.domain_offset((k_start, 0), m[0, None, head, None])  # noqa: E731
        else:
            b.num_queries = t.mQuery.shape[1]
            b.num_keys = t.mKey.shape[1]
            rows_q = lambda m: m[batch, None, head, None]  # noqa: E731
            rows_k = rows_q
        b.query, b.output, b.grad_output, b.grad_query = (
            rows_q(m) for m in (t.mQuery, t.mOutput, t.mGradOutput, t.mGradQuery)
        )
        b.key, b.value, b.grad_key, b.grad_value = (rows_k(m) for m in (t.mKey, t.mValue, t.mGradKey, t.mGradValue))
        # LSE and Δ keep per-sequence rows [sequences, heads, max seqlen] (the C++
        # offsets LSE by the batch before "jumping" it to 0; Δ is ours, laid out alike).
        b.logsumexp = t.mLogsumexp[batch, head, None]
        b.delta = t.mDelta[batch, head, None]
        b.head_dim = t.mQuery.shape[3]
        b.head_dim_value = t.mValue.shape[3]
        b.workspace_gq = t.mWorkspace[batch * t.mQuery.shape[2] + head, None, None]
        if const_expr(self.cfg.has_bias):  # (queries, keys) of this batch and head
            b.bias = t.mBias[batch, head, None, None]
        if const_expr(self.cfg.grad_bias):
            b.grad_bias = t.mGradBias[batch, head, None, None]
        return b

    # ------------------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        mQuery: cute.Tensor,
        mKey: cute.Tensor,
        mValue: cute.Tensor,
        mOutput: cute.Tensor,
        mGradOutput: cute.Tensor,
        mLogsumexp: cute.Tensor,
        mDelta: cute.Tensor,
        mGradQuery: cute.Tensor,
        mGradKey: cute.Tensor,
        mGradValue: cute.Tensor,
        mWorkspace: cute.Tensor,
        mWorkspaceGradKV: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mBias: cute.Tensor,
        mGradBias: cute.Tensor,
        scale: Float32,
        custom_mask_type: Int32,
        window_size: Int32,
        philox_seed,
        philox_offset,
        dropout_p,
        dropout_scale,
        dropout_bh_elems,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        split_key, head, batch = cute.arch.block_idx()
        num_splits_key = cute.arch.grid_dim()[0]
        tensors = SimpleNamespace(
            mQuery=mQuery,
            mKey=mKey,
            mValue=mValue,
            mOutput=mOutput,
            mGradOutput=mGradOutput,
            mLogsumexp=mLogsumexp,
            mDelta=mDelta,
            mGradQuery=mGradQuery,
            mGradKey=mGradKey,
            mGradValue=mGradValue,
            mWorkspace=mWorkspace,
            mCuSeqlensQ=mCuSeqlensQ,
            mCuSeqlensK=mCuSeqlensK,
            mBias=mBias,
            mGradBias=mGradBias,
        )
        p = self.advance_to_block(batch, head, tensors)
        if const_expr(not cfg.output_in_rf):
            # this split's dK_j / dV_j accumulators (p.workspace_gk / p.workspace_gv)
            gkv = mWorkspaceGradKV[batch * mQuery.shape[2] + head, split_key, None]
            p.workspace_gk = gkv.iterator
            p.workspace_gv = gkv.iterator + cfg.grad_kv_accum_words
        it = IterationParams(
            p.num_queries,
            p.num_keys,
            custom_mask_type,
            window_size,
            num_splits_key,
            split_key,
            cfg.block_size_i,
            cfg.block_size_j,
        )

        # Shared memory: the phase unions of SharedStorage.
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pers = storage.persistent
        part1 = storage.parts.part1
        part2 = storage.parts.part2
        s = SimpleNamespace()
        s.di = pers.di.get_tensor(cute.make_layout((cfg.block_size_i, cfg.stages_q)))
        s.lse = pers.lse.get_tensor(cute.make_layout((cfg.block_size_i, cfg.stages_q)))
        s.flag = pers.flag.get_tensor(cute.make_layout(1))
        s.k = pers.mm_qk_k.get_tensor(cfg.smem_layout_k().build(self.dtype))
        s.v = pers.mm_doivj_v.get_tensor(cfg.smem_layout_v().build(self.dtype))
        # Q_i / dO_i: (rows, cols, stages) buffers; a 2-D layout gets a unit stage mode.
        s.q = part1.mm_qk_q.get_tensor(self._staged(cfg.smem_layout_q().build(self.dtype)))
        s.do = part1.mm_gradV_do.get_tensor(self._staged(cfg.smem_layout_do().build(self.dtype)))
        s.attn = part1.attn_shared_storage.get_tensor(cfg.smem_layout_attn().build(self.dtype))
        if const_expr(cfg.tmp_own_buffer):
            s.tmp = part1.tmp_own.get_tensor(cfg.smem_layout_attn().build(self.dtype))
        else:
            s.tmp = part2.tmp_shared_storage.get_tensor(cfg.smem_layout_attn().build(self.dtype))
        if const_expr(cfg.has_bias):
            s.bias = part1.bias.get_tensor(cfg.smem_layout_bias().build(self.dtype))
        rng = None
        if const_expr(cfg.apply_dropout):
            zij = cfg.smem_layout_zij()
            s.zij = part1.zij.get_tensor(zij.build(cutlass.Uint8))
            words = (zij.shape[1] + zij.pad) // 4  # one Uint32 store per quad of flags
            s.zij32 = cute.make_tensor(
                cute.recast_ptr(s.zij.iterator, dtype=Uint32),
                cute.make_layout((zij.shape[0], words), stride=(words, 1)),
            )
            # curand_init(seed, 0, offset + batch_head_offset): the key and this
            # (batch, head)'s first word; each block skips ahead from there.
            seed = philox_scalar(philox_seed)
            rng = SimpleNamespace(
                k0=Uint32(seed),
                k1=Uint32(seed >> Int64(32)),
                base=philox_scalar(philox_offset)
                + (Int64(batch) * Int64(mQuery.shape[2]) + Int64(head)) * Int64(dropout_bh_elems),
                p=Float32(dropout_p),
                scale=Float32(dropout_scale),
            )

        # Computes (dO*out).sum(-1) and writes it to Δ (the C++: once per CTA).
        if const_expr(self.kernel_computes_delta):
            delta_copy = self.delta_tiles.gmem_load().build(self.dtype)
            for query_start in cutlass.range(0, p.num_queries, self.delta_rows, unroll=1):
                compute_delta(
                    self.delta_tiles,
                    delta_copy,
                    p.grad_output,
                    p.output,
                    p.delta,
                    query_start,
                    p.num_queries,
                    p.head_dim_value,
                    tidx,
                )
            cute.arch.barrier()

        m = self.make_matmuls(tidx, s)
        acc_dk = acc_dv = None  # not output_in_rf: per column chunk, in accumulate_grad_kv
        if const_expr(cfg.output_in_rf):
            acc_dk = cute.make_rmem_tensor(m.thr_dkv.partition_shape_C((cfg.block_size_j, cfg.max_k)), Float32)
            acc_dv = cute.make_rmem_tensor(m.thr_dkv.partition_shape_C((cfg.block_size_j, cfg.max_k)), Float32)
        scale_log2 = scale * LOG2_E

        stage = Int32(0)
        for key_start in cutlass.range(
            split_key * cfg.block_size_j, p.num_keys, num_splits_key * cfg.block_size_j, unroll=1
        ):
            if const_expr(cfg.output_in_rf):
                acc_dk.fill(0.0)
                acc_dv.fill(0.0)
            num_keys_in_block = cutlass.min(cfg.block_size_j, p.num_keys - key_start)
            # A key block no query sees (window, bottom-right) leaves its K_j / V_j
            # cp.async in flight: land it before this block's copies target the same
            # bytes (racecheck found the overlap).
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # the previous key block's readers of K_j / V_j are done
            self.load_tile(
                m.copy_k, cute.domain_offset((key_start, 0), p.key), s.k, num_keys_in_block, p.head_dim, tidx
            )
            self.load_tile(
                m.copy_k, cute.domain_offset((key_start, 0), p.value), s.v, num_keys_in_block, p.head_dim_value, tidx
            )
            query_start = get_query_start(it, key_start)
            visited = query_start < p.num_queries
            if query_start < p.num_queries:
                self.load_query_block(_view(p), _view(s), _view(m), query_start, stage, tidx)
                if const_expr(cfg.has_bias):
                    self.load_bias(_view(p), _view(s), _view(m), query_start, key_start, tidx)
            cute.arch.cp_async_commit_group()  # K_j, V_j and the first query block (and its B_ij)

            next_key = key_start
            while (next_key == key_start) & (query_start < p.num_queries):
                self.process_block_ij(
                    _view(p),
                    it,
                    _view(s),
                    _view(m),
                    acc_dk,
                    acc_dv,
                    query_start,
                    key_start,
                    num_keys_in_block,
                    scale,
                    scale_log2,
                    custom_mask_type,
                    window_size,
                    num_splits_key,
                    split_key,
                    stage,
                    tidx,
                    None if const_expr(rng is None) else _view(rng),
                )
                next_query, next_key = incr_iteration(it, query_start, key_start)
                query_start = next_query
                if const_expr(cfg.stages_q > 1):
                    stage = stage ^ 1
            if const_expr(cfg.output_in_rf):
                self.write_frags_to_gmem(p, m, acc_dk, acc_dv, key_start, num_keys_in_block, tidx)
            else:
                if ~visited:  # the last query block wrote dK_j / dV_j; no query block: zeros
                    self.zfill_grad_kv(_view(p), _view(m), key_start, num_keys_in_block, tidx)

    # ---------------------------------------------------------------------- matmuls
    def make_matmuls(self, tidx, s: SimpleNamespace) -> SimpleNamespace:
        """Tiled MMAs, ldmatrix copies and the per-thread partitions of the five matmuls."""
        cfg, dt = self.cfg, self.dtype
        m = SimpleNamespace()
        m.copy_q = cfg.gmem_tiled_copy(cfg.max_k).build(dt)
        m.copy_k = m.copy_q
        m.copy_row = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        ldsm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dt)
        ldsm_t = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dt)
        simt = not cfg.is_half  # fp32: SIMT FMA, operands loaded element by element (no ldmatrix)
        s2r = lambda atom, mma, fn: None if simt else fn(atom, mma).get_slice(tidx)  # noqa: E731
        st_pair = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=cfg.smem_store_bits())

        # MatmulQK (attn_T = K_j Q_iᵀ) and MatmulDOIVJ (dPᵀ = V_j dO_iᵀ): one fragment layout.
        mma_sdp = cfg.mma_qk().build(dt)
        m.mma_sdp = mma_sdp
        m.thr_sdp = thr = mma_sdp.get_slice(tidx)
        a_sdp = s2r(ldsm, mma_sdp, cute.make_tiled_copy_A)
        b_sdp = s2r(ldsm, mma_sdp, cute.make_tiled_copy_B)
        m.s2r_a_sdp, m.s2r_b_sdp = a_sdp, b_sdp
        m.qk_rA, m.qk_rB, m.qk_sA, m.qk_sB = _operands(thr, a_sdp, b_sdp, s.k, s.q)
        m.doivj_rA, m.doivj_rB, m.doivj_sA, m.doivj_sB = _operands(thr, a_sdp, b_sdp, s.v, s.do)
        m.coord_s = thr.partition_C(cute.make_identity_tensor((cfg.block_size_j, cfg.block_size_i)))
        r2s = cute.make_tiled_copy_C(st_pair, mma_sdp).get_slice(tidx)
        m.r2s_sdp = r2s
        m.attn_r2s = r2s.partition_D(s.attn)
        m.tmp_r2s = r2s.partition_D(s.tmp)

        # MatmulGradV (dV_j += attn_T dO_i) and MatmulGradK (dK_j += tmp_T Q_i).
        mma_dkv = cfg.mma_grad_kv().build(dt)
        m.mma_dkv = mma_dkv
        m.thr_dkv = thr = mma_dkv.get_slice(tidx)
        a_dkv = s2r(ldsm, mma_dkv, cute.make_tiled_copy_A)
        b_dkv = s2r(ldsm_t, mma_dkv, cute.make_tiled_copy_B)
        m.s2r_a_dkv, m.s2r_b_dkv = a_dkv, b_dkv
        do_t, q_t = transpose_view(s.do), transpose_view(s.q)
        m.gv_rA, m.gv_rB, m.gv_sA, m.gv_sB = _operands(thr, a_dkv, b_dkv, s.attn, do_t)
        m.gk_rA, m.gk_rB, m.gk_sA, m.gk_sB = _operands(thr, a_dkv, b_dkv, s.tmp, q_t)
        m.coord_kv = thr.partition_C(cute.make_identity_tensor((cfg.block_size_j, cfg.max_k)))

        # MatmulGradQ (dQ_i += tmp_Tᵀ K_j): both operands through transposed views.
        mma_dq = cfg.mma_grad_q().build(dt)
        m.mma_dq = mma_dq
        m.thr_dq = thr = mma_dq.get_slice(tidx)
        a_dq = s2r(ldsm_t, mma_dq, cute.make_tiled_copy_A)
        b_dq = s2r(ldsm_t, mma_dq, cute.make_tiled_copy_B)
        m.s2r_a_dq, m.s2r_b_dq = a_dq, b_dq
        tmp_t, k_t = transpose_view(s.tmp), transpose_view(s.k)
        m.gq_rA, m.gq_rB, m.gq_sA, m.gq_sB = _operands(thr, a_dq, b_dq, tmp_t, k_t)
        m.coord_q = thr.partition_C(cute.make_identity_tensor((cfg.block_size_i, cfg.max_k)))
        if const_expr(cfg.has_bias):
            m.copy_bias = cfg.bias_tiled_copy().build(dt)
        if const_expr(cfg.grad_bias):
            m.copy_grad_bias = cfg.grad_bias_tiled_copy().build(dt)
        return m

    # ------------------------------------------------------------------- tile loads
    @cute.jit
    def load_tile(self, copy: cute.TiledCopy, g: cute.Tensor, s: cute.Tensor, rows, cols, tidx):
        """gmem rows x cols (from the block start) -> the shared tile, zeros outside.

        Out-of-bounds rows and columns must be zeros, not garbage: they meet zero
        probabilities in the matmuls, and 0 * NaN would poison real outputs.
        """
        tile = (cute.size(s, mode=[0]), cute.size(s, mode=[1]))
        thr = copy.get_slice(tidx)
        tG = thr.partition_S(cute.local_tile(g, tile, (0, 0)))
        tS = thr.partition_D(s)
        tC = thr.partition_S(cute.make_identity_tensor(tile))
        for r in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            for c in cutlass.range_constexpr(cute.size(tS, mode=[2])):
                crd = tC[0, r, c]
                if (crd[0] < rows) & (crd[1] < cols):
                    cute.copy(copy, tG[None, r, c], tS[None, r, c])
                else:
                    tS[None, r, c].fill(0)

    @staticmethod
    def _staged(layout):
        return layout if cute.rank(layout) == 3 else cute.append(layout, cute.make_layout(1))

    @cute.jit
    def load_query_block(self, p, s, m, query_start, stage, tidx):
        """Q_i, dO_i (cp.async, zeros outside) and LSE_i, Δ_i (4-byte cp.async) into ``stage``."""
        cfg = self.cfg
        rows = cutlass.min(cfg.block_size_i, p.num_queries - query_start)
        self.load_tile(
            m.copy_q, cute.domain_offset((query_start, 0), p.query), s.q[None, None, stage], rows, p.head_dim, tidx
        )
        self.load_tile(
            m.copy_q,
            cute.domain_offset((query_start, 0), p.grad_output),
            s.do[None, None, stage],
            rows,
            p.head_dim_value,
            tidx,
        )
        if tidx < cfg.block_size_i:
            one = cute.make_layout(1)
            dst = tidx + stage * cfg.block_size_i
            if tidx < rows:
                src = query_start + tidx
                cute.copy(
                    m.copy_row,
                    cute.make_tensor(p.logsumexp.iterator + src, one),
                    cute.make_tensor(s.lse.iterator + dst, one),
                )
                cute.copy(
                    m.copy_row,
                    cute.make_tensor(p.delta.iterator + src, one),
                    cute.make_tensor(s.di.iterator + dst, one),
                )
            else:
                s.lse[tidx, stage] = Float32(0.0)
                s.di[tidx, stage] = Float32(0.0)

    # -------------------------------------------------------------- process_block_ij
    @cute.jit
    def load_bias(self, p, s, m, query_start, key_start, tidx):
        """BiasLoader::load: B_ij (queries x keys) into the bias tile, zeros outside."""
        cfg = self.cfg
        rows = cutlass.min(cfg.block_size_i, p.num_queries - query_start)
        cols = cutlass.min(cfg.block_size_j, p.num_keys - key_start)
        # block coordinates (starts are multiples of the block sizes) keep the 128-bit
        # alignment of the tile start visible to the copy
        tile = (cfg.block_size_i, cfg.block_size_j)
        g = cute.local_tile(p.bias, tile, (query_start // cfg.block_size_i, key_start // cfg.block_size_j))
        self.load_tile(m.copy_bias, g, s.bias, rows, cols, tidx)

    @cute.jit
    def draw_zij(self, p, s, rng, query_start, key_start, tidx):
        """Zij of block (i, j): thread t draws ``zij_quads_per_thread`` quads of one query
        row (the C++'s threads_per_row / elts_per_thread split), one skipahead to its first
        (query, key), one Uint32 of four flags per quad. Rows and keys past the sequence
        get flags too: their probabilities are 0."""
        cfg = self.cfg
        tpr = cfg.zij_threads_per_row
        quads = cfg.zij_quads_per_thread
        row = tidx // tpr
        col = (tidx % tpr) * (4 * quads)
        word = Int64(query_start + row) * Int64(p.num_keys) + Int64(key_start + col)
        flags = keep_flags_quads(Uint64(rng.base + word), rng.k0, rng.k1, rng.p, quads)
        for c in cutlass.range_constexpr(quads):
            s.zij32[row, col // 4 + c] = flags[c]

    @cute.jit
    def store_grad_bias(self, p, s, m, query_start, key_start, tidx):
        """BiasGradEpilogue: the staged dB_ij to global memory (128 bits per store). Our
        grad_bias rows are padded to 128 bits, so a chunk over the last key stays inside."""
        cfg = self.cfg
        rows = cutlass.min(cfg.block_size_i, p.num_queries - query_start)
        cols = cutlass.min(cfg.block_size_j, p.num_keys - key_start)
        tile = (cfg.block_size_i, cfg.block_size_j)
        g = cute.local_tile(p.grad_bias, tile, (query_start // cfg.block_size_i, key_start // cfg.block_size_j))
        thr = m.copy_grad_bias.get_slice(tidx)
        tG = thr.partition_D(g)
        tS = thr.partition_S(s.bias)
        tC = thr.partition_S(cute.make_identity_tensor(tile))
        for r in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            for c in cutlass.range_constexpr(cute.size(tS, mode=[2])):
                crd = tC[0, r, c]
                if (crd[0] < rows) & (crd[1] < cols):
                    frag = cute.make_fragment_like(tS[None, r, c])
                    cute.autovec_copy(tS[None, r, c], frag)
                    cute.autovec_copy(frag, tG[None, r, c])

    @cute.jit
    def process_block_ij(
        self,
        p,
        it,
        s,
        m,
        acc_dk,
        acc_dv,
        query_start,
        key_start,
        num_keys_in_block,
        scale,
        scale_log2,
        custom_mask_type,
        window_size,
        num_splits_key,
        split_key,
        stage,
        tidx,
        rng,
    ):
        cfg = self.cfg
        num_queries_in_block = cutlass.min(cfg.block_size_i, p.num_queries - query_start)

        cute.arch.barrier()  # the previous block's readers of its buffers and of tmp_T are done
        if const_expr(cfg.stages_q > 1):
            # kPreload: fetch the next query block of this key block into the other buffers.
            next_query, next_key = incr_iteration(it, query_start, key_start)
            if (next_key == key_start) & (next_query < p.num_queries):
                self.load_query_block(_view(p), _view(s), _view(m), next_query, stage ^ 1, tidx)
            cute.arch.cp_async_commit_group()
            if const_expr(cfg.apply_dropout):  # while the copies fly (zij's last readers are done)
                self.draw_zij(_view(p), _view(s), _view(rng), query_start, key_start, tidx)
            cute.arch.cp_async_wait_group(1)  # everything but that prefetch has landed
        else:
            self.load_query_block(_view(p), _view(s), _view(m), query_start, stage, tidx)
            cute.arch.cp_async_commit_group()
            if const_expr(cfg.apply_dropout):
                self.draw_zij(_view(p), _view(s), _view(rng), query_start, key_start, tidx)
            cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        qk_sB = m.qk_sB[None, None, None, stage]
        doivj_sB = m.doivj_sB[None, None, None, stage]
        gv_sB = m.gv_sB[None, None, None, stage]
        gk_sB = m.gk_sB[None, None, None, stage]
        s_lse = s.lse[None, stage]
        s_di = s.di[None, stage]

        # ---- MatmulQK: attn_T = K_j Q_iᵀ, then P = exp(attn_T * scale - LSE), masked.
        acc_s = cute.make_rmem_tensor(m.thr_sdp.partition_shape_C((cfg.block_size_j, cfg.block_size_i)), Float32)
        acc_s.fill(0.0)
        gemm_smem(m.mma_sdp, acc_s, m.qk_rA, m.qk_rB, m.qk_sA, qk_sB, m.s2r_a_sdp, m.s2r_b_sdp)
        # coordinates local to the block: key kk, query qq; the mask's offset shifted by its corner
        mask = AttentionMask(cfg.block_size_i, cfg.block_size_j, custom_mask_type, has_window=None)
        shift = mask.causal_offset(p.num_queries, p.num_keys, shift=query_start - key_start)
        # Only blocks on an edge (sequence ends, the diagonal, the window's far side)
        # pay for the per-element mask.
        if mask.needs_masking(0, 0, num_queries_in_block, num_keys_in_block, shift, window_size):
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kk, qq = m.coord_s[e]
                masked = mask.masked(qq, kk, num_queries_in_block, num_keys_in_block, shift, window_size)
                prob = cute.math.exp2(
                    self.logit_log2(s, acc_s[e], scale_log2, kk, qq) - s_lse[qq] * LOG2_E, fastmath=True
                )
                acc_s[e] = cutlass.select_(masked, Float32(0.0), prob)
        else:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kk, qq = m.coord_s[e]
                acc_s[e] = cute.math.exp2(
                    self.logit_log2(s, acc_s[e], scale_log2, kk, qq) - s_lse[qq] * LOG2_E, fastmath=True
                )
        r_p = cute.make_fragment_like(acc_s, self.dtype)
        keep_bits = None
        if const_expr(cfg.apply_dropout):
            # Z_ij of this thread's fragment as bits (the C++'s dropout_keep_mask_doivj);
            # attn_T holds the dropped P∘Z, the operand of dV.
            keep_bits = self.fragment_keep_bits(s, m)
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kept = self.kept(keep_bits, e)
                r_p[e] = Float32(cutlass.select_(kept, acc_s[e] * rng.scale, Float32(0.0))).to(self.dtype)
        else:
            r_p.store(acc_s.load().to(self.dtype))
        cute.copy(m.r2s_sdp, m.r2s_sdp.retile(r_p), m.attn_r2s)

        # ---- MatmulDOIVJ: dPᵀ = V_j dO_iᵀ; dS = (dP - Δ)·P · scale (P from registers).
        acc_dp = cute.make_rmem_tensor(m.thr_sdp.partition_shape_C((cfg.block_size_j, cfg.block_size_i)), Float32)
        acc_dp.fill(0.0)
        gemm_smem(m.mma_sdp, acc_dp, m.doivj_rA, m.doivj_rB, m.doivj_sA, doivj_sB, m.s2r_a_sdp, m.s2r_b_sdp)
        for e in cutlass.range_constexpr(cute.size(acc_dp)):
            kk, qq = m.coord_s[e]
            dp = acc_dp[e]
            if const_expr(cfg.apply_dropout):  # dP = dP_dropped * Zij
                dp = Float32(cutlass.select_(self.kept(keep_bits, e), dp * rng.scale, Float32(0.0)))
            ds = acc_s[e] * (dp - s_di[qq])
            if const_expr(cfg.grad_bias):  # dB_ij = dS_ij, staged over this thread's own B_ij
                s.bias[qq, kk] = ds.to(self.dtype)
            acc_dp[e] = ds * scale
        r_ds = cute.make_fragment_like(acc_dp, self.dtype)
        r_ds.store(acc_dp.load().to(self.dtype))
        if const_expr(cfg.tmp_own_buffer):
            cute.copy(m.r2s_sdp, m.r2s_sdp.retile(r_ds), m.tmp_r2s)
        cute.arch.barrier()  # attn_T (and tmp_T, dB_ij) are complete
        if const_expr(cfg.grad_bias):
            self.store_grad_bias(_view(p), _view(s), _view(m), query_start, key_start, tidx)

        # ---- MatmulGradV: dV_j += attn_T dO_i.
        if const_expr(cfg.output_in_rf):
            gemm_smem(m.mma_dkv, acc_dv, m.gv_rA, m.gv_rB, m.gv_sA, gv_sB, m.s2r_a_dkv, m.s2r_b_dkv)
        else:
            self.accumulate_grad_kv(
                _view(p),
                it,
                False,
                s.attn,
                s.do[None, None, stage],
                query_start,
                key_start,
                num_keys_in_block,
                _view(m),
                tidx,
            )
        if const_expr(not cfg.tmp_own_buffer):
            cute.arch.barrier()  # every warp is done with attn_T: tmp_T takes its bytes
            cute.copy(m.r2s_sdp, m.r2s_sdp.retile(r_ds), m.tmp_r2s)
            cute.arch.barrier()
        if const_expr(cfg.has_bias):
            # B_ij's readers (and dB_ij's writers) are done: fetch the next block's B_ij
            # now, so that it lands behind this block's gradient matmuls.
            if const_expr(cfg.tmp_own_buffer and cfg.grad_bias):
                cute.arch.barrier()
            next_query, next_key = incr_iteration(it, query_start, key_start)
            if (next_key == key_start) & (next_query < p.num_queries):
                self.load_bias(_view(p), _view(s), _view(m), next_query, key_start, tidx)
            cute.arch.cp_async_commit_group()

        # ---- MatmulGradQ: dQ_i += dS K_j, accumulated in GradQTempStorage.
        if const_expr(cfg.output_in_rf):
            self.grad_q(
                _view(p),
                it,
                _view(s),
                _view(m),
                query_start,
                key_start,
                num_queries_in_block,
                num_splits_key,
                split_key,
                tidx,
            )
        else:
            self.grad_q_columns(
                _view(p), it, _view(s), _view(m), query_start, key_start, num_queries_in_block, num_splits_key, tidx
            )

        # ---- MatmulGradK: dK_j += tmp_T Q_i.
        if const_expr(cfg.output_in_rf):
            gemm_smem(m.mma_dkv, acc_dk, m.gk_rA, m.gk_rB, m.gk_sA, gk_sB, m.s2r_a_dkv, m.s2r_b_dkv)
        else:
            self.accumulate_grad_kv(
                _view(p),
                it,
                True,
                s.tmp,
                s.q[None, None, stage],
                query_start,
                key_start,
                num_keys_in_block,
                _view(m),
                tidx,
            )

    def logit_log2(self, s, acc, scale_log2, kk, qq):
        """log2(e) x (scale x (K_j Q_iᵀ) + B_ij): the logit before the LSE, in exp2 units."""
        logit = acc * scale_log2
        if const_expr(self.cfg.has_bias):
            logit = logit + s.bias[qq, kk].to(Float32) * LOG2_E
        return logit

    def fragment_keep_bits(self, s, m):
        """The keep flags of this thread's attn_T fragment, 32 per Uint32."""
        n = cute.size(m.coord_s)
        words = []
        for w in range((n + 31) // 32):
            bits = Uint32(0)
            for e in range(32 * w, min(n, 32 * w + 32)):
                kk, qq = m.coord_s[e]
                bits = bits | (Uint32(s.zij[qq, kk]) << Uint32(e - 32 * w))
            words.append(bits)
        return words

    @staticmethod
    def kept(keep_bits, e: int):
        return (keep_bits[e // 32] & Uint32(1 << (e % 32))) != Uint32(0)
