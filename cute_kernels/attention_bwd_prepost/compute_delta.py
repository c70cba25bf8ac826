"""compute_delta, after the mem-eff kernel's ``computeDelta`` (kernel_backward.h).

    Δ[i] = Σ_k dO[i, k] * O[i, k]     (fp32; O already carries dropout's scaling)

``compute_delta`` is a device function: an attention kernel calls it with its own
threads for the kBlockSizeI queries starting at ``query_start``. kNumThreadsPerLine
(1, 2 or 4) threads share a row; each walks the row in steps of
kElementsPerAccess * kNumThreadsPerLine columns with a 2-stage register pipeline (the
load of step i + 1 is issued before step i is summed), and the row's threads finish
with a shuffle-xor. ``ComputeDelta`` launches it on its own, one CTA per
(query block, head, batch).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_kernels.common.row_reduce import row_allreduce_sum
from layouts.attention_bwd_prepost import ComputeDeltaTiles

from .seqlen import seq_rows


@cute.jit
def compute_delta(
    tiles: cutlass.Constexpr, copy, mGradOutput, mOutput, mDelta, query_start, num_queries, head_dim, thread_id
):
    """Δ for queries ``query_start`` .. + kBlockSizeI of (queries, head_dim) row views.

    ``copy`` is ``tiles.gmem_load().build(dtype)``; ``mDelta`` is the (queries,) fp32 row.
    """
    tile = (tiles.block_i, tiles.max_k)
    thr = copy.get_slice(thread_id)
    tGg = thr.partition_S(cute.local_tile(cute.domain_offset((query_start, 0), mGradOutput), tile, (0, 0)))
    tOg = thr.partition_S(cute.local_tile(cute.domain_offset((query_start, 0), mOutput), tile, (0, 0)))
    tC = thr.partition_S(cute.make_identity_tensor(tile))
    lane_row = tC[0, 0, 0][0]
    row_pred = query_start + lane_row < num_queries
    stages = tiles.stages
    iters = tiles.max_iters
    frag_grad_output = [cute.make_rmem_tensor_like(tGg[None, 0, 0]) for _ in range(stages)]
    frag_output = [cute.make_rmem_tensor_like(tOg[None, 0, 0]) for _ in range(stages)]

    # prologue: the first kPipelineStages - 1 loads
    for it in cutlass.range_constexpr(stages - 1):
        frag_grad_output[it].fill(0.0)
        frag_output[it].fill(0.0)
        if row_pred:
            if tC[0, 0, it][1] < head_dim:
                cute.copy(copy, tGg[None, 0, it], frag_grad_output[it])
                cute.copy(copy, tOg[None, 0, it], frag_output[it])
    delta = Float32(0.0)
    for it in cutlass.range_constexpr(iters):
        nxt = it + stages - 1  # load for a later step before this one is summed
        if const_expr(nxt < iters):
            frag_grad_output[nxt % stages].fill(0.0)
            frag_output[nxt % stages].fill(0.0)
            if row_pred:
                if tC[0, 0, nxt][1] < head_dim:
                    cute.copy(copy, tGg[None, 0, nxt], frag_grad_output[nxt % stages])
                    cute.copy(copy, tOg[None, 0, nxt], frag_output[nxt % stages])
        st = it % stages
        prod = frag_output[st].load().to(Float32) * frag_grad_output[st].load().to(Float32)
        delta = delta + prod.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
    delta = row_allreduce_sum(delta, tiles.threads_per_line)  # between the row's workers
    if row_pred:
        if tC[0, 0, 0][1] == 0:
            mDelta[query_start + lane_row] = delta


class ComputeDelta:
    """``compute_delta`` as its own launch over [B, M, H, K] (or packed [total, H, K]) tensors."""

    def __init__(self, dtype, tiles: ComputeDeltaTiles):
        if dtype.width != tiles.elem_bits:
            raise ValueError(f"tiles are for {tiles.elem_bits}-bit elements, dtype is {dtype}")
        self.dtype = dtype
        self.tiles = tiles

    @cute.jit
    def __call__(
        self,
        mGradOutput: cute.Tensor,  # [B, M, H, K] or [total, H, K]
        mOutput: cute.Tensor,  # same
        mDelta: cute.Tensor,  # [B, H, M (or max seqlen)] fp32
        mCuSeqlens: cute.Tensor,  # [B + 1] int32 or None
        stream: cuda.CUstream,
    ):
        copy = self.tiles.gmem_load().build(self.dtype)
        self.kernel(mGradOutput, mOutput, mDelta, mCuSeqlens, copy).launch(
            grid=[cute.ceil_div(mDelta.shape[2], self.tiles.block_i), mDelta.shape[1], mDelta.shape[0]],
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mGradOutput, mOutput, mDelta, mCuSeqlens, copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        q_block, bidh, bidb = cute.arch.block_idx()
        mGO_b, seqlen = seq_rows(mGradOutput, mCuSeqlens, bidb, bidh)
        mO_b, _ = seq_rows(mOutput, mCuSeqlens, bidb, bidh)
        query_start = q_block * self.tiles.block_i
        if query_start < seqlen:
            compute_delta(
                self.tiles, copy, mGO_b, mO_b, mDelta[bidb, bidh, None], query_start, seqlen, mGO_b.shape[1], tidx
            )
