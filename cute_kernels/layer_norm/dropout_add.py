"""Dropout + residual add fused into the LayerNorm / RMSNorm row kernels (flash-attention's
``dropout_add_ln``), as compile-time switches of ``LnFwd`` and ``LnBwd``.

Forward, per vector of a row, before the statistics:

    r = dropout(x + x_bias) + residual       (fp32, then rounded to r's dtype)

The norm then reads r as rounded, as the backward will, so y = norm(r) holds for the r
returned. Backward, per vector, after the norm's input gradient dx_norm:

    dr        = dx_norm + dr_in               (dr_in: the incoming gradient of r, prenorm)
    dresidual = dr
    dx        = dr * keep / (1 - p)           dx_bias = column sums of dx

The keep bits are ``ops.dropout_bias_forward``'s: ``common/philox.keep_byte`` keyed by the
flat byte index of a dense [rows, ceil(N / 8)] bit mask, bit j of byte b being column 8 b + j
(bits past N zero). A vector holds at most 8 elements and starts at a multiple of its width,
so it lies inside one byte: a thread draws (or reads) that byte and shifts its bits down; where
several threads share a byte, the one at its first column stores it.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32, Uint64

from cute_kernels.common.philox import keep_byte


@dataclass(frozen=True)
class DropoutAdd:
    """The switches: dtypes of x (and dx), the residual (None: no residual), r (what the norm
    reads), x_bias (None: none), the incoming gradient of r (backward, prenorm; None: none);
    whether a keep bit mask is drawn (forward) or read (backward)."""

    x_dtype: type
    res_dtype: Optional[type]
    r_dtype: type
    xb_dtype: Optional[type]
    dropout: bool
    dr_dtype: Optional[type] = None


def vector_column(tiles, th, col_tile, it: int) -> Int32:
    """First column of this thread's vector ``it``."""
    return (col_tile[it] * tiles.threads_per_row + th.tid_r) * tiles.vec


@cute.jit
def draw_bits(mMask: cute.Tensor, rng, row, c0, n):
    """(the 8 keep bits of the byte holding column ``c0`` of ``row``, bits past N cleared;
    whether this thread stores that byte)."""
    k0, k1, counter, threshold = rng
    byte = c0 // 8
    index = Uint64(row) * Uint64(mMask.shape[1]) + Uint64(byte)
    in_row = cutlass.min(n - byte * 8, 8)
    valid = (Uint32(1) << Uint32(in_row)) - Uint32(1)
    return keep_byte(k0, k1, counter, index, threshold) & valid, c0 % 8 == 0


@cute.jit
def read_bits(mMask: cute.Tensor, row, c0, ok) -> Uint32:
    """The keep bits of this thread's vector at column ``c0`` (bit i: element i), 0 where not ``ok``."""
    bits = Uint32(0)
    if ok:
        bits = Uint32(mMask[row, c0 // 8]) >> Uint32(c0 % 8)
    return bits


@cute.jit
def store_bits(mMask: cute.Tensor, row, c0, bits, ok):
    if ok:
        mMask[row, c0 // 8] = Uint8(bits)


def apply_keep(v, bits, scale: Float32, like: cute.Tensor):
    """``v`` (fp32, a vector) times ``scale`` where bit i of ``bits`` keeps element i, else 0.
    ``like``: a register tensor of the vector's layout. Plain Python, traced inline."""
    rA = cute.make_rmem_tensor_like(like, Float32)
    rA.store(v * scale)
    for i in range(cute.size(rA)):
        kept = ((bits >> Uint32(i)) & Uint32(1)) != Uint32(0)
        rA[i] = cutlass.select_(kept, rA[i], Float32(0.0))
    return rA.load()


def registers_of(like: cute.Tensor, dtype, ldgs: int) -> list:
    return [cute.make_rmem_tensor_like(like, dtype) for _ in range(ldgs)]
