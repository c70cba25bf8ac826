"""Softcapped attention scores (Gemma 2, Grok): s = scale q kᵀ becomes c tanh(s / c) before the
bias, the mask and the softmax (FlashAttention's order). The kernels fold the softmax scale into
tanh's argument and c log2(e) into the softmax's log2 multiplier, as FlashAttention does: a score
S = q kᵀ becomes t = tanh(S scale / c), and t c log2(e) its capped value in log2 units.

tanh is computed as 1 - 2 / (2^(2 x log2 e) + 1) from ex2.approx and rcp.approx (relative errors
near 2^-22, two MUFU instructions): PTX's tanh.approx.f32 (one) errs by up to 2^-11 relative, which
at c = 50 moves a score by up to 0.02 (2% of its probability).

The backward needs 1 - t² of each score but keeps no copy of t: it recovers t from the probability
it computed, P = 2^(t c log2 e [+ B log2 e] - LSE log2 e), as t = (log2 P + LSE log2 e [- B log2 e])
/ (c log2 e) (``cap_derivative``): one lg2 and three FMAs, no registers held across the step."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_kernels.common.log2_units import LOG2_E


@cute.jit
def tanh(x):
    """tanh(x) to ~1e-7: 1 - 2 / (e^(2x) + 1) (e^(2x) = inf gives 1, 0 gives -1: no NaN)."""
    e = cute.math.exp2(x * (2.0 * LOG2_E), fastmath=True)
    return 1.0 - 2.0 * cute.arch.rcp_approx(e + 1.0)


@cute.jit
def cap_scores(acc, tanh_scale):
    """An accumulator fragment of S = q kᵀ becomes t = tanh(S tanh_scale) in place (tanh_scale =
    scale / c); the caller's softmax then multiplies by c log2(e) instead of scale log2(e)."""
    n = cute.size(acc)
    for i0 in cutlass.range_constexpr(0, n, 32):  # (the DSL warns of static loops over 64 values)
        for i in cutlass.range_constexpr(i0, min(i0 + 32, n)):
            acc[i] = tanh(acc[i] * tanh_scale)


@cute.jit
def cap_derivative(p, log2_sum, inv_cap_log2):
    """1 - t² of a score whose probability is ``p``, with ``log2_sum`` = LSE log2(e) (less the
    bias in log2 units where there is one) and ``inv_cap_log2`` = 1 / (c log2 e). A masked or
    underflowed P (0: log2 is -inf) gives 0, as its gradient is 0 anyway; t is clamped to 1 (a
    saturated tanh recovered through rounding)."""
    t = (cute.math.log2(p, fastmath=True) + log2_sum) * inv_cap_log2
    return Float32(1.0) - cute.arch.fmin(t * t, Float32(1.0))
