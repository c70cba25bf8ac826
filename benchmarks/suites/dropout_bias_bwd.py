"""Suite dropout_bias_bwd: the fused dropout + bias (+ activation) backward.

Peers in the same run: torch eager and torch.compile of the same math (fp32 compute,
outputs in dY's dtype), and a device copy moving the same number of bytes. Ours runs with the
byte mask ("ours") and with the forward's bit mask ("ours bits": N / 8 bytes a row).
Bytes counted: dY, mask, (x), dX once each (the bit mask's row as N / 8); bias terms are negligible.
"""

from __future__ import annotations

import torch

NAME = "dropout_bias_bwd"


def _case_name(shape, dtype, act):
    return f"{shape[0]}x{shape[1]}:{dtype}" + (f":{act}" if act else "")


def run(settings, quick: bool):
    import ops
    from ops.reference import dropout_bias_backward_ref, dropout_bias_backward_torch, pack_mask

    from ..timing import time_case

    rows_out = []
    p = 0.1
    for shape, dtype_name, act in settings.DROPOUT_BIAS_BWD["quick" if quick else "full"]:
        dtype = getattr(torch, dtype_name)
        r, n = shape
        dy = torch.randn(r, n, device="cuda", dtype=dtype)
        mask = torch.rand(r, n, device="cuda") >= p
        x = bias = None
        if act:
            x = torch.randn(r, n, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
        bits = pack_mask(mask)
        esize = dy.element_size()
        nbytes = r * n * (2 * esize + 1 + (esize if act else 0))
        bits_bytes = nbytes - r * n + bits.numel()

        # correctness first, on these inputs
        gi, gb = ops.dropout_bias_backward(dy, mask, p, x, bias, act)
        ref_dx, ref_db = dropout_bias_backward_ref(dy, mask, p, x, bias, act)
        err_dx = ((gi.double() - ref_dx).norm() / ref_dx.norm()).item()
        err_db = ((gb.double() - ref_db).norm() / ref_db.norm()).item()
        gi_bits, gb_bits = ops.dropout_bias_backward(dy, bits, p, x, bias, act, mask_bits=True)
        if not (torch.equal(gi, gi_bits) and torch.equal(gb, gb_bits)):
            raise RuntimeError(f"{_case_name(shape, dtype_name, act)}: the bit mask gives other gradients")
        if not (err_dx < 1e-2 and err_db < 1e-2):
            raise RuntimeError(
                f"{_case_name(shape, dtype_name, act)}: wrong result, rel err dX {err_dx} dBias {err_db}"
            )

        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled_torch = torch.compile(dropout_bias_backward_torch, dynamic=False)
        impls = {
            "ours": lambda: ops.dropout_bias_backward(dy, mask, p, x, bias, act),
            "ours bits": (lambda: ops.dropout_bias_backward(dy, bits, p, x, bias, act, mask_bits=True), bits_bytes),
            "torch": lambda: dropout_bias_backward_torch(dy, mask, p, x, bias, act),
            "torch.compile": lambda: compiled_torch(dy, mask, p, x, bias, act),
        }
        rows_out += time_case(NAME, _case_name(shape, dtype_name, act), impls, nbytes)
    return rows_out


def compile_configs(arch: str, quick: bool):
    """The kernel's configurations for ``arch``: with ``quick``, those the quick cases run;
    else every one (dtype x activation x vector width x byte / bit mask), the tests' included."""
    import cutlass

    from cute_kernels.common.activation import ACTIVATIONS
    from layouts.dropout_bias import MAX_VECTOR_BITS
    from ops._compile import cute_dtype

    from ..arch import settings
    from ..compile_check import Config, widest_vec

    if quick:
        keys = []
        for (_, n), dtype_name, act in settings(arch).DROPOUT_BIAS_BWD["quick"]:
            dtype = cute_dtype(getattr(torch, dtype_name))  # dY's, and dBias's (the bias has dY's dtype)
            vec = widest_vec(n, dtype.width, MAX_VECTOR_BITS)
            keys += [(dtype, dtype, act, vec, arch, mask_bits) for mask_bits in (False, True)]
    else:
        dtypes = (cutlass.Float32, cutlass.Float16, cutlass.BFloat16)
        vecs = {d: [v for v in (16, 8, 4, 2, 1) if v * d.width <= MAX_VECTOR_BITS] for d in dtypes}
        keys = [
            (d, d, act, v, arch, mask_bits)
            for d in dtypes
            for act in (None,) + ACTIVATIONS
            for v in vecs[d]
            for mask_bits in (False, True)
        ]
    return [Config("ops.dropout_bias:compiled", k) for k in dict.fromkeys(keys)]


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
