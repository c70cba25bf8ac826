"""Suite norm_train: LayerNorm / RMSNorm forward + backward as a training step calls them,
through each implementation's public autograd entry.

Cases (``NORM_TRAIN`` in ``benchmarks/arch/*.py``, ``layer_norm_fwd``'s): ``ROWSxN:dtype:layer|rms``.
A timed call sets the leaves' ``.grad`` to None, runs the forward on x, weight (and bias) that
require gradients and ``y.backward(dy)``:

- ``ours``: ``ops.layer_norm`` / ``ops.rms_norm`` (fp32 weight and bias; our forward and backward);
- ``quack``: ``quack.rmsnorm.rmsnorm`` (its autograd Function; RMSNorm cases only: quack has no
  LayerNorm autograd entry);
- ``torch``: ``F.layer_norm`` / ``F.rms_norm`` (weight and bias in x's dtype, as torch's kernels
  require);
- ``torch.compile``: the same function under ``torch.compile`` (forward and backward graphs);
- ``copy``: a device copy of the same bytes.

Ours is checked first against fp64 autograd (dx, dweight, dbias). Bytes: x read and y written
by the forward, x and dy read and dx written by the backward.
"""

from __future__ import annotations

import torch

from .layer_norm_fwd import EPS, case_name, forward_configs, inputs, ours_fn, runs, torch_fn

NAME = "norm_train"


def _step(fn, x, w, b, dy):
    """The timed call and its (dx, dw, db), run once."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]

    def call():
        for t in leaves:
            t.grad = None
        y = fn(*leaves) if b is not None else fn(*leaves, None)
        y.backward(dy)

    return call, leaves


def _check(ours, x, w, b, dy, name):
    call, leaves = _step(ours, x, w, b, dy)
    call()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    x64, w64 = ref[0], ref[1]
    if b is not None:
        y = torch.nn.functional.layer_norm(x64, (x.shape[-1],), w64, ref[2], EPS)
    else:
        y = torch.nn.functional.rms_norm(x64, (x.shape[-1],), w64, EPS)
    y.backward(dy.double())
    errs = [((t.grad.double() - r.grad).norm() / r.grad.norm()).item() for t, r in zip(leaves, ref)]
    if not all(e < 1e-2 for e in errs):
        raise RuntimeError(f"{name}: wrong gradients, rel err dx/dw(/db) {errs}")


def run(settings, quick: bool):
    from ..timing import time_case

    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm
    except ImportError:  # quack-kernels not installed: the row is left out, not faked
        quack_rmsnorm = None

    rows_out = []
    for shape, dtype_name, kind in settings.NORM_TRAIN["quick" if quick else "full"]:
        name = case_name(shape, dtype_name, kind)
        x, w, b = inputs(shape, dtype_name, kind)
        dy = torch.randn_like(x)
        m, n = shape
        nbytes = 5 * m * n * x.element_size()
        ours, ref = ours_fn(kind, n), torch_fn(kind, n)
        _check(ours, x, w, b, dy, name)

        wt = w.to(x.dtype)
        bt = None if b is None else b.to(x.dtype)
        torch._dynamo.reset()  # a fresh graph per case: no recompile limit, no guards shared
        compiled = torch.compile(ref, dynamic=False)
        impls = {
            "ours": _step(ours, x, w, b, dy)[0],
            "torch": _step(ref, x, wt, bt, dy)[0],
            "torch.compile": _step(compiled, x, wt, bt, dy)[0],
        }
        if quack_rmsnorm is not None and kind == "rms":
            impls["quack"] = _step(lambda x, w, b: quack_rmsnorm(x, w, eps=EPS), x, w, None, dy)[0]
        impls = {k: f for k, f in impls.items() if runs(f"{name} {k}", f)}
        rows_out += time_case(NAME, name, impls, nbytes)
    return rows_out


def _backward_configs(n: int, dtype, kind: str, arch: str):
    """The backward ``ours`` compiles for the case (fp32 weight, and bias for LayerNorm): the row
    kernel and the finalize, keyed as ``ops.norm`` keys them."""
    import cutlass

    from cute_kernels.layer_norm import config as ln_config
    from layouts import layer_norm as tiling

    from ..compile_check import Config

    f32 = cutlass.Float32
    rms = kind == "rms"
    vec = tiling.widest_vec(n, dtype.width)
    t = ln_config.ln_bwd_tiles(n, dtype.width, dtype.width, 32, vec, arch, num_partials=1 if rms else 2)
    return [
        Config("ops.norm:compiled", (dtype, dtype, f32, t, rms, True, not rms, arch)),
        Config(
            "ops.norm:compiled_finalize", (f32, dtype if rms else f32, ln_config.finalize_tiles(n), True, not rms, arch)
        ),
    ]


def compile_configs(arch: str, quick: bool):
    """The forward's and the backward's configurations of the cases (quick: the quick ones)."""
    from ops._compile import cute_dtype

    from ..arch import settings

    configs = []
    for (_, n), name, kind in settings(arch).NORM_TRAIN["quick" if quick else "full"]:
        dtype = cute_dtype(getattr(torch, name))
        fwd = forward_configs(n, dtype, kind, arch)
        if fwd is not None:
            configs += fwd + _backward_configs(n, dtype, kind, arch)
    return list(dict.fromkeys(configs))


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
