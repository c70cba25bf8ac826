"""GPU: randomized attention_bwd_preprocess + compute_delta, convert_dq and convert_dkv against
their references: batch, heads, lengths, head dims (odd ones too), variable lengths, split
partials, [B, S, H, D] / [total, H, D] views with permuted and padded strides
(tests/randomized_common.py describes the suite)."""

import pytest
import torch
from hypothesis import strategies as st

from ops import attention_bwd_prepost as A
from ops.reference import convert_dkv_ref, convert_dq_ref

from .randomized_common import (
    BF16,
    DEV,
    F16,
    F32,
    _apply_layout,
    _dt,
    _family,
    _layout,
    _lengths,
    _pad_last,
    _vec_of_len,
    _vmax,
)
from .test_attention_bwd_prepost_gpu import (
    check_converted,
    check_delta,
    nan_padded_dkv_accum,
    nan_padded_dq_accum,
    nan_padded_dq_accum_varlen,
    poison_allocator,
)
from .test_mem_eff_attention_gpu import cu_seqlens

pytestmark = pytest.mark.gpu


# ============================================================ attention_bwd_prepost

# (dtype, padded head dim, vector width): one compiled configuration per (class, varlen, ...)
PP_CLASSES = [
    (BF16, 64, 8),
    (F16, 128, 4),
    (BF16, 256, 1),
    (F16, 32, 1),
    (BF16, 160, 2),
    (F32, 96, 4),  # preprocess / compute_delta only (the conversions write fp16 / bf16)
]
PP_CONVERT_CLASSES = PP_CLASSES[:5]


def pp_head_dims(dtype, hd, vec):
    """Head dims whose padded head dim is hd and whose widest vector is vec."""
    return [d for d in range(hd - 31, hd + 1) if _vec_of_len(d, _vmax(dtype)) == vec]


def _pp_layout(vec, nd):
    """Strided views keeping the class's vector: padded head-dim pitch and start offset in
    multiples of vec; other dims permuted and padded freely."""
    return _layout(st.integers(0, 3).map(lambda k: vec * k), st.integers(0, 3).map(lambda k: vec * k), nd)


@st.composite
def preprocess_specs(draw, ci):
    dtype, hd, vec = PP_CLASSES[ci]
    d = draw(st.sampled_from(pp_head_dims(dtype, hd, vec)))
    varlen = draw(st.booleans())
    spec = dict(
        dtype=dtype,
        head_dim=d,
        vec=vec,
        varlen=varlen,
        heads=draw(st.integers(1, 4)),
        zero_dq_accum=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 0.9, 0.5, 0.0])),
    )
    if varlen:
        spec["lengths"] = draw(_lengths(600))
        spec["max_seqlen"] = max(spec["lengths"]) + draw(st.sampled_from([0, 0, 3, 130]))
    else:
        spec["batch"] = draw(st.integers(1, 3))
        spec["seqlen"] = draw(st.one_of(st.integers(1, 700), st.sampled_from([1, 127, 128, 129, 255, 256, 257])))
    nd = 3 if varlen else 4
    spec["layouts"] = (draw(_pp_layout(vec, nd)), draw(_pp_layout(vec, nd)))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


def preprocess_inputs(s, device=None):
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    shape = (sum(s["lengths"]), h, d) if s["varlen"] else (s["batch"], s["seqlen"], h, d)
    out = _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=s["dtype"]), s["layouts"][0])
    grad_out = _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=s["dtype"]), s["layouts"][1])
    cu = cu_seqlens(s["lengths"]) if s["varlen"] else None
    return out, grad_out, cu


def _preprocess_case(s):
    out, grad_out, cu = preprocess_inputs(s)
    varlen, h, d = s["varlen"], s["heads"], s["head_dim"]
    max_seqlen = s["max_seqlen"] if varlen else None
    b = len(s["lengths"]) if varlen else s["batch"]
    poison_allocator(b * h * A.seqlen_rounded(max_seqlen if varlen else s["seqlen"]) * 4)
    res = A.attention_bwd_preprocess(
        out, grad_out, scale=s["scale"], cu_seqlens_q=cu, max_seqlen_q=max_seqlen, zero_dq_accum=s["zero_dq_accum"]
    )
    delta = res[0] if s["zero_dq_accum"] else res
    check_delta(delta, out, grad_out, s["scale"], cu, max_seqlen)
    if s["zero_dq_accum"]:
        acc = res[1]
        rows = sum(s["lengths"]) if varlen else s["seqlen"]
        assert acc.shape == A.dq_accum_shape(b, rows, h, d, varlen=varlen) and acc.dtype == torch.float32
        assert (acc == 0).all(), f"{(acc != 0).sum().item()} dQ accumulator elements not zeroed"
    # the mem-eff kernel's Δ on the same inputs: unscaled, unrounded rows
    delta2 = A.attention_bwd_compute_delta(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=max_seqlen)
    check_delta(delta2, out, grad_out, 1.0, cu, max_seqlen, rounded=False)


_preprocess_family = _family("attention_bwd_preprocess", PP_CLASSES, preprocess_specs, _preprocess_case)


@pytest.mark.parametrize("ci", range(len(PP_CLASSES)), ids=[f"{_dt(c[0])}-hd{c[1]}-vec{c[2]}" for c in PP_CLASSES])
def test_attention_bwd_preprocess_randomized(ci):
    _preprocess_family(ci)


def _convert_common(draw, ci):
    dtype, hd, vec = PP_CONVERT_CLASSES[ci]
    varlen = draw(st.booleans())
    spec = dict(
        dtype=dtype,
        head_dim=draw(st.sampled_from(pp_head_dims(dtype, hd, vec))),
        vec=vec,
        varlen=varlen,
        heads=draw(st.integers(1, 4)),
        p_dropout=draw(st.sampled_from([0.0, 0.1, 0.5])),
        scale=draw(st.sampled_from([1.0, 0.125, 0.0625, 0.3])),
    )
    if varlen:
        spec["lengths"] = draw(_lengths(600))
        spec["extra"] = draw(st.sampled_from([0, 0, 5, 200]))
    else:
        spec["batch"] = draw(st.integers(1, 3))
        spec["seqlen"] = draw(st.one_of(st.integers(1, 700), st.sampled_from([1, 31, 32, 33, 127, 128, 129, 256])))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


@st.composite
def convert_dq_specs(draw, ci):
    spec = _convert_common(draw, ci)
    spec["nsplits"] = draw(st.sampled_from([None, 1, 2, 3]))
    spec["acc_pad"] = draw(st.sampled_from([0, 0, 4, 32]))  # extra fp32 columns: a row-strided accumulator
    return spec


def convert_dq_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    if s["varlen"]:
        acc = nan_padded_dq_accum_varlen(s["lengths"], h, d, s["nsplits"], gen)
    else:
        acc = nan_padded_dq_accum(s["batch"], s["seqlen"], h, d, s["nsplits"], gen)
    return _pad_last(acc, s["acc_pad"])


def _convert_dq_case(s):
    acc = convert_dq_inputs(s)
    h, d, dtype, p, scale = s["heads"], s["head_dim"], s["dtype"], s["p_dropout"], s["scale"]
    if s["varlen"]:
        cu = cu_seqlens(s["lengths"])
        max_seqlen = max(s["lengths"]) + s["extra"]
        poison_allocator(sum(s["lengths"]) * h * d * 2)
        dq = A.attention_bwd_convert_dq(
            acc, scale, head_dim=d, cu_seqlens_q=cu, max_seqlen_q=max_seqlen, p_dropout=p, dtype=dtype
        )
        ref = convert_dq_ref(acc, scale, head_dim=d, cu_seqlens_q=cu, p_dropout=p)
    else:
        sq = s["seqlen"]
        poison_allocator(s["batch"] * sq * h * d * 2)
        dq = A.attention_bwd_convert_dq(acc, scale, head_dim=d, seqlen_q=sq, p_dropout=p, dtype=dtype)
        ref = convert_dq_ref(acc, scale, head_dim=d, seqlen_q=sq, p_dropout=p)
    check_converted(dq, ref, dtype)


_convert_dq_family = _family("attention_bwd_convert_dq", PP_CONVERT_CLASSES, convert_dq_specs, _convert_dq_case)
_PP_CONVERT_IDS = [f"{_dt(c[0])}-hd{c[1]}-vec{c[2]}" for c in PP_CONVERT_CLASSES]


@pytest.mark.parametrize("ci", range(len(PP_CONVERT_CLASSES)), ids=_PP_CONVERT_IDS)
def test_attention_bwd_convert_dq_randomized(ci):
    _convert_dq_family(ci)


@st.composite
def convert_dkv_specs(draw, ci):
    return _convert_common(draw, ci)


def convert_dkv_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    if s["varlen"]:
        lengths = s["lengths"]
        max_seqlen = max(lengths) + s["extra"]
    else:
        lengths = [s["seqlen"]] * s["batch"]
        max_seqlen = s["seqlen"]
    dk_acc = nan_padded_dkv_accum(lengths, h, d, max_seqlen, gen)
    dv_acc = nan_padded_dkv_accum(lengths, h, d, max_seqlen, gen)
    return dk_acc, dv_acc


def _convert_dkv_case(s):
    dk_acc, dv_acc = convert_dkv_inputs(s)
    h, d, dtype, p, scale = s["heads"], s["head_dim"], s["dtype"], s["p_dropout"], s["scale"]
    if s["varlen"]:
        cu, total = cu_seqlens(s["lengths"]), sum(s["lengths"])
        kw = dict(seqlen_k=total, cu_seqlens_k=cu)
    else:
        total = s["batch"] * s["seqlen"]
        kw = dict(seqlen_k=s["seqlen"])
    poison_allocator(*[total * h * d * 2] * 2)
    dk, dv = A.attention_bwd_convert_dkv(dk_acc, dv_acc, scale, head_dim=d, p_dropout=p, dtype=dtype, **kw)
    ref_dk, ref_dv = convert_dkv_ref(dk_acc, dv_acc, scale, head_dim=d, p_dropout=p, **kw)
    check_converted(dk, ref_dk, dtype)
    check_converted(dv, ref_dv, dtype)


_convert_dkv_family = _family("attention_bwd_convert_dkv", PP_CONVERT_CLASSES, convert_dkv_specs, _convert_dkv_case)


@pytest.mark.parametrize("ci", range(len(PP_CONVERT_CLASSES)), ids=_PP_CONVERT_IDS)
def test_attention_bwd_convert_dkv_randomized(ci):
    _convert_dkv_family(ci)
