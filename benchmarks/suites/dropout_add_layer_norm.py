"""Suite dropout_add_layer_norm: the fused dropout + residual add + LayerNorm / RMSNorm, forward and
backward as a pre-norm training step calls them.

Cases (``DROPOUT_ADD_LAYER_NORM`` in ``benchmarks/arch/*.py``): ``ROWSxN:dtype:layer|rms``; x and
the residual in that dtype, p = 0.1, prenorm (y and r both used). A timed call sets the leaves'
``.grad`` to None, runs the forward on x, residual, weight (and bias) that require gradients and
the backward from dy and dr:

- ``ours``: ``ops.dropout_add_layer_norm`` / ``dropout_add_rms_norm`` (fp32 weight and bias; one
  forward kernel, one backward row kernel and the fold of dweight / dbias);
- ``torch``: ``F.dropout(x) + residual`` then ``F.layer_norm`` / ``F.rms_norm`` (weight and bias
  in x's dtype, as torch's kernels require);
- ``torch.compile``: the same function under ``torch.compile`` (forward and backward graphs);
- ``copy``: a device copy of the same bytes.

Ours is checked first against fp64 autograd over the keep mask it returns (y, r, dx, dresidual).
Bytes: x and the residual read, y and r written by the forward; r, dy and dr read, dx and
dresidual written by the backward (the mask bits, statistics and parameters are small).
"""

from __future__ import annotations

import torch

from .layer_norm_fwd import EPS, case_name, runs

NAME = "dropout_add_layer_norm"
P = 0.1


def _inputs(shape, dtype_name, kind, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    m, n = shape
    x = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    res = (torch.randn(m, n, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
    w = torch.randn(n, device="cuda", generator=gen)
    b = torch.randn(n, device="cuda", generator=gen) if kind == "layer" else None
    return x, res, w, b


def _ours(kind):
    import ops

    fn = ops.dropout_add_layer_norm if kind == "layer" else ops.dropout_add_rms_norm

    def call(x, res, w, b, mask=False):
        return fn(x, res, w, b, P, EPS, prenorm=True, return_dropout_mask=mask)

    return call


def _torch(kind, n):
    def call(x, res, w, b):
        r = torch.nn.functional.dropout(x, P) + res
        if kind == "layer":
            return torch.nn.functional.layer_norm(r, (n,), w, b, EPS), r
        return torch.nn.functional.rms_norm(r, (n,), w, EPS), r

    return call


def _step(fn, x, res, w, b, dy, dr):
    leaves = [t.detach().requires_grad_() for t in (x, res, w, b) if t is not None]

    def call():
        for t in leaves:
            t.grad = None
        y, r = fn(*leaves) if b is not None else fn(*leaves, None)
        torch.autograd.backward([y, r], [dy, dr])

    return call


def _check(kind, x, res, w, b, dy, dr, name):
    """Ours against fp64 autograd over the mask it drew; raises when wrong."""
    from ops.dropout_bias_forward import unpack_mask

    k = min(x.shape[0], 2048)
    leaves = [t[:k].detach().requires_grad_() for t in (x, res)] + [w, b]
    y, r, bits = _ours(kind)(*leaves, mask=True)
    torch.autograd.backward([y, r], [dy[:k], dr[:k]])
    keep = unpack_mask(bits, x.shape[-1])
    ref = [t.detach().double().requires_grad_() for t in leaves[:2]]
    r64 = ref[0] * keep / (1 - P) + ref[1]
    n = x.shape[-1]
    bd = None if b is None else b.double()
    if kind == "layer":
        y64 = torch.nn.functional.layer_norm(r64, (n,), w.double(), bd, EPS)
    else:
        y64 = torch.nn.functional.rms_norm(r64, (n,), w.double(), EPS)
    torch.autograd.backward([y64, r64], [dy[:k].double(), dr[:k].double()])
    rel = lambda a, e: ((a.double() - e).norm() / e.norm()).item()  # noqa: E731
    errs = {"y": rel(y, y64), "r": rel(r, r64), "dx": rel(leaves[0].grad, ref[0].grad)}
    errs["dresidual"] = rel(leaves[1].grad, ref[1].grad)
    if not all(e < 2e-2 for e in errs.values()):
        raise RuntimeError(f"{name}: wrong result, {errs}")


def run(settings, quick: bool):
    from ..timing import time_case

    rows_out = []
    for shape, dtype_name, kind in settings.DROPOUT_ADD_LAYER_NORM["quick" if quick else "full"]:
        name = case_name(shape, dtype_name, kind)
        x, res, w, b = _inputs(shape, dtype_name, kind)
        dy, dr = torch.randn_like(x), torch.randn_like(x)
        m, n = shape
        nbytes = 9 * m * n * x.element_size()
        _check(kind, x, res, w, b, dy, dr, name)

        ref = _torch(kind, n)
        wt = w.to(x.dtype)
        bt = None if b is None else b.to(x.dtype)
        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled = torch.compile(ref, dynamic=False)
        impls = {
            "ours": _step(_ours(kind), x, res, w, b, dy, dr),
            "torch": _step(ref, x, res, wt, bt, dy, dr),
            "torch.compile": _step(compiled, x, res, wt, bt, dy, dr),
        }
        impls = {k: f for k, f in impls.items() if runs(f"{name} {k}", f)}
        rows_out += time_case(NAME, name, impls, nbytes)
    return rows_out


def _configs(n: int, dtype, kind: str, arch: str):
    """What ``ours`` compiles for a case (x, residual, r, dy, dr of ``dtype``; fp32 weight, and
    bias for LayerNorm; p > 0, no x_bias), keyed as ``ops.dropout_add_norm_kernels`` keys them."""
    import cutlass

    from cute_kernels.layer_norm import config as ln_config
    from cute_kernels.layer_norm.dropout_add import DropoutAdd
    from layouts import layer_norm as tiling

    from ..compile_check import Config

    f32 = cutlass.Float32
    rms = kind == "rms"
    b_dt = None if rms else f32
    vec = tiling.widest_vec(n, dtype.width)
    try:
        t = ln_config.ln_fwd_tiles(n, dtype.width, 32 if rms else 64, vec, arch, dtype.width)
    except NotImplementedError:
        return []
    tb = ln_config.ln_bwd_tiles(
        n, dtype.width, dtype.width, 32, vec, arch, num_partials=1 if rms else 2, extra_bits=dtype.width
    )
    fwd = DropoutAdd(dtype, dtype, dtype, None, True)
    bwd = DropoutAdd(dtype, dtype, dtype, None, True, dtype)
    return [
        Config("ops.norm_forward:compiled", (dtype, f32, b_dt, t, rms, arch, fwd, False)),
        Config("ops.norm:compiled", (dtype, dtype, f32, tb, rms, True, not rms, arch, bwd)),
        Config(
            "ops.norm:compiled_finalize",
            (f32, dtype if rms else f32, ln_config.finalize_tiles(n), True, not rms, arch, None),
        ),
    ]


def compile_configs(arch: str, quick: bool):
    """The forward's, the backward's and the finalize's configurations of the cases (quick: the quick ones)."""
    from ops._compile import cute_dtype

    from ..arch import settings

    configs = []
    for (_, n), name, kind in settings(arch).DROPOUT_ADD_LAYER_NORM["quick" if quick else "full"]:
        configs += _configs(n, cute_dtype(getattr(torch, name)), kind, arch)
    return list(dict.fromkeys(configs))


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
