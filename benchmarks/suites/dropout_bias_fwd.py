"""Suite dropout_bias_fwd: the fused bias + activation + dropout forward.

Peers in the same run: torch eager and torch.compile of the same composition (act(x + bias),
then ``torch.native_dropout``: y and its bool keep mask), and a device copy moving the same
number of bytes. Bytes counted: x read, y written, the bit mask written (N / 8 a row); the bias
is negligible. torch's bool mask is a byte per element: its GB/s counts only our bytes.
"""

from __future__ import annotations

import torch

NAME = "dropout_bias_fwd"


def _case_name(shape, dtype, act):
    return f"{shape[0]}x{shape[1]}:{dtype}" + (f":{act}" if act else "")


def bias_dropout_torch(x, bias, p, act):
    """What a torch user writes: the activation of x + bias, then torch's fused dropout."""
    from ops.dropout_bias import _act_forward

    return torch.native_dropout(_act_forward(x + bias, act), p, True)


def _check(x, bias, p, act, name):
    import ops
    from ops.dropout_bias_forward import unpack_mask
    from ops.reference import bias_dropout_forward_ref

    y, bits = ops.dropout_bias_forward(x, bias, p, act)
    keep = unpack_mask(bits, x.shape[-1])
    ref = bias_dropout_forward_ref(x, bias, keep, p, act)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    rate = keep.float().mean().item()
    if not (err < 1e-2 and abs(rate - (1 - p)) < 1e-2):
        raise RuntimeError(f"{name}: wrong result, rel err y {err}, keep rate {rate} (expected {1 - p})")


def run(settings, quick: bool):
    import ops

    from ..timing import time_case

    rows_out = []
    p = 0.1
    for shape, dtype_name, act in settings.DROPOUT_BIAS_FWD["quick" if quick else "full"]:
        dtype = getattr(torch, dtype_name)
        r, n = shape
        x = torch.randn(r, n, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        nbytes = r * n * 2 * x.element_size() + r * ((n + 7) // 8)
        name = _case_name(shape, dtype_name, act)
        _check(x, bias, p, act, name)  # correctness first, on these inputs

        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled_torch = torch.compile(bias_dropout_torch, dynamic=False)
        impls = {
            "ours": lambda: ops.dropout_bias_forward(x, bias, p, act),
            "torch": lambda: bias_dropout_torch(x, bias, p, act),
            "torch.compile": lambda: compiled_torch(x, bias, p, act),
        }
        rows_out += time_case(NAME, name, impls, nbytes)
    return rows_out


def compile_configs(arch: str, quick: bool):
    """The kernel's configurations for ``arch``: with ``quick``, those the quick cases run;
    else every one (dtype x activation x vector width x seed on the host / device), the tests'
    included."""
    import cutlass

    from cute_kernels.common.activation import ACTIVATIONS
    from layouts.dropout_bias import MAX_VECTOR_BITS
    from ops._compile import cute_dtype

    from ..arch import settings
    from ..compile_check import Config, widest_vec

    if quick:
        keys = []
        for (_, n), dtype_name, act in settings(arch).DROPOUT_BIAS_FWD["quick"]:
            dtype = cute_dtype(getattr(torch, dtype_name))
            keys.append((dtype, act, widest_vec(n, dtype.width, MAX_VECTOR_BITS), arch, False))
    else:
        dtypes = (cutlass.Float32, cutlass.Float16, cutlass.BFloat16)
        vecs = {d: [v for v in (16, 8, 4, 2, 1) if v * d.width <= MAX_VECTOR_BITS] for d in dtypes}
        keys = [
            (d, act, v, arch, on_device)
            for d in dtypes
            for act in (None,) + ACTIVATIONS
            for v in vecs[d]
            for on_device in (False, True)
        ]
    return [Config("ops.dropout_bias_forward:compiled", k) for k in dict.fromkeys(keys)]


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
