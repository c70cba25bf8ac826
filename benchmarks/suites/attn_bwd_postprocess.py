"""Suite attn_bwd_postprocess: the attention backward's fp32 accumulators -> bf16 gradients.

Cases ``BxHxSxD:bf16:nsplitsN``: convert_dq of N split partials [N, B, S_r, H, D_r]
-> dQ [B, S, H, D]; impls ``ours`` (attention_bwd_convert_dq), ``torch`` / ``torch.compile``
(convert_dq_torch: sum, slice, scale, cast), ``copy`` (a device copy of the same bytes).
Cases ``BxHxSxD:bf16:dkv``: convert_dkv of [B, H, S_r, D_r] accumulators -> dK, dV
[B, S, H, D]; impls ``ours:convert_dkv``, ``torch`` (convert_dkv_torch), ``copy``.
Bytes counted: the used rows and columns of the accumulators read once (B S H D x 4 per
accumulator or split), the outputs written once.
"""

from __future__ import annotations

import torch

NAME = "attn_bwd_postprocess"

DTYPES = ("Float16", "BFloat16")
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # the widest vector (8)
# (head dim, vector) of odd head dims: outputs are allocated contiguous, so the head
# dim alone sets the vector
NARROW = ((1, 1), (33, 1), (98, 2), (100, 4), (255, 1))
SOFTMAX_SCALE = 0.08838834764831845  # 1 / sqrt(128)


def configurations():
    """(cutlass dtype name, padded head dim, vector, varlen): convert_dq and convert_dkv each."""
    from layouts.attention_bwd_prepost import head_dim_rounded

    pairs = [(d, 8) for d in HEAD_DIMS] + list(NARROW)
    return [
        (dtype, head_dim_rounded(d), vec, varlen) for dtype in DTYPES for d, vec in pairs for varlen in (False, True)
    ]


def clear_configurations():
    """Padded head dims of clear_dkv_accum (its only compile key besides the arch)."""
    return HEAD_DIMS


SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _case_name(shape, dtype, tag):
    return "x".join(map(str, shape)) + f":{SHORT[dtype]}:{tag}"


def _check(name, got, ref):
    err = ((got.double() - ref).norm() / ref.norm()).item()
    if got.isnan().any() or not err < 1e-2:
        raise RuntimeError(f"{name}: wrong result, rel err {err}")


def run(settings, quick: bool):
    from ops.attention_bwd_prepost import (
        attention_bwd_convert_dkv,
        attention_bwd_convert_dq,
        dkv_accum_shape,
        dq_accum_shape,
    )
    from ops.reference import (
        convert_dkv_ref,
        convert_dkv_torch,
        convert_dq_ref,
        convert_dq_torch,
    )

    from ..timing import time_case

    rows_out = []
    scale = SOFTMAX_SCALE
    for shape, dtype_name, nsplits_list in settings.ATTN_BWD_POSTPROCESS["quick" if quick else "full"]:
        b, h, s, d = shape
        dtype = getattr(torch, dtype_name)
        esize = torch.empty((), dtype=dtype).element_size()
        used = b * s * h * d  # elements of one accumulator (or split) that reach the output

        for nsplits in nsplits_list:
            case = _case_name(shape, dtype_name, f"nsplits{nsplits}")
            acc = torch.randn(dq_accum_shape(b, s, h, d, nsplits=nsplits), device="cuda")
            nbytes = used * (4 * nsplits + esize)
            got = attention_bwd_convert_dq(acc, scale, head_dim=d, seqlen_q=s, dtype=dtype)
            _check(case, got, convert_dq_ref(acc, scale, head_dim=d, seqlen_q=s))
            del got

            torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
            compiled_torch = torch.compile(convert_dq_torch, dynamic=False)
            impls = {
                "ours": lambda: attention_bwd_convert_dq(acc, scale, head_dim=d, seqlen_q=s, dtype=dtype),
                "torch": lambda: convert_dq_torch(acc, scale, s, d, dtype),
                "torch.compile": lambda: compiled_torch(acc, scale, s, d, dtype),
            }
            rows_out += time_case(NAME, case, impls, nbytes)

        case = _case_name(shape, dtype_name, "dkv")
        dk_acc = torch.randn(dkv_accum_shape(b, h, s, d), device="cuda")
        dv_acc = torch.randn(dkv_accum_shape(b, h, s, d), device="cuda")
        nbytes = 2 * used * (4 + esize)
        dk, dv = attention_bwd_convert_dkv(dk_acc, dv_acc, scale, head_dim=d, seqlen_k=s, dtype=dtype)
        ref_dk, ref_dv = convert_dkv_ref(dk_acc, dv_acc, scale, head_dim=d, seqlen_k=s)
        _check(f"{case} dK", dk, ref_dk)
        _check(f"{case} dV", dv, ref_dv)
        del dk, dv, ref_dk, ref_dv
        impls = {
            "ours:convert_dkv": lambda: attention_bwd_convert_dkv(
                dk_acc, dv_acc, scale, head_dim=d, seqlen_k=s, dtype=dtype
            ),
            "torch": lambda: convert_dkv_torch(dk_acc, dv_acc, scale, s, d, dtype),
        }
        rows_out += time_case(NAME, case, impls, nbytes)
    return rows_out


def compile_configs(arch: str, quick: bool):
    """The configurations for ``arch``: with ``quick``, convert_dq and convert_dkv as the quick
    cases run them (contiguous, no varlen; the split count is a runtime argument); else both
    for every one of ``configurations()`` and the accumulator clears."""
    import cutlass

    from layouts import attention_bwd_prepost as tiling
    from ops._compile import cute_dtype

    from ..arch import settings
    from ..compile_check import Config, widest_vec

    if quick:
        rows = []
        for (_, _, _, d), dtype_name, _ in settings(arch).ATTN_BWD_POSTPROCESS["quick"]:
            dtype = cute_dtype(getattr(torch, dtype_name))
            vec = widest_vec(d, dtype.width, tiling.MAX_VECTOR_BITS)
            rows.append((dtype, tiling.head_dim_rounded(d), vec, False))
        clears = ()
    else:
        rows = [(getattr(cutlass, name), hd, vec, varlen) for name, hd, vec, varlen in configurations()]
        clears = clear_configurations()
    keys = [(cache, row + (arch,)) for row in rows for cache in ("compiled_convert_dq", "compiled_convert_dkv")]
    keys += [("compiled_clear_dkv_accum", (hd, arch)) for hd in clears]
    return [Config(f"ops.attention_bwd_prepost:{cache}", key) for cache, key in dict.fromkeys(keys)]


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
