"""Bias, dropout and the sink of the Hopper attention forward's consumers (``AttentionForwardSm90``'s
configuration): the bias added to a block's scores, and the dropout keep flags of torch's
memory-efficient forward, drawn per block into shared memory and applied to P. The device code
they share with the sm90 backward: the bias fragment (``cute_kernels/attention/bias.py``) and
the Philox draw and its packing (``cute_kernels/attention/dropout.py``)."""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint8, Uint16, Uint32, const_expr

from cute_kernels.attention.bias import load_bias_fragment
from cute_kernels.attention.dropout import flag_byte, keep_flags, philox_stream
from cute_kernels.attention.named_barrier import NamedBarrierFwd
from cute_kernels.common.log2_units import LOG2_E
from layouts.attention_fwd_sm90 import KEEP_FLAG_BUFFERS, MMA_ROWS

from .wgmma import acc_mn_layout


@dataclass(frozen=True)
class ForwardFeatures:
    """What the consumers need of bias, dropout and the sink, per CTA (None where unused): the
    CTA's bias (Sq, Sk) of its (batch, head), the keep-flag buffers in shared memory (bytes), the
    batch's ``PhiloxStream``, the CTA's query head (its place in the stream) and the head's sink
    in log2 units (Float32)."""

    bias: Any
    keep: Any
    philox: Any
    head: Any
    sink: Any = None


class ForwardFeaturesMixin:
    """Bias and dropout per CTA and per key block, the sink per CTA (``AttentionForwardSm90``'s
    ``has_bias``, ``dropout``, ``sink`` and tiles)."""

    @cute.jit
    def features(self, mBias, sKeep, rng, batch, head, heads, mSink=None) -> ForwardFeatures:
        """The ``ForwardFeatures`` of the CTA's (batch, head) of ``heads`` query heads."""
        bias = mBias[batch, head, None, None] if const_expr(self.has_bias) else None
        philox = philox_stream(rng, batch, heads) if const_expr(self.dropout) else None
        sink = mSink[head] * LOG2_E if const_expr(self.sink) else None
        return ForwardFeatures(bias, sKeep, philox, head, sink)

    @cute.jit
    def add_bias(self, acc_S, S, feat, cS, q0, key0, seqlen_q, seqlen_k, scale_log2):
        """S <- S * scale_log2 + B * log2(e): the block's scores with the bias, in log2 units (the
        softmax then takes scale 1). ``S``: acc_S rows x columns; ``cS``: each value's (query, key)
        in the block at (q0, key0). Positions past the sequences read the last row / key (never
        out of bounds; the mask hides them)."""
        rB = cute.make_rmem_tensor(acc_S.layout.shape, self.dtype)
        B = cute.make_tensor(rB.iterator, acc_mn_layout(rB.layout))
        load_bias_fragment(feat.bias, B, cS, q0, key0, seqlen_q, seqlen_k, keys_as_rows=False)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                S[r, c] = S[r, c] * scale_log2 + B[r, c].to(Float32) * LOG2_E

    def keep_flag_view(self, sKeep, dtype):
        """The keep-flag buffers as (query, word, buffer) of ``dtype`` (Uint8: 8 keys a word, as
        they are drawn; Uint16: 16, as they are read)."""
        t = self.tiles
        words = t.tile_n // dtype.width
        layout = cute.make_layout((t.tile_m, words, KEEP_FLAG_BUFFERS), stride=(words, 1, t.tile_m * words))
        return cute.make_tensor(cute.recast_ptr(sKeep.iterator, dtype=dtype), layout)

    @cute.jit
    def draw_keep_flags(self, feat, i, q0, key0, seqlen_k, tidx):
        """Dropout: the warpgroup draws the keep flags of its 64 rows of block ``i`` into buffer
        i % 2, thread t (of the consumers) the tile_n / 2 consecutive keys of one row: curand's
        words q * Sk + k of the (batch, head) stream, 4 per Philox call (the shared ``keep_flags``),
        as bits (bit k % 8 of byte k / 8 of the row). Warpgroup barrier KEEP_FLAGS_WG0 + w before
        they are read (``keep_probs``). A warpgroup draws into buffer i % 2 again (block i + 2)
        after all its threads passed block i + 1's barrier, i.e. read block i's flags."""
        t = self.tiles
        keys = t.tile_n // 2
        lt = tidx % 128
        row = (tidx // 128) * MMA_ROWS + lt // 2
        col = (lt % 2) * keys
        flags = keep_flags(feat.philox, feat.head, q0, row, key0, col, seqlen_k, keys)
        s8 = self.keep_flag_view(feat.keep, Uint8)
        buf = i % KEEP_FLAG_BUFFERS
        for b in cutlass.range_constexpr(keys // 8):
            s8[row, col // 8 + b, buf] = Uint8(flag_byte(flags, b))

    @cute.jit
    def keep_probs(self, S, feat, i, cS, t0S, wg):
        """P (``S``: rows x columns, unnormalised) where block ``i``'s keep flag is set, else 0;
        the kept ones' 1 / (1 - p) waits for the epilogue (``finalize``). Reads buffer i % 2 after
        the warpgroup's barrier (all its threads drew block i).

        Columns 4 g .. 4 g + 3 of a wgmma accumulator's rows are keys 16 g' + o + {0, 1, 8, 9}
        (o = 2 (lane % 4), the thread's column offset): one 16-bit word of flags serves all four.
        The bit of each column is thread 0's key (a compile-time constant) after a shift by o."""
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.KEEP_FLAGS_WG0) + wg, number_of_threads=128)
        s16 = self.keep_flag_view(feat.keep, Uint16)
        buf = i % KEEP_FLAG_BUFFERS
        shift = Uint32(cS[0, 0][1] - t0S[0, 0][1])
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            q = cS[r, 0][0]
            for g in cutlass.range_constexpr(cute.size(S, mode=[1]) // 4):
                word = Uint32(s16[q, t0S[0, 4 * g][1] // 16, buf]) >> shift
                for j in cutlass.range_constexpr(4):
                    c = 4 * g + j
                    kept = (word & Uint32(1 << (t0S[0, c][1] % 16))) != Uint32(0)
                    S[r, c] = Float32(cutlass.select_(kept, S[r, c], Float32(0.0)))
