"""curand's Philox4x32-10 as DSL device functions, and the mem-eff attention keep mask.

curand (``curand_philox4x32_x.h``) keys Philox with (lo32(seed), hi32(seed)) and
counts 32-bit words: ``curand_init(seed, 0, offset)`` then ``skipahead(n)`` puts the
state at word ``offset + n`` of the stream whose 128-bit counter c yields words
4c .. 4c + 3, and ``curand_uniform4`` returns the next four words as floats
``u32 * 2^-32 + 2^-33``. PyTorch's memory-efficient attention draws element
(query, key) of (batch, head) from word

    philox_offset + batch * H * Mq * Mk + head * Mq * Mk + query * Mk + key

and keeps it when its uniform is > p. The CPU twin is ``ops.reference.philox4x32_10``.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32, Uint64

PHILOX_W32_0 = 0x9E3779B9  # key schedule (golden ratio, sqrt(3) - 1)
PHILOX_W32_1 = 0xBB67AE85
PHILOX_M4X32_0 = 0xD2511F53  # round multipliers
PHILOX_M4X32_1 = 0xCD9E8D57
PHILOX_ROUNDS = 10
TWO_POW32_INV = 2.3283064e-10  # CURAND_2POW32_INV (float 2^-32)
TWO_POW32_INV_HALF = TWO_POW32_INV / 2.0


def philox_scalar(x):
    """A Philox seed or offset as Int64: the scalar argument itself, or element 0 of a
    device tensor (under CUDA-graph capture torch's forward writes them to device memory,
    and reading them on the host would end the capture)."""
    if isinstance(x, cute.Tensor):
        return Int64(x[0])
    return Int64(x)


def _mulhilo(a: int, b) -> tuple:
    # One mul.wide.u32: the 64-bit product of two zero-extended words.
    prod = Uint64(a) * Uint64(b)
    return Uint32(prod >> Uint64(32)), Uint32(prod)


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple:
    """The four 32-bit words of counter (c0..c3) under key (k0, k1) (Uint32 values)."""
    for r in range(PHILOX_ROUNDS):
        if r > 0:
            k0 = k0 + Uint32(PHILOX_W32_0)
            k1 = k1 + Uint32(PHILOX_W32_1)
        hi0, lo0 = _mulhilo(PHILOX_M4X32_0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M4X32_1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniform(word) -> Float32:
    """curand's ``_curand_uniform``: (0, 1], never 0."""
    return Float32(word) * Float32(TWO_POW32_INV) + Float32(TWO_POW32_INV_HALF)


@cute.jit
def keep_flags_quads(word_index: Uint64, k0: Uint32, k1: Uint32, dropout_p: Float32, num_quads: cutlass.Constexpr):
    """Keep flags of ``4 * num_quads`` consecutive stream words from ``word_index``:
    one Uint32 per quad, flag j of the quad in byte j (1 = kept, u > p).

    The curand pattern: one skipahead to the first word, then ``curand_uniform4`` per
    quad; a start inside a counter (state = word_index % 4) mixes two outputs, so
    ``num_quads + 1`` Philox calls serve ``num_quads`` quads.
    """
    ctr = word_index >> Uint64(2)
    state = Uint32(word_index) & Uint32(3)

    def output(c):
        ctr_c = ctr + Uint64(c)
        return philox4x32_10(Uint32(ctr_c), Uint32(ctr_c >> Uint64(32)), Uint32(0), Uint32(0), k0, k1)

    # one output ahead, not all of them: 8 words live instead of 4 (num_quads + 1)
    cur = output(0)
    flags = []
    for c in cutlass.range_constexpr(num_quads):
        nxt = output(c + 1)
        packed = Uint32(0)
        for j in cutlass.range_constexpr(4):
            # word state + j of the 8 words cur ++ nxt
            cand = [cur[j + s] if j + s < 4 else nxt[j + s - 4] for s in range(4)]
            w = cutlass.select_(
                state == Uint32(0),
                cand[0],
                cutlass.select_(state == Uint32(1), cand[1], cutlass.select_(state == Uint32(2), cand[2], cand[3])),
            )
            keep = uniform(Uint32(w)) > dropout_p
            packed = packed | (Uint32(cutlass.select_(keep, Uint32(1), Uint32(0))) << Uint32(8 * j))
        flags.append(packed)
        cur = nxt
    return flags


# --- elementwise dropout: one Philox call per 8 elements -----------------------------
#
# Element j of byte b of a bit mask (rows of ceil(N / 8) bytes, b the flat byte index) is
# half j of the four words of counter (offset / 4, b): curand_init(seed, b, offset)'s first
# curand4, each word split into two 16-bit halves, low half first. It is kept (bit j set) where
# the half is >= round(p 2^16): 8 elements per call, p resolved to 2^-16. A draw advances the
# generator's offset by 4 (one counter), whatever its size.

KEEP_THRESHOLD_BITS = 16


def keep_threshold(p: float) -> int:
    """The 16-bit threshold a half must reach to be kept: round(p 2^16), at most 2^16 - 1."""
    return min(round(p * (1 << KEEP_THRESHOLD_BITS)), (1 << KEEP_THRESHOLD_BITS) - 1)


def keep_byte_key(seed, offset, threshold) -> tuple:
    """(k0, k1, counter, threshold) of ``keep_byte`` from torch's seed and offset (Int64 values,
    or Int64 [1] device tensors under CUDA-graph capture: ``philox_scalar``)."""
    s = philox_scalar(seed)
    return Uint32(s), Uint32(s >> cutlass.Int64(32)), Uint64(philox_scalar(offset)) >> Uint64(2), Uint32(threshold)


def keep_byte(k0, k1, counter, byte_index, threshold):
    """The 8 keep bits (bit j: element j, 1 = kept) of mask byte ``byte_index`` (Uint64) for
    Philox key (``k0``, ``k1``) and ``counter`` (Uint64, the offset / 4), as a Uint32 whose
    high 24 bits are zero. Plain Python, traced inline by its callers."""
    words = philox4x32_10(
        Uint32(counter), Uint32(counter >> Uint64(32)), Uint32(byte_index), Uint32(byte_index >> Uint64(32)), k0, k1
    )
    bits = Uint32(0)
    for j in range(8):
        half = (words[j // 2] >> Uint32(16 * (j % 2))) & Uint32(0xFFFF)
        bits = bits | cutlass.select_(half >= threshold, Uint32(1 << j), Uint32(0))
    return bits
