"""Bias, dropout and softcap of the sm90 backward's consumers: the bias fragment, the bias
gradient's TMA stores, the keep-flag buffers and bits, the softcap's scales."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint16, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.bias import load_bias_fragment
from cute_kernels.attention.dropout import PhiloxArgs, apply_keep, flag_half, keep_flags, philox_stream
from cute_kernels.attention.named_barrier import NamedBarrier
from cute_kernels.attention.softcap import cap_derivative
from cute_kernels.common.log2_units import LOG2_E
from cute_kernels.common.convert import convert_packed
from layouts.attention_sm90 import (
    GRAD_BIAS_BOX_KEYS,
    KEEP_FLAG_BUFFERS,
)

from .arguments import Features, GradBiasTma, ScoreCap
from .wgmma import acc_mn_layout


class FeaturesMixin:
    """Bias and dropout per CTA and per block (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def features(self, mBias, grad_bias_tma: GradBiasTma, sKeep, rng: PhiloxArgs, batch, heads) -> Features:
        """What the consumers need of bias and dropout, per CTA (``Features``, None where unused):
        the batch's bias view (H, Sq, Sk), the bias gradient's TMA atom and (Sq, Sk, H) view, the
        keep-flag buffers and the batch's Philox stream of ``heads`` query heads."""
        bias = mBias[batch, None, None, None] if const_expr(self.has_bias) else None
        grad_bias = None
        if const_expr(self.grad_bias):
            grad_bias = GradBiasTma(grad_bias_tma.atom, grad_bias_tma.coords[None, None, None, batch])
        philox = None
        if const_expr(self.dropout):
            philox = philox_stream(rng, batch, heads)
        return Features(bias, grad_bias, sKeep, philox)

    @cute.jit
    def score_scales(self, softmax_scale, softcap):
        """(the softmax's log2 multiplier, ``ScoreCap`` or None): scale log2(e), or with a softcap
        c log2(e) and tanh(S scale / c) first (``cute_kernels/attention/softcap.py``)."""
        if const_expr(self.softcap):
            scale_log2 = softcap * LOG2_E
            return scale_log2, ScoreCap(softmax_scale / softcap, cute.arch.rcp_approx(scale_log2))
        return softmax_scale * LOG2_E, None

    @cute.jit
    def capped(self, ds, p, lse_log2, cap, B, r, c):
        """softcap: dS of a capped score times 1 - tanh² (dQ / dK take it; the bias gradient the
        capped score's ``ds``), tanh recovered from P, the column's LSE in log2 units and the bias
        ``B`` (rows x columns, None without)."""
        log2_sum = lse_log2
        if const_expr(self.has_bias):
            log2_sum = lse_log2 - B[r, c].to(Float32) * LOG2_E
        return ds * cap_derivative(p, log2_sum, cap.inv_scale_log2)

    @cute.jit
    def block_features(self, feat, head, i, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp, wg, tidx):
        """(bias fragment, keep bits) of step ``i``'s block (None where unused)."""
        rBias, keep = None, None
        if const_expr(self.has_bias):
            rBias = self.load_bias(feat.bias, head, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp)
        if const_expr(self.dropout):
            self.draw_keep_flags(feat, head, i, q0, key0, seqlen_k, wg, tidx)
            keep = self.keep_bits(feat, i, cS_mn, wg)
        return rBias, keep

    @cute.jit
    def load_bias(self, bias, head, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp):
        """B^T of the thread's S^T fragment. Positions past the sequences read the last row /
        key instead (never out of bounds; probs zeroes them)."""
        gB = bias[head, None, None]
        rB = cute.make_rmem_tensor(shape_sdp, self.dtype)
        B = cute.make_tensor(rB.iterator, acc_mn_layout(rB.layout))
        load_bias_fragment(gB, B, cS_mn, q0, key0, seqlen_q, seqlen_k, keys_as_rows=True)
        return rB

    @cute.jit
    def store_grad_bias(self, feat, sdS, buf, boxes, head, m_block, n_block):
        """dB = dS: TMA stores of dS buffer ``buf``'s key boxes ``boxes`` (GRAD_BIAS_BOX_KEYS
        keys each; an index or a list) to query block m_block, key block n_block (TMA drops
        what lies past the sequences). Called by one thread after dS is written and fenced."""
        t = self.tiles
        tma_dB, gdB = feat.grad_bias.atom, feat.grad_bias.coords
        box = (t.tile_m, GRAD_BIAS_BOX_KEYS)
        per_block = t.tile_n // GRAD_BIAS_BOX_KEYS
        g = cute.local_tile(gdB[None, None, head], box, (None, None))  # (rows, keys, m, n)
        s = cute.local_tile(sdS[None, None, buf], box, (0, None))  # (rows, keys, box)
        ts, tg = cpasync.tma_partition(
            tma_dB, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )
        for b in boxes if isinstance(boxes, list) else [boxes]:
            cute.copy(tma_dB, ts[None, b], tg[None, m_block, n_block * per_block + b])
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def grad_bias_wait(self, storing):
        """Before a thread announces its next dS: its last bias-gradient store has read the
        buffer (the dS barriers then order the buffer's next write after that read)."""
        if const_expr(self.grad_bias):
            if storing:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def draw_keep_flags(self, feat, head, i, q0, key0, seqlen_k, wg, tidx):
        """Dropout: the warpgroup draws its part of step ``i``'s block into keep-flag buffer
        i % 2: thread t the ``keep_flag_keys`` consecutive keys of one query row (curand's
        words q * Sk + k of the (batch, head) stream, 4 per Philox call), as bits (bit k % 16
        of half-word k / 16 of row q). Called while the tensor cores compute the block's S^T and
        dP^T (drawing a step ahead, behind the gradient products, measured no faster: the Philox
        rounds cost issue slots, not latency; docs/attention_sm90.md). The draw and the packing are
        the shared ``keep_flags`` / ``flag_half`` (``cute_kernels/attention/dropout.py``)."""
        t = self.tiles
        keys, _ = t.sdp_wg_tile
        per_thread = t.keep_flag_keys
        key_org, q_org = t.sdp_wg_origin(wg)
        lt = tidx % 128
        row = q_org + lt // (keys // per_thread)
        col = key_org + (lt % (keys // per_thread)) * per_thread
        flags = keep_flags(feat.philox, head, q0, row, key0, col, seqlen_k, per_thread)
        s16 = self.keep_flag_halves(feat.keep)
        for h in cutlass.range_constexpr(per_thread // 16):
            s16[row, col // 16 + h, i % KEEP_FLAG_BUFFERS] = Uint16(flag_half(flags, h))

    def keep_flag_halves(self, sKeep):
        """The keep-flag buffers as (query, 16-key half-word, buffer) Uint16."""
        t = self.tiles
        layout = cute.make_layout(
            (t.tile_m, t.tile_n // 16, KEEP_FLAG_BUFFERS), stride=(t.tile_n // 16, 1, t.tile_m * t.tile_n // 16)
        )
        return cute.make_tensor(cute.recast_ptr(sKeep.iterator, dtype=Uint16), layout)

    @cute.jit
    def keep_bits(self, feat, i, cS_mn, wg):
        """Dropout keep flags of the thread's S^T fragment, one bit each (Uint32 words in the
        fragment's rows x columns order), from buffer i % 2 after the warpgroup's barrier (all
        its threads drew step i). With two buffers the one barrier suffices: a warpgroup draws
        into buffer i % 2 again (step i + 2) after all its threads passed step i + 1's
        barrier, i.e. read step i's bits.

        Rows 2 m and 2 m + 1 of a wgmma accumulator fragment are keys 8 apart in one 16-key
        group (row r0 * 8 + lane / 4 of the warp's 16), so one half-word serves both."""
        s16 = self.keep_flag_halves(feat.keep)
        buf = i % KEEP_FLAG_BUFFERS
        # static barrier ids (a register id makes ptxas reserve all 16)
        if wg == 0:
            cute.arch.barrier(barrier_id=NamedBarrier.KEEP_FLAGS, number_of_threads=128)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.KEEP_FLAGS_WG1, number_of_threads=128)
        rows = cute.size(cS_mn, mode=[0])
        n = rows * cute.size(cS_mn, mode=[1])
        words = [Uint32(0) for _ in range((n + 31) // 32)]
        for c in cutlass.range_constexpr(cute.size(cS_mn, mode=[1])):
            for r in cutlass.range_constexpr(0, rows, 2):
                k, q = cS_mn[r, c]
                half = Uint32(s16[q, k // 16, buf]) >> Uint32(k % 16)
                for r0 in cutlass.range_constexpr(2):
                    e = c * rows + r + r0
                    words[e // 32] = words[e // 32] | (((half >> Uint32(8 * r0)) & Uint32(1)) << Uint32(e % 32))
        return words

    @cute.jit
    def dropped(self, keep, e, x, feat):
        """x / (1 - p) where element ``e`` of the fragment is kept, else 0."""
        return apply_keep(keep, e, x, feat.philox.scale)

    @cute.jit
    def p_operand(self, acc_P, cS_mn, keep, feat):
        """P^T in the element type, the A operand of dV += P^T dO: with dropout P∘Z."""
        rP = cute.make_rmem_tensor(acc_P.layout.shape, self.dtype)
        if const_expr(self.dropout):
            # P∘Z in fp32 beside P (the wide kernel's dS still reads P), then packed
            kept = cute.make_rmem_tensor(acc_P.layout.shape, Float32)
            P = cute.make_tensor(acc_P.iterator, acc_mn_layout(acc_P.layout))
            Pd = cute.make_tensor(kept.iterator, acc_mn_layout(kept.layout))
            rows = cute.size(P, mode=[0])
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                for r in cutlass.range_constexpr(rows):
                    Pd[r, c] = self.dropped(keep, c * rows + r, P[r, c], feat)
            convert_packed(kept, rP)
        else:
            convert_packed(acc_P, rP)
        return rP
