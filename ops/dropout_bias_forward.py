"""Launch of the fused bias + activation + dropout forward (``cute_kernels.dropout_bias.DropoutBiasFwd``).

``bias_dropout_forward(x, bias, p, activation)`` returns y = dropout(act(x + bias)) and the
keep mask as bits: uint8 [..., ceil(N / 8)], bit j of byte b keeping column 8 b + j
(``unpack_mask`` turns it into bools). The bits come from Philox on the device, keyed by
torch's default CUDA generator (``ops.philox``): ``torch.manual_seed`` reproduces them, each
call advances the generator's offset by 4, and under CUDA-graph capture every replay draws
anew. An element is kept where a 16-bit draw is >= round(p 2^16) (p resolved to 2^-16);
kept elements are scaled by 1 / (1 - p).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from cute_kernels.common.philox import keep_threshold
from cute_kernels.dropout_bias import config as dropout_bias_config
from layouts import dropout_bias as tiling

from . import _compile as cc
from ._memo import Memo
from ._validate import rows_view
from .philox import philox_seed_offset, philox_state_captured

# one Philox counter per mask byte: a call advances the generator's offset by one counter
PHILOX_WORDS = 4


def _build(dtype, activation, vec, arch, rng_on_device):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.dropout_bias import DropoutBiasFwd

    t = dropout_bias_config.tiles(dtype.width, vec, arch)
    rows, n = cute.sym_int(), cute.sym_int()
    seed, offset, _, _, _ = cc.fake_rng_args(rng_on_device)
    return cc.compile_kernel(
        DropoutBiasFwd(dtype, activation, t),
        cc.fake_tensor(dtype, (rows, n), vec),  # x
        cc.fake_tensor(dtype, (n,), vec),  # bias
        cc.fake_tensor(dtype, (rows, n), vec),  # y
        cc.fake_tensor(cutlass.Uint8, (rows, cute.sym_int()), 1),  # mask bits
        seed,
        offset,
        cutlass.Int32(0),  # threshold
        cutlass.Float32(1.0),  # 1 / (1 - p)
        cutlass.Int32(1),  # chunks
        cutlass.Int32(1),  # row blocks per chunk
        cc.fake_stream(),
        arch=arch,
    )


compiled = cc.CompileCache("dropout_bias_fwd", _build)


def mask_bytes(n: int) -> int:
    """Bytes of one row's keep bits."""
    return (n + 7) // 8


def unpack_mask(bits: Tensor, n: int) -> Tensor:
    """The bool keep mask [..., N] of a bit mask [..., ceil(N / 8)] (any device)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    flags = (bits.unsqueeze(-1) >> shifts) & 1
    return flags.reshape(*bits.shape[:-1], -1)[..., :n].bool()


class _Plan:
    """What a call's metadata decides: vector width, grid split, the compiled functions (host
    and device seed)."""

    __slots__ = ("rows", "n", "chunks", "per_chunk", "key")

    def __init__(self, x, bias, activation):
        n = x.shape[-1]
        xs = rows_view("x", x)
        vec = cc.max_vector_elems(tiling.MAX_VECTOR_BITS, (xs, n), (bias.view(1, n), n))
        dev = x.device.index
        arch = cc.device_arch(dev)
        t = dropout_bias_config.tiles(8 * x.element_size(), vec, arch)
        self.rows, self.n = xs.shape
        self.chunks, self.per_chunk = dropout_bias_config.row_chunks(self.rows, n, t, cc.num_sms(dev))
        self.key = (cc.cute_dtype(x.dtype), activation, vec, arch)


_plans = Memo()


def _plan(x, bias, activation) -> _Plan:
    key = (x.shape, x.stride(), x.dtype, x.device, bias.stride(), activation, x.data_ptr() & 15, bias.data_ptr() & 15)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _Plan(x, bias, activation))
    return plan


def bias_dropout_forward(x: Tensor, bias: Tensor, p: float, activation: Optional[str]) -> Tuple[Tensor, Tensor]:
    """(y, mask bits) of y = dropout(act(x + bias), p); x [..., N] CUDA, bias [N] of x's dtype
    (the caller validates). y is contiguous in x's dtype; the mask uint8 [..., ceil(N / 8)]."""
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mask = torch.empty((*x.shape[:-1], mask_bytes(n)), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return y, mask
    if not x.is_contiguous():  # the kernel reads rows; torch's dropout takes any layout
        x = x.contiguous()
    if bias.stride(0) != 1:
        bias = bias.contiguous()
    plan = _plan(x, bias, activation)
    on_device = cc.capturing()
    fn = compiled(*plan.key, on_device)  # before the draw: a failed compile leaves the generator as it was
    if on_device:
        seed, offset = philox_state_captured(x.device)
    else:
        seed, offset = philox_seed_offset(x.device, PHILOX_WORDS)
    fn(
        x.view(plan.rows, plan.n),
        bias,
        y.view(plan.rows, plan.n),
        mask.view(plan.rows, -1),
        seed,
        offset,
        keep_threshold(p),
        1.0 / (1.0 - p),
        plan.chunks,
        plan.per_chunk,
    )
    return y, mask
