"""Suite layer_norm_bwd: LayerNorm backward (dX, dgamma, dbeta complete, finalize included).

Peers in the same run: torch (autograd of F.layer_norm, weight in x's dtype as torch
requires), quack's ``layernorm_bwd`` (fp32 weight, its partial sums reduced by torch
as quack does), and a device copy moving the same number of bytes.
Bytes counted as the peers count them: x and dz read, dX written (the vectors are small).
"""

from __future__ import annotations

import torch

NAME = "layer_norm_bwd"


def _case_name(shape, dtype):
    return f"{shape[0]}x{shape[1]}:{dtype}"


def run(settings, quick: bool):
    import ops
    from ops.reference import norm_backward_ref

    from ..timing import time_case

    try:
        from quack.rmsnorm import layernorm_bwd as quack_layernorm_bwd
    except ImportError:  # quack-kernels not installed: the row is left out, not faked
        quack_layernorm_bwd = None

    rows_out = []
    eps = 1e-5
    for shape, dtype_name in settings.LAYER_NORM_BWD["quick" if quick else "full"]:
        dtype = getattr(torch, dtype_name)
        m, n = shape
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        dz = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=torch.float32)
        b = torch.randn(n, device="cuda", dtype=torch.float32)
        var, mean = torch.var_mean(x.float(), -1, correction=0)
        rstd = torch.rsqrt(var + eps)
        nbytes = 3 * m * n * x.element_size()

        # correctness first, on these inputs (a slice of rows for dX; all rows for dW, dB)
        dx, dw, db = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
        k = min(m, 4096)
        rdx, _, _ = norm_backward_ref(dz[:k], x[:k], w, mean[:k], rstd[:k], True)
        rdw = (dz.float() * ((x.float() - mean[:, None]) * rstd[:, None])).sum(0)
        rdb = dz.float().sum(0)
        errs = [
            ((a.double() - r.double()).norm() / r.double().norm()).item()
            for a, r in ((dx[:k], rdx), (dw, rdw), (db, rdb))
        ]
        if not all(e < 1e-2 for e in errs):
            raise RuntimeError(f"{_case_name(shape, dtype_name)}: wrong result, rel err dX/dW/dB {errs}")

        xr = x.detach().requires_grad_()
        wr = w.to(dtype).requires_grad_()
        br = b.to(dtype).requires_grad_()
        y = torch.nn.functional.layer_norm(xr, (n,), wr, br, eps)
        impls = {
            "ours": lambda: ops.layer_norm_backward(dz, x, w, mean, rstd, b),
            "torch": lambda: torch.autograd.grad(y, (xr, wr, br), dz, retain_graph=True),
        }
        if quack_layernorm_bwd is not None:
            impls["quack"] = lambda: quack_layernorm_bwd(x, w, dz, rstd, mean, True)
        rows_out += time_case(NAME, _case_name(shape, dtype_name), impls, nbytes)
    return rows_out


ROW_LENGTHS = (1, 7, 64, 1000, 1024, 4096, 8192, 16384, 65536)  # the suite's and the tests' rows


def _configs(n: int, dtype, arch: str, rms: bool):
    """The backward of rows of ``n`` (x, dz: ``dtype``; weight and bias fp32) as the op
    compiles it: the LayerNorm kernel (the RMSNorm one too with ``rms``) and the finalize.
    None where the row needs clusters and ``arch`` has none."""
    import cutlass

    from cute_kernels.layer_norm import config as ln_config
    from layouts import layer_norm as tiling

    from ..compile_check import Config

    f32 = cutlass.Float32

    def tiles(partials):  # column sums kept: dgamma and dbeta (LayerNorm), dgamma (RMSNorm)
        vec = tiling.widest_vec(n, dtype.width)
        return ln_config.ln_bwd_tiles(n, dtype.width, dtype.width, f32.width, vec, arch, num_partials=partials)

    try:
        configs = [Config("ops.norm:compiled", (dtype, dtype, f32, tiles(2), False, True, True, arch))]
    except NotImplementedError:
        return None
    if rms:
        configs.append(Config("ops.norm:compiled", (dtype, dtype, f32, tiles(1), True, True, False, arch)))
    configs.append(Config("ops.norm:compiled_finalize", (f32, f32, ln_config.finalize_tiles(n), True, True, arch)))
    return configs


def compile_configs(arch: str, quick: bool):
    """The configurations for ``arch``: with ``quick``, those the quick cases run; else the
    LayerNorm and RMSNorm backwards of ROW_LENGTHS in fp32 and bf16 (each once: the
    finalize's configuration does not depend on the dtype)."""
    import cutlass

    from ops._compile import cute_dtype

    from ..arch import settings

    if quick:
        rows = [(n, cute_dtype(getattr(torch, name))) for (_, n), name in settings(arch).LAYER_NORM_BWD["quick"]]
    else:
        rows = [(n, dtype) for dtype in (cutlass.Float32, cutlass.BFloat16) for n in ROW_LENGTHS]
    configs = [c for n, dtype in rows for c in _configs(n, dtype, arch, rms=not quick) or ()]
    return list(dict.fromkeys(configs))


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
