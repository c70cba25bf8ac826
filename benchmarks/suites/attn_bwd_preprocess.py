"""Suite attn_bwd_preprocess: Δ = rowsum(dO∘O), the attention backward's preprocessing.

Impls: ``ours`` (attention_bwd_preprocess, flash's compute_dot_do_o), ``ours:clear_dq``
(the same launch also returns a zeroed fp32 dQ accumulator), ``ours:compute_delta``
(the mem-eff kernel's computeDelta), ``torch`` / ``torch.compile`` (attention_delta_torch:
an fp32 rowsum), ``copy`` (a device copy of the same bytes).
Bytes counted: O and dO read once, Δ written once in fp32; ``ours:clear_dq`` adds the
accumulator's writes (B x round_up(S, 128) x H x round_up(D, 32) fp32).
"""

from __future__ import annotations

import torch

NAME = "attn_bwd_preprocess"

DTYPES = ("Float16", "BFloat16")
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # contiguous: the widest vector (8)
# (head dim, vector): odd head dims take narrower vectors, and so do misaligned views
NARROW = ((1, 1), (33, 1), (100, 4), (255, 1), (128, 2))


def configurations():
    """(cutlass dtype name, padded head dim, vector, varlen): what compile_only compiles.

    Each is compiled three times: compute_dot_do_o with and without the dQ-accumulator
    clear, and compute_delta.
    """
    from layouts.attention_bwd_prepost import head_dim_rounded

    pairs = [(d, 8) for d in HEAD_DIMS] + list(NARROW)
    return [
        (dtype, head_dim_rounded(d), vec, varlen) for dtype in DTYPES for d, vec in pairs for varlen in (False, True)
    ]


SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _case_name(shape, dtype):
    return "x".join(map(str, shape)) + f":{SHORT[dtype]}"


def _check(name, got, ref, out, grad_out):
    """|Δ - ref| within 1e-3 of |O_row| |dO_row| (fp32 sums of exact products)."""
    bound = 1e-3 * out.float().norm(dim=-1) * grad_out.float().norm(dim=-1)  # [B, S, H]
    s = out.shape[1]
    excess = ((got[:, :, :s].double() - ref[:, :, :s]).abs() - bound.transpose(1, 2)).max().item()
    if got.isnan().any() or excess > 0 or (got[:, :, s:] != 0).any():
        raise RuntimeError(f"{name}: wrong result (error exceeds its bound by {excess})")


def run(settings, quick: bool):
    from ops.attention_bwd_prepost import (
        attention_bwd_compute_delta,
        attention_bwd_preprocess,
    )
    from ops.reference import attention_delta_ref, attention_delta_torch

    from ..timing import time_case

    rows_out = []
    for shape, dtype_name in settings.ATTN_BWD_PREPROCESS["quick" if quick else "full"]:
        b, h, s, d = shape
        dtype = getattr(torch, dtype_name)
        case = _case_name(shape, dtype_name)
        out = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        grad_out = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        nbytes = 2 * out.numel() * out.element_size() + b * h * s * 4

        # correctness first, on these inputs
        ref = attention_delta_ref(out, grad_out)
        _check(f"{case} ours", attention_bwd_preprocess(out, grad_out), ref, out, grad_out)
        _check(f"{case} compute_delta", attention_bwd_compute_delta(out, grad_out), ref, out, grad_out)
        delta, dq_accum = attention_bwd_preprocess(out, grad_out, zero_dq_accum=True)
        _check(f"{case} clear_dq", delta, ref, out, grad_out)
        if (dq_accum != 0).any():
            raise RuntimeError(f"{case} clear_dq: the dQ accumulator is not zero")
        acc_bytes = dq_accum.numel() * 4
        del ref, delta, dq_accum

        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled_torch = torch.compile(attention_delta_torch, dynamic=False)
        impls = {
            "ours": (lambda: attention_bwd_preprocess(out, grad_out), nbytes),
            "ours:clear_dq": (lambda: attention_bwd_preprocess(out, grad_out, zero_dq_accum=True), nbytes + acc_bytes),
            "ours:compute_delta": (lambda: attention_bwd_compute_delta(out, grad_out), nbytes),
            "torch": (lambda: attention_delta_torch(out, grad_out), nbytes),
            "torch.compile": (lambda: compiled_torch(out, grad_out), nbytes),
        }
        rows_out += time_case(NAME, case, impls, nbytes)
    return rows_out


def _keys(dtype, head_dim: int, vec: int, varlen: bool, arch: str):
    """compute_dot_do_o with and without the dQ-accumulator clear, and compute_delta, as
    compile keys ((cache, arguments)); ``head_dim`` padded."""
    return [
        ("compiled_preprocess", (dtype, head_dim, vec, varlen, False, arch)),
        ("compiled_preprocess", (dtype, head_dim, vec, varlen, True, arch)),
        ("compiled_compute_delta", (dtype, head_dim, vec, varlen, arch)),
    ]


def compile_configs(arch: str, quick: bool):
    """The configurations for ``arch``: with ``quick``, those the quick cases run (contiguous
    [B, S, H, D], no varlen); else every one of ``configurations()``."""
    import cutlass

    from layouts import attention_bwd_prepost as tiling
    from ops._compile import cute_dtype

    from ..arch import settings
    from ..compile_check import Config, widest_vec

    if quick:
        keys = []
        for (_, _, _, d), dtype_name in settings(arch).ATTN_BWD_PREPROCESS["quick"]:
            dtype = cute_dtype(getattr(torch, dtype_name))
            vec = widest_vec(d, dtype.width, tiling.MAX_VECTOR_BITS)
            keys += _keys(dtype, tiling.head_dim_rounded(d), vec, False, arch)
    else:
        keys = [k for name, *c in configurations() for k in _keys(getattr(cutlass, name), *c, arch)]
    return [Config(f"ops.attention_bwd_prepost:{cache}", key) for cache, key in dict.fromkeys(keys)]


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
