"""Dropout of attention kernels as torch's memory-efficient attention draws it: curand's Philox
stream of one (batch, head), one word per (query, key) (``common/philox.py``), kept where the
word's uniform exceeds p and scaled by 1 / (1 - p). A forward and a backward draw the same bits
from the same arguments."""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32, Uint64

from cute_kernels.common.philox import keep_flags_quads, philox_scalar


@dataclass(frozen=True)
class PhiloxArgs:
    """A launch's dropout arguments: the Philox seed and offset (Int64, or Int64 [1] device
    tensors), p and 1 / (1 - p) (Float32) and the stream words of one (batch, head)
    (``bh_elems``, Mq * Mk: Int64)."""

    seed: Any
    offset: Any
    p: Any
    scale: Any
    bh_elems: Any


@dataclass(frozen=True)
class PhiloxStream:
    """One batch's draw: the Philox key (``k0``, ``k1``), the batch's first stream word
    (``base``), p, 1 / (1 - p) and the words per head."""

    k0: Any
    k1: Any
    base: Any
    p: Any
    scale: Any
    bh_elems: Any


@cute.jit
def philox_stream(args: PhiloxArgs, batch, heads) -> PhiloxStream:
    """Batch ``batch``'s stream of ``heads`` query heads: curand_init(seed, 0, offset + (batch * H
    + head) * Mq * Mk), as torch's forward seeds it."""
    seed = philox_scalar(args.seed)
    base = philox_scalar(args.offset) + Int64(batch) * Int64(heads) * Int64(args.bh_elems)
    return PhiloxStream(
        Uint32(seed), Uint32(seed >> Int64(32)), base, Float32(args.p), Float32(args.scale), Int64(args.bh_elems)
    )


@cute.jit
def keep_flags(stream: PhiloxStream, head, q0, row, key0, col, seqlen_k, keys: cutlass.Constexpr):
    """Keep flags of ``keys`` consecutive keys (a multiple of 4) from key0 + col of query q0 + row
    (the word of (q, k) is q * Sk + k of the head's stream), 4 per Philox call: a Uint32 per 4
    keys, key j's flag in byte j (``keep_flags_quads``; ``flag_half`` / ``flag_byte`` pack them)."""
    word = stream.base + Int64(head) * stream.bh_elems + Int64(q0 + row) * Int64(seqlen_k) + Int64(key0 + col)
    return keep_flags_quads(Uint64(word), stream.k0, stream.k1, stream.p, keys // 4)


def flag_bits(flags, first: int, quads: int):
    """Keys 4 ``first`` .. 4 (``first`` + ``quads``) - 1 of ``keep_flags``' flags as the low bits
    of a Uint32 (key 4 ``first`` in bit 0). Plain Python, traced inline by its callers."""
    bits = Uint32(0)
    # flag j of quad c is bit 8 j of flags[c]: a quad makes a nibble
    for c in range(quads):
        f = flags[first + c]
        nibble = (f | (f >> Uint32(7)) | (f >> Uint32(14)) | (f >> Uint32(21))) & Uint32(0xF)
        bits = bits | (nibble << Uint32(4 * c))
    return bits


@cute.jit
def flag_half(flags, h: cutlass.Constexpr):
    """Keys 16 h .. 16 h + 15 of ``keep_flags``' flags as bits 0 .. 15 of a Uint32."""
    return flag_bits(flags, 4 * h, 4)


@cute.jit
def flag_byte(flags, b: cutlass.Constexpr):
    """Keys 8 b .. 8 b + 7 of ``keep_flags``' flags as bits 0 .. 7 of a Uint32."""
    return flag_bits(flags, 2 * b, 2)


@cute.jit
def apply_keep(keep, e, x, scale):
    """x * ``scale`` (1 / (1 - p)) where bit ``e`` of the keep words ``keep`` (Uint32 each) is
    set, else 0."""
    kept = (keep[e // 32] & Uint32(1 << (e % 32))) != Uint32(0)
    return Float32(cutlass.select_(kept, x * scale, Float32(0.0)))
