"""What the bad-input tables (tests/test_bad_inputs_*_cpu.py) share: builders of inputs that
pass validation (a case changes one thing in them), the ``Case`` a table row holds, and the
launch guard under which a case must raise (tests/test_bad_inputs_cpu.py says how)."""

import re
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
import ops.attention as A
import ops.attention_bwd_prepost as P
import ops.context_parallel as CPA
import ops.dropout_add_norm as DAN
import ops.dropout_bias as D
import ops.norm as N
import ops.norm_forward as NF
from ops import _compile as cc

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I32, I64, BOOL, U8 = torch.int32, torch.int64, torch.bool, torch.uint8


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
db_bits = _call(
    ops.dropout_bias_backward, grad_out=lambda: fc(4, 12), mask=lambda: fc(4, 2, dtype=U8), p=0.1, mask_bits=True
)
bd = _call(ops.bias_dropout, x=lambda: fc(4, 8), bias=lambda: fc(8), p=0.1)
dbf = _call(ops.dropout_bias_forward, x=lambda: fc(4, 8), bias=lambda: fc(8), p=0.1)
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


dan = _call(
    ops.dropout_add_layer_norm,
    x=lambda: fc(4, 8),
    residual=lambda: fc(4, 8),
    weight=lambda: f32(8),
    bias=lambda: f32(8),
    p=0.1,
    eps=1e-5,
)
darn = _call(
    ops.dropout_add_rms_norm, x=lambda: fc(4, 8), residual=lambda: fc(4, 8), weight=lambda: fc(8), bias=None, p=0.1
)


def dropout_add_norm_module(cls, x=None, residual=None, **kw):
    return lambda: cls(8, device="cuda", dtype=BF16, **kw)(fc(4, 8) if x is None else x, residual)


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


# ------------------------------------------------------------------ launch guards

# Each op's first step past validation: reaching one means validation let the call through.
_ENTRIES = {
    "dropout_bias_backward": [(D, "_dropout_bias_backward_impl"), (D, "_dropout_bias_backward")],
    "bias_dropout": [(D, "_bias_dropout_forward"), (D, "_act_forward")],
    "BiasDropout": [(D, "_bias_dropout_forward"), (D, "_act_forward")],
    "dropout_bias_forward": [(D, "_bias_dropout_forward")],
    "layer_norm_backward": [(N, "_norm_backward_call")],
    "rms_norm_backward": [(N, "_norm_backward_call")],
    "layer_norm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "rms_norm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "LayerNorm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "RMSNorm": [(N, "_norm_forward"), (N, "_norm_forward_impl")],
    "dropout_add_layer_norm": [(DAN, "_cuda_call"), (DAN, "_torch_call")],
    "dropout_add_rms_norm": [(DAN, "_cuda_call"), (DAN, "_torch_call")],
    "DropoutAddLayerNorm": [(DAN, "_cuda_call"), (DAN, "_torch_call")],
    "DropoutAddRMSNorm": [(DAN, "_cuda_call"), (DAN, "_torch_call")],
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


# ------------------------------------------------------------------------ the check


def check_refused(case: Case, monkeypatch):
    """``case`` raises its exception, naming its argument and its fault, before any launch."""
    _guard(monkeypatch, case.op, entries=not case.late)
    with pytest.raises(case.exc, match=_argument_named(case.arg)) as info:
        _run(case)
    assert case.detail in str(info.value), f"{case.detail!r} not in {str(info.value)!r}"
