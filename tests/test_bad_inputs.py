"""Every public op refuses bad inputs with a clear error naming the argument, before any launch.

One table per op in ``ops.__all__``: wrong device, dtype, rank, shapes that disagree,
layouts the kernels cannot read, head dims over the limit, probabilities outside
[0, 1), malformed cu_seqlens, empty tensors where they are not allowed, wrong weight
shapes... Each case changes one thing in inputs that pass validation (``GOOD`` shows
that they do), so it fails for its own reason.

The CUDA tensors are FakeTensorMode tensors on device "cuda": validation sees real
metadata, nothing runs, and the cases run on CPU-only machines. Cases that need real
values or addresses (cu_seqlens contents, misaligned pointers) are marked ``gpu``.

"Before any launch" is enforced, not hoped for: while a case runs, the compile caches,
every launch through a memoised launch plan (whose compiled functions skip the compile
caches once cached) and each op's first step after validation (its custom op, its
implementation, torch's forward for the autograd ops) raise ``_Reached`` instead, which no
case expects.
"""

import re
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
import ops.attention as A
from ops import attention_sdpa as SD
import ops.attention_bwd_prepost as P
import ops.context_parallel as CPA
import ops.dropout_bias as D
import ops.norm as N
import ops.norm_forward as NF
from ops import _compile as cc

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I32, I64, BOOL = torch.int32, torch.int64, torch.bool


class _Reached(Exception):
    """Validation let the call through to the op's launch path."""


# ------------------------------------------------------------------------- builders
# Called inside FakeTensorMode (or, for gpu cases, with a real GPU): device="cuda" is fine.


def fc(*shape, dtype=BF16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def f32(*shape):
    return fc(*shape, dtype=F32)


def cpu(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=dtype)


def strided(shape, stride, dtype=BF16):
    return torch.empty_strided(shape, stride, device="cuda", dtype=dtype)


def cu(*lengths, dtype=I32):
    """cu_seqlens of ``lengths`` (fake: shape only; real: the offsets)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, device="cuda", dtype=dtype)


def misaligned(*shape):
    """A fp32 CUDA tensor whose data pointer is 4 bytes past a 16-byte boundary (real GPU only)."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + 4, device="cuda", dtype=F32)[1 : n + 1].view(shape)


def _call(fn, **defaults):
    """A builder: keyword overrides on top of inputs that pass validation; returns the call."""

    def build(**kw):
        args = {k: v() if callable(v) else v for k, v in defaults.items()}  # fresh tensors in the current mode
        args.update(kw)
        return lambda: fn(**args)

    return build


db = _call(ops.dropout_bias_backward, grad_out=lambda: fc(4, 8), mask=lambda: fc(4, 8, dtype=BOOL), p=0.1)
db_act = _call(
    ops.dropout_bias_backward,
    grad_out=lambda: fc(4, 8),
    mask=lambda: fc(4, 8, dtype=BOOL),
    p=0.1,
    x=lambda: fc(4, 8),
    bias=lambda: fc(8),
    activation="gelu",
)
bd = _call(ops.bias_dropout, x=lambda: fc(4, 8), bias=lambda: fc(8), p=0.1)
lnb = _call(
    ops.layer_norm_backward,
    grad_out=lambda: fc(4, 8),
    x=lambda: fc(4, 8),
    weight=lambda: f32(8),
    mean=lambda: f32(4),
    rstd=lambda: f32(4),
    bias=lambda: f32(8),
)
rnb = _call(
    ops.rms_norm_backward, grad_out=lambda: fc(4, 8), x=lambda: fc(4, 8), weight=lambda: fc(8), rstd=lambda: f32(4)
)
ln = _call(ops.layer_norm, x=lambda: fc(4, 8), normalized_shape=8, weight=lambda: fc(8), bias=lambda: fc(8))
rn = _call(ops.rms_norm, x=lambda: fc(4, 8), normalized_shape=(8,), weight=lambda: fc(8))
pre = _call(ops.attention_bwd_preprocess, out=lambda: fc(2, 77, 3, 64), grad_out=lambda: fc(2, 77, 3, 64))
pre_var = _call(
    ops.attention_bwd_preprocess,
    out=lambda: fc(30, 3, 64),
    grad_out=lambda: fc(30, 3, 64),
    cu_seqlens_q=lambda: cu(10, 20),
    max_seqlen_q=20,
)
delta = _call(ops.attention_bwd_compute_delta, out=lambda: fc(2, 77, 3, 64), grad_out=lambda: fc(2, 77, 3, 64))
delta_var = _call(
    ops.attention_bwd_compute_delta,
    out=lambda: fc(30, 3, 64),
    grad_out=lambda: fc(30, 3, 64),
    cu_seqlens_q=lambda: cu(10, 20),
    max_seqlen_q=20,
)
cdq = _call(
    ops.attention_bwd_convert_dq, dq_accum=lambda: f32(2, 128, 3, 64), softmax_scale=0.125, head_dim=64, seqlen_q=77
)
cdq_var = _call(
    ops.attention_bwd_convert_dq,
    dq_accum=lambda: f32(296, 3, 64),
    softmax_scale=0.125,
    head_dim=64,
    cu_seqlens_q=lambda: cu(40),
    max_seqlen_q=40,
)
cdkv = _call(
    ops.attention_bwd_convert_dkv,
    dk_accum=lambda: f32(2, 3, 128, 64),
    dv_accum=lambda: f32(2, 3, 128, 64),
    softmax_scale=0.125,
    head_dim=64,
    seqlen_k=77,
)
clr = _call(ops.attention_bwd_clear_dkv_accum, dk_accum=lambda: f32(2, 3, 128, 64), dv_accum=lambda: f32(2, 3, 128, 64))
_EAB = dict(
    grad_out_=lambda: fc(1, 40, 2, 32),
    query=lambda: fc(1, 40, 2, 64),
    key=lambda: fc(1, 48, 2, 64),
    value=lambda: fc(1, 48, 2, 32),
    bias=None,
    out=lambda: fc(1, 40, 2, 32),
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=40,
    max_seqlen_k=48,
    logsumexp=lambda: f32(1, 2, 64),
    dropout_p=0.0,
    philox_seed=None,
    philox_offset=None,
    custom_mask_type=0,
    bias_requires_grad=False,
)
eab = _call(ops.efficient_attention_backward, **_EAB)
eab_var = _call(
    ops.efficient_attention_backward,
    **dict(
        _EAB,
        cu_seqlens_q=lambda: cu(15, 25),
        cu_seqlens_k=lambda: cu(20, 28),
        max_seqlen_q=25,
        max_seqlen_k=28,
        logsumexp=lambda: f32(2, 2, 32),
    ),
)
mea = _call(
    ops.memory_efficient_attention,
    query=lambda: fc(1, 40, 2, 64),
    key=lambda: fc(1, 48, 2, 64),
    value=lambda: fc(1, 48, 2, 32),
)
eaf = _call(
    ops.efficient_attention_forward,
    query=lambda: fc(1, 40, 2, 64),
    key=lambda: fc(1, 48, 2, 64),
    value=lambda: fc(1, 48, 2, 32),
    bias=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    custom_mask_type=0,
)
cpa = _call(
    ops.context_parallel_attention,
    query=lambda: fc(1, 64, 4, 64),
    key=lambda: fc(1, 64, 2, 64),
    value=lambda: fc(1, 64, 2, 32),
    causal=True,
)
mea_var = _call(
    ops.memory_efficient_attention,
    query=lambda: fc(1, 40, 2, 64),
    key=lambda: fc(1, 48, 2, 64),
    value=lambda: fc(1, 48, 2, 32),
    cu_seqlens_q=lambda: cu(15, 25),
    cu_seqlens_k=lambda: cu(20, 28),
    max_seqlen_q=25,
    max_seqlen_k=28,
)


def bias_dropout_module(x=None, **kw):
    return lambda: ops.BiasDropout(8, device="cuda", dtype=BF16, **kw)(fc(4, 8) if x is None else x)


def layer_norm_module(x=None, **kw):
    kw.setdefault("device", "cuda")
    return lambda: ops.LayerNorm(8, **kw)(fc(4, 8) if x is None else x)


def rms_norm_module(x=None, **kw):
    kw.setdefault("device", "cuda")
    return lambda: ops.RMSNorm(8, **kw)(fc(4, 8) if x is None else x)


def bias_dropout_p_changed():
    m = ops.BiasDropout(8, device="cuda", dtype=BF16)
    m.p = 1.0
    return lambda: m(fc(4, 8))


def sdpa_enter(**kw):
    def run():
        with ops.use_for_sdpa(**kw):
            pass

    return run


# --------------------------------------------------------------------------- tables


class Case(NamedTuple):
    op: str  # the public name in ops.__all__
    build: object  # () -> the call, built inside the tensor mode
    exc: type
    arg: str  # the offending argument, which the message must name
    detail: str  # a fragment of the message: the fault it reports
    gpu: bool = False  # needs real CUDA tensors (values, addresses)
    late: bool = False  # checked in the launch plan, after the op's entry (compiles and launches still guarded)


def C(op, desc, build, exc, arg, detail, **kw):
    return pytest.param(
        Case(op, build, exc, arg, detail, **kw), id=f"{op}/{desc}", marks=[pytest.mark.gpu] if kw.get("gpu") else []
    )


DROPOUT_BIAS_BACKWARD = [
    C(
        "dropout_bias_backward",
        "grad_out-on-cpu",
        lambda: db(grad_out=cpu(4, 8), mask=cpu(4, 8, dtype=BOOL)),
        ValueError,
        "grad_out",
        "CUDA",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-int32",
        lambda: db(grad_out=fc(4, 8, dtype=I32)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-float64",
        lambda: db(grad_out=fc(4, 8, dtype=F64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-0d",
        lambda: db(grad_out=fc(), mask=fc(dtype=BOOL)),
        ValueError,
        "grad_out",
        "at least one dimension",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-empty-last-dim",
        lambda: db(grad_out=fc(4, 0), mask=fc(4, 0, dtype=BOOL)),
        ValueError,
        "grad_out",
        "N >= 1",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-not-a-tensor",
        lambda: db(grad_out=[[1.0]]),
        TypeError,
        "grad_out",
        "torch.Tensor",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-columns-strided",
        lambda: db(grad_out=fc(8, 4).t()),
        ValueError,
        "grad_out",
        "contiguous",
    ),
    C("dropout_bias_backward", "mask-shape", lambda: db(mask=fc(4, 7, dtype=BOOL)), ValueError, "mask", "shape"),
    C("dropout_bias_backward", "mask-float", lambda: db(mask=fc(4, 8, dtype=F32)), TypeError, "mask", "dtype"),
    C("dropout_bias_backward", "mask-on-cpu", lambda: db(mask=cpu(4, 8, dtype=BOOL)), ValueError, "mask", "cpu"),
    C("dropout_bias_backward", "mask-not-a-tensor", lambda: db(mask=[1, 0]), TypeError, "mask", "torch.Tensor"),
    C(
        "dropout_bias_backward",
        "mask-columns-strided",
        lambda: db(mask=fc(8, 4, dtype=BOOL).t()),
        ValueError,
        "mask",
        "contiguous",
    ),
    C("dropout_bias_backward", "p-1", lambda: db(p=1.0), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-negative", lambda: db(p=-0.1), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-nan", lambda: db(p=float("nan")), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-str", lambda: db(p="0.1"), TypeError, "p", "float"),
    C("dropout_bias_backward", "p-bool", lambda: db(p=True), TypeError, "p", "float"),
    C(
        "dropout_bias_backward",
        "activation-unknown",
        lambda: db_act(activation="tanh"),
        ValueError,
        "activation",
        "one of",
    ),
    C(
        "dropout_bias_backward",
        "activation-without-x",
        lambda: db_act(x=None),
        ValueError,
        "x",
        "needs the pre-activation input",
    ),
    C(
        "dropout_bias_backward",
        "x-without-activation",
        lambda: db(x=fc(4, 8)),
        ValueError,
        "x",
        "only used with an activation",
    ),
    C("dropout_bias_backward", "x-dtype", lambda: db_act(x=fc(4, 8, dtype=F16)), TypeError, "x", "dtype"),
    C("dropout_bias_backward", "x-shape", lambda: db_act(x=fc(4, 9)), ValueError, "x", "shape"),
    C("dropout_bias_backward", "x-on-cpu", lambda: db_act(x=cpu(4, 8)), ValueError, "x", "cpu"),
    C("dropout_bias_backward", "bias-shape", lambda: db(bias=fc(9)), ValueError, "bias", "shape"),
    C("dropout_bias_backward", "bias-int", lambda: db(bias=fc(8, dtype=I32)), TypeError, "bias", "dtype"),
    C("dropout_bias_backward", "bias-on-cpu", lambda: db(bias=cpu(8)), ValueError, "bias", "cpu"),
    C("dropout_bias_backward", "bias-dtype-with-activation", lambda: db_act(bias=f32(8)), TypeError, "bias", "dtype"),
]

BIAS_DROPOUT = [
    C("bias_dropout", "x-on-cpu", lambda: bd(x=cpu(4, 8)), ValueError, "bias", "cpu"),
    C("bias_dropout", "x-int", lambda: bd(x=fc(4, 8, dtype=I64)), TypeError, "x", "dtype"),
    C("bias_dropout", "x-0d", lambda: bd(x=fc()), ValueError, "x", "at least one dimension"),
    C("bias_dropout", "x-not-a-tensor", lambda: bd(x=1.0), TypeError, "x", "torch.Tensor"),
    C("bias_dropout", "bias-shape", lambda: bd(bias=fc(4, 2)), ValueError, "bias", "shape"),
    C("bias_dropout", "bias-on-cpu", lambda: bd(bias=cpu(8)), ValueError, "bias", "cpu"),
    C("bias_dropout", "bias-dtype", lambda: bd(bias=f32(8)), TypeError, "bias", "dtype"),
    C("bias_dropout", "bias-not-a-tensor", lambda: bd(bias=None), TypeError, "bias", "torch.Tensor"),
    C("bias_dropout", "p-1.5", lambda: bd(p=1.5), ValueError, "p", "[0, 1)"),
    C("bias_dropout", "p-none", lambda: bd(p=None), TypeError, "p", "float"),
    C("bias_dropout", "activation-unknown", lambda: bd(activation="swish"), ValueError, "activation", "one of"),
]

BIAS_DROPOUT_MODULE = [
    C("BiasDropout", "p-1", lambda: lambda: ops.BiasDropout(8, p=1.0), ValueError, "p", "[0, 1)"),
    C("BiasDropout", "p-str", lambda: lambda: ops.BiasDropout(8, p="0.1"), TypeError, "p", "float"),
    C(
        "BiasDropout",
        "activation-unknown",
        lambda: lambda: ops.BiasDropout(8, activation="tanh"),
        ValueError,
        "activation",
        "one of",
    ),
    C("BiasDropout", "features-negative", lambda: lambda: ops.BiasDropout(-1), ValueError, "features", ">= 0"),
    C("BiasDropout", "features-float", lambda: lambda: ops.BiasDropout(8.0), TypeError, "features", "int"),
    C("BiasDropout", "x-on-cpu", lambda: bias_dropout_module(x=cpu(4, 8)), ValueError, "bias", "cpu"),
    C("BiasDropout", "x-last-dim", lambda: bias_dropout_module(x=fc(4, 9)), ValueError, "x", "last dim"),
    C("BiasDropout", "x-dtype", lambda: bias_dropout_module(x=fc(4, 8, dtype=F16)), TypeError, "x", "dtype"),
    C("BiasDropout", "p-changed-to-1", bias_dropout_p_changed, ValueError, "p", "[0, 1)"),
]

LAYER_NORM_BACKWARD = [
    C("layer_norm_backward", "x-on-cpu", lambda: lnb(x=cpu(4, 8), grad_out=cpu(4, 8)), ValueError, "x", "CUDA"),
    C("layer_norm_backward", "x-int", lambda: lnb(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("layer_norm_backward", "x-0d", lambda: lnb(x=fc(), grad_out=fc()), ValueError, "x", "at least one dimension"),
    C("layer_norm_backward", "x-empty-last-dim", lambda: lnb(x=fc(4, 0), grad_out=fc(4, 0)), ValueError, "x", "N >= 1"),
    C("layer_norm_backward", "x-columns-strided", lambda: lnb(x=fc(8, 4).t()), ValueError, "x", "contiguous"),
    C("layer_norm_backward", "grad_out-shape", lambda: lnb(grad_out=fc(4, 9)), ValueError, "grad_out", "shape"),
    C(
        "layer_norm_backward",
        "grad_out-int64",
        lambda: lnb(grad_out=fc(4, 8, dtype=I64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C("layer_norm_backward", "grad_out-on-cpu", lambda: lnb(grad_out=cpu(4, 8)), ValueError, "grad_out", "cpu"),
    C(
        "layer_norm_backward",
        "grad_out-columns-strided",
        lambda: lnb(grad_out=fc(8, 4).t()),
        ValueError,
        "grad_out",
        "contiguous",
    ),
    C(
        "layer_norm_backward",
        "grad_out-not-a-tensor",
        lambda: lnb(grad_out=None),
        TypeError,
        "grad_out",
        "torch.Tensor",
    ),
    C("layer_norm_backward", "weight-shape", lambda: lnb(weight=f32(9)), ValueError, "weight", "shape"),
    C("layer_norm_backward", "weight-2d", lambda: lnb(weight=f32(1, 8)), ValueError, "weight", "shape"),
    C("layer_norm_backward", "weight-int", lambda: lnb(weight=fc(8, dtype=I32)), TypeError, "weight", "dtype"),
    C("layer_norm_backward", "weight-on-cpu", lambda: lnb(weight=cpu(8, dtype=F32)), ValueError, "weight", "cpu"),
    C("layer_norm_backward", "weight-list", lambda: lnb(weight=[1.0] * 8), TypeError, "weight", "torch.Tensor"),
    C("layer_norm_backward", "bias-shape", lambda: lnb(bias=f32(4, 2)), ValueError, "bias", "shape"),
    C("layer_norm_backward", "bias-float64", lambda: lnb(bias=fc(8, dtype=F64)), TypeError, "bias", "dtype"),
    C("layer_norm_backward", "mean-fp16", lambda: lnb(mean=fc(4, dtype=F16)), TypeError, "mean", "float32"),
    C("layer_norm_backward", "mean-count", lambda: lnb(mean=f32(5)), ValueError, "mean", "one value per row"),
    C("layer_norm_backward", "mean-missing", lambda: lnb(mean=None), TypeError, "mean", "torch.Tensor"),
    C("layer_norm_backward", "rstd-count", lambda: lnb(rstd=f32(4, 2)), ValueError, "rstd", "one value per row"),
    C("layer_norm_backward", "rstd-on-cpu", lambda: lnb(rstd=cpu(4, dtype=F32)), ValueError, "rstd", "cpu"),
]

RMS_NORM_BACKWARD = [
    C("rms_norm_backward", "x-on-cpu", lambda: rnb(x=cpu(4, 8), grad_out=cpu(4, 8)), ValueError, "x", "CUDA"),
    C(
        "rms_norm_backward",
        "grad_out-float64",
        lambda: rnb(grad_out=fc(4, 8, dtype=F64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C("rms_norm_backward", "weight-shape", lambda: rnb(weight=fc(4)), ValueError, "weight", "shape"),
    C("rms_norm_backward", "rstd-count", lambda: rnb(rstd=f32(3)), ValueError, "rstd", "one value per row"),
    C("rms_norm_backward", "rstd-bf16", lambda: rnb(rstd=fc(4)), TypeError, "rstd", "float32"),
    C("rms_norm_backward", "rstd-missing", lambda: rnb(rstd=None), TypeError, "rstd", "torch.Tensor"),
]

LAYER_NORM = [
    C("layer_norm", "x-on-cpu", lambda: ln(x=cpu(4, 8), weight=None, bias=None), ValueError, "x", "CUDA"),
    C("layer_norm", "x-int", lambda: ln(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C(
        "layer_norm",
        "x-0d",
        lambda: ln(x=fc(), normalized_shape=None, weight=None, bias=None),
        ValueError,
        "x",
        "at least one dimension",
    ),
    C("layer_norm", "x-not-a-tensor", lambda: ln(x=[1.0] * 8, normalized_shape=None), TypeError, "x", "torch.Tensor"),
    C(
        "layer_norm",
        "normalized_shape-mismatch",
        lambda: ln(normalized_shape=(4,)),
        ValueError,
        "normalized_shape",
        "does not end with",
    ),
    C(
        "layer_norm",
        "normalized_shape-float",
        lambda: ln(normalized_shape=8.0),
        TypeError,
        "normalized_shape",
        "sequence of ints",
    ),
    C(
        "layer_norm",
        "normalized_shape-empty",
        lambda: ln(normalized_shape=()),
        ValueError,
        "normalized_shape",
        "at least one dimension",
    ),
    C("layer_norm", "weight-shape", lambda: ln(weight=fc(4)), ValueError, "weight", "shape"),
    C("layer_norm", "weight-on-cpu", lambda: ln(weight=cpu(8)), ValueError, "weight", "cpu"),
    C("layer_norm", "weight-int", lambda: ln(weight=fc(8, dtype=I32)), TypeError, "weight", "dtype"),
    C("layer_norm", "bias-shape", lambda: ln(bias=fc(9)), ValueError, "bias", "shape"),
    C("layer_norm", "eps-nan", lambda: ln(eps=float("nan")), TypeError, "eps", "finite float"),
    C("layer_norm", "eps-str", lambda: ln(eps="1e-5"), TypeError, "eps", "finite float"),
    C("layer_norm", "eps-none", lambda: ln(eps=None), TypeError, "eps", "finite float"),
]

RMS_NORM = [
    C("rms_norm", "x-on-cpu", lambda: rn(x=cpu(4, 8), weight=None), ValueError, "x", "CUDA"),
    C("rms_norm", "x-int", lambda: rn(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C(
        "rms_norm",
        "x-0d",
        lambda: rn(x=fc(), normalized_shape=None, weight=None),
        ValueError,
        "x",
        "at least one dimension",
    ),
    C(
        "rms_norm",
        "normalized_shape-mismatch",
        lambda: rn(normalized_shape=(2, 4)),
        ValueError,
        "normalized_shape",
        "does not end with",
    ),
    C(
        "rms_norm",
        "normalized_shape-str",
        lambda: rn(normalized_shape="8"),
        TypeError,
        "normalized_shape",
        "sequence of ints",
    ),
    C("rms_norm", "weight-shape", lambda: rn(weight=fc(2, 4)), ValueError, "weight", "shape"),
    C("rms_norm", "eps-inf", lambda: rn(eps=float("inf")), TypeError, "eps", "finite float"),
]

NORM_MODULES = [
    C("LayerNorm", "x-last-dim", lambda: layer_norm_module(x=fc(4, 9)), ValueError, "x", "does not end with"),
    C("LayerNorm", "x-int", lambda: layer_norm_module(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("LayerNorm", "parameters-on-cpu", lambda: layer_norm_module(device="cpu"), ValueError, "weight", "cpu"),
    C("LayerNorm", "parameters-float64", lambda: layer_norm_module(dtype=F64), TypeError, "weight", "dtype"),
    C("RMSNorm", "x-last-dim", lambda: rms_norm_module(x=fc(4, 9)), ValueError, "x", "does not end with"),
    C("RMSNorm", "x-int", lambda: rms_norm_module(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("RMSNorm", "parameters-on-cpu", lambda: rms_norm_module(device="cpu"), ValueError, "weight", "cpu"),
    C("RMSNorm", "eps-str", lambda: rms_norm_module(eps="1e-6"), TypeError, "eps", "finite float"),
]

PREPROCESS = [
    C(
        "attention_bwd_preprocess",
        "out-on-cpu",
        lambda: pre(out=cpu(2, 77, 3, 64), grad_out=cpu(2, 77, 3, 64)),
        ValueError,
        "out",
        "CUDA",
    ),
    C(
        "attention_bwd_preprocess",
        "grad_out-on-cpu",
        lambda: pre(grad_out=cpu(2, 77, 3, 64)),
        ValueError,
        "grad_out",
        "cpu",
    ),
    C(
        "attention_bwd_preprocess",
        "out-float64",
        lambda: pre(out=fc(2, 77, 3, 64, dtype=F64)),
        TypeError,
        "out",
        "dtype",
    ),
    C(
        "attention_bwd_preprocess",
        "grad_out-dtype",
        lambda: pre(grad_out=fc(2, 77, 3, 64, dtype=F16)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C(
        "attention_bwd_preprocess",
        "grad_out-shape",
        lambda: pre(grad_out=fc(2, 78, 3, 64)),
        ValueError,
        "grad_out",
        "shape",
    ),
    C(
        "attention_bwd_preprocess",
        "grad_out-not-a-tensor",
        lambda: pre(grad_out=[1.0]),
        TypeError,
        "grad_out",
        "torch.Tensor",
    ),
    C(
        "attention_bwd_preprocess",
        "out-rank-3-dense",
        lambda: pre(out=fc(77, 3, 64), grad_out=fc(77, 3, 64)),
        ValueError,
        "out",
        "[batch, seqlen, heads, head_dim]",
    ),
    C(
        "attention_bwd_preprocess",
        "out-rank-4-varlen",
        lambda: pre_var(out=fc(1, 30, 3, 64), grad_out=fc(1, 30, 3, 64)),
        ValueError,
        "out",
        "[total, heads, head_dim]",
    ),
    C(
        "attention_bwd_preprocess",
        "head-dim-300",
        lambda: pre(out=fc(2, 77, 3, 300), grad_out=fc(2, 77, 3, 300)),
        ValueError,
        "out",
        "head_dim must be in [1, 256]",
    ),
    C(
        "attention_bwd_preprocess",
        "head-dim-0",
        lambda: pre(out=fc(2, 77, 3, 0), grad_out=fc(2, 77, 3, 0)),
        ValueError,
        "out",
        "head_dim must be in [1, 256]",
    ),
    C(
        "attention_bwd_preprocess",
        "out-last-dim-strided",
        lambda: pre(out=fc(2, 77, 64, 3).transpose(-1, -2)),
        ValueError,
        "out",
        "contiguous in its last dim",
    ),
    C(
        "attention_bwd_preprocess",
        "grad_out-last-dim-strided",
        lambda: pre(grad_out=fc(2, 77, 64, 3).transpose(-1, -2)),
        ValueError,
        "grad_out",
        "contiguous in its last dim",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-int64",
        lambda: pre_var(cu_seqlens_q=cu(10, 20, dtype=I64)),
        ValueError,
        "cu_seqlens_q",
        "int32",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-2d",
        lambda: pre_var(cu_seqlens_q=cu(10, 20).view(1, 3)),
        ValueError,
        "cu_seqlens_q",
        "1-D",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-one-entry",
        lambda: pre_var(cu_seqlens_q=cu()),
        ValueError,
        "cu_seqlens_q",
        "[batch + 1]",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-on-cpu",
        lambda: pre_var(cu_seqlens_q=torch.tensor([0, 10, 30], dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "cpu",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-list",
        lambda: pre_var(cu_seqlens_q=[0, 10, 30]),
        TypeError,
        "cu_seqlens_q",
        "torch.Tensor",
    ),
    C(
        "attention_bwd_preprocess",
        "cu_seqlens_q-strided",
        lambda: pre_var(cu_seqlens_q=strided((3,), (2,), dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "contiguous",
    ),
    C(
        "attention_bwd_preprocess",
        "max_seqlen_q-missing",
        lambda: pre_var(max_seqlen_q=None),
        ValueError,
        "max_seqlen_q",
        "needs",
    ),
    C(
        "attention_bwd_preprocess",
        "max_seqlen_q-without-cu_seqlens_q",
        lambda: pre(max_seqlen_q=77),
        ValueError,
        "max_seqlen_q",
        "only used with",
    ),
    C(
        "attention_bwd_preprocess",
        "max_seqlen_q-float",
        lambda: pre_var(max_seqlen_q=20.0),
        TypeError,
        "max_seqlen_q",
        "int",
    ),
    C(
        "attention_bwd_preprocess",
        "max_seqlen_q-negative",
        lambda: pre_var(max_seqlen_q=-1),
        ValueError,
        "max_seqlen_q",
        ">= 0",
    ),
    C("attention_bwd_preprocess", "scale-nan", lambda: pre(scale=float("nan")), TypeError, "scale", "finite float"),
]

COMPUTE_DELTA = [
    C("attention_bwd_compute_delta", "out-on-cpu", lambda: delta(out=cpu(2, 77, 3, 64)), ValueError, "out", "CUDA"),
    C(
        "attention_bwd_compute_delta",
        "out-float64",
        lambda: delta(out=fc(2, 77, 3, 64, dtype=F64)),
        TypeError,
        "out",
        "dtype",
    ),
    C(
        "attention_bwd_compute_delta",
        "out-rank-5",
        lambda: delta(out=fc(1, 2, 77, 3, 64), grad_out=fc(1, 2, 77, 3, 64)),
        ValueError,
        "out",
        "[batch, seqlen, heads, head_dim]",
    ),
    C(
        "attention_bwd_compute_delta",
        "head-dim-257",
        lambda: delta(out=fc(2, 77, 3, 257), grad_out=fc(2, 77, 3, 257)),
        ValueError,
        "out",
        "head_dim must be in [1, 256]",
    ),
    C(
        "attention_bwd_compute_delta",
        "grad_out-heads",
        lambda: delta(grad_out=fc(2, 77, 4, 64)),
        ValueError,
        "grad_out",
        "shape",
    ),
    C(
        "attention_bwd_compute_delta",
        "grad_out-last-dim-strided",
        lambda: delta(grad_out=fc(2, 77, 64, 3).transpose(-1, -2)),
        ValueError,
        "grad_out",
        "contiguous",
    ),
    C(
        "attention_bwd_compute_delta",
        "cu_seqlens_q-int64",
        lambda: delta_var(cu_seqlens_q=cu(10, 20, dtype=I64)),
        ValueError,
        "cu_seqlens_q",
        "int32",
    ),
    C(
        "attention_bwd_compute_delta",
        "max_seqlen_q-missing",
        lambda: delta_var(max_seqlen_q=None),
        ValueError,
        "max_seqlen_q",
        "needs",
    ),
]

CONVERT_DQ = [
    C(
        "attention_bwd_convert_dq",
        "dq_accum-bf16",
        lambda: cdq(dq_accum=fc(2, 128, 3, 64)),
        TypeError,
        "dq_accum",
        "float32",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-on-cpu",
        lambda: cdq(dq_accum=cpu(2, 128, 3, 64, dtype=F32)),
        ValueError,
        "dq_accum",
        "CUDA",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-rank-3-dense",
        lambda: cdq(dq_accum=f32(128, 3, 64)),
        ValueError,
        "dq_accum",
        "4 or 5 dims",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-rank-5-varlen",
        lambda: cdq_var(dq_accum=f32(1, 1, 296, 3, 64)),
        ValueError,
        "dq_accum",
        "3 or 4 dims",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-last-dim-not-rounded",
        lambda: cdq(dq_accum=f32(2, 128, 3, 40), head_dim=40),
        ValueError,
        "dq_accum",
        "rounded up to 32 = 64",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-row-stride",
        lambda: cdq(dq_accum=strided((2, 128, 3, 64), (128 * 3 * 66, 3 * 66, 66, 1), dtype=F32)),
        ValueError,
        "dq_accum",
        "multiples of 4",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-last-dim-strided",
        lambda: cdq(dq_accum=f32(2, 128, 64, 3).transpose(-1, -2)),
        ValueError,
        "dq_accum",
        "contiguous",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-too-few-rows-varlen",
        lambda: cdq_var(dq_accum=f32(100, 3, 64)),
        ValueError,
        "dq_accum",
        "total_q + 128 * batch",
    ),
    C(
        "attention_bwd_convert_dq",
        "head_dim-300",
        lambda: cdq(dq_accum=f32(2, 128, 3, 320), head_dim=300),
        ValueError,
        "head_dim",
        "[1, 256]",
    ),
    C("attention_bwd_convert_dq", "head_dim-0", lambda: cdq(head_dim=0), ValueError, "head_dim", ">= 1"),
    C("attention_bwd_convert_dq", "head_dim-float", lambda: cdq(head_dim=64.0), TypeError, "head_dim", "int"),
    C("attention_bwd_convert_dq", "seqlen_q-missing", lambda: cdq(seqlen_q=None), ValueError, "seqlen_q", "required"),
    C("attention_bwd_convert_dq", "seqlen_q-past-rows", lambda: cdq(seqlen_q=200), ValueError, "seqlen_q", "rows"),
    C("attention_bwd_convert_dq", "seqlen_q-negative", lambda: cdq(seqlen_q=-3), ValueError, "seqlen_q", ">= 0"),
    C(
        "attention_bwd_convert_dq",
        "seqlen_q-with-cu_seqlens_q",
        lambda: cdq_var(seqlen_q=40),
        ValueError,
        "seqlen_q",
        "drop",
    ),
    C(
        "attention_bwd_convert_dq",
        "max_seqlen_q-without-cu_seqlens_q",
        lambda: cdq(max_seqlen_q=77),
        ValueError,
        "max_seqlen_q",
        "only used with",
    ),
    C(
        "attention_bwd_convert_dq",
        "max_seqlen_q-missing",
        lambda: cdq_var(max_seqlen_q=None),
        ValueError,
        "max_seqlen_q",
        "needs",
    ),
    C(
        "attention_bwd_convert_dq",
        "cu_seqlens_q-int64",
        lambda: cdq_var(cu_seqlens_q=cu(40, dtype=I64)),
        ValueError,
        "cu_seqlens_q",
        "int32",
    ),
    C(
        "attention_bwd_convert_dq",
        "cu_seqlens_q-on-cpu",
        lambda: cdq_var(cu_seqlens_q=torch.tensor([0, 40], dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "cpu",
    ),
    C("attention_bwd_convert_dq", "dtype-float32", lambda: cdq(dtype=F32), TypeError, "dtype", "float16 or bfloat16"),
    C("attention_bwd_convert_dq", "dtype-str", lambda: cdq(dtype="bfloat16"), TypeError, "dtype", "'bfloat16'"),
    C("attention_bwd_convert_dq", "p_dropout-1", lambda: cdq(p_dropout=1.0), ValueError, "p_dropout", "[0, 1)"),
    C(
        "attention_bwd_convert_dq",
        "softmax_scale-inf",
        lambda: cdq(softmax_scale=float("inf")),
        TypeError,
        "softmax_scale",
        "finite float",
    ),
    C(
        "attention_bwd_convert_dq",
        "dq_accum-misaligned",
        lambda: cdq(dq_accum=misaligned(2, 128, 3, 64)),
        ValueError,
        "dq_accum",
        "16-byte aligned",
        gpu=True,
        late=True,
    ),
]

CONVERT_DKV = [
    C(
        "attention_bwd_convert_dkv",
        "dk_accum-on-cpu",
        lambda: cdkv(dk_accum=cpu(2, 3, 128, 64, dtype=F32)),
        ValueError,
        "dk_accum",
        "CUDA",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dv_accum-on-cpu",
        lambda: cdkv(dv_accum=cpu(2, 3, 128, 64, dtype=F32)),
        ValueError,
        "dv_accum",
        "CUDA",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dk_accum-rank-3",
        lambda: cdkv(dk_accum=f32(3, 128, 64)),
        ValueError,
        "dk_accum",
        "4 dims",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dv_accum-shape",
        lambda: cdkv(dv_accum=f32(2, 3, 256, 64)),
        ValueError,
        "dv_accum",
        "shape",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dv_accum-fp16",
        lambda: cdkv(dv_accum=fc(2, 3, 128, 64, dtype=F16)),
        TypeError,
        "dv_accum",
        "float32",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dv_accum-last-dim",
        lambda: cdkv(dv_accum=f32(2, 3, 128, 96)),
        ValueError,
        "dv_accum",
        "rounded up to 32 = 64",
    ),
    C("attention_bwd_convert_dkv", "head_dim-300", lambda: cdkv(head_dim=300), ValueError, "head_dim", "[1, 256]"),
    C("attention_bwd_convert_dkv", "seqlen_k-past-rows", lambda: cdkv(seqlen_k=129), ValueError, "seqlen_k", "rows"),
    C("attention_bwd_convert_dkv", "seqlen_k-negative", lambda: cdkv(seqlen_k=-1), ValueError, "seqlen_k", ">= 0"),
    C("attention_bwd_convert_dkv", "seqlen_k-none", lambda: cdkv(seqlen_k=None), TypeError, "seqlen_k", "int"),
    C(
        "attention_bwd_convert_dkv",
        "cu_seqlens_k-batch",
        lambda: cdkv(cu_seqlens_k=cu(10, 20, 30), seqlen_k=60),
        ValueError,
        "cu_seqlens_k",
        "3 sequences",
    ),
    C(
        "attention_bwd_convert_dkv",
        "cu_seqlens_k-int64",
        lambda: cdkv(cu_seqlens_k=cu(10, 20, dtype=I64), seqlen_k=30),
        ValueError,
        "cu_seqlens_k",
        "int32",
    ),
    C("attention_bwd_convert_dkv", "dtype-float32", lambda: cdkv(dtype=F32), TypeError, "dtype", "float16 or bfloat16"),
    C(
        "attention_bwd_convert_dkv",
        "p_dropout-negative",
        lambda: cdkv(p_dropout=-0.5),
        ValueError,
        "p_dropout",
        "[0, 1)",
    ),
    C(
        "attention_bwd_convert_dkv",
        "softmax_scale-bool",
        lambda: cdkv(softmax_scale=True),
        TypeError,
        "softmax_scale",
        "finite float",
    ),
    C(
        "attention_bwd_convert_dkv",
        "dk_accum-misaligned",
        lambda: cdkv(dk_accum=misaligned(2, 3, 128, 64)),
        ValueError,
        "dk_accum",
        "16-byte aligned",
        gpu=True,
        late=True,
    ),
]

CLEAR_DKV_ACCUM = [
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-last-dim-40",
        lambda: clr(dk_accum=f32(2, 3, 128, 40), dv_accum=f32(2, 3, 128, 40)),
        ValueError,
        "dk_accum",
        "multiple of 32",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-last-dim-288",
        lambda: clr(dk_accum=f32(2, 3, 128, 288), dv_accum=f32(2, 3, 128, 288)),
        ValueError,
        "dk_accum",
        "[32, 256]",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-not-a-tensor",
        lambda: clr(dk_accum=3.0),
        TypeError,
        "dk_accum",
        "torch.Tensor",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dv_accum-not-a-tensor",
        lambda: clr(dv_accum=None),
        TypeError,
        "dv_accum",
        "torch.Tensor",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-bf16",
        lambda: clr(dk_accum=fc(2, 3, 128, 64)),
        TypeError,
        "dk_accum",
        "float32",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-on-cpu",
        lambda: clr(dk_accum=cpu(2, 3, 128, 64, dtype=F32)),
        ValueError,
        "dk_accum",
        "CUDA",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dv_accum-on-cpu",
        lambda: clr(dv_accum=cpu(2, 3, 128, 64, dtype=F32)),
        ValueError,
        "dv_accum",
        "CUDA",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-rank-5",
        lambda: clr(dk_accum=f32(1, 2, 3, 128, 64), dv_accum=f32(1, 2, 3, 128, 64)),
        ValueError,
        "dk_accum",
        "4 dims",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dv_accum-shape",
        lambda: clr(dv_accum=f32(2, 4, 128, 64)),
        ValueError,
        "dv_accum",
        "shape",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dk_accum-row-stride",
        lambda: clr(dk_accum=strided((2, 3, 128, 64), (3 * 128 * 66, 128 * 66, 66, 1), dtype=F32)),
        ValueError,
        "dk_accum",
        "multiples of 4",
    ),
    C(
        "attention_bwd_clear_dkv_accum",
        "dv_accum-misaligned",
        lambda: clr(dv_accum=misaligned(2, 3, 128, 64)),
        ValueError,
        "dv_accum",
        "16-byte aligned",
        gpu=True,
        late=True,
    ),
]

EFFICIENT_ATTENTION_BACKWARD = [
    C(
        "efficient_attention_backward",
        "query-on-cpu",
        lambda: eab(query=cpu(1, 40, 2, 64)),
        ValueError,
        "query",
        "CUDA",
    ),
    C(
        "efficient_attention_backward",
        "grad_out-on-cpu",
        lambda: eab(grad_out_=cpu(1, 40, 2, 32)),
        ValueError,
        "grad_out",
        "CUDA",
    ),
    C(
        "efficient_attention_backward",
        "value-on-cpu",
        lambda: eab(value=cpu(1, 48, 2, 32)),
        ValueError,
        "value",
        "CUDA",
    ),
    C("efficient_attention_backward", "key-not-a-tensor", lambda: eab(key=None), TypeError, "key", "torch.Tensor"),
    C(
        "efficient_attention_backward",
        "query-float64",
        lambda: eab(query=fc(1, 40, 2, 64, dtype=F64)),
        TypeError,
        "query",
        "dtype",
    ),
    C(
        "efficient_attention_backward",
        "key-dtype",
        lambda: eab(key=fc(1, 48, 2, 64, dtype=F16)),
        TypeError,
        "key",
        "dtype",
    ),
    C(
        "efficient_attention_backward",
        "out-dtype",
        lambda: eab(out=fc(1, 40, 2, 32, dtype=F16)),
        TypeError,
        "out",
        "dtype",
    ),
    C("efficient_attention_backward", "query-3d", lambda: eab(query=fc(40, 2, 64)), ValueError, "query", "4-D"),
    C("efficient_attention_backward", "key-head-dim", lambda: eab(key=fc(1, 48, 2, 32)), ValueError, "key", "shape"),
    C("efficient_attention_backward", "key-heads", lambda: eab(key=fc(1, 48, 4, 64)), ValueError, "key", "shape"),
    C(
        "efficient_attention_backward",
        "value-seqlen",
        lambda: eab(value=fc(1, 47, 2, 32)),
        ValueError,
        "value",
        "shape",
    ),
    C("efficient_attention_backward", "out-head-dim", lambda: eab(out=fc(1, 40, 2, 64)), ValueError, "out", "shape"),
    C(
        "efficient_attention_backward",
        "grad_out-seqlen",
        lambda: eab(grad_out_=fc(1, 41, 2, 32)),
        ValueError,
        "grad_out",
        "shape",
    ),
    C(
        "efficient_attention_backward",
        "query-last-dim-strided",
        lambda: eab(query=strided((1, 40, 2, 64), (10240, 256, 128, 2))),
        ValueError,
        "query",
        "contiguous",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-bf16",
        lambda: eab(logsumexp=fc(1, 2, 64)),
        TypeError,
        "logsumexp",
        "float32",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-on-cpu",
        lambda: eab(logsumexp=cpu(1, 2, 64, dtype=F32)),
        ValueError,
        "logsumexp",
        "CUDA",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-2d",
        lambda: eab(logsumexp=f32(2, 64)),
        ValueError,
        "logsumexp",
        "shape",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-too-few-queries",
        lambda: eab(logsumexp=f32(1, 2, 32)),
        ValueError,
        "logsumexp",
        ">= 40",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-heads",
        lambda: eab(logsumexp=f32(1, 3, 64)),
        ValueError,
        "logsumexp",
        "shape",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-strided",
        lambda: eab(logsumexp=f32(1, 64, 2).transpose(1, 2)),
        ValueError,
        "logsumexp",
        "contiguous",
    ),
    C(
        "efficient_attention_backward",
        "bias-shape",
        lambda: eab(bias=fc(1, 2, 40, 47)),
        ValueError,
        "bias",
        "does not broadcast",
    ),
    C(
        "efficient_attention_backward",
        "bias-rank-5",
        lambda: eab(bias=fc(1, 1, 2, 40, 48)),
        ValueError,
        "bias",
        "does not broadcast",
    ),
    C(
        "efficient_attention_backward",
        "bias-dtype",
        lambda: eab(bias=fc(1, 2, 40, 48, dtype=F16)),
        TypeError,
        "bias",
        "dtype",
    ),
    C("efficient_attention_backward", "bias-on-cpu", lambda: eab(bias=cpu(1, 2, 40, 48)), ValueError, "bias", "CUDA"),
    C(
        "efficient_attention_backward",
        "bias_requires_grad-without-bias",
        lambda: eab(bias_requires_grad=True),
        ValueError,
        "bias_requires_grad",
        "needs a bias",
    ),
    C(
        "efficient_attention_backward",
        "dropout_p-0.1-without-seed",
        lambda: eab(dropout_p=0.1),
        ValueError,
        "philox_seed",
        "int64 scalar",
    ),
    C("efficient_attention_backward", "dropout_p-1", lambda: eab(dropout_p=1.0), ValueError, "dropout_p", "[0, 1)"),
    C(
        "efficient_attention_backward",
        "dropout_p-str",
        lambda: eab(dropout_p="0"),
        TypeError,
        "dropout_p",
        "finite float",
    ),
    C(
        "efficient_attention_backward",
        "custom_mask_type-3",
        lambda: eab(custom_mask_type=3),
        ValueError,
        "custom_mask_type",
        "0 (none)",
    ),
    C(
        "efficient_attention_backward",
        "custom_mask_type-bool",
        lambda: eab(custom_mask_type=True),
        ValueError,
        "custom_mask_type",
        "0 (none)",
    ),
    C(
        "efficient_attention_backward",
        "custom_mask_type-str",
        lambda: eab(custom_mask_type="1"),
        ValueError,
        "custom_mask_type",
        "0 (none)",
    ),
    C(
        "efficient_attention_backward",
        "window_size-without-causal",
        lambda: eab(window_size=8),
        ValueError,
        "window_size",
        "causal",
    ),
    C(
        "efficient_attention_backward",
        "window_size-negative",
        lambda: eab(custom_mask_type=1, window_size=-1),
        ValueError,
        "window_size",
        "non-negative",
    ),
    C(
        "efficient_attention_backward",
        "window_size-float",
        lambda: eab(custom_mask_type=1, window_size=2.5),
        ValueError,
        "window_size",
        "non-negative int",
    ),
    C(
        "efficient_attention_backward",
        "num_splits_key-0",
        lambda: eab(num_splits_key=0),
        ValueError,
        "num_splits_key",
        "positive int",
    ),
    C(
        "efficient_attention_backward",
        "num_splits_key-float",
        lambda: eab(num_splits_key=1.5),
        ValueError,
        "num_splits_key",
        "positive int",
    ),
    C("efficient_attention_backward", "scale-nan", lambda: eab(scale=float("nan")), TypeError, "scale", "finite float"),
    C(
        "efficient_attention_backward",
        "head-dim-544",
        lambda: eab(query=fc(1, 40, 2, 544), key=fc(1, 48, 2, 544)),
        NotImplementedError,
        "query",
        "512",
    ),
    C(
        "efficient_attention_backward",
        "value-head-dim-544",
        lambda: eab(value=fc(1, 48, 2, 544), out=fc(1, 40, 2, 544), grad_out_=fc(1, 40, 2, 544)),
        NotImplementedError,
        "value",
        "512",
    ),
    C(
        "efficient_attention_backward",
        "fp32-head-dim-288",
        lambda: eab(
            query=fc(1, 40, 2, 288, dtype=F32),
            key=fc(1, 48, 2, 288, dtype=F32),
            value=fc(1, 48, 2, 32, dtype=F32),
            out=fc(1, 40, 2, 32, dtype=F32),
            grad_out_=fc(1, 40, 2, 32, dtype=F32),
        ),
        NotImplementedError,
        "query",
        "256",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens_q-alone",
        lambda: eab_var(cu_seqlens_k=None),
        ValueError,
        "cu_seqlens_k",
        "together",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens-batch-2",
        lambda: eab_var(
            query=fc(2, 40, 2, 64),
            key=fc(2, 48, 2, 64),
            value=fc(2, 48, 2, 32),
            out=fc(2, 40, 2, 32),
            grad_out_=fc(2, 40, 2, 32),
        ),
        ValueError,
        "query",
        "batch",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens_q-int64",
        lambda: eab_var(cu_seqlens_q=cu(15, 25, dtype=I64)),
        ValueError,
        "cu_seqlens_q",
        "int32",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens_k-on-cpu",
        lambda: eab_var(cu_seqlens_k=torch.tensor([0, 20, 48], dtype=I32)),
        ValueError,
        "cu_seqlens_k",
        "CUDA",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens_q-strided",
        lambda: eab_var(cu_seqlens_q=strided((3,), (2,), dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "contiguous",
    ),
    C(
        "efficient_attention_backward",
        "cu_seqlens-counts-differ",
        lambda: eab_var(cu_seqlens_k=cu(20, 20, 8)),
        ValueError,
        "cu_seqlens_k",
        "same number of sequences",
    ),
    C(
        "efficient_attention_backward",
        "max_seqlen_q-missing",
        lambda: eab_var(max_seqlen_q=None),
        ValueError,
        "max_seqlen_q",
        "non-negative int",
    ),
    C(
        "efficient_attention_backward",
        "max_seqlen_k-str",
        lambda: eab_var(max_seqlen_k="28"),
        ValueError,
        "max_seqlen_k",
        "non-negative int",
    ),
    C(
        "efficient_attention_backward",
        "max_seqlen_k-negative",
        lambda: eab_var(max_seqlen_k=-1),
        ValueError,
        "max_seqlen_k",
        "non-negative int",
    ),
    C(
        "efficient_attention_backward",
        "logsumexp-sequences",
        lambda: eab_var(logsumexp=f32(1, 2, 32)),
        ValueError,
        "logsumexp",
        "shape",
    ),
    C(
        "efficient_attention_backward",
        "shared_storage_dqdkdv-lengths",
        lambda: eab(shared_storage_dqdkdv=True),
        ValueError,
        "shared_storage_dqdkdv",
        "one length",
        gpu=True,
        late=True,
    ),
    C(
        "efficient_attention_backward",
        "backend-typo",
        lambda: eab(backend="hopper"),
        ValueError,
        "backend",
        "'auto', 'sm90', 'mem_eff'",
    ),
    C("efficient_attention_backward", "backend-none", lambda: eab(backend=None), ValueError, "backend", "got None"),
    # the choice is made on the real tensors (their device's arch); Dv 32 is no head dim of the sm90 path anyway
    C(
        "efficient_attention_backward",
        "backend-sm90-dqk-ne-dv",
        lambda: eab(backend="sm90"),
        NotImplementedError,
        "backend",
        "cannot take this attention backward",
        gpu=True,
        late=True,
    ),
]

MEMORY_EFFICIENT_ATTENTION = [
    C("memory_efficient_attention", "query-on-cpu", lambda: mea(query=cpu(1, 40, 2, 64)), ValueError, "query", "CUDA"),
    C(
        "memory_efficient_attention",
        "backend-typo",
        lambda: mea(backend="sm_90a"),
        ValueError,
        "backend",
        "'auto', 'sm90', 'mem_eff'",
    ),
    C("memory_efficient_attention", "key-on-cpu", lambda: mea(key=cpu(1, 48, 2, 64)), ValueError, "key", "cpu"),
    C("memory_efficient_attention", "value-not-a-tensor", lambda: mea(value=[1.0]), TypeError, "value", "torch.Tensor"),
    C(
        "memory_efficient_attention",
        "query-int",
        lambda: mea(query=fc(1, 40, 2, 64, dtype=I32)),
        TypeError,
        "query",
        "dtype",
    ),
    C(
        "memory_efficient_attention",
        "key-dtype",
        lambda: mea(key=fc(1, 48, 2, 64, dtype=F16)),
        TypeError,
        "key",
        "dtype",
    ),
    C("memory_efficient_attention", "query-3d", lambda: mea(query=fc(40, 2, 64)), ValueError, "query", "4-D"),
    C("memory_efficient_attention", "key-heads", lambda: mea(key=fc(1, 48, 3, 64)), ValueError, "key", "shape"),
    C("memory_efficient_attention", "value-seqlen", lambda: mea(value=fc(1, 47, 2, 32)), ValueError, "value", "seqlen"),
    C(
        "memory_efficient_attention",
        "query-empty-head-dim",
        lambda: mea(query=fc(1, 40, 2, 0), key=fc(1, 48, 2, 0)),
        ValueError,
        "query",
        "head_dim >= 1",
    ),
    C(
        "memory_efficient_attention",
        "value-empty-head-dim",
        lambda: mea(value=fc(1, 48, 2, 0)),
        ValueError,
        "value",
        "head_dim >= 1",
    ),
    C(
        "memory_efficient_attention",
        "key-last-dim-strided",
        lambda: mea(key=strided((1, 48, 2, 64), (12288, 256, 128, 2))),
        ValueError,
        "key",
        "contiguous",
    ),
    C(
        "memory_efficient_attention",
        "causal-typo",
        lambda: mea(causal="bottom-right"),
        ValueError,
        "causal",
        "'bottom_right'",
    ),
    C("memory_efficient_attention", "causal-int", lambda: mea(causal=1), ValueError, "causal", "'top_left'"),
    C(
        "memory_efficient_attention",
        "window_size-without-causal",
        lambda: mea(window_size=8),
        ValueError,
        "window_size",
        "causal",
    ),
    C(
        "memory_efficient_attention",
        "window_size-negative",
        lambda: mea(causal=True, window_size=-1),
        ValueError,
        "window_size",
        ">= 0",
    ),
    C(
        "memory_efficient_attention",
        "window_size-pair-negative",
        lambda: mea(window_size=(-5, -5)),
        ValueError,
        "window_size",
        "-1 for unbounded",
    ),
    C(
        "memory_efficient_attention",
        "window_size-pair-right",
        lambda: mea(window_size=(4, 2)),
        NotImplementedError,
        "window_size",
        "past the diagonal",
    ),
    C(
        "memory_efficient_attention",
        "window_size-triple",
        lambda: mea(window_size=(4, 0, 1)),
        TypeError,
        "window_size",
        "two ints",
    ),
    C(
        "memory_efficient_attention",
        "head-dim-past-the-backward",
        lambda: mea(query=fc(1, 40, 2, 1024).requires_grad_(), key=fc(1, 48, 2, 1024), value=fc(1, 48, 2, 32)),
        NotImplementedError,
        "head",
        "up to 512",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "backend-sm90-fp32",
        lambda: mea(
            query=f32(1, 40, 2, 64).requires_grad_(), key=f32(1, 48, 2, 64), value=f32(1, 48, 2, 64), backend="sm90"
        ),
        NotImplementedError,
        "backend",
        "fp16 / bf16 only",
        gpu=True,
    ),
    C("memory_efficient_attention", "scale-str", lambda: mea(scale="0.1"), TypeError, "scale", "finite float"),
    C("memory_efficient_attention", "softcap-negative", lambda: mea(softcap=-30.0), ValueError, "softcap", "> 0"),
    C("memory_efficient_attention", "softcap-nan", lambda: mea(softcap=float("nan")), ValueError, "softcap", "finite"),
    C("memory_efficient_attention", "softcap-inf", lambda: mea(softcap=float("inf")), ValueError, "softcap", "finite"),
    C("memory_efficient_attention", "softcap-str", lambda: mea(softcap="30"), TypeError, "softcap", "got str"),
    C("memory_efficient_attention", "softcap-bool", lambda: mea(softcap=True), TypeError, "softcap", "got bool"),
    C("memory_efficient_attention", "softcap-tensor", lambda: mea(softcap=f32()), TypeError, "softcap", "Tensor"),
    C(
        "memory_efficient_attention",
        "softcap-fp32-training",
        lambda: mea(
            query=f32(1, 40, 2, 64).requires_grad_(), key=f32(1, 48, 2, 64), value=f32(1, 48, 2, 64), softcap=30.0
        ),
        NotImplementedError,
        "softcap",
        "memory-efficient backward has no softcap",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "softcap-bias-gradient",
        lambda: mea(
            query=fc(1, 40, 2, 64).requires_grad_(),
            value=fc(1, 48, 2, 64),
            attn_bias=fc(1, 2, 40, 48).requires_grad_(),
            softcap=30.0,
        ),
        NotImplementedError,
        "softcap",
        "memory-efficient backward has no softcap",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_k-alone",
        lambda: mea_var(cu_seqlens_q=None),
        ValueError,
        "cu_seqlens_q",
        "required",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_q-int64",
        lambda: mea_var(cu_seqlens_q=cu(15, 25, dtype=I64)),
        TypeError,
        "cu_seqlens_q",
        "int32",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_k-2d",
        lambda: mea_var(cu_seqlens_k=cu(20, 28).view(3, 1)),
        ValueError,
        "cu_seqlens_k",
        "1-D",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_q-one-entry",
        lambda: mea_var(cu_seqlens_q=cu(), cu_seqlens_k=cu()),
        ValueError,
        "cu_seqlens_q",
        "at least 2 entries",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_q-strided",
        lambda: mea_var(cu_seqlens_q=strided((3,), (2,), dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "contiguous",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens-counts-differ",
        lambda: mea_var(cu_seqlens_k=cu(20, 20, 8)),
        ValueError,
        "cu_seqlens_k",
        "shape",
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens-batch-2",
        lambda: mea_var(query=fc(2, 40, 2, 64), key=fc(2, 48, 2, 64), value=fc(2, 48, 2, 32)),
        ValueError,
        "query",
        "batch 1",
    ),
    C(
        "memory_efficient_attention",
        "max_seqlen_q-without-cu_seqlens",
        lambda: mea(max_seqlen_q=40),
        ValueError,
        "max_seqlen_q",
        "only used with",
    ),
    C(
        "memory_efficient_attention",
        "max_seqlen_k-0",
        lambda: mea_var(max_seqlen_k=0),
        ValueError,
        "max_seqlen_k",
        ">= 1",
    ),
    C(
        "memory_efficient_attention",
        "max_seqlen_q-float",
        lambda: mea_var(max_seqlen_q=25.0),
        TypeError,
        "max_seqlen_q",
        "int",
    ),
    C(
        "memory_efficient_attention",
        "max_seqlen_q-past-packed-length",
        lambda: mea_var(max_seqlen_q=41),
        ValueError,
        "max_seqlen_q",
        "packed length",
    ),
    C(
        "memory_efficient_attention",
        "max_seqlens-missing-when-traced",
        lambda: mea_var(max_seqlen_q=None, max_seqlen_k=None),
        ValueError,
        "max_seqlen_q",
        "required",
    ),
    C(
        "memory_efficient_attention",
        "attn_bias-shape",
        lambda: mea(attn_bias=fc(1, 2, 40, 47)),
        ValueError,
        "attn_bias",
        "does not broadcast",
    ),
    C(
        "memory_efficient_attention",
        "attn_bias-dtype",
        lambda: mea(attn_bias=fc(1, 2, 40, 48, dtype=F16)),
        TypeError,
        "attn_bias",
        "dtype",
    ),
    C(
        "memory_efficient_attention",
        "attn_bias-varlen",
        lambda: mea_var(attn_bias=fc(1, 2, 40, 48)),
        NotImplementedError,
        "attn_bias",
        "cu_seqlens",
    ),
    C(
        "memory_efficient_attention",
        "attn_bias-not-a-tensor",
        lambda: mea(attn_bias=1.0),
        TypeError,
        "attn_bias",
        "torch.Tensor",
    ),
    C("memory_efficient_attention", "dropout_p-1", lambda: mea(dropout_p=1.0), ValueError, "dropout_p", "[0, 1)"),
    C(
        "memory_efficient_attention",
        "dropout_p-str",
        lambda: mea(dropout_p="0.1"),
        TypeError,
        "dropout_p",
        "finite float",
    ),
    C(
        "memory_efficient_attention",
        "bottom-right-more-queries",
        lambda: mea(query=fc(1, 60, 2, 64), causal="bottom_right"),
        NotImplementedError,
        "causal",
        "60 > 48",
    ),
    # cu_seqlens values: read back in eager calls, so these need real CUDA tensors
    C(
        "memory_efficient_attention",
        "cu_seqlens_q-not-from-0",
        lambda: mea_var(cu_seqlens_q=torch.tensor([2, 15, 40], device="cuda", dtype=I32)),
        ValueError,
        "cu_seqlens_q",
        "start at 0",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_k-decreasing",
        lambda: mea_var(cu_seqlens_k=torch.tensor([0, 30, 20], device="cuda", dtype=I32)),
        ValueError,
        "cu_seqlens_k",
        "non-decreasing",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "cu_seqlens_q-past-packed-length",
        lambda: mea_var(cu_seqlens_q=torch.tensor([0, 15, 41], device="cuda", dtype=I32), max_seqlen_q=None),
        ValueError,
        "cu_seqlens_q",
        "past the packed length",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "max_seqlen_k-shorter-than-a-sequence",
        lambda: mea_var(max_seqlen_k=27),
        ValueError,
        "max_seqlen_k",
        "shorter than the longest",
        gpu=True,
    ),
    C(
        "memory_efficient_attention",
        "bottom-right-varlen-more-queries",
        lambda: mea_var(
            causal="bottom_right",
            cu_seqlens_q=cu(25, 15),
            cu_seqlens_k=cu(20, 28),
            max_seqlen_q=None,
            max_seqlen_k=None,
        ),
        NotImplementedError,
        "causal",
        "bottom_right",
        gpu=True,
    ),
]

USE_FOR_SDPA = [
    C("use_for_sdpa", "enabled-str", lambda: lambda: ops.use_for_sdpa("no"), TypeError, "enabled", "bool"),
    C("use_for_sdpa", "enabled-none", lambda: sdpa_enter(enabled=None), TypeError, "enabled", "bool"),
    C(
        "use_for_sdpa",
        "enable-dispatch_key-lowercase",
        lambda: lambda: ops.use_for_sdpa.enable("cuda"),
        ValueError,
        "dispatch_key",
        "'cuda'",
    ),
    C(
        "use_for_sdpa",
        "enable-dispatch_key-int",
        lambda: lambda: ops.use_for_sdpa.enable(1),
        ValueError,
        "dispatch_key",
        "got 1",
    ),
    C(
        "use_for_sdpa",
        "disable-dispatch_key-unknown",
        lambda: lambda: ops.use_for_sdpa.disable("Bogus"),
        ValueError,
        "dispatch_key",
        "'Bogus'",
    ),
]

EFFICIENT_ATTENTION_FORWARD = [
    C("efficient_attention_forward", "query-on-cpu", lambda: eaf(query=cpu(1, 40, 2, 64)), ValueError, "query", "CUDA"),
    C(
        "efficient_attention_forward",
        "mask-type",
        lambda: eaf(custom_mask_type=3),
        ValueError,
        "custom_mask_type",
        "0, 1 or 2",
    ),
    C(
        "efficient_attention_forward",
        "mask-type-str",
        lambda: eaf(custom_mask_type="1"),
        TypeError,
        "custom_mask_type",
        "int",
    ),
    C(
        "efficient_attention_forward",
        "seqlen_k",
        lambda: eaf(seqlen_k=fc(1, dtype=I32)),
        NotImplementedError,
        "seqlen_k",
        "not taken",
    ),
    C("efficient_attention_forward", "key-heads", lambda: eaf(key=fc(1, 48, 3, 64)), ValueError, "key", "shape"),
    C("efficient_attention_forward", "dropout", lambda: eaf(dropout_p=1.5), ValueError, "dropout_p", "[0, 1)"),
]

CONTEXT_PARALLEL_ATTENTION = [
    C("context_parallel_attention", "query-3d", lambda: cpa(query=fc(64, 4, 64)), ValueError, "query", "4-D"),
    C(
        "context_parallel_attention",
        "odd-local-seqlen",
        lambda: cpa(query=fc(1, 63, 4, 64), key=fc(1, 63, 2, 64), value=fc(1, 63, 2, 32)),
        ValueError,
        "query",
        "two chunks",
    ),
    C("context_parallel_attention", "key-heads", lambda: cpa(key=fc(1, 64, 3, 64)), ValueError, "key", "Hk dividing"),
    C(
        "context_parallel_attention",
        "key-local-seqlen",
        lambda: cpa(key=fc(1, 32, 2, 64), value=fc(1, 32, 2, 32)),
        ValueError,
        "key",
        "local seqlen",
    ),
    C("context_parallel_attention", "value-on-cpu", lambda: cpa(value=cpu(1, 64, 2, 32)), ValueError, "value", "agree"),
    C(
        "context_parallel_attention",
        "query-float64",
        lambda: cpa(
            query=fc(1, 64, 4, 64, dtype=F64), key=fc(1, 64, 2, 64, dtype=F64), value=fc(1, 64, 2, 32, dtype=F64)
        ),
        TypeError,
        "query",
        "dtype",
    ),
    C(
        "context_parallel_attention",
        "window-without-causal",
        lambda: cpa(causal=False, window_size=8),
        ValueError,
        "window_size",
        "needs causal",
    ),
    C("context_parallel_attention", "scale-nan", lambda: cpa(scale=float("nan")), TypeError, "scale", "finite"),
    C("context_parallel_attention", "backend", lambda: cpa(backend="fast"), ValueError, "backend", "'auto'"),
    C("context_parallel_attention", "return_lse-str", lambda: cpa(return_lse="yes"), TypeError, "return_lse", "bool"),
    C(
        "context_parallel_attention",
        "attention-fn",
        lambda: cpa(attention=len),
        TypeError,
        "attention",
        "ChunkAttention",
    ),
]

TABLES = {
    "dropout_bias_backward": DROPOUT_BIAS_BACKWARD,
    "bias_dropout": BIAS_DROPOUT,
    "BiasDropout": BIAS_DROPOUT_MODULE,
    "layer_norm_backward": LAYER_NORM_BACKWARD,
    "rms_norm_backward": RMS_NORM_BACKWARD,
    "layer_norm": LAYER_NORM,
    "rms_norm": RMS_NORM,
    "norm modules": NORM_MODULES,
    "attention_bwd_preprocess": PREPROCESS,
    "attention_bwd_compute_delta": COMPUTE_DELTA,
    "attention_bwd_convert_dq": CONVERT_DQ,
    "attention_bwd_convert_dkv": CONVERT_DKV,
    "attention_bwd_clear_dkv_accum": CLEAR_DKV_ACCUM,
    "efficient_attention_backward": EFFICIENT_ATTENTION_BACKWARD,
    "memory_efficient_attention": MEMORY_EFFICIENT_ATTENTION,
    "efficient_attention_forward": EFFICIENT_ATTENTION_FORWARD,
    "use_for_sdpa": USE_FOR_SDPA,
    "context_parallel_attention": CONTEXT_PARALLEL_ATTENTION,
}
BAD = [p for table in TABLES.values() for p in table]


# ------------------------------------------------------------------ launch guards

# Each op's first step past validation: reaching one means validation let the call through.
_ENTRIES = {
    "dropout_bias_backward": [(D, "_dropout_bias_backward_impl"), (D, "_dropout_bias_backward")],
    "bias_dropout": [(D, "_bias_dropout_forward"), (D, "_act_forward")],
    "BiasDropout": [(D, "_bias_dropout_forward"), (D, "_act_forward")],
    "layer_norm_backward": [(N, "_norm_backward_call")],
    "rms_norm_backward": [(N, "_norm_backward_call")],
    "layer_norm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "rms_norm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "LayerNorm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "RMSNorm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "attention_bwd_preprocess": [(P, "_preprocess_impl"), (P, "_preprocess_op")],
    "attention_bwd_compute_delta": [(P, "compute_delta"), (P, "_compute_delta_op")],
    "attention_bwd_convert_dq": [(P, "convert_dq"), (P, "_convert_dq_op")],
    "attention_bwd_convert_dkv": [(P, "_convert_dkv_impl"), (P, "_convert_dkv_op")],
    "attention_bwd_clear_dkv_accum": [(P, "launch_clear_dkv_accum"), (P, "_clear_dkv_accum_op")],
    "efficient_attention_backward": [(A, "run_backward"), (A, "_op")],
    "memory_efficient_attention": [(A, "_mea_forward"), (A, "_mea_impl")],
    "efficient_attention_forward": [(A, "_mea_forward"), (A, "_mea_impl")],
    "use_for_sdpa": [(torch.library, "Library")],
    "context_parallel_attention": [(CPA, "_plan")],  # the group, then the collectives
}


def _reached(what):
    def raiser(*args, **kwargs):
        raise _Reached(f"{what} was reached: validation let the input through")

    return raiser


class _GuardedPlan:
    """A norm / dropout-bias ``_Plan`` whose compiled functions raise _Reached (other fields as they are)."""

    def __init__(self, plan, what):
        self._plan, self._what = plan, what

    def __getattr__(self, name):
        value = getattr(self._plan, name)
        return _reached(f"{self._what}.{name}") if callable(value) else value


def _guarded_plan(plan, what):
    """``plan`` with every compiled function in it replaced by a raiser: a bare function (Δ,
    clear_dkv_accum), a tuple holding one (preprocess, convert_dq, convert_dkv), a ``_Plan``
    (norm, dropout-bias) or None (nothing to launch)."""
    if plan is None:
        return None
    if callable(plan):
        return _reached(what)
    if isinstance(plan, tuple):
        return tuple(_reached(what) if callable(part) else part for part in plan)
    return _GuardedPlan(plan, what)


# The memos of launch plans: a cached plan holds compiled functions, so a call that finds its
# plan there launches without going through the compile caches.
_PLAN_MAKERS = [(P, "_cached_plan"), (D, "_plan"), (N, "_plan"), (NF, "_plan")]


def _guard(monkeypatch, op, entries=True):
    """Compiling anything, launching through any plan (new or cached), or (with ``entries``)
    reaching ``op``'s launch path, raises _Reached."""
    monkeypatch.setattr(cc, "compile_kernel", _reached("compile_kernel"))
    monkeypatch.setattr(cc.CompileCache, "__call__", lambda self, *key: _reached(f"compile cache {self.name}")())
    for module, name in _PLAN_MAKERS:
        make = getattr(module, name)
        what = f"a launch through {module.__name__}.{name}"
        monkeypatch.setattr(module, name, lambda *a, _make=make, _what=what: _guarded_plan(_make(*a), _what))
    if entries:
        for module, name in _ENTRIES[op]:
            monkeypatch.setattr(module, name, _reached(f"{module.__name__}.{name}"))


def _argument_named(arg: str) -> str:
    """A regex for ``arg`` as a whole name (not part of a longer identifier)."""
    return rf"(?<![\w]){re.escape(arg)}(?![\w])"


def _run(case: Case):
    if case.gpu:  # real CUDA tensors: their values and addresses are what is checked
        return case.build()()
    with FakeTensorMode(allow_non_fake_inputs=True):
        return case.build()()


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_before_launch(case: Case, monkeypatch):
    _guard(monkeypatch, case.op, entries=not case.late)
    with pytest.raises(case.exc, match=_argument_named(case.arg)) as info:
        _run(case)
    assert case.detail in str(info.value), f"{case.detail!r} not in {str(info.value)!r}"


GOOD = [
    ("dropout_bias_backward", db),
    ("dropout_bias_backward", db_act),
    ("bias_dropout", bd),
    ("BiasDropout", bias_dropout_module),
    ("layer_norm_backward", lnb),
    ("rms_norm_backward", rnb),
    ("layer_norm", ln),
    ("rms_norm", rn),
    ("LayerNorm", layer_norm_module),
    ("RMSNorm", rms_norm_module),
    ("attention_bwd_preprocess", pre),
    ("attention_bwd_preprocess", pre_var),
    ("attention_bwd_compute_delta", delta),
    ("attention_bwd_compute_delta", delta_var),
    ("attention_bwd_convert_dq", cdq),
    ("attention_bwd_convert_dq", cdq_var),
    ("attention_bwd_convert_dkv", cdkv),
    ("attention_bwd_clear_dkv_accum", clr),
    ("efficient_attention_backward", eab),
    ("efficient_attention_backward", eab_var),
    ("memory_efficient_attention", mea),
    ("memory_efficient_attention", mea_var),
    ("context_parallel_attention", cpa),
    ("use_for_sdpa", sdpa_enter),
    ("use_for_sdpa", lambda: lambda: ops.use_for_sdpa.enable("CPU")),
]


@pytest.mark.parametrize("op,build", GOOD, ids=[f"{op}/{i}" for i, (op, _) in enumerate(GOOD)])
def test_base_inputs_pass_validation(op, build, monkeypatch):
    """The inputs every bad case starts from reach the launch path: each case fails for its own fault.

    Without grad: autograd on fake CUDA parameters aborts a CPU-only torch build (validation is
    the same either way)."""
    _guard(monkeypatch, op)
    with pytest.raises(_Reached):
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            build()()


def _cpu_launches():
    """(op, launch) pairs that run a kernel through each kind of memoised plan, on CPU tensors
    (the plan makers only read metadata and addresses; a stand-in takes the compiled
    function's place)."""
    acc = lambda: torch.zeros(1, 1, 128, 64)  # noqa: E731
    dk_accum, dv_accum, dk, dv = (
        acc(),
        acc(),
        torch.empty(1, 77, 1, 64, dtype=BF16),
        torch.empty(1, 77, 1, 64, dtype=BF16),
    )
    dy, mask, dx, dbias = (
        torch.ones(4, 8, dtype=BF16),
        torch.ones(4, 8, dtype=torch.uint8),
        torch.empty(4, 8, dtype=BF16),
        torch.empty(8, dtype=BF16),
    )
    x, w, stat, dw = torch.ones(4, 8, dtype=BF16), torch.ones(8), torch.ones(4), torch.empty(8)
    return [
        ("attention_bwd_clear_dkv_accum", lambda: P.launch_clear_dkv_accum(dk_accum, dv_accum)),  # a bare function
        (
            "attention_bwd_convert_dkv",
            lambda: P.launch_convert_dkv(dk_accum, dv_accum, dk, dv, 0.125, 1.0, None),
        ),  # a tuple
        ("dropout_bias_backward", lambda: D.launch(dy, mask, 0.1, None, None, None, dx, dbias)),  # a _Plan
        (
            "layer_norm_backward",
            lambda: N.launch(dy, x, w, stat, stat, None, False, dx, dw, None),
        ),  # a _Plan, finalize too
        ("layer_norm", lambda: NF.forward(x, w, None, 1e-5, False)),  # the forward's _Plan
    ]


@pytest.mark.parametrize("index", range(len(_cpu_launches())), ids=[op for op, _ in _cpu_launches()])
def test_guard_catches_a_launch_through_a_cached_plan(index, monkeypatch):
    """A plan cached before the guard holds a compiled function that no compile cache sees
    again: the guard must still stop its launch. Without the plan guard (compile caches
    alone) the same call launches."""
    from ops._memo import Memo

    for module in (P, D, N, NF):  # fresh memos: nothing of this test stays behind in the real ones
        monkeypatch.setattr(module, "_plans", Memo())
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")  # no driver to ask on CPU
    monkeypatch.setattr(cc, "num_sms", lambda index: 132)
    monkeypatch.setattr(cc, "ticket_counters", lambda device, count: torch.zeros(count, dtype=I32))
    launched = []
    stand_in = lambda *args: launched.append(len(args))  # noqa: E731
    op, launch = _cpu_launches()[index]
    with monkeypatch.context() as warm:  # warm the plan cache: the compile cache hands out the stand-in
        warm.setattr(cc.CompileCache, "__call__", lambda self, *key: stand_in)
        launch()
    assert launched, "the warm-up launched nothing"
    with monkeypatch.context() as compiles_only:  # compile caches guarded alone: the cached plan launches
        compiles_only.setattr(cc, "compile_kernel", _reached("compile_kernel"))
        compiles_only.setattr(cc.CompileCache, "__call__", lambda self, *key: _reached(f"compile cache {self.name}")())
        before = len(launched)
        launch()
        assert len(launched) > before, "the plan was not cached: this test shows nothing"
    before = len(launched)
    _guard(monkeypatch, op, entries=False)
    with pytest.raises(_Reached, match="a launch through"):
        launch()
    assert len(launched) == before, "a kernel launched under the guard"


def test_refused_sdpa_switches_change_nothing():
    before = {key: SD._sdpa_enabled(key) for key in ("CUDA", "CPU")}
    for bad in ("cuda", "Bogus", 1, None):
        with pytest.raises(ValueError, match="dispatch_key"):
            ops.use_for_sdpa.enable(bad)
    assert {key: SD._sdpa_enabled(key) for key in ("CUDA", "CPU")} == before


def test_every_public_op_has_a_table():
    covered = {p.values[0].op for p in BAD}
    assert covered == set(ops.__all__), set(ops.__all__) ^ covered
    for name in ops.__all__:  # several faults per op, most of them checked on CPU
        mine = [p for p in BAD if p.values[0].op == name]
        assert len(mine) >= 4 and sum(not p.values[0].gpu for p in mine) >= 4, name


def test_enough_cases_run_without_a_gpu():
    cpu_cases = [p for p in BAD if not p.values[0].gpu]
    assert len(BAD) >= 60 and len(cpu_cases) >= 50, (len(BAD), len(cpu_cases))
    assert len({p.id for p in BAD}) == len(BAD), "case ids must be unique"


# ------------------------------------------- layouts the forward takes, the backward too


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_dropout"])
def test_transposed_x_through_the_autograd_ops(op):
    """torch's forward takes x in any layout; the backward must not then refuse it as unflattenable."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64, 32, device="cuda", generator=gen)
    w = torch.randn(64, device="cuda", generator=gen)
    dy = torch.randn(32, 64, device="cuda", generator=gen)
    grads = []
    for ours in (True, False):
        x = base.clone().t().requires_grad_()  # [32, 64], column stride 32
        p = w.clone().requires_grad_()
        if op == "layer_norm":
            y = (ops.layer_norm if ours else torch.nn.functional.layer_norm)(x, (64,), p, None, 1e-5)
        elif op == "rms_norm":
            y = (ops.rms_norm if ours else torch.nn.functional.rms_norm)(x, (64,), p, 1e-5)
        else:
            y = ops.bias_dropout(x, p, 0.0, "relu") if ours else torch.relu(x + p)
        y.backward(dy)
        grads.append((x.grad, p.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
