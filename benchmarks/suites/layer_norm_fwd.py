"""Suite layer_norm_fwd: the LayerNorm / RMSNorm forward (y and the saved fp32 statistics).

Cases (``LAYER_NORM_FWD`` in ``benchmarks/arch/*.py``): ``ROWSxN:dtype:layer|rms``. Each
implementation through its public entry under ``torch.no_grad()``:

- ``ours``: ``ops.layer_norm`` / ``ops.rms_norm`` (weight and bias fp32; our forward kernel,
  which also stores mean / rstd);
- ``quack``: ``quack.rmsnorm.layernorm_fwd`` (fp32 weight and bias, as it requires; mean and
  rstd returned) / ``rmsnorm_fwd`` (rstd stored);
- ``torch``: ``F.layer_norm`` / ``F.rms_norm`` (weight and bias in x's dtype: torch's CUDA
  kernels refuse the mix);
- ``torch.compile``: the same function under ``torch.compile`` (one graph per case);
- ``copy``: a device copy of the same bytes.

Checked first against an fp64 reference (y, mean, rstd; ours timed only when right). Bytes
counted as the peers count them: x read and y written (the statistics and parameters are small).
"""

from __future__ import annotations

import torch

NAME = "layer_norm_fwd"
EPS = 1e-5
ROW_LENGTHS = (1, 7, 64, 1000, 1024, 4096, 8192, 16384, 65536, 131072)  # the full compile list


def case_name(shape, dtype, kind):
    return f"{shape[0]}x{shape[1]}:{dtype}:{kind}"


def inputs(shape, dtype_name, kind, seed=0):
    """x, fp32 weight, fp32 bias (None for RMSNorm) of a case."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    m, n = shape
    x = (torch.randn(m, n, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
    w = torch.randn(n, device="cuda", generator=gen)
    b = torch.randn(n, device="cuda", generator=gen) if kind == "layer" else None
    return x, w, b


def torch_fn(kind, n):
    """torch's functional forward of ``kind`` over rows of ``n``."""
    if kind == "layer":
        return lambda x, w, b: torch.nn.functional.layer_norm(x, (n,), w, b, EPS)
    return lambda x, w, b: torch.nn.functional.rms_norm(x, (n,), w, EPS)


def ours_fn(kind, n):
    import ops

    if kind == "layer":
        return lambda x, w, b: ops.layer_norm(x, n, w, b, EPS)
    return lambda x, w, b: ops.rms_norm(x, n, w, EPS)


def _reference(x, w, b, kind):
    """y, mean (None for RMSNorm), rstd in fp64."""
    x64 = x.double()
    if kind == "layer":
        var, mean = torch.var_mean(x64, -1, correction=0)
    else:
        var, mean = x64.square().mean(-1), None
    rstd = torch.rsqrt(var + EPS)
    y = (x64 if mean is None else x64 - mean[:, None]) * rstd[:, None] * w.double()
    return (y if b is None else y + b.double()), mean, rstd


def _rel(a, r) -> float:
    return ((a.double() - r).norm() / r.norm()).item()


def check(x, w, b, kind, name):
    """Our y, mean, rstd against the fp64 reference on a slice of rows; raises when wrong."""
    from ops import norm_forward

    k = min(x.shape[0], 4096)
    y, mean, rstd = norm_forward.forward(x[:k], w, b, EPS, kind == "rms")
    ry, rmean, rrstd = _reference(x[:k], w, b, kind)
    errs = {"y": _rel(y, ry), "rstd": _rel(rstd, rrstd)}
    if rmean is not None:
        errs["mean"] = (mean.double() - rmean).abs().max().item() / rrstd.reciprocal().max().item()
    tol = {"y": 1e-2 if x.dtype != torch.float32 else 1e-5, "rstd": 1e-5, "mean": 1e-5}
    if not all(e < tol[key] for key, e in errs.items()):
        raise RuntimeError(f"{name}: wrong result, {errs}")


def _quack():
    try:
        from quack.rmsnorm import layernorm_fwd, rmsnorm_fwd
    except ImportError:  # quack-kernels not installed: the row is left out, not faked
        return None
    return layernorm_fwd, rmsnorm_fwd


def runs(name, fn) -> bool:
    """Whether ``fn()`` runs (a peer that refuses a case loses its row, with the reason printed)."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001 - a peer's own refusal, reported
        print(f"{name}: left out ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return False


def run(settings, quick: bool):
    from ..timing import time_case

    quack = _quack()
    rows_out = []
    for shape, dtype_name, kind in settings.LAYER_NORM_FWD["quick" if quick else "full"]:
        name = case_name(shape, dtype_name, kind)
        x, w, b = inputs(shape, dtype_name, kind)
        m, n = shape
        nbytes = 2 * m * n * x.element_size()
        check(x, w, b, kind, name)

        ours, ref = ours_fn(kind, n), torch_fn(kind, n)
        wt = w.to(x.dtype)
        bt = None if b is None else b.to(x.dtype)
        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled = torch.compile(ref, dynamic=False)
        impls = {
            "ours": lambda: ours(x, w, b),
            "torch": lambda: ref(x, wt, bt),
            "torch.compile": lambda: compiled(x, wt, bt),
        }
        if quack is not None:
            if kind == "layer":
                impls["quack"] = lambda: quack[0](x, w, b, EPS, return_rstd=True, return_mean=True)
            else:
                impls["quack"] = lambda: quack[1](x, w, eps=EPS, store_rstd=True)
        with torch.no_grad():
            impls = {k: f for k, f in impls.items() if runs(f"{name} {k}", f)}
            rows_out += time_case(NAME, name, impls, nbytes)
    return rows_out


def forward_configs(n: int, dtype, kind: str, arch: str):
    """The forward ``ours`` compiles for rows of ``n`` (x ``dtype``, fp32 weight, fp32 bias
    for LayerNorm); None where the row needs clusters and ``arch`` has none."""
    import cutlass

    from cute_kernels.layer_norm import config as ln_config
    from layouts import layer_norm as tiling

    from ..compile_check import Config

    f32 = cutlass.Float32
    b_dt = f32 if kind == "layer" else None
    param_bits = 32 + (32 if b_dt is not None else 0)
    try:
        t = ln_config.ln_fwd_tiles(n, dtype.width, param_bits, tiling.widest_vec(n, dtype.width), arch)
    except NotImplementedError:
        return None
    return [Config("ops.norm_forward:compiled", (dtype, f32, b_dt, t, kind == "rms", arch))]


def compile_configs(arch: str, quick: bool):
    """The configurations for ``arch``: with ``quick``, those the quick cases run; else the
    LayerNorm and RMSNorm forwards of ROW_LENGTHS in fp32 and bf16."""
    import cutlass

    from ops._compile import cute_dtype

    from ..arch import settings

    if quick:
        rows = [
            (n, cute_dtype(getattr(torch, name)), kind) for (_, n), name, kind in settings(arch).LAYER_NORM_FWD["quick"]
        ]
    else:
        rows = [
            (n, d, kind) for d in (cutlass.Float32, cutlass.BFloat16) for n in ROW_LENGTHS for kind in ("layer", "rms")
        ]
    configs = [c for n, dtype, kind in rows for c in forward_configs(n, dtype, kind, arch) or ()]
    return list(dict.fromkeys(configs))


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
